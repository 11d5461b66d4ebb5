"""The op table of :class:`SafeSparseTensor`: what each torch op's sparse result is worth.

Three kinds (:class:`OpKind`):

* ``PRESERVING`` - the result keeps the input's index data (a view, or a copy of it): checked
  without validation when every sparse input was checked before and after the op.
* ``NEW_INDICES`` - torch builds new index data (coalesce, add, sparse @ sparse, conversions):
  the result is validated before it counts as checked (torch 2.13's own kernels emit invalid
  tensors). An invalid result is repaired where a repair exists (:data:`tensor.REPAIRS`),
  otherwise refused with an error naming the op; never returned.
* ``UNKNOWN`` - everything not listed: the result is a SafeSparseTensor, but unchecked.

Whatever the kind, a sparse input that is not a checked SafeSparseTensor (a plain torch tensor
included) leaves the result unchecked. Strided results are never wrapped.

safesparse's own rows are declared in one place, :func:`builtin_rows` (an op's kind, its
implementation, its fast-path handler and, for products, the kind of the product route's
result: one row per op), and registered by one explicit call, :func:`register_builtin_ops`,
which the package makes once when it is imported. Users extend the table with
``SafeSparseTensor.classify([funcs], kind)`` or ``@SafeSparseTensor.implements([funcs], kind)``.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import COMPRESSED_LAYOUTS, compressed_members
from ..catalog.errors import InvariantError
from ..engine.metadata import values_of
from ..engine.validation import validate_tensor
from ..operators.functions import PRODUCT_FUNCTIONS
from ..state import checked, writers
from . import fastpath, products, transpose
from .binding import Product, bind
from .core import (
    REPAIRS,
    OpKind,
    SafeSparseTensor,
    _inputs_checked,
    _is_checked,
    _is_sparse,
    after_inplace,
    op_name,
    wrap_results,
)
from .optable import VALUES_ONLY, OpEntry

T = torch.Tensor
PRESERVING, NEW_INDICES = OpKind.PRESERVING, OpKind.NEW_INDICES


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, complex, bool)) or (
        isinstance(x, torch.Tensor) and x.dim() == 0 and x.layout == torch.strided
    )


def positive_power(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
    """``t ** p`` for a scalar p > 0 keeps zeros zero (the indices); anything else is unknown."""
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    ok = isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent > 0
    return PRESERVING if ok else OpKind.UNKNOWN


def scalar_else_new(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
    """Multiplying/dividing by a scalar keeps the indices; with a tensor, torch builds new ones."""
    other = args[1] if len(args) > 1 else kwargs.get("other")
    return PRESERVING if _is_scalar(other) else NEW_INDICES


def _contiguous(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch refuses ``contiguous()`` on sparse tensors; here it means row-contiguous members.

    A compressed tensor whose values are not contiguous (a block-transposed BSR/BSC view) gets a
    contiguous copy of its values on the same, shared index tensors; anything else is returned
    as it is.
    """
    t = args[0]
    fmt = args[1] if len(args) > 1 else kwargs.get("memory_format", torch.contiguous_format)
    if fmt not in (torch.contiguous_format, torch.preserve_format):
        raise RuntimeError(f"contiguous(): sparse tensors support no memory format {fmt}")
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo or t.values().is_contiguous():
            return t
        compressed, plain = compressed_members(t)
        values = t.values().contiguous()
        out = torch.sparse_compressed_tensor(
            compressed, plain, values, t.shape, layout=t.layout, dtype=values.dtype,
            device=values.device, check_invariants=False,
        )
    return wrap_results(func, PRESERVING, args, kwargs, out)


# ---------------------------------------------------------------------------------------------
# Repairs and corrections for torch kernels that build invalid or wrong results


def _sort_plain_indices(t: torch.Tensor) -> torch.Tensor | None:
    """5.6 repair: the same matrix with its plain indices sorted within each line (torch 2.13's
    CSR @ CSR can leave columns unsorted). Non-batched tensors only; None otherwise."""
    with DisableTorchFunctionSubclass():
        compressed, plain = compressed_members(t)
        if compressed.dim() != 1 or plain.numel() == 0:
            return None
        n_plain = checked.geometry_of(t)[2]  # type: ignore[index]
        lines = torch.repeat_interleave(
            torch.arange(compressed.numel() - 1, device=compressed.device), compressed.diff())
        order = torch.argsort(lines * max(int(n_plain), 1) + plain, stable=True)
        values = t.values()[order]
        return torch.sparse_compressed_tensor(
            compressed, plain[order], values, t.shape, layout=t.layout, dtype=values.dtype,
            device=values.device, check_invariants=False)


REPAIRS["5.6"] = _sort_plain_indices


def _as_csr_transpose(t: torch.Tensor) -> torch.Tensor:
    """A 2-D CSC tensor's transpose as a CSR tensor on the same storage."""
    return torch.sparse_csr_tensor(
        t.ccol_indices(), t.row_indices(), t.values(), (t.shape[1], t.shape[0]),
        dtype=t.dtype, device=t.device, check_invariants=False)


def _as_csc(r: torch.Tensor) -> torch.Tensor:
    """The transpose of a 2-D CSR result, as the CSC tensor on the same storage."""
    if r.layout != torch.sparse_csr:
        return r
    return torch.sparse_csc_tensor(
        r.crow_indices(), r.col_indices(), r.values(), (r.shape[1], r.shape[0]),
        dtype=r.dtype, device=r.device, check_invariants=False)


def _csc_2d(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.layout == torch.sparse_csc and t.dim() == 2
               for t in ts)


def _csc_repair(func: Any, p: Product) -> torch.Tensor | None:
    """torch 2.13's products of 2-D CSC tensors: ``torch.sparse.mm`` returns a broken structure
    with the values lost, ``addmm`` with ``input``, ``mat1`` and ``mat2`` all CSC segfaults or
    returns a wrong result. Here they are computed as transposes through the CSR kernel (the
    transposes are free): ``a @ b == (b.T @ a.T).T``, ``addmm(c, a, b) == addmm(c.T, b.T,
    a.T).T``, returned as CSC. None for every other call (``torch.mm`` / ``@`` of two CSC
    tensors is right in torch, and returns CSR: its result is validated as any other)."""
    if (func is torch.sparse.mm and p.op in ("mm", "matmul") and p.input is None
            and _csc_2d(p.mat1, p.mat2)):
        return _as_csc(torch.mm(_as_csr_transpose(p.mat2), _as_csr_transpose(p.mat1)))
    if p.op == "addmm" and _csc_2d(p.input, p.mat1, p.mat2):
        return _as_csc(torch.addmm(
            _as_csr_transpose(p.input), _as_csr_transpose(p.mat2),
            _as_csr_transpose(p.mat1), beta=p.beta, alpha=p.alpha))
    return None


#: The out-of-place function that computes each bound operation.
_OUT_OF_PLACE = {"mm": torch.mm, "matmul": torch.matmul, "addmm": torch.addmm}


def _product_route(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every product function (the rows of :func:`builtin_rows` with a ``product`` kind:
    ``mm``, ``matmul``, ``@``, ``addmm`` and ``addmm_``, ``torch.sparse.mm`` / ``addmm``,
    ``F.linear``), its arguments bound by name (:func:`safesparse.tensor.binding.bind`),
    whatever form the call has.

    * a sparse ``out=`` / in-place target: :func:`_into_sparse` (before any kernel runs);
    * a BSR / BSC factor with a dense one: the block route
      (:func:`safesparse.tensor.products.route`), where torch 2.13 has no CPU kernel; a dense
      ``out=`` / in-place target receives the result;
    * products of 2-D CSC tensors torch gets wrong: :func:`_csc_repair`;
    * anything else: torch's kernel, its sparse result validated (``NEW_INDICES``).
    """
    p = bind(func, args, kwargs)
    if (p is not None and not p.extra and func in _SPARSE_FORMS and _csc_2d(p.mat1)
            and isinstance(p.mat2, torch.Tensor) and p.mat2.layout == torch.strided):
        # torch 2.13 has no backward for torch.sparse.mm / addmm of a CSC matrix and a dense
        # one ("sparse_addmm_sparse_backward: unsupported combination of layouts"); torch.mm /
        # torch.addmm compute the same product, with gradients
        func = _SPARSE_FORMS[func]
        if func is torch.mm:
            args, kwargs = (p.mat1, p.mat2), {}
        else:
            args, kwargs = (p.input, p.mat1, p.mat2), {"beta": p.beta, "alpha": p.alpha}
    if p is not None and not p.extra:
        target = p.target
        if _is_sparse(target):
            return _into_sparse(func, p, target)
        call = products.route(p)
        if call is not None:
            y = products.block_product(call)
            return y if target is None else _into_dense(func, p, target, y)
        if target is None:
            before = _inputs_checked(args, kwargs)  # (before the repair's kernels run)
            repaired = _csc_repair(func, p)
            if repaired is not None:
                return wrap_results(func, NEW_INDICES, args, kwargs, repaired, before=before)
    before = _inputs_checked(args, kwargs)
    ret = func(*args, **kwargs)
    return wrap_results(func, _PRODUCT_KINDS[func], args, kwargs, ret, before=before)


_SPARSE_FORMS = {torch.sparse.mm: torch.mm, torch.sparse.addmm: torch.addmm}


def _no_autograd(func: Any, p: Product, target: torch.Tensor) -> None:
    """torch's rule for ``out=`` (and, for sparse targets here, in-place) forms."""
    if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (p.input, p.mat1, p.mat2, target)):
        form = "in-place" if p.inplace else "out="
        raise RuntimeError(
            f"{op_name(func)}(): functions with {form} arguments don't support automatic "
            "differentiation, but one of the arguments requires grad.")


def _into_dense(func: Any, p: Product, target: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The block route's result written into a dense ``out=`` / in-place target."""
    if not p.inplace:
        _no_autograd(func, p, target)
        if target.shape != y.shape:
            target.resize_(y.shape)
    target.copy_(y)
    return target


def _same_structure(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (same layout, shape) have equal index data."""
    ma: tuple[torch.Tensor, ...]
    mb: tuple[torch.Tensor, ...]
    if a.layout == torch.sparse_coo:
        ma, mb = (a._indices(),), (b._indices(),)
        if a.is_coalesced() != b.is_coalesced():
            return False
    else:
        ma, mb = compressed_members(a), compressed_members(b)
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
               for x, y in zip(ma, mb, strict=True))


def _into_sparse(func: Any, p: Product, target: torch.Tensor) -> torch.Tensor:
    """A sparse ``out=`` or in-place target (``c.addmm_(a, b)``, ``torch.addmm(..., out=o)``,
    ``torch.mm(a, b, out=o)``). torch's kernels write the result's index data into the
    target's index storage, which other tensors may share (a twin built on the same index
    tensors, the ``.mT`` view), and its CSC kernels write an invalid structure there. Here,
    before any kernel runs, the result is computed out of place (through the routes and
    repairs above, validated); when its index data equals the target's, only the values are
    written, into the target's values (the target stays checked; no index storage is
    written). Otherwise it is refused with ``RuntimeError`` naming the out-of-place form
    (torch 2.13 has no way to give a sparse compressed tensor new index tensors in place:
    ``t.data = r`` leaves its members as they are). Refused too: a result of another layout
    or dtype than the target's, and any form where autograd would be needed (torch's rule
    for ``out=``).
    """
    _no_autograd(func, p, target)
    fresh_func = _OUT_OF_PLACE[p.op]
    if p.op == "addmm":
        fresh = _product_route(fresh_func, (p.input, p.mat1, p.mat2),
                               {"beta": p.beta, "alpha": p.alpha})
    else:
        fresh = _product_route(fresh_func, (p.mat1, p.mat2), {})
    where = "input" if p.inplace else "out="
    call = f"{fresh_func.__name__}({'input, ' if p.op == 'addmm' else ''}mat1, mat2)"
    if not (isinstance(fresh, torch.Tensor) and fresh.layout == target.layout
            and fresh.dtype == target.dtype):
        got = (f"{fresh.layout}, {fresh.dtype}" if isinstance(fresh, torch.Tensor)
               else type(fresh).__name__)
        raise RuntimeError(
            f"{op_name(func)}: the result ({got}) cannot be written into the {where} tensor "
            f"({target.layout}, {target.dtype}); use the out-of-place form torch.{call}")
    if not (fresh.shape == target.shape and _same_structure(fresh, target)):
        raise RuntimeError(
            f"{op_name(func)}: the result's sparsity pattern differs from the {where} "
            f"tensor's; a sparse {where} tensor only receives new values (writing its index "
            "storage would change every tensor sharing it); use the out-of-place form "
            f"torch.{call}")
    values_of(target).copy_(values_of(fresh))
    if isinstance(target, SafeSparseTensor):
        after_inplace(target, keeps_indices=True)
    return target


def _same_index_data(t: Any, other: Any) -> bool:
    """Both checked SafeSparseTensors on one index structure with the same geometry."""
    if not (isinstance(t, SafeSparseTensor) and isinstance(other, SafeSparseTensor)):
        return False
    if t.layout != other.layout or t.shape != other.shape:
        return False
    a, b = checked.record(t), checked.record(other)
    return (a is not None and b is not None and checked.same_index_data(a, b)
            and _is_checked(t) and _is_checked(other))


class _OnPattern(threading.local):
    ids: frozenset[int] = frozenset()


_on_pattern = _OnPattern()


def on_pattern(params: Any) -> None:
    """The parameters whose ``add_`` of a dense tensor, in this thread, adds it on their
    pattern (an optimizer step: :mod:`safesparse.nn` sets them before SGD's step and clears
    them after); ``()`` clears."""
    _on_pattern.ids = frozenset(id(p) for p in params)


def _dense_on_pattern(t: Any, other: Any) -> bool:
    """``t.add_(other)`` inside an optimizer step allowed on ``t``'s pattern (see
    :func:`on_pattern`): ``other`` dense, of ``t``'s shape, ``t`` a checked non-hybrid
    compressed tensor."""
    return (id(t) in _on_pattern.ids and isinstance(t, SafeSparseTensor)
            and isinstance(other, torch.Tensor) and other.layout == torch.strided
            and other.shape == t.shape and other.device == t.device
            and t.layout in COMPRESSED_LAYOUTS and t.dense_dim() == 0)


def _add_inplace(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.add_(g)`` where ``g`` has the same checked index data as ``t`` (an optimizer step
    with a gradient built on the parameter's indices) is a values-only update: ``t`` stays
    checked. Inside an SGD step (:func:`on_pattern`), a dense ``g`` is added at ``t``'s
    stored positions (the masked update of a fixed pattern): values-only too. Anything else
    runs torch's kernel, which builds new index data (validated)."""
    before = _inputs_checked(args, kwargs)
    t = args[0]
    other: Any = args[1] if len(args) > 1 else kwargs.get("other")
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    plain_args = set(kwargs) <= {"other", "alpha"}
    no_grad = not (torch.is_grad_enabled() and (t.requires_grad or other.requires_grad))
    sign = -1 if func in (T.sub_, T.__isub__) else 1
    if before and plain_args and no_grad and _same_index_data(t, other):
        values_of(t).add_(values_of(other), alpha=sign * alpha)
        after_inplace(t, keeps_indices=True)
        return t
    if before and plain_args and no_grad and _dense_on_pattern(t, other):
        update = other.reshape(-1)[products.pattern_positions(t)]
        values_of(t).add_(update, alpha=sign * alpha)
        after_inplace(t, keeps_indices=True)
        return t
    ret = func(*args, **kwargs)
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)`` from a checked tensor of the same layout and shape (e.g.
    ``load_state_dict``) leaves ``dst`` holding ``src``'s valid index data: checked without
    validation. Other sources: torch's copy, then validation as for any new index data."""
    dst, src = args[0], args[1]
    before = _inputs_checked(args, kwargs)
    same = (before and isinstance(src, SafeSparseTensor) and src.layout == dst.layout
            and src.shape == dst.shape)
    snap = writers.before_copy(dst) if same else {}
    ret = func(*args, **kwargs)
    if same and ret is dst and _is_checked(src) and writers.copied(dst, snap):
        return dst
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


def _set_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.data = new`` (``nn.Module._apply`` does this, e.g. ``module.to(dtype)``): ``t`` now
    holds ``new``'s data and is checked exactly when ``new`` was."""
    t, new = args[0], args[1]
    if new is t:  # (a conversion to what it already is: ``module.double()`` of a double)
        return
    was_checked = _is_checked(new)
    if _swap_instead(t, new):
        return
    func(*args, **kwargs)
    # its members were replaced: a record on the new ones, checked when new was
    writers.replaced(t, was_checked and _is_checked(new) and _metadata_ok(t))


def _swap_instead(t: torch.Tensor, new: Any) -> bool:
    """torch 2.13's ``t.data = new`` on a compressed tensor takes ``new``'s dtype and device but
    keeps ``t``'s members (values of the old dtype under a weight that says the new one): for a
    conversion of a sparse compressed tensor (``module.double()``, ``.half()``, ``.to(dtype)``
    of a module holding a checked sparse ``nn.Parameter``), ``t`` takes ``new``'s data whole
    (:func:`torch.utils.swap_tensors`, which moves ``new``'s record, and so its checked state,
    with the data) and keeps its own Python attributes (``nn.Parameter``-ness) and
    ``requires_grad``; one with a gradient is refused, naming the way. Returns whether it
    did."""
    if (not isinstance(new, torch.Tensor) or new.layout != t.layout
            or t.layout not in COMPRESSED_LAYOUTS
            or (new.dtype == t.dtype and new.device == t.device)):
        return False
    if t.grad is not None:  # (torch refuses a strided gradient set on a sparse tensor)
        raise TypeError(
            f"converting a sparse {t.layout} tensor with a gradient to {new.dtype} on "
            f"{new.device} in place (`t.data = ...`, as module.to() / .half() / .double() "
            "do) is not supported: torch 2.13 would keep its old values under the new dtype\n"
            "  Drop the gradients first (model.zero_grad(set_to_none=True)), then convert.")
    keep = {k: v for k, v in t.__dict__.items() if k != checked.RECORD_ATTR}
    requires_grad = t.requires_grad
    with torch.no_grad():
        torch.utils.swap_tensors(t, new)  # type: ignore[no-untyped-call]
    for k in list(t.__dict__):
        if k != checked.RECORD_ATTR and k not in keep:
            del t.__dict__[k]
    t.__dict__.update(keep)
    t.requires_grad_(requires_grad)
    return True


def _metadata_ok(t: torch.Tensor) -> bool:
    """The O(1) invariants of ``t`` hold (torch 2.13's ``t.data = new`` on a compressed tensor
    takes ``new``'s dtype but keeps ``t``'s members: 1.4 then fails, and ``t`` stays unchecked
    until validation refuses it, before a kernel reads values of the wrong width)."""
    try:
        validate_tensor(t, check_indices=False)
    except InvariantError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The rows: every op safesparse knows, in one place


def _forms(names: tuple[str, ...], inplace: bool = True) -> list[Any]:
    """``torch.name``, ``Tensor.name`` and (``inplace``) ``Tensor.name_`` for each name, where
    torch has them."""
    return [f for name in names
            for f in (getattr(torch, name, None), getattr(T, name, None),
                      getattr(T, name + "_", None) if inplace else None)
            if f is not None]


def builtin_rows() -> dict[Any, OpEntry]:
    """safesparse's own op table: torch function -> its row (kind, implementation, fast-path
    handler, product kind). The one place an op is added."""
    rows: dict[Any, OpEntry] = {}

    def row(funcs: list[Any], kind: Any, impl: Any = None, fast: Any = None,
            product: OpKind | None = None) -> None:
        for f in funcs:
            rows[f] = OpEntry(kind, impl, fast, product)

    fresh, scalar, power, move = fastpath._fresh, fastpath._scalar, fastpath._power, fastpath._move
    # copies and views of the whole tensor
    row([T.clone, torch.clone, T.__neg__, T.__pos__, T.__abs__], PRESERVING, fast=fresh)
    row([T.detach, torch.detach], PRESERVING, fast=fastpath._detach)
    row([T.detach_, T.requires_grad_, T.pin_memory], PRESERVING)
    row([T.to, T.cpu, T.cuda, T.float, T.double, T.half, T.bfloat16, T.int, T.long, T.bool,
         T.type], PRESERVING, fast=move)
    # elementwise ops on values only (the in-place forms on the general path)
    row(_forms(VALUES_ONLY, inplace=False), PRESERVING, fast=fresh)
    row([getattr(T, n + "_") for n in VALUES_ONLY if hasattr(T, n + "_")], PRESERVING)
    row([T.pow, torch.pow, T.__pow__], positive_power, fast=power)
    row([T.pow_, T.__ipow__], positive_power)
    row([T.mul, torch.mul, T.__mul__, T.__rmul__, T.div, torch.div, T.__truediv__],
        scalar_else_new, fast=scalar)
    row([T.mul_, T.__imul__, T.div_, T.__itruediv__], scalar_else_new)
    # torch builds new index data
    row([T.coalesce, T.add, torch.add, T.__add__, T.__radd__, T.sub, torch.sub, T.__sub__,
         T.to_sparse, T.to_sparse_coo, T.to_sparse_csr, T.to_sparse_csc, T.to_sparse_bsr,
         T.to_sparse_bsc], NEW_INDICES)
    row([T.add_, T.__iadd__, T.sub_, T.__isub__], NEW_INDICES, _add_inplace)
    row([T.copy_], NEW_INDICES, _copy)
    row([T.data.__set__], PRESERVING, _set_data)  # type: ignore[attr-defined]
    row([T.contiguous], PRESERVING, _contiguous)
    # the zero-copy transposes (transpose.py); torch's own views on the fast path
    view = fastpath._view
    row([T.transpose, torch.transpose], PRESERVING, transpose._transpose, fast=view)
    row([torch.swapaxes, T.swapaxes, torch.swapdims, T.swapdims], PRESERVING,
        transpose._transpose)
    row([T.t, torch.t], PRESERVING, transpose._t, fast=view)
    row([T.mT.__get__], PRESERVING, transpose._mT, fast=view)  # type: ignore[attr-defined]
    row([T.adjoint, torch.adjoint, T.mH.__get__], PRESERVING,  # type: ignore[attr-defined]
        transpose._adjoint)
    # the products: the one list of product functions (safesparse.operators.functions), their
    # arguments bound by binding.py, each with its result's kind and its fast-path handler
    fast_products = {"mm": fastpath._product, "matmul": fastpath._product,
                     "sparse_mm": fastpath._sparse_mm}
    for f, how in PRODUCT_FUNCTIONS.items():
        row([f], NEW_INDICES, _product_route, fast=fast_products.get(how),
            product=OpKind.UNKNOWN if how == "rmatmul" else NEW_INDICES)
    return rows


_ROWS: Final = builtin_rows()
#: The product functions, each with the kind of the product route's result (read off the rows).
_PRODUCT_KINDS: Final = {f: r.product for f, r in _ROWS.items() if r.product is not None}


def register_builtin_ops(cls: type[SafeSparseTensor]) -> None:
    """Register safesparse's own rows (:func:`builtin_rows`) in ``cls``'s op table and give the
    fast path its handlers from them; the fast path then applies to each of those ops while it
    keeps this row (an op a user re-registers takes the general path and its new entry). Called
    once, by ``safesparse/__init__.py``, when the package is imported."""
    cls.set_op_table({**cls.op_table(), **_ROWS})
    fastpath.FAST.clear()  # (the dict the dispatcher reads: its handlers come from the rows)
    fastpath.FAST.update({f: r.fast for f, r in _ROWS.items() if r.fast is not None})
    cls._freeze_fast_path()


__all__ = [
    "VALUES_ONLY",
    "builtin_rows",
    "positive_power",
    "register_builtin_ops",
    "scalar_else_new",
]

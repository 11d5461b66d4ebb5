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
included) leaves the result unchecked. Strided results are never wrapped. Extend the table
with ``SafeSparseTensor.classify([funcs], kind)`` or
``@SafeSparseTensor.implements([funcs], kind)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from . import blocks, checked
from .errors import InvariantError
from .metadata import compressed_members, values_of
from .tensor import (
    REPAIRS,
    OpKind,
    SafeSparseTensor,
    _inputs_checked,
    _is_checked,
    after_inplace,
    wrap_results,
)
from .validation import validate_tensor

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


#: Zero-preserving elementwise ops torch applies to the values of a sparse tensor alone (f(0) is
#: 0, so the index data of the result is the input's): function, method and in-place forms.
VALUES_ONLY = (
    "abs", "absolute", "angle", "arcsin", "arcsinh", "arctan", "arctanh", "asin", "asinh",
    "atan", "atanh", "ceil", "conj_physical", "deg2rad", "erf", "erfinv", "expm1", "fix",
    "floor", "frac", "isinf", "isnan", "isneginf", "isposinf", "log1p", "nan_to_num", "neg",
    "negative", "positive", "rad2deg", "relu", "round", "sgn", "sign", "signbit", "sin", "sinh",
    "sqrt", "square", "tan", "tanh", "trunc",
)


def _forms(names: tuple[str, ...]) -> list[Any]:
    """``torch.name``, ``Tensor.name`` and ``Tensor.name_`` for each name, where torch has them."""
    return [f for name in names
            for f in (getattr(torch, name, None), getattr(T, name, None),
                      getattr(T, name + "_", None))
            if f is not None]


SafeSparseTensor.classify([
    # copies and views of the whole tensor
    T.clone, torch.clone, T.detach, torch.detach, T.detach_, T.requires_grad_,
    T.to, T.cpu, T.cuda, T.float, T.double, T.half, T.bfloat16, T.int, T.long, T.bool,
    T.type, T.pin_memory, T.__neg__, T.__pos__, T.__abs__,
    # elementwise ops on values only
    *_forms(VALUES_ONLY),
], PRESERVING)
SafeSparseTensor.classify([T.pow, torch.pow, T.__pow__, T.pow_, T.__ipow__], positive_power)
SafeSparseTensor.classify([
    T.mul, torch.mul, T.__mul__, T.__rmul__, T.div, torch.div, T.__truediv__,
    T.mul_, T.__imul__, T.div_, T.__itruediv__,
], scalar_else_new)
SafeSparseTensor.classify([
    T.coalesce, T.add, torch.add, T.__add__, T.__radd__, T.sub, torch.sub, T.__sub__,
    T.to_sparse, T.to_sparse_coo, T.to_sparse_csr, T.to_sparse_csc, T.to_sparse_bsr,
    T.to_sparse_bsc,
], NEW_INDICES)


@SafeSparseTensor.implements([T.contiguous], PRESERVING)
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


@SafeSparseTensor.implements([torch.sparse.mm], NEW_INDICES)
def _sparse_mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch 2.13's ``torch.sparse.mm`` of two CSC tensors returns a broken structure with the
    values lost; here it is computed as ``(b.T @ a.T).T`` through the CSR kernel (the
    transposes are free), giving the CSC result torch means."""
    before = _inputs_checked(args, kwargs)
    a, b = (*args, None, None)[:2]
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.layout == b.layout == torch.sparse_csc and a.dim() == b.dim() == 2
            and not kwargs):
        product = torch.mm(_as_csr_transpose(b), _as_csr_transpose(a))
        if product.layout == torch.sparse_csr:
            ret = torch.sparse_csc_tensor(
                product.crow_indices(), product.col_indices(), product.values(),
                (product.shape[1], product.shape[0]), dtype=product.dtype,
                device=product.device, check_invariants=False)
        else:
            ret = product
    else:
        ret = func(*args, **kwargs)
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


def _addmm_operands(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, Any, Any, Any, Any] | None:
    """``(input, mat1, mat2, beta, alpha)`` of an addmm call, or None for forms we leave to
    torch (``out=``, extra positional arguments)."""
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    return (*args, kwargs.get("beta", 1), kwargs.get("alpha", 1))


def _addmm_route(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.addmm`` / ``Tensor.addmm`` / ``torch.sparse.addmm`` with compressed sparse
    operands. torch 2.13 crashes (segfault) or returns a wrong result when ``input``, ``mat1``
    and ``mat2`` are all 2-D CSC tensors; here that case is computed as the transpose of
    ``addmm(input.T, mat2.T, mat1.T)`` through the CSR kernel (the transposes are free) and
    returned as CSC. Every other combination runs torch's kernel (CPU refuses the other CSC
    mixes with a clear ``RuntimeError``); sparse results are validated (``NEW_INDICES``).
    A BSR/BSC ``mat1`` or ``mat2`` with dense other operands takes the block route first
    (:func:`safesparse.blocks.block_call`), where torch 2.13 has no CPU kernel."""
    call = blocks.block_call(func, args, kwargs)
    if call is not None:
        return blocks.block_product(call)
    before = _inputs_checked(args, kwargs)
    ops = _addmm_operands(func, args, kwargs)
    if ops is not None:
        c, a, b, beta, alpha = ops
        if all(isinstance(x, torch.Tensor) and x.layout == torch.sparse_csc and x.dim() == 2
               for x in (c, a, b)):
            r = torch.addmm(_as_csr_transpose(c), _as_csr_transpose(b), _as_csr_transpose(a),
                            beta=beta, alpha=alpha)
            ret = torch.sparse_csc_tensor(
                r.crow_indices(), r.col_indices(), r.values(), (r.shape[1], r.shape[0]),
                dtype=r.dtype, device=r.device, check_invariants=False)
            return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)
    ret = func(*args, **kwargs)
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


SafeSparseTensor.implements([torch.addmm, T.addmm, torch.sparse.addmm], NEW_INDICES)(
    _addmm_route)


def _same_index_data(t: Any, other: Any) -> bool:
    """Both checked SafeSparseTensors on one index structure with the same geometry."""
    if not (isinstance(t, SafeSparseTensor) and isinstance(other, SafeSparseTensor)):
        return False
    if t.layout != other.layout or t.shape != other.shape:
        return False
    a, b = checked.record(t), checked.record(other)
    return (a is not None and b is not None and checked.same_index_data(a, b)
            and _is_checked(t) and _is_checked(other))


@SafeSparseTensor.implements([T.add_, T.__iadd__, T.sub_, T.__isub__], NEW_INDICES)
def _add_inplace(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.add_(g)`` where ``g`` has the same checked index data as ``t`` (an optimizer step
    with a gradient built on the parameter's indices) is a values-only update: ``t`` stays
    checked. Anything else runs torch's kernel, which builds new index data (validated)."""
    before = _inputs_checked(args, kwargs)
    t = args[0]
    other: Any = args[1] if len(args) > 1 else kwargs.get("other")
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    if (before and _same_index_data(t, other) and set(kwargs) <= {"other", "alpha"}
            and not (torch.is_grad_enabled() and (t.requires_grad or other.requires_grad))):
        sign = -1 if func in (T.sub_, T.__isub__) else 1
        values_of(t).add_(values_of(other), alpha=sign * alpha)
        after_inplace(t, keeps_indices=True)
        return t
    ret = func(*args, **kwargs)
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


@SafeSparseTensor.implements([T.copy_], NEW_INDICES)
def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)`` from a checked tensor of the same layout and shape (e.g.
    ``load_state_dict``) leaves ``dst`` holding ``src``'s valid index data: checked without
    validation. Other sources: torch's copy, then validation as for any new index data."""
    dst, src = args[0], args[1]
    before = _inputs_checked(args, kwargs)
    same = (before and isinstance(src, SafeSparseTensor) and src.layout == dst.layout
            and src.shape == dst.shape)
    snap = checked.snapshot(checked.current(dst))[0] if same else {}
    ret = func(*args, **kwargs)
    if same and ret is dst and _is_checked(src) and checked.mark_copied(
            checked.current(dst), checked.geometry_of(dst), snap):
        return dst
    return wrap_results(func, NEW_INDICES, args, kwargs, ret, before=before)


@SafeSparseTensor.implements([T.data.__set__], PRESERVING)  # type: ignore[attr-defined]
def _set_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.data = new`` (``nn.Module._apply`` does this, e.g. ``module.to(dtype)``): ``t`` now
    holds ``new``'s data and is checked exactly when ``new`` was."""
    t, new = args[0], args[1]
    was_checked = _is_checked(new)
    func(*args, **kwargs)
    rec = checked.renew(t)  # its members were replaced: a record on the new ones
    if was_checked and _is_checked(new) and _metadata_ok(t):
        checked.mark_derived(rec, checked.geometry_of(t))


def _metadata_ok(t: torch.Tensor) -> bool:
    """The O(1) invariants of ``t`` hold (torch 2.13's ``t.data = new`` on a compressed tensor
    takes ``new``'s dtype but keeps ``t``'s members: 1.4 then fails, and ``t`` stays unchecked
    until validation refuses it, before a kernel reads values of the wrong width)."""
    try:
        validate_tensor(t, check_indices=False)
    except InvariantError:
        return False
    return True


__all__ = [
    "VALUES_ONLY",
    "positive_power",
    "scalar_else_new",
]

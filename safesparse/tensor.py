"""``SafeSparseTensor``: a torch sparse tensor that remembers it was checked.

The class is a real ``torch.Tensor`` (built with ``Tensor._make_subclass``, the one subclassing
route torch 2.13 allows for sparse layouts) whose ``__torch_function__`` runs every torch
function on the underlying tensor and re-wraps sparse results, deciding their checked state
from the per-class op table (:mod:`safesparse.ops`).

Autograd: ``_make_subclass`` detaches, so wrapping and unwrapping a tensor that takes part in
autograd go through identity :class:`torch.autograd.Function` s (:class:`_ToSafe`,
:class:`_ToPlain`), which keep the graph connected.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch._C import DisableTorchFunctionSubclass

from . import checked
from ._compile import not_traced
from .checked import IndexKey, IndexState
from .debug import is_debug
from .errors import InvariantError
from .invariants import SPARSE_LAYOUTS
from .validation import compressed_members, validate_tensor

F = TypeVar("F", bound=Callable[..., Any])


class OpKind(enum.Enum):
    """How an operation's sparse result relates to the invariants of its inputs."""

    PRESERVING = "preserving"  # same index data (or a copy of it): checked, no validation
    TRUSTED = "trusted"  # torch built new indices itself: checked outside debug mode
    UNKNOWN = "unknown"  # anything else: the result is unchecked


Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
Classifier = Callable[[tuple[Any, ...], dict[str, Any]], OpKind]


@dataclass(frozen=True)
class OpEntry:
    """One row of the op table: the kind of the op, or a function deciding it from the args,
    and optionally an implementation replacing torch's (e.g. the zero-copy transposes)."""

    kind: OpKind | Classifier
    impl: Handler | None = None

    def kind_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
        return self.kind if isinstance(self.kind, OpKind) else self.kind(args, kwargs)


# ---------------------------------------------------------------------------------------------
# Members and keys of plain torch sparse tensors


def index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index tensors of a sparse tensor (compressed + plain, or the COO indices)."""
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            return (t._indices(),)
        return compressed_members(t)


def geometry_of(t: torch.Tensor) -> Hashable:
    """What, beyond the index tensors themselves, their validity depends on.

    Cached on a SafeSparseTensor against its shape (the only input that can change while the
    index members stay the same tensors)."""
    with DisableTorchFunctionSubclass():
        shape = t.shape
        cached = getattr(t, "_ss_geometry", None)
        if cached is not None and cached[0] == shape:
            return cast(Hashable, cached[1])
        geometry = _geometry(t)
        if isinstance(t, SafeSparseTensor):
            t._ss_geometry = (shape, geometry)
        return geometry


def _geometry(t: torch.Tensor) -> Hashable:
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            return ("coo", tuple(t.shape[: t.sparse_dim()]), t.is_coalesced())
        compressed, _ = compressed_members(t)
        m = compressed.dim() - 1
        blocked = t.layout in (torch.sparse_bsr, torch.sparse_bsc)
        vshape = t.values().shape
        b0, b1 = (vshape[m + 1], vshape[m + 2]) if blocked else (1, 1)
        rows, cols = t.shape[m], t.shape[m + 1]
        row_compressed = t.layout in (torch.sparse_csr, torch.sparse_bsr)
        extent, block = (cols, b1) if row_compressed else (rows, b0)
        return compressed_geometry(compressed.shape[-1] - 1, extent // block if block else 0)


def compressed_geometry(n_compressed: int, n_plain: int) -> Hashable:
    return ("compressed", n_compressed, n_plain)


def key_of(t: torch.Tensor) -> IndexKey:
    return checked.index_key(index_members(t))


# ---------------------------------------------------------------------------------------------
# The class


_T = torch.Tensor
#: Runs a torch function with subclass dispatch off and returns its raw result (torch's C impl).
_run_plain: Callable[..., Any] = torch._C._disabled_torch_function_impl
#: Ops that only read metadata or return member tensors: passed straight to torch (also in
#: debug mode: they run no kernel over the index data and return nothing sparse).
_GETTERS = ("shape", "layout", "dtype", "device", "requires_grad", "is_sparse", "grad_fn",
            "is_leaf", "ndim", "is_cuda")
_INSPECTION: frozenset[Callable[..., Any]] = frozenset({
    *(getattr(_T, name).__get__ for name in _GETTERS),
    _T.dim, _T.size, _T.numel, _T.nelement, _T.sparse_dim, _T.dense_dim, _T._nnz,
    _T.crow_indices, _T.col_indices, _T.ccol_indices, _T.row_indices, _T.values,
    _T._values, _T._indices, _T.indices, _T.is_coalesced, _T.data_ptr, _T.element_size,
    _T.get_device, _T.is_floating_point, _T.is_complex,
})


class SafeSparseTensor(torch.Tensor):
    """A torch sparse tensor (COO, CSR, CSC, BSR, BSC) that remembers it was checked.

    Build one with the safe factories (``ss.sparse_csr_tensor`` ...) or ``ss.validate``. Every
    torch function works on it; sparse results are ``SafeSparseTensor`` again, strided results
    and member tensors are plain tensors.
    """

    _ss_state: IndexState | None  # the state of the index structure this tensor is built on
    _ss_trusted: bool  # False: built unchecked (check_invariants=False, unknown op)
    _ss_geometry: tuple[torch.Size, Hashable]  # cache of geometry_of(self) for a shape
    _OPS: ClassVar[dict[Callable[..., Any], OpEntry]] = {}

    @classmethod
    def implements(
        cls, funcs: Iterable[Callable[..., Any]], kind: OpKind | Classifier = OpKind.UNKNOWN
    ) -> Callable[[F], F]:
        """Decorator registering ``impl(func, args, kwargs)`` for each of ``funcs``."""

        def register(impl: F) -> F:
            for func in funcs:
                cls._OPS[func] = OpEntry(kind, impl)
            return impl

        return register

    @classmethod
    def classify(cls, kind: OpKind | Classifier, funcs: Iterable[Callable[..., Any]]) -> None:
        """Record the kind of each of ``funcs`` (torch's own implementation runs)."""
        for func in funcs:
            cls._OPS[func] = OpEntry(kind)

    @classmethod
    def op_table(cls) -> dict[Callable[..., Any], OpEntry]:
        """A copy of the table (func -> entry)."""
        return dict(cls._OPS)

    @classmethod
    def set_op_table(cls, table: dict[Callable[..., Any], OpEntry]) -> None:
        """Replace the whole table, e.g. with a copy taken by :meth:`op_table` earlier."""
        cls._OPS.clear()
        cls._OPS.update(table)

    @classmethod
    @not_traced
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _INSPECTION:
            # Metadata and member accessors: no sparse result, no kernel over the index data.
            return _run_plain(func, types, args, kwargs or {})
        kwargs = kwargs or {}
        args = tuple(args)
        entry = cls._OPS.get(func)
        # Everything below sees SafeSparseTensors as plain tensors: no re-entry from our own
        # attribute accesses, and torch's results come back unwrapped for us to wrap.
        with DisableTorchFunctionSubclass():
            debug = is_debug()
            if debug:
                _validate_inputs(func, args, kwargs)
            if entry is not None and entry.impl is not None:
                return entry.impl(func, args, kwargs)
            kind = entry.kind_for(args, kwargs) if entry is not None else OpKind.UNKNOWN
            # An in-place op bumps the tensor's version counter, which its index members share
            # (torch 2.13), so a known-safe in-place op must re-record the state it keeps.
            refresh = kind is not OpKind.UNKNOWN and _is_inplace(func) and not debug and all(
                _is_checked(x) for x in _sparse_inputs(args, kwargs))
            ret = func(*args, **kwargs)
            if refresh and args and ret is args[0] and isinstance(ret, SafeSparseTensor):
                state_of(ret).retake(ret)
                return ret
            return wrap_results(func, kind, args, kwargs, ret)

    def __deepcopy__(self, memo: dict[int, Any]) -> SafeSparseTensor:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():
            out = cast(SafeSparseTensor, self.clone())
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        with DisableTorchFunctionSubclass():
            body: str = torch.Tensor.__repr__(self)  # type: ignore[no-untyped-call]
        prefix = f"{type(self).__name__}("
        body = body[len(prefix):] if body.startswith(prefix) else body + ")"
        return f"{prefix}checked={_is_checked(self)}, {body}"


# ---------------------------------------------------------------------------------------------
# Wrapping, unwrapping and checked state


class _ToSafe(torch.autograd.Function):
    """Identity from a plain sparse tensor to a SafeSparseTensor, keeping the graph."""

    @staticmethod
    def forward(ctx: Any, plain: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an undefined grad stays undefined (no sparse zeros)
        return torch.Tensor._make_subclass(SafeSparseTensor, plain, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


class _ToPlain(torch.autograd.Function):
    """Identity from a SafeSparseTensor to the plain torch tensor, keeping the graph."""

    @staticmethod
    def forward(ctx: Any, safe: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an undefined grad stays undefined (no sparse zeros)
        return torch.Tensor._make_subclass(torch.Tensor, safe, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


def wrap(plain: torch.Tensor, *, leaf_requires_grad: bool = False,
         key: IndexKey | None = None) -> SafeSparseTensor:
    """A SafeSparseTensor sharing ``plain``'s data, joined to its index structure's state, not
    yet checked (see :func:`prove` and :func:`derive`). ``leaf_requires_grad`` makes a
    new autograd leaf; a ``plain`` that requires grad stays connected to its graph instead.
    ``key`` is the index key of the tensors ``plain`` was built from, if the caller has it.
    """
    if plain.requires_grad:
        out = _ToSafe.apply(plain)  # type: ignore[no-untyped-call]
    else:
        out = torch.Tensor._make_subclass(SafeSparseTensor, plain, leaf_requires_grad)
    assert isinstance(out, SafeSparseTensor)
    out._ss_trusted = False
    _join(out, index_members(out), key)
    return out


def _join(t: SafeSparseTensor, members: tuple[torch.Tensor, ...],
          key: IndexKey | None = None) -> IndexState:
    # A caller's key is reused when the members are still those tensors (torch did not copy).
    if key is None or [m.data_ptr() for m in members] != [k[0] for k in key]:
        key = checked.index_key(members)
    state = checked.state_for(key)
    state.witness(t, members)
    t._ss_state = state
    return state


def state_of(t: SafeSparseTensor) -> IndexState:
    """The state of ``t``'s index structure, joining it (witnessing ``t``'s members) if ``t``
    is new to it or its members were replaced since."""
    state = t._ss_state
    members = index_members(t)
    if state is None or state.key != checked.index_key(members):
        state = _join(t, members)
    return state


def witness_inputs(t: SafeSparseTensor, inputs: Iterable[torch.Tensor]) -> None:
    """The caller's index tensors that ``t`` (just wrapped) shares storage with can write it:
    watch them too."""
    state = t._ss_state if t._ss_state is not None else state_of(t)
    ptrs = {entry[0] for entry in state.key}  # the data pointers of t's index members
    for x in inputs:
        if x.data_ptr() in ptrs and x.numel() and not isinstance(x, SafeSparseTensor):
            state.witness(x, (x,))


def prove(t: SafeSparseTensor, geometry: Hashable | None = None) -> None:
    """``t`` (just wrapped, or just given its current state) was validated: record it as
    checked. ``geometry`` is ``geometry_of(t)`` if the caller knows it."""
    state = t._ss_state if t._ss_state is not None else state_of(t)
    state.prove(geometry_of(t) if geometry is None else geometry)
    t._ss_trusted = True


def derive(t: SafeSparseTensor, geometry: Hashable | None = None) -> None:
    """``t`` (just wrapped) came from checked tensors through a known op: checked, without
    validation, as long as its index structure's state holds."""
    state = t._ss_state if t._ss_state is not None else state_of(t)
    t._ss_trusted = state.derive(geometry_of(t) if geometry is None else geometry)


@not_traced
def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain torch tensor behind ``t`` (no copy; autograd stays connected)."""
    if not isinstance(t, SafeSparseTensor):
        return t
    if t.requires_grad:
        with DisableTorchFunctionSubclass():
            out: torch.Tensor = _ToPlain.apply(t)  # type: ignore[no-untyped-call]
        return out
    return torch.Tensor._make_subclass(torch.Tensor, t, False)


def _is_checked(t: torch.Tensor) -> bool:
    if not isinstance(t, SafeSparseTensor) or not getattr(t, "_ss_trusted", False):
        return False
    state = t._ss_state
    return (state is not None and state.key == key_of(t)
            and state.is_proven(geometry_of(t)))


@not_traced
def is_checked(t: torch.Tensor) -> bool:
    """Whether ``t`` is a SafeSparseTensor whose index data is known valid and unmodified."""
    return _is_checked(t)


@not_traced
def validate(t: torch.Tensor) -> SafeSparseTensor:
    """Validate ``t`` (once) and return it as a checked SafeSparseTensor sharing its storage.

    A tensor already checked is not validated again (outside debug mode). Raises
    :class:`InvariantError` for a broken invariant and ``TypeError`` for a non-sparse tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"validate() expects a torch sparse tensor, got {type(t).__name__}")
    with DisableTorchFunctionSubclass():
        if t.layout not in SPARSE_LAYOUTS:
            raise TypeError(f"validate() expects a sparse tensor, got layout {t.layout}")
        debug = is_debug()
        if not debug and _is_checked(t):
            checked.count("skipped")
            return t  # type: ignore[return-value]
        out = t if isinstance(t, SafeSparseTensor) else wrap(t)
        state = state_of(out)
        if not debug and _fresh(out) and state.is_proven(geometry_of(out)):
            validate_tensor(out, check_indices=False)  # indices proven; metadata is O(1)
            checked.count("skipped")
        else:
            validate_tensor(out)
            checked.count("validations")
        prove(out)
    return out


def _fresh(t: torch.Tensor) -> bool:
    """Whether ``t``'s own version counter never moved: no write through ``t`` that a proof
    made before ``t`` was known could have missed."""
    return all(m._version == 0 for m in index_members(t))


_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})


def _is_inplace(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


def op_name(func: Callable[..., Any]) -> str:
    """A readable name: ``mul``, or ``mT`` for a property getter."""
    name: str = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a property: name the descriptor, not its getter
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _sparse_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[SafeSparseTensor]:
    found = [a for a in args if isinstance(a, SafeSparseTensor)]
    for a in args:
        if isinstance(a, (list, tuple)):
            found += [x for x in a if isinstance(x, SafeSparseTensor)]
    found += [v for v in kwargs.values() if isinstance(v, SafeSparseTensor)]
    return found


def _validate_inputs(func: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
    """Debug mode: inputs whose checked state was lost are validated before the op runs."""
    for t in _sparse_inputs(args, kwargs):
        if t.layout in SPARSE_LAYOUTS and not _is_checked(t):
            _validate_in_debug(func, t)


def wrap_results(
    func: Callable[..., Any],
    kind: OpKind,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ret: Any,
    geometry: Hashable | None = None,
) -> Any:
    """Re-wrap the sparse tensors in ``ret`` and give them their checked state. ``geometry``:
    that of a single sparse result, when the op knows it (a transpose keeps its input's)."""
    if isinstance(ret, torch.Tensor):
        return _wrap_one(func, kind, args, kwargs, ret, geometry)
    if isinstance(ret, (tuple, list)):
        return type(ret)(wrap_results(func, kind, args, kwargs, r) for r in ret)
    return ret


def _wrap_one(
    func: Callable[..., Any],
    kind: OpKind,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ret: torch.Tensor,
    geometry: Hashable | None = None,
) -> torch.Tensor:
    if ret.layout not in SPARSE_LAYOUTS:
        return ret
    if isinstance(ret, SafeSparseTensor):
        # An in-place op returned its input: in debug mode the result is validated like any
        # other; otherwise is_checked notices if the op replaced or wrote the index members.
        if is_debug():
            _validate_in_debug(func, ret)
        return ret
    inputs = _sparse_inputs(args, kwargs)
    out = wrap(ret)
    if is_debug():
        _validate_in_debug(func, out)
    elif kind is not OpKind.UNKNOWN and inputs and all(_is_checked(t) for t in inputs):
        derive(out, geometry)  # derived from checked tensors by a known op: no validation
    return out


def _validate_in_debug(func: Callable[..., Any], t: SafeSparseTensor) -> None:
    """Debug mode: validate ``t`` fully (no cache), naming ``func`` in the error."""
    try:
        validate_tensor(t)
    except InvariantError as err:
        raise err.with_context(op=op_name(func)) from None
    checked.count("validations")
    state_of(t)  # an in-place op may have replaced the members
    prove(t)

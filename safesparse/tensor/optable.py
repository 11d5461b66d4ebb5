"""The op table's vocabulary: the kinds of operations and the table's row, one per torch
function, holding everything safesparse knows about that function.

Two tables of rows:

* the **inspection rows** here (:data:`INSPECTION_ROWS`): the torch functions that only read
  metadata or hand out members, which no check or wrapping applies to (their rows say they read
  no index data, and whether they hand out an index member); :data:`INSPECTION` and
  :data:`INDEX_ACCESSORS` are read off them;
* the **op table** of :class:`safesparse.SafeSparseTensor` (:meth:`~SafeSparseTensor.op_table`):
  a row per operation with the kind of its sparse result, the implementation replacing torch's,
  the fast path's handler and, for the products, the kind of the product route's result.
  safesparse's own rows are declared in one function, :func:`safesparse.tensor.ops.builtin_rows`,
  and registered by one explicit call when the package is imported
  (:func:`safesparse.tensor.ops.register_builtin_ops`); adding an op is adding its row there.
  The table is the class's; a subclass shares it (there is one table, not one per class).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

__all__ = [
    "INDEX_ACCESSORS",
    "INSPECTION",
    "INSPECTION_ROWS",
    "VALUES_ONLY",
    "Classifier",
    "Handler",
    "Inspection",
    "OpEntry",
    "OpKind",
    "op_name",
]


class OpKind(enum.Enum):
    """How an operation's sparse result relates to the index data of its inputs.

    The kinds of the op table (:meth:`SafeSparseTensor.classify`):

    * ``PRESERVING``: the result has its input's index data (a view or a copy): checked
      without validation when every sparse input is checked before and after the op.
    * ``NEW_INDICES``: torch builds new index data (coalesce, add, conversions, sparse @
      sparse): the result is validated before it counts as checked, repaired where torch is
      known to build it wrongly, and refused (``InvariantError`` naming the op) otherwise.
    * ``UNKNOWN``: anything else (the default for ops not in the table): the result is
      unchecked.
    """

    PRESERVING = "preserving"  # keeps the inputs' index data (a view or a copy): no validation
    NEW_INDICES = "new_indices"  # torch builds new index data: validated before it is checked
    UNKNOWN = "unknown"  # anything else: the result is unchecked


Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
Classifier = Callable[[tuple[Any, ...], dict[str, Any]], OpKind]


@dataclass(frozen=True)
class OpEntry:
    """One row of the op table: the kind of the op, or a function deciding it from the args;
    optionally an implementation replacing torch's (e.g. the zero-copy transposes); the fast
    path's handler for the op (:mod:`safesparse.tensor.fastpath`: ``fast(cls, func, types,
    args, fallback)``, run before anything else when the call has no keyword arguments); and,
    for a product function, the kind of the sparse result the product route returns
    (``product``)."""

    kind: OpKind | Classifier
    impl: Handler | None = None
    fast: Callable[..., Any] | None = None
    product: OpKind | None = None

    def kind_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
        return self.kind if isinstance(self.kind, OpKind) else self.kind(args, kwargs)


_T = torch.Tensor
#: Runs a torch function with subclass dispatch off and returns its raw result (torch's C impl).
_run_plain: Callable[..., Any] = torch._C._disabled_torch_function_impl
_aten = torch.ops.aten


@dataclass(frozen=True)
class Inspection:
    """The row of a torch function that reads no index data through a kernel and returns
    nothing sparse (metadata, member accessors): passed straight to torch, in debug mode too.
    ``hands_out``: it returns an index member, which shares the tensor's version counter (the
    checked state is told: ``checked.hand_out``)."""

    hands_out: bool = False


def _inspection_rows() -> dict[Callable[..., Any], Inspection]:
    rows: dict[Callable[..., Any], Inspection] = {}
    reads, hands = Inspection(), Inspection(hands_out=True)
    # metadata getters (properties), methods, and their aten packets and overloads
    for name in ("shape", "layout", "dtype", "device", "requires_grad", "is_sparse", "grad_fn",
                 "is_leaf", "ndim", "is_cuda", "_base", "grad", "nbytes", "itemsize", "names",
                 "_version", "is_sparse_csr", "is_meta", "is_quantized", "is_nested", "is_cpu",
                 "output_nr", "_cdata", "retains_grad", "name", "is_mkldnn", "is_xpu", "is_mps",
                 "is_ipu", "is_xla", "is_vulkan", "is_mtia", "is_maia"):
        if hasattr(getattr(_T, name, None), "__get__"):
            rows[getattr(_T, name).__get__] = reads
    for f in (_T.dim, _T.size, _T.numel, _T.nelement, _T.sparse_dim, _T.dense_dim, _T._nnz,
              _T.values, _T._values, _T.is_coalesced, _T.data_ptr, _T.element_size,
              _T.get_device, _T.is_floating_point, _T.is_complex, _T._is_view, _T.is_inference,
              _T.__len__, _T.is_contiguous, _T.storage_offset, _T.stride, _T.__format__,
              _T.is_pinned, _T.is_signed, _aten.size.int,
              torch._has_compatible_shallow_copy_type):  # (compares TensorImpl types)
        rows[f] = reads
    for name in ("values", "_values", "_nnz", "sparse_dim", "dense_dim", "is_coalesced",
                 "_dimI", "_dimV", "dim", "numel", "size"):
        rows[getattr(_aten, name)] = rows[getattr(_aten, name).default] = reads
    # the accessors that hand out index members, torch's aten overloads included
    # (decompositions and compiled code call those)
    for name in ("crow_indices", "col_indices", "ccol_indices", "row_indices", "_indices",
                 "indices"):
        for f in (getattr(_T, name), getattr(_aten, name), getattr(_aten, name).default):
            rows[f] = hands
    return rows


#: The inspection rows: torch function -> :class:`Inspection`.
INSPECTION_ROWS: Final[dict[Callable[..., Any], Inspection]] = _inspection_rows()
#: The functions of :data:`INSPECTION_ROWS` (read off them: the dispatcher's set).
INSPECTION: Final[frozenset[Callable[..., Any]]] = frozenset(INSPECTION_ROWS)
#: The inspection rows that hand out index members (read off them).
INDEX_ACCESSORS: Final[frozenset[Callable[..., Any]]] = frozenset(
    f for f, row in INSPECTION_ROWS.items() if row.hands_out)


_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__",
                              "__ifloordiv__", "__imod__", "__iand__", "__ior__", "__ixor__",
                              "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
                              "__delitem__", "__set__"})


def _mutates(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes its first argument in place (torch's naming: a trailing
    underscore, or an in-place dunder)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


def op_name(func: Callable[..., Any]) -> str:
    """A readable name: ``mul``, or ``mT`` for a property getter."""
    name: str = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):  # a property: name the descriptor, not its accessor
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


#: Zero-preserving elementwise ops torch applies to the values of a sparse tensor alone (f(0) is
#: 0, so the index data of the result is the input's): function, method and in-place forms.
#: The op table (ops.py) lists them as preserving; the fast path (fastpath.py) takes them.
VALUES_ONLY = (
    "abs", "absolute", "angle", "arcsin", "arcsinh", "arctan", "arctanh", "asin", "asinh",
    "atan", "atanh", "ceil", "conj_physical", "deg2rad", "erf", "erfinv", "expm1", "fix",
    "floor", "frac", "isinf", "isnan", "isneginf", "isposinf", "log1p", "nan_to_num", "neg",
    "negative", "positive", "rad2deg", "relu", "round", "sgn", "sign", "signbit", "sin", "sinh",
    "sqrt", "square", "tan", "tanh", "trunc",
)

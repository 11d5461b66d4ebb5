"""Where a sparse matrix enters compiled code: :func:`as_operand`, :func:`from_operand`,
:func:`compile`.

Validation stays here, outside the graph: :func:`as_operand` validates a tensor that is not
checked (O(1) for a checked one) and hands its index members out (they carry its proof, which
the operators confirm in O(1) at every call); :func:`from_operand` rebuilds the checked
``SafeSparseTensor`` on them (a proven rebuild: no O(nnz) check). :func:`compile` is
``torch.compile`` turning ``SafeSparseTensor`` arguments into operands at each call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..base.layouts import BY_SHORT_NAME, COMPRESSED_LAYOUTS, SHORT_NAMES, compressed_members
from ..factories import sparse_compressed_tensor
from ..operators.library import check_matrix
from ..tensor import SafeSparseTensor, validate
from .operand import FROM_OPERAND, SparseOperand, make, read_values

__all__ = ["as_operand", "compile", "from_operand"]



def as_operand(a: torch.Tensor) -> SparseOperand:
    """A sparse matrix as an input of compiled or exported code (a :class:`SparseOperand`).

    ``torch.compile(fn, fullgraph=True)`` and ``torch.export`` take the result as an input;
    inside them ``A @ x``, ``x @ A``, ``torch.mm``, ``torch.sparse.mm``,
    ``torch.sparse.addmm``, ``F.linear(x, A, b)``, the transposes and scalar arithmetic on
    the values become ``safesparse`` operators (gradients reach the dense operand and the
    values); any other op is refused with its name.

    Args:
        a: a 2-D CSR, CSC, BSR or BSC tensor without dense dimensions (any block shape):
            O(1) for a checked one, validated once otherwise. A ``SparseOperand`` is
            returned as it is.

    Returns:
        The operand over ``a``'s proven index members and its values (no copy); gradients
        to its values reach ``a``'s values.

    Raises:
        InvariantError: ``a`` is not checked and not valid.
        TypeError: ``a`` is not a compressed sparse tensor.
    """
    if isinstance(a, SparseOperand):
        return a
    check_matrix("as_operand", a)
    checked = validate(a)
    c, p = compressed_members(checked)
    # the values as a tensor of their own (not a view of the sparse tensor: compiled code
    # guards on it), connected to a's autograd graph
    values = checked.values()
    if values.requires_grad:
        values = values + 0 if values._base is not None else values
    else:
        values = values.detach()
    return make(values, c, p, SHORT_NAMES[a.layout], (int(a.shape[0]), int(a.shape[1])))


def from_operand(a: SparseOperand) -> SafeSparseTensor:
    """The checked ``SafeSparseTensor`` behind an operand (also ``A.to_sparse()``).

    Call it outside compiled code (inside, it is a graph break). No O(nnz) check: the members
    are the proven ones (members written since are validated again, and refused if invalid).

    Args:
        a: a :class:`SparseOperand`.

    Returns:
        A checked ``SafeSparseTensor`` of the operand's layout and shape over its members
        and values; gradients reach the operand's values.
    """
    if not isinstance(a, SparseOperand):
        raise TypeError(f"from_operand: a SparseOperand is needed, got {type(a).__name__}")
    out: SafeSparseTensor = sparse_compressed_tensor(
        a.compressed, a.plain, read_values(a), (int(a.shape[0]), int(a.shape[1])),
        layout=BY_SHORT_NAME[a.layout_name])
    return out


FROM_OPERAND.append(from_operand)  # A.to_sparse()


def _convert(x: Any) -> Any:
    if isinstance(x, SafeSparseTensor) and x.layout in COMPRESSED_LAYOUTS \
            and x.dim() == 2 and x.dense_dim() == 0:
        return as_operand(x)
    return x


def compile(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``torch.compile`` for functions that take sparse matrices.

    Each call turns every 2-D CSR / CSC / BSR / BSC ``SafeSparseTensor`` argument, at any
    position of the arguments' pytree (lists, tuples, dicts), into a :class:`SparseOperand`
    (:func:`as_operand`: O(1) for a checked tensor; one written since it was checked is
    validated again) and calls the compiled function. Usable as ``ss.compile(fn, ...)``,
    ``@ss.compile`` or ``@ss.compile(fullgraph=True)``.

    Args:
        fn: the function to compile (``None``: return a decorator).
        kwargs: ``torch.compile``'s keyword arguments (``fullgraph``, ``dynamic``,
            ``backend``, ``mode`` ...).

    Returns:
        The compiled function (its ``compiled`` attribute is ``torch.compile``'s).
    """
    if fn is None:
        return functools.partial(compile, **kwargs)
    compiled = torch.compile(fn, **kwargs)

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        args, kw = pytree.tree_map(_convert, (args, kw))
        return compiled(*args, **kw)

    call.compiled = compiled  # type: ignore[attr-defined]
    return call

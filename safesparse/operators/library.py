"""The ``safesparse`` operators: sparse products over the dense members of a proven matrix.

Each sparse product (of :mod:`safesparse.nn`'s layers, of compiled operands) is one
``torch.library`` custom operator whose inputs are strided tensors only (the compressed and
plain index members, the values, the dense operand), so ``torch.compile(fullgraph=True)``
traces it as one node (its fake implementation gives the output's shape) and ``torch.export``
exports it. Their autograd formulas are operators too (gradient to the dense operand: the
transposed product; to the values: one small product per stored block; :mod:`.autograd`), so
compiled backward graphs hold them the same way.

Validation happens where data enters (the modules' construction, ``load_state_dict``, setting
a new weight, ``ss.as_operand``) and, for index members that are not the proven ones, here:
by the engine (the factories' validation), the proof made and remembered by the checked state
(:mod:`safesparse.state.members_proof`), never by a factory of the layers above. Every real
implementation asks :func:`safesparse.state.members_proof.confirm`, in O(1), whether the index
members it was given are proven for this geometry and unwritten since; members that are not
(written by DDP's default buffer broadcast, in a program loaded with ``torch.export.load``, in
shared memory, received through a process queue, made under inference mode) are validated
(O(nnz), the factories' validation) before any kernel reads them: invalid data raises
``InvariantError`` naming the operator and the member (the module's forward adds its key), valid
data is proven for the next call (never where the memory cannot be watched: validated at each
use). The metadata the kernels rely on beyond the proof (the values' shape against the number
of stored blocks, the block shape against the sizes, the dense operand's shape, dtypes and
devices) is checked next to it, also in O(1). In a child started by ``fork()`` the kernels run
with one intra-op thread (as validation does there).

``layout`` is passed as a string (``"csr"``, ``"csc"``, ``"bsr"``, ``"bsc"``): custom operators
take no ``torch.layout`` argument.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.library import custom_op

from ..base import originals as _originals
from ..base.debug_flag import is_debug
from ..base.layouts import (
    BLOCK_LAYOUTS,
    COMPRESSED_BY_SHORT_NAME,
    COMPRESSED_LAYOUTS,
    extents,
)
from ..catalog.errors import InvariantError
from ..engine.indices import per_batch_contiguous
from ..engine.metadata import CompressedMeta, check_compressed_metadata
from ..engine.validation import check_compressed_indices
from ..kernels import blocks as blockkernels
from ..kernels.pattern import matrix
from ..state import checked, members_proof
from ..state.writers import Validation, admit

__all__ = ["UnprovenMembersError", "check_matrix", "linear", "linear_bias", "linear_grad_input",
           "linear_grad_values", "matmul", "matmul_grad_input", "matmul_grad_values",
           "member_of"]

#: The operators' ``layout`` strings (``base.layouts.SHORT_NAMES`` of the compressed layouts).
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class UnprovenMembersError(RuntimeError):
    """A ``safesparse`` operator was given index members or values whose shapes cannot be
    those of its matrix (checked in O(1), before any validation or kernel)."""

    __module__ = "safesparse.nn"  # printed and pickled by its public name


def _refuse(op: str, what: str) -> UnprovenMembersError:
    return UnprovenMembersError(
        f"safesparse::{op}: {what}\n"
        "  The members' shapes must be those of the matrix the operator is given (compressed: "
        "n_compressed + 1 offsets, plain and values: one entry per stored element or block). "
        "Set a new pattern through the module (`layer.weight = W`, `load_state_dict`), which "
        "validates it.")


def _shapes(op: str, layout_name: str, compressed: torch.Tensor, plain: torch.Tensor,
            values: torch.Tensor, n_rows: int, n_cols: int) -> torch.layout:
    """The O(1) checks that the members and ``values`` can be those of an ``n_rows x n_cols``
    matrix of ``layout_name``; returns the layout. Run by the real implementations and by the
    fakes alike (``torch._check_with``: under a compile, sizes that are symbolic are checked,
    not specialised), so a compiled or exported program is refused at trace time where the
    real call would be."""
    layout = COMPRESSED_BY_SHORT_NAME.get(layout_name)
    if layout is None:
        raise ValueError(f"safesparse::{op}: unknown layout {layout_name!r} "
                         f"(one of {', '.join(COMPRESSED_BY_SHORT_NAME)})")
    blocked = layout in BLOCK_LAYOUTS
    if values.layout != torch.strided or values.dim() != (3 if blocked else 1):
        raise _refuse(op, f"values of shape {tuple(values.shape)} do not fit a 2-D "
                          f"{layout_name.upper()} matrix")
    if values.dtype not in _FLOATS:
        raise TypeError(f"safesparse::{op}: values dtype {values.dtype} is not supported "
                        "(float32, float64, float16, bfloat16)")
    r, c = (values.shape[1], values.shape[2]) if blocked else (1, 1)
    torch._check_with(UnprovenMembersError, r > 0 and c > 0 and n_rows % r == 0
                      and n_cols % c == 0, lambda: _refuse(
                          op, f"block shape ({r}, {c}) does not divide the size "
                              f"({n_rows}, {n_cols})").args[0])
    n_compressed = extents(layout, n_rows, n_cols, r, c)[0]
    fits = compressed.dim() == 1 and plain.dim() == 1 and values.device == plain.device
    torch._check_with(UnprovenMembersError, fits and compressed.shape[0] == n_compressed + 1
                      and plain.shape[0] == values.shape[0], lambda: _refuse(
                          op, f"members of shapes {tuple(compressed.shape)}, "
                              f"{tuple(plain.shape)}, {tuple(values.shape)} do not fit a "
                              f"{n_rows} x {n_cols} {layout_name.upper()} matrix").args[0])
    return layout


def _geometry(op: str, layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
              values: torch.Tensor, n_rows: int, n_cols: int
              ) -> tuple[torch.Tensor, torch.Tensor, dict[Any, Any] | None]:
    """Checks, in O(1), that the members (which :func:`_shapes` found to fit) are the proven
    ones for an ``n_rows x n_cols`` matrix of ``layout`` (validates them otherwise); returns
    the members the kernel reads (validated copies where the memory is written unseen:
    :func:`_prove`) and the proof's cache for the kernels' pattern data
    (:func:`members_proof.proof`; None in debug mode, where the members were just validated,
    or where the state keeps none)."""
    r, c = (int(values.shape[1]), int(values.shape[2])) if layout in BLOCK_LAYOUTS else (1, 1)
    geometry = checked.compressed_geometry(*extents(layout, n_rows, n_cols, r, c))
    proven, cache = (False, None) if is_debug() else members_proof.proof(compressed, plain,
                                                                          geometry)
    if not proven:
        # not proven (written by DDP's buffer broadcast, loaded with torch.export.load, in
        # shared memory, made under inference mode; debug mode trusts no remembered proof):
        # validated here, O(nnz), before any kernel reads them, and proven for the next call
        compressed, plain = _prove(op, layout, compressed, plain, values, n_rows, n_cols)
    return compressed, plain, cache


def _prove(op: str, layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
           values: torch.Tensor, n_rows: int, n_cols: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates the members (the factories' validation) and has the state remember the proof
    for these member objects (:func:`members_proof.remember`; not where their memory cannot be
    watched: validated at each use). Invalid data raises ``InvariantError`` naming the
    operator and the member (``plain_indices``, ``compressed_indices``)."""
    if _broadcast_by_ddp():
        members_proof.unwatched(compressed, plain)
    unseen = members_proof.is_unwatched(compressed, plain)
    if unseen:  # written without a counter moving: fresh copies, validated and read
        compressed, plain = compressed.clone(), plain.clone()
    try:
        proven = _validated(compressed, plain, values.detach(), n_rows, n_cols, layout)
    except InvariantError as err:
        raise err.with_context(op=f"safesparse::{op}", path=member_of(err)) from None
    if not unseen:
        members_proof.remember(proven, compressed, plain)
    return compressed, plain


def _validated(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
               n_rows: int, n_cols: int, layout: torch.layout) -> torch.Tensor:
    """A plain tensor of ``layout`` built on the members once the engine validated them (the
    factories' validation: the metadata stage, then the index stage), carrying the record the
    checked state gave it (:func:`safesparse.state.admission.admit`: whether and how a proof
    is made is answered there). Raises ``InvariantError`` naming the first violation."""
    c, p = per_batch_contiguous(compressed), per_batch_contiguous(plain)
    vals = values.contiguous()  # (a checked tensor's values are contiguous: 3.7)
    meta = check_compressed_metadata(c, p, vals, (n_rows, n_cols), layout,
                                     requested_layout=layout)

    def check(ms: tuple[torch.Tensor, ...], m: CompressedMeta, est: bool) -> CompressedMeta:
        return check_compressed_indices(m, ms[0], ms[1], estimate=est, values=vals)

    def build(ms: tuple[torch.Tensor, ...], m: CompressedMeta) -> torch.Tensor:
        return _originals.sparse_compressed_tensor(ms[0].detach(), ms[1].detach(), vals,
                                                   m.size, layout=layout,
                                                   check_invariants=False)

    def geometry(m: CompressedMeta) -> Any:
        return checked.compressed_geometry(m.n_compressed, m.n_plain)

    how = Validation(check, build, geometry, lambda _, m: geometry(m), lambda m: (geometry(m),))
    built, _ = admit((c, p)).validate(how, meta, debug=is_debug())
    return built


def _broadcast_by_ddp() -> bool:
    """Whether a ``DistributedDataParallel`` with ``broadcast_buffers=True`` is running this
    forward (a caller's frame): it writes every buffer before each forward below autograd,
    moving no version counter, so its index buffers are validated at every call. Asked only
    where members are validated (DDP's first broadcast, at its construction, moves them)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.parallel.DistributedDataParallel):
            return bool(owner.broadcast_buffers)
        frame = frame.f_back  # type: ignore[assignment]
    return False


def member_of(err: InvariantError) -> str:
    """Which index member an invariant of a compressed layout is about: the compressed one
    (catalog 5.1 to 5.3), the plain one (5.4 to 5.6), else both."""
    if err.invariant in ("5.1", "5.2", "5.3"):
        return "compressed_indices"
    if err.invariant in ("5.4", "5.5", "5.6"):
        return "plain_indices"
    return "compressed_indices, plain_indices"


def check_matrix(owner: str, matrix: Any) -> None:
    """``matrix`` is a matrix the operators take (2-D CSR, CSC, BSR or BSC without dense
    dims): ``TypeError`` / ``ValueError`` naming ``owner`` otherwise."""
    if not isinstance(matrix, torch.Tensor) or matrix.layout not in COMPRESSED_LAYOUTS:
        got = matrix.layout if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        raise TypeError(
            f"{owner}: the matrix must be a CSR, CSC, BSR or BSC tensor, got {got}\n"
            "  Convert a dense one with .to_sparse_csr() or .to_sparse_bsr(blocksize).")
    if matrix.dim() != 2 or matrix.dense_dim() != 0:
        raise ValueError(
            f"{owner}: the matrix must be 2-D without dense dims, got shape "
            f"{tuple(matrix.shape)} with {matrix.dense_dim()} dense dims")


def _operand(op: str, x: torch.Tensor, values: torch.Tensor, shape: tuple[Any, Any],
             what: str) -> None:
    """``x`` is 2-D of ``shape`` (sizes checked with ``torch._check_with``: symbolic under a
    compile), of the values' dtype and device."""
    if x.dim() != 2:
        raise ValueError(f"safesparse::{op}: {what} must have shape {tuple(shape)}, got "
                         f"{tuple(x.shape)}")
    for dim in (0, 1):
        torch._check_with(ValueError, x.shape[dim] == shape[dim], lambda: (
            f"safesparse::{op}: {what} must have shape {tuple(shape)}, got {tuple(x.shape)}"))
    if x.dtype != values.dtype or x.device != values.device:
        raise RuntimeError(f"safesparse::{op}: {what} is {x.dtype} on {x.device}, values are "
                        f"{values.dtype} on {values.device} (convert one of them)")


# Each operator's O(1) checks are one function, run by its real implementation (before the
# proof is confirmed) and by its fake (a wrong width raises at trace time as at run time).

# ---------------------------------------------------------------------------------------------
# y = x @ W.T  (SparseLinear)


def _linear_checks(op: str, x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                   values: torch.Tensor, layout: str, out_features: int, in_features: int
                   ) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, out_features, in_features)
    _operand(op, x, values, (x.shape[0], in_features), "x")
    return lay


@custom_op("safesparse::linear", mutates_args=())
def linear(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
           layout: str, out_features: int, in_features: int) -> torch.Tensor:
    """``x @ W.T`` for the proven ``out_features x in_features`` matrix ``W`` with these
    members; ``x`` of shape ``(N, in_features)``."""
    lay = _linear_checks("linear", x, compressed, plain, values, layout, out_features,
                         in_features)
    compressed, plain, cache = _geometry("linear", lay, compressed, plain, values, out_features,
                                         in_features)
    return blockkernels.linear(matrix(lay, compressed, plain, values, out_features, in_features),
                               x, cache=cache)


@linear.register_fake
def _(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      layout: str, out_features: int, in_features: int) -> torch.Tensor:
    _linear_checks("linear", x, compressed, plain, values, layout, out_features, in_features)
    return x.new_empty(x.shape[0], out_features)


def _linear_grad_input_checks(op: str, g: torch.Tensor, compressed: torch.Tensor,
                              plain: torch.Tensor, values: torch.Tensor, layout: str,
                              out_features: int, in_features: int) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, out_features, in_features)
    _operand(op, g, values, (g.shape[0], out_features), "g")
    return lay


@custom_op("safesparse::linear_grad_input", mutates_args=())
def linear_grad_input(g: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                      values: torch.Tensor, layout: str, out_features: int,
                      in_features: int) -> torch.Tensor:
    """``g @ W``: the gradient of :func:`linear` to ``x``."""
    op = "linear_grad_input"
    lay = _linear_grad_input_checks(op, g, compressed, plain, values, layout, out_features,
                                    in_features)
    compressed, plain, cache = _geometry(op, lay, compressed, plain, values, out_features,
                                         in_features)
    return blockkernels.linear_grad_input(
        matrix(lay, compressed, plain, values, out_features, in_features), g, cache=cache)


@linear_grad_input.register_fake
def _(g: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      layout: str, out_features: int, in_features: int) -> torch.Tensor:
    _linear_grad_input_checks("linear_grad_input", g, compressed, plain, values, layout,
                              out_features, in_features)
    return g.new_empty(g.shape[0], in_features)


def _linear_grad_values_checks(op: str, g: torch.Tensor, x: torch.Tensor,
                               compressed: torch.Tensor, plain: torch.Tensor,
                               values: torch.Tensor, layout: str, out_features: int,
                               in_features: int) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, out_features, in_features)
    _operand(op, g, values, (g.shape[0], out_features), "g")
    _operand(op, x, values, (g.shape[0], in_features), "x")
    return lay


@custom_op("safesparse::linear_grad_values", mutates_args=())
def linear_grad_values(g: torch.Tensor, x: torch.Tensor, compressed: torch.Tensor,
                       plain: torch.Tensor, values: torch.Tensor, layout: str,
                       out_features: int, in_features: int) -> torch.Tensor:
    """The gradient of :func:`linear` to ``values`` (``values``' shape)."""
    op = "linear_grad_values"
    lay = _linear_grad_values_checks(op, g, x, compressed, plain, values, layout, out_features,
                                     in_features)
    compressed, plain, cache = _geometry(op, lay, compressed, plain, values, out_features,
                                         in_features)
    return blockkernels.linear_grad_values(
        matrix(lay, compressed, plain, values, out_features, in_features), g, x, cache=cache)


@linear_grad_values.register_fake
def _(g: torch.Tensor, x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
      values: torch.Tensor, layout: str, out_features: int, in_features: int) -> torch.Tensor:
    _linear_grad_values_checks("linear_grad_values", g, x, compressed, plain, values, layout,
                               out_features, in_features)
    return values.new_empty(values.shape)  # contiguous, as the kernel's (whatever values' strides)


def _linear_bias_checks(op: str, x: torch.Tensor, compressed: torch.Tensor,
                        plain: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                        layout: str, out_features: int, in_features: int) -> torch.layout:
    lay = _linear_checks(op, x, compressed, plain, values, layout, out_features, in_features)
    _operand(op, bias.view(1, -1) if bias.dim() == 1 else bias, values, (1, out_features),
             "bias")
    return lay


@custom_op("safesparse::linear_bias", mutates_args=())
def linear_bias(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                values: torch.Tensor, bias: torch.Tensor, layout: str, out_features: int,
                in_features: int) -> torch.Tensor:
    """``x @ W.T + bias``: :func:`linear` with the bias added in the same pass (the native
    kernels start each output from it)."""
    op = "linear_bias"
    lay = _linear_bias_checks(op, x, compressed, plain, values, bias, layout, out_features,
                              in_features)
    compressed, plain, cache = _geometry(op, lay, compressed, plain, values, out_features,
                                         in_features)
    return blockkernels.linear(matrix(lay, compressed, plain, values, out_features, in_features),
                               x, cache=cache, bias=bias)


@linear_bias.register_fake
def _(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      bias: torch.Tensor, layout: str, out_features: int, in_features: int) -> torch.Tensor:
    _linear_bias_checks("linear_bias", x, compressed, plain, values, bias, layout, out_features,
                        in_features)
    return x.new_empty(x.shape[0], out_features)


# ---------------------------------------------------------------------------------------------
# y = A @ x  (SparseMatmul)


def _matmul_checks(op: str, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                   layout: str, n_rows: int, n_cols: int, x: torch.Tensor) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, n_rows, n_cols)
    _operand(op, x, values, (n_cols, x.shape[1]), "x")
    return lay


@custom_op("safesparse::matmul", mutates_args=())
def matmul(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
           n_rows: int, n_cols: int, x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` for the proven ``n_rows x n_cols`` matrix ``A`` with these members; ``x`` of
    shape ``(n_cols, N)``."""
    lay = _matmul_checks("matmul", compressed, plain, values, layout, n_rows, n_cols, x)
    compressed, plain, cache = _geometry("matmul", lay, compressed, plain, values, n_rows,
                                         n_cols)
    return blockkernels.matmul(matrix(lay, compressed, plain, values, n_rows, n_cols), x,
                               cache=cache)


@matmul.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, x: torch.Tensor) -> torch.Tensor:
    _matmul_checks("matmul", compressed, plain, values, layout, n_rows, n_cols, x)
    return x.new_empty(n_rows, x.shape[1])


def _matmul_grad_input_checks(op: str, compressed: torch.Tensor, plain: torch.Tensor,
                              values: torch.Tensor, layout: str, n_rows: int, n_cols: int,
                              g: torch.Tensor) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, n_rows, n_cols)
    _operand(op, g, values, (n_rows, g.shape[1]), "g")
    return lay


@custom_op("safesparse::matmul_grad_input", mutates_args=())
def matmul_grad_input(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                      layout: str, n_rows: int, n_cols: int, g: torch.Tensor) -> torch.Tensor:
    """``A.T @ g``: the gradient of :func:`matmul` to ``x``."""
    op = "matmul_grad_input"
    lay = _matmul_grad_input_checks(op, compressed, plain, values, layout, n_rows, n_cols, g)
    compressed, plain, cache = _geometry(op, lay, compressed, plain, values, n_rows, n_cols)
    return blockkernels.matmul_grad_input(matrix(lay, compressed, plain, values, n_rows, n_cols),
                                          g, cache=cache)


@matmul_grad_input.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, g: torch.Tensor) -> torch.Tensor:
    _matmul_grad_input_checks("matmul_grad_input", compressed, plain, values, layout, n_rows,
                              n_cols, g)
    return g.new_empty(n_cols, g.shape[1])


def _matmul_grad_values_checks(op: str, compressed: torch.Tensor, plain: torch.Tensor,
                               values: torch.Tensor, layout: str, n_rows: int, n_cols: int,
                               g: torch.Tensor, x: torch.Tensor) -> torch.layout:
    lay = _shapes(op, layout, compressed, plain, values, n_rows, n_cols)
    _operand(op, g, values, (n_rows, g.shape[1]), "g")
    _operand(op, x, values, (n_cols, g.shape[1]), "x")
    return lay


@custom_op("safesparse::matmul_grad_values", mutates_args=())
def matmul_grad_values(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                       layout: str, n_rows: int, n_cols: int, g: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`matmul` to ``values`` (``values``' shape)."""
    op = "matmul_grad_values"
    lay = _matmul_grad_values_checks(op, compressed, plain, values, layout, n_rows, n_cols, g,
                                     x)
    compressed, plain, cache = _geometry(op, lay, compressed, plain, values, n_rows, n_cols)
    return blockkernels.matmul_grad_values(
        matrix(lay, compressed, plain, values, n_rows, n_cols), g, x, cache=cache)


@matmul_grad_values.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _matmul_grad_values_checks("matmul_grad_values", compressed, plain, values, layout, n_rows,
                               n_cols, g, x)
    return values.new_empty(values.shape)  # contiguous, as the kernel's (whatever values' strides)

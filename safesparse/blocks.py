"""Block products: checked BSR / BSC tensors times dense tensors, forward and backward.

torch 2.13 multiplies a BSR tensor by a dense one on CPU only for square blocks (MKL), has no
CPU kernel for BSC (so none for ``A.mT @ g``, the BSC view of a BSR ``A``) and none for the
gradient with respect to the dense operand. Here every such product goes through torch's CSR
kernels, which exist on every device:

A block matrix with blocks ``(r, c)`` is, with its rows reordered by their offset ``i`` inside
their block row (all rows ``R * r + i`` for one ``i`` together), a CSR matrix whose rows are
the block rows' ``i``-th lines. Its index data is the block index data scaled (no per-element
search), its values are the block values with two dims swapped (one copy): the "stacked" CSR
matrix of :class:`_Side`. One ``torch.mm`` of that CSR matrix with the dense operand, and the
reverse reordering of the result's rows, is the block product.

Autograd (:class:`_BlockProduct`): the gradient with respect to the dense operand is the product
with the transpose (the same index data read the other way: for a BSR tensor the BSC view, one
stable sort of the block columns), the gradient with respect to the values is
``torch.sparse.sampled_addmm`` on the same stacked pattern: per-block products of the output
gradient and the dense operand, never a densified copy of the sparse tensor. The functions are
registered for ``torch.mm``, ``torch.matmul``, ``@`` and ``torch.addmm`` (see :func:`block_call`
for which calls take this route; everything else runs torch's own kernel as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from . import _originals
from .tensor import (
    OpKind,
    SafeSparseTensor,
    ToSafeSparseTensor,
    _inputs_checked,
    _is_checked,
    _ToPlain,
    wrap_results,
)

T = torch.Tensor
BLOCK_LAYOUTS = (torch.sparse_bsr, torch.sparse_bsc)
#: dtypes with a CSR @ dense kernel on CPU (MKL); other devices take the half types too.
_CPU_DTYPES = (torch.float32, torch.float64)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# The block index structure, read either way


@dataclass(frozen=True)
class _Side:
    """One orientation of a block matrix as a stacked CSR matrix (see the module docstring).

    ``order`` sorts the blocks by output block (None: they already are), ``blocks_t`` says
    whether the oriented blocks are the stored blocks transposed; ``crow``/``col`` are the
    stacked CSR index data, ``n_out`` / ``n_in`` the numbers of output / input blocks, ``r`` /
    ``c`` the oriented block shape.
    """

    order: torch.Tensor | None
    blocks_t: bool
    crow: torch.Tensor
    col: torch.Tensor
    n_out: int
    n_in: int
    r: int
    c: int

    @staticmethod
    def build(out_idx: torch.Tensor, in_idx: torch.Tensor, n_out: int, n_in: int,
              r: int, c: int, *, blocks_t: bool, is_sorted: bool) -> _Side:
        """The stacked CSR index data of blocks at (``out_idx``, ``in_idx``) of shape (r, c)."""
        n = out_idx.numel()
        dev = out_idx.device
        order = None
        if not is_sorted:
            order = torch.argsort(out_idx, stable=True)  # keeps in_idx ascending per output
            out_idx, in_idx = out_idx[order], in_idx[order]
        # where each output block's blocks start (searchsorted, unlike bincount, needs no
        # device sync for its size)
        starts = torch.searchsorted(out_idx, torch.arange(n_out + 1, device=dev,
                                                          dtype=out_idx.dtype))
        # line i of every block row: rows i * n_out .. (i + 1) * n_out of the stacked matrix
        lines = torch.arange(r, dtype=torch.long, device=dev).unsqueeze(1) * n
        # int32 where it fits: torch's MKL (and cuSPARSE) path would convert int64 per call
        small = max(r * n * c, c * n_in, r * n_out) < 2**31
        index = torch.int32 if small else torch.long
        crow = torch.empty(r * n_out + 1, dtype=index, device=dev)
        crow[:-1].view(r, n_out).copy_((starts[:-1].unsqueeze(0) + lines) * c)
        crow[-1] = r * n * c
        col = (in_idx.to(index).unsqueeze(1) * c
               + torch.arange(c, dtype=index, device=dev)).reshape(-1).repeat(r)
        return _Side(order, blocks_t, crow, col, n_out, n_in, r, c)

    def oriented(self, values: torch.Tensor) -> torch.Tensor:
        """The block values (nnzb, r, c) as this side reads them, in its order."""
        v = values.transpose(-2, -1) if self.blocks_t else values
        return v if self.order is None else v[self.order]

    def matrix(self, stacked_values: torch.Tensor) -> torch.Tensor:
        return _originals.sparse_csr_tensor(
            self.crow, self.col, stacked_values, (self.r * self.n_out, self.c * self.n_in),
            dtype=stacked_values.dtype, device=stacked_values.device, check_invariants=False)

    def product(self, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(the oriented matrix) @ ``x``, ``x`` of shape (n_in * c, k): (n_out * r, k)."""
        stacked = self.oriented(values).transpose(0, 1).reshape(-1)
        y = torch.mm(self.matrix(stacked), x)
        k = x.shape[1]
        return y.view(self.r, self.n_out, k).transpose(0, 1).reshape(self.n_out * self.r, k)

    def sampled(self, gy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gradient of the stored values (nnzb, ., .) for ``y = product(values, x)``."""
        k = gy.shape[1]
        rows = gy.reshape(self.n_out, self.r, k).transpose(0, 1).reshape(self.r * self.n_out, k)
        pattern = self.matrix(gy.new_zeros(self.col.numel()))
        s: torch.Tensor = torch.sparse.sampled_addmm(pattern, rows, x.mT, beta=0.0).values()
        grad = s.view(self.r, -1, self.c).transpose(0, 1)  # (nnzb, r, c), this side's order
        if self.order is not None:
            grad = torch.empty_like(grad).index_copy_(0, self.order, grad)
        return grad.transpose(-2, -1) if self.blocks_t else grad


class _Structure:
    """A (batched) BSR or BSC tensor's block structure, both orientations built lazily.

    Batches are one block-diagonal matrix: output block ``b * n_rows + R``; input block
    ``b * n_cols + C`` when the dense operand is batched too, ``C`` when it is shared.
    """

    def __init__(self, a: torch.Tensor, x_batched: bool) -> None:
        r, c = a.values().shape[-2:]
        batch = a.dim() - 2
        n_batch = 1
        for s in a.shape[:batch]:
            n_batch *= s
        compressed = (a.crow_indices() if a.layout == torch.sparse_bsr
                      else a.ccol_indices()).reshape(n_batch, -1)
        plain = (a.col_indices() if a.layout == torch.sparse_bsr
                 else a.row_indices()).reshape(n_batch, -1)
        nnzb = plain.shape[1]
        n_rows, n_cols = a.shape[-2] // r, a.shape[-1] // c
        n_compressed = compressed.shape[1] - 1
        dev = plain.device
        lines = torch.repeat_interleave(
            torch.arange(n_compressed, device=dev).repeat(n_batch),
            compressed.diff(dim=1).reshape(-1), output_size=n_batch * nnzb)
        if a.layout == torch.sparse_bsr:
            rows, cols = lines, plain.reshape(-1)
        else:
            rows, cols = plain.reshape(-1), lines
        if n_batch > 1:
            batch_of = torch.arange(n_batch, device=dev).repeat_interleave(nnzb)
            rows = rows + batch_of * n_rows
            cols = cols + batch_of * n_cols if x_batched else cols
        self.rows, self.cols = rows, cols
        self.n_rows = n_batch * n_rows
        self.n_cols = n_batch * n_cols if x_batched else n_cols
        self.r, self.c = int(r), int(c)
        self.bsr = a.layout == torch.sparse_bsr
        # the input blocks of a BSC tensor come in order, unless batches share the operand
        self.cols_sorted = not self.bsr and (x_batched or n_batch == 1)
        self._sides: dict[bool, _Side] = {}

    def side(self, transpose: bool) -> _Side:
        """``A`` (``transpose=False``) or ``A^T`` as a stacked CSR matrix."""
        if transpose not in self._sides:
            if transpose:
                self._sides[True] = _Side.build(
                    self.cols, self.rows, self.n_cols, self.n_rows, self.c, self.r,
                    blocks_t=True, is_sorted=self.cols_sorted)
            else:
                self._sides[False] = _Side.build(
                    self.rows, self.cols, self.n_rows, self.n_cols, self.r, self.c,
                    blocks_t=False, is_sorted=self.bsr)
        return self._sides[transpose]


class _BlockProduct(torch.autograd.Function):
    """``y = op(A) @ x`` for block values ``values`` (nnzb, r, c) of ``A`` (``op`` the identity
    or the transpose), ``x`` of shape (n_in * c, k). Backward: ``op(A)^T @ gy`` and the sampled
    block products, through the same structure.

    ``a`` is None when the gradient of ``A`` flows through ``values`` (``A.values()``, sparse
    all the way); otherwise ``a`` is ``A`` itself and gets a strided gradient, as torch's own
    BSR product gives it (torch 2.13 cannot accumulate a BSR / BSC gradient into a BSR / BSC
    leaf, see :func:`_gradient_through_values`).
    """

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, x: torch.Tensor, a: torch.Tensor | None,
                structure: _Structure, transpose: bool) -> torch.Tensor:
        ctx.structure, ctx.transpose = structure, transpose
        ctx.a_meta = None if a is None else _Meta.of(a)
        ctx.save_for_backward(values, x)
        return structure.side(transpose).product(values, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        values, x = ctx.saved_tensors
        structure, transpose = ctx.structure, ctx.transpose
        gy = gy.contiguous()
        g_values = g_x = g_a = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            g_values = structure.side(transpose).sampled(gy, x)
        if ctx.needs_input_grad[1]:
            g_x = structure.side(not transpose).product(values, gy)
        if ctx.needs_input_grad[2]:
            g_a = ctx.a_meta.dense(g_values)
        return (g_values if ctx.needs_input_grad[0] else None), g_x, g_a, None, None


@dataclass(frozen=True)
class _Meta:
    """What a strided gradient of a block tensor needs: its index members, shape and layout."""

    compressed: torch.Tensor
    plain: torch.Tensor
    values_shape: torch.Size
    shape: torch.Size
    layout: torch.layout

    @staticmethod
    def of(a: torch.Tensor) -> _Meta:
        bsr = a.layout == torch.sparse_bsr
        return _Meta(a.crow_indices() if bsr else a.ccol_indices(),
                     a.col_indices() if bsr else a.row_indices(),
                     a.values().shape, a.shape, a.layout)

    def dense(self, g_values: torch.Tensor) -> torch.Tensor:
        return _originals.sparse_compressed_tensor(
            self.compressed, self.plain, g_values.reshape(self.values_shape), self.shape,
            layout=self.layout, dtype=g_values.dtype, device=g_values.device,
            check_invariants=False).to_dense()


#: Autograd nodes below which a sparse tensor's gradient is a dense one (its values' or a
#: dense tensor's): the walk of :func:`_gradient_through_values` stops there.
_TO_DENSE_NODES = frozenset({"SparseCompressedTensorBackward0", "ToSparseBsrBackward0",
                             "ToSparseBscBackward0", "ToSparseBackward0",
                             "ToSparseCsrBackward0", "ToSparseCscBackward0"})
_WALK_LIMIT = 64


def _gradient_through_values(a: torch.Tensor) -> bool:
    """Whether ``a``'s gradient can flow as ``a.values()``'s: no BSR / BSC leaf below ``a``
    (torch 2.13 fails to accumulate the BSR / BSC gradient ``values()`` gives into one). A
    bounded walk of ``a``'s graph; when in doubt, False (a strided gradient always works)."""
    if not a.requires_grad or a.grad_fn is None:
        return False
    stack = [a.grad_fn]
    seen = 0
    while stack:
        node = stack.pop()
        name = type(node).__name__
        if name in _TO_DENSE_NODES:
            continue
        if name == "AccumulateGrad":
            if getattr(node, "variable").layout != torch.strided:  # noqa: B009
                return False
            continue
        seen += 1
        if seen > _WALK_LIMIT:
            return False
        stack += [n for n, _ in node.next_functions if n is not None]
    return True


# ---------------------------------------------------------------------------------------------
# Which calls take the block route


@dataclass(frozen=True)
class BlockCall:
    """A call that takes the block route: ``a`` the block-sparse operand, ``x`` the dense one,
    ``sparse_left`` whether the product is ``a @ x`` (else ``x @ a``); for ``addmm``, ``bias``
    (the dense ``input``, or None), ``beta`` and ``alpha``."""

    a: torch.Tensor
    x: torch.Tensor
    sparse_left: bool
    bias: torch.Tensor | None = None
    beta: Any = 1
    alpha: Any = 1


_MM = (torch.mm, T.mm)
_MATMUL = (torch.matmul, T.matmul, T.__matmul__)
_ADDMM = (torch.addmm, T.addmm)
FUNCS = (*_MM, *_MATMUL, T.__rmatmul__, *_ADDMM)


def _is_block(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout in BLOCK_LAYOUTS


def _is_dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _fits(a: torch.Tensor, x: torch.Tensor, sparse_left: bool, matmul: bool) -> bool:
    """``a`` (checked, non-hybrid block tensor) and ``x`` (dense) multiply on this route."""
    if not (_is_checked(a) and a.dense_dim() == 0 and x.dtype == a.dtype
            and x.device == a.device and a.dtype in _DTYPES
            and (a.device.type != "cpu" or a.dtype in _CPU_DTYPES)):
        return False
    if not matmul:
        side = int(sparse_left)
        return a.dim() == 2 and x.dim() == 2 and a.shape[side] == x.shape[1 - side]
    if x.dim() == 0:
        return False
    inner = x.shape[0] if x.dim() == 1 else x.shape[-2 if sparse_left else -1]
    if a.shape[-1 if sparse_left else -2] != inner:
        return False
    if a.dim() == 2 or x.dim() <= 2:
        return True
    return x.shape[:-2] == a.shape[:-2]  # batched: the same batch shape


def block_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall | None:
    """The block route for ``func(*args, **kwargs)``, or None: torch's own kernel runs.

    The route is taken for ``mm`` / ``matmul`` / ``@`` / ``addmm`` where one factor is a checked,
    non-hybrid BSR or BSC tensor and the other a dense tensor of the same dtype and device
    (float32 / float64; half types off CPU), ``addmm``'s ``input`` dense, no ``out=``.
    """
    if func in _ADDMM:
        if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
            return None
        bias, m1, m2 = args
        if not _is_dense(bias):
            return None
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    elif len(args) == 2 and not kwargs:
        m1, m2 = args if func is not T.__rmatmul__ else (args[1], args[0])
        bias, beta, alpha = None, 1, 1
    else:
        return None
    matmul = func in _MATMUL or func is T.__rmatmul__
    if _is_block(m1) and _is_dense(m2) and _fits(m1, m2, True, matmul):
        return BlockCall(m1, m2, True, bias, beta, alpha)
    if _is_dense(m1) and _is_block(m2) and _fits(m2, m1, False, matmul):
        return BlockCall(m2, m1, False, bias, beta, alpha)
    return None


def _torch_is_faster(call: BlockCall) -> bool:
    """torch's own kernel where it has one and beats this route (benchmarks/group_blocks.py):
    MKL's square-block BSR @ dense on CPU, when no gradient is needed."""
    a = call.a
    return (a.device.type == "cpu" and a.layout == torch.sparse_bsr and call.sparse_left
            and a.dim() == 2 and call.x.dim() == 2
            and a.values().shape[-1] == a.values().shape[-2]
            and not (torch.is_grad_enabled() and (a.requires_grad or call.x.requires_grad)))


def block_product(call: BlockCall) -> torch.Tensor:
    """The dense result of ``call`` (its product, plus ``addmm``'s terms)."""
    a, x = call.a, call.x
    y = torch.mm(a, x) if _torch_is_faster(call) else _product(a, x, call.sparse_left)
    if call.bias is None:
        return y
    if isinstance(call.beta, (int, float)) and call.beta == 0:
        return torch.mul(y, call.alpha)  # torch ignores input (its NaNs too) when beta is 0
    return torch.add(call.bias * call.beta, y, alpha=call.alpha)


#: The autograd nodes of wrapping and unwrapping (identity Functions in tensor.py).
_IDENTITY_NODES = frozenset(f.__name__ + "Backward" for f in (ToSafeSparseTensor, _ToPlain))


def _signed(dim: int) -> int:
    return dim - 2**64 if dim >= 2**63 else dim  # autograd keeps saved dims as unsigned


def _values_source(a: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``a``'s values were built from, as ``a.values()`` sees it, connected to its
    own graph; None unless ``a`` is such a tensor after wrapping and transposes only.

    torch's backward of the sparse factory densifies its gradient (``sparse_mask`` through
    ``to_dense``: hundreds of ms for a 2048 x 2048 matrix); reading the values from the
    factory's node lets the gradient reach them directly, sparse. The tensor found must have
    exactly ``a.values()``'s shape, strides and memory, or it is not used.
    """
    node = a.grad_fn
    flips = 0
    for _ in range(_WALK_LIMIT):
        name = type(node).__name__
        if name == "SparseCompressedTensorBackward0":
            values: torch.Tensor = getattr(node, "_saved_values")  # noqa: B009
            if flips % 2:
                values = values.transpose(-2, -1)
            mine = a.values()
            same = (values.shape == mine.shape and values.stride() == mine.stride()
                    and values.data_ptr() == mine.data_ptr() and values.dtype == mine.dtype)
            return values if same else None
        if name == "TransposeBackward0":
            ndim = a.dim()
            dims = {_signed(getattr(node, "_saved_dim0")) % ndim,  # noqa: B009
                    _signed(getattr(node, "_saved_dim1")) % ndim}  # noqa: B009
            if dims != {ndim - 2, ndim - 1}:
                return None
            flips += 1
        elif name == "TBackward0":
            flips += 1
        elif name not in _IDENTITY_NODES:
            return None
        if node is None or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    return None


def _product(a: torch.Tensor, x: torch.Tensor, sparse_left: bool) -> torch.Tensor:
    """``a @ x`` or ``x @ a`` with matmul's shapes, through :class:`_BlockProduct`."""
    grad = torch.is_grad_enabled() and a.requires_grad
    source = _values_source(a) if grad else None
    via_values = source is not None or (grad and _gradient_through_values(a))
    if source is None:
        source = a.values() if via_values else a.values().detach()
    values = source
    target = a if grad and not via_values else None
    batch = a.shape[:-2]
    m, n = a.shape[-2:]
    if not sparse_left:  # x @ a == (a^T @ x^T)^T
        if x.dim() == 1:
            return _product_left(a, target, values, x, batch, m, transpose=True)
        return _product_left(a, target, values, x.mT, batch, m, transpose=True).mT
    return _product_left(a, target, values, x, batch, n, transpose=False)


def _product_left(a: torch.Tensor, target: torch.Tensor | None, values: torch.Tensor,
                  x: torch.Tensor,
                  batch: torch.Size, inner: int, *, transpose: bool) -> torch.Tensor:
    """``op(a) @ x``, ``x`` of shape (inner,), (inner, k), or batched (*batch, inner, k)."""
    vector = x.dim() == 1
    if vector:
        x = x.unsqueeze(1)
    flat = values.reshape(-1, *values.shape[-2:])
    x_batched = x.dim() > 2 and len(batch) > 0
    out_rows = a.shape[-1] if transpose else a.shape[-2]
    k = x.shape[-1]
    if x.dim() > 2 and not batch:  # one matrix, many operands: (inner, B * k)
        lead = x.shape[:-2]
        x2 = x.movedim(-2, 0).reshape(inner, lead.numel() * k)
        y2 = _apply(flat, x2, target, _Structure(a, False), transpose)
        return y2.reshape(out_rows, *lead, k).movedim(0, -2)
    x2 = x.reshape(x.shape[:-1].numel(), k)
    y = _apply(flat, x2, target, _Structure(a, x_batched), transpose)
    y = y.reshape(*batch, out_rows, k)
    return y.squeeze(-1) if vector else y


def _apply(values: torch.Tensor, x: torch.Tensor, target: torch.Tensor | None,
           structure: _Structure, transpose: bool) -> torch.Tensor:
    y: torch.Tensor = _BlockProduct.apply(  # type: ignore[no-untyped-call]
        values, x, target, structure, transpose)
    return y


def _block_mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The block route where :func:`block_call` takes it; otherwise torch's kernel, its
    sparse result (sparse @ sparse) treated as before: new indices for ``mm`` / ``matmul`` /
    ``@``, unknown for ``addmm`` and ``__rmatmul__``."""
    with DisableTorchFunctionSubclass():
        call = block_call(func, args, kwargs)
        if call is not None:
            return block_product(call)
        before = _inputs_checked(args, kwargs)
        ret = func(*args, **kwargs)
        kind = OpKind.NEW_INDICES if func in _MM + _MATMUL else OpKind.UNKNOWN
        return wrap_results(func, kind, args, kwargs, ret, before=before)


SafeSparseTensor.implements([*_MM, *_MATMUL], OpKind.NEW_INDICES)(_block_mm)
SafeSparseTensor.implements([T.__rmatmul__], OpKind.UNKNOWN)(_block_mm)
# addmm's entry is ops._addmm_route: it takes this module's route first (block_call), then
# repairs torch's crashing all-CSC addmm.


__all__ = [
    "BLOCK_LAYOUTS",
    "FUNCS",
    "BlockCall",
    "block_call",
    "block_product",
]

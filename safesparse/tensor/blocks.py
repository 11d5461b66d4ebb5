"""Block products: checked BSR / BSC tensors times dense tensors, forward and backward.

torch 2.13 multiplies a BSR tensor by a dense one on CPU only for square blocks (MKL), has no
CPU kernel for BSC (so none for ``A.mT @ g``, the BSC view of a BSR ``A``, nor for
``F.linear(x, W)`` with a BSR ``W``) and none for the gradient with respect to the dense
operand. Here every such product goes through torch's CSR kernels, which exist on every device:

A block matrix with blocks ``(r, c)`` is a CSR matrix of its elements: row ``R * r + i`` holds
line ``i`` of every block of block row ``R``, in block-column order. Its index data follows
from the block index data (no per-element search), its values are the block values gathered
in that order (one ``index_select`` through a precomputed permutation): :class:`_Side`. One
``torch.mm`` of that CSR matrix with the dense operand is the block product, rows in order.

Reading the blocks by block row needs them sorted by block row: free for a BSR tensor, one
stable sort for a BSC tensor (or for the transpose of a BSR tensor). That structure depends
on the index data alone and is kept with its proof (:func:`structure`, through
:func:`safesparse.state.checked.proof_cache`): built once per index state, dropped whenever the
state drops, so a write through any alias of the indices is never read through a stale one.

Autograd (:class:`_BlockProduct`): the gradient with respect to the dense operand is the product
with the transpose (the same index data read the other way), the gradient with respect to the
values is ``torch.sparse.sampled_addmm`` on the same element pattern: per-block products of the
output gradient and the dense operand, never a densified copy of the sparse tensor.

Which calls take this route: :func:`route`, on the arguments bound by name
(:func:`safesparse.tensor.binding.bind`); the product functions are registered in
:mod:`safesparse.tensor.ops`, which also writes ``out=`` and in-place results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..base import originals as _originals
from ..state import checked
from .binding import Product, bind
from .core import ToSafeSparseTensor, _is_checked, _ToPlain

T = torch.Tensor
BLOCK_LAYOUTS = (torch.sparse_bsr, torch.sparse_bsc)
#: dtypes with a CSR @ dense kernel on CPU (MKL); other devices take the half types too.
_CPU_DTYPES = (torch.float32, torch.float64)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# The block index structure, read either way


def _flat(values: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``values`` (nb, r, c) as a flat view of its memory and whether that memory holds the
    blocks transposed (the values of a transposed view); a copy only when neither holds."""
    if values.is_contiguous():
        return values.view(-1), False
    flipped = values.transpose(-2, -1)
    if flipped.is_contiguous():
        return flipped.reshape(-1), True
    return values.contiguous().view(-1), False


class _Side:
    """One orientation of a block matrix as a CSR matrix of its elements (module docstring).

    ``crow`` / ``col``: the element-wise CSR index data, rows in their natural order (row
    ``R * r + i`` of the oriented matrix), columns ascending within a row; ``perm[p]``: the
    flat position, in the block values read as (nb, r, c) in this side's orientation's source
    order, of the element the CSR matrix stores at ``p`` (``values.reshape(-1)[perm]`` are the
    CSR values). ``n_out`` / ``n_in``: output / input blocks; ``r`` / ``c``: the oriented block
    shape; ``blocks_t``: whether the oriented blocks are the stored blocks transposed.
    """

    __slots__ = ("_inverse", "_perms", "blocks_t", "c", "col", "crow", "n_in", "n_out", "r")

    def __init__(self, crow: torch.Tensor, col: torch.Tensor, perm: torch.Tensor,
                 n_out: int, n_in: int, r: int, c: int, blocks_t: bool) -> None:
        self.crow, self.col = crow, col
        self._perms: dict[bool, torch.Tensor] = {False: perm}
        self._inverse: torch.Tensor | None = None
        self.n_out, self.n_in, self.r, self.c = n_out, n_in, r, c
        self.blocks_t = blocks_t

    @staticmethod
    def build(out_idx: torch.Tensor, in_idx: torch.Tensor, n_out: int, n_in: int,
              r: int, c: int, *, blocks_t: bool, is_sorted: bool) -> _Side:
        """The element CSR data of blocks at (``out_idx``, ``in_idx``) of shape (r, c), in
        ``in_idx`` order within each output block (ascending: the index data is checked)."""
        n = out_idx.numel()
        dev = out_idx.device
        block = torch.arange(n, device=dev)
        if not is_sorted:
            block = torch.argsort(out_idx, stable=True)  # keeps in_idx ascending per output
            out_idx, in_idx = out_idx[block], in_idx[block]
        # where each output block's blocks start (searchsorted, unlike bincount, needs no
        # device sync for its size)
        starts = torch.searchsorted(out_idx, torch.arange(n_out + 1, device=dev,
                                                          dtype=out_idx.dtype))
        count = starts.diff()
        total = r * n * c
        small = max(total, c * n_in, r * n_out) < 2**31
        index = torch.int32 if small else torch.long  # MKL / cuSPARSE take int32 as it is
        crow = torch.empty(r * n_out + 1, dtype=torch.long, device=dev)
        i = torch.arange(r, device=dev)
        crow[:-1].view(n_out, r).copy_(starts[:-1, None] * (r * c) + i * (count[:, None] * c))
        crow[-1] = total
        # sorted block t of output block R, element (i, j): CSR position
        # starts[R] r c + i count[R] c + (t - starts[R]) c + j
        first = starts[out_idx]
        base = first * (r * c) + (torch.arange(n, device=dev) - first) * c
        j = torch.arange(c, device=dev)
        pos = (base[:, None, None] + i[None, :, None] * (count[out_idx] * c)[:, None, None]
               + j[None, None, :]).reshape(-1)
        cols = (in_idx[:, None, None] * c + j[None, None, :]).expand(n, r, c).reshape(-1)
        if blocks_t:  # oriented (i, j) is stored (j, i) of a block stored as (c, r)
            src = block[:, None, None] * (r * c) + j[None, None, :] * r + i[None, :, None]
        else:
            src = block[:, None, None] * (r * c) + i[None, :, None] * c + j[None, None, :]
        col = torch.empty(total, dtype=index, device=dev)
        col[pos] = cols.to(index)
        perm = torch.empty(total, dtype=index, device=dev)  # (int32: half the memory traffic)
        perm[pos] = src.reshape(-1).to(index)
        return _Side(crow.to(index), col, perm, n_out, n_in, r, c, blocks_t)

    def perm(self, flipped: bool) -> torch.Tensor:
        """``perm`` for values whose memory holds each block transposed (``flipped``)."""
        p = self._perms.get(flipped)
        if p is None:
            # stored block (rs, cs): memory offset of (a, e) is a * cs + e, flipped e * rs + a
            rs, cs = (self.c, self.r) if self.blocks_t else (self.r, self.c)
            base = self._perms[False]
            inner = base % (rs * cs)
            p = base - inner + (inner % cs) * rs + inner // cs
            self._perms[flipped] = p
        return p

    def inverse(self) -> torch.Tensor:
        """Where each stored value (read as (nb, ., .), contiguous) sits in the CSR values."""
        if self._inverse is None:
            perm = self._perms[False]
            inv = torch.empty_like(perm)
            inv[perm.long()] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
            self._inverse = inv
        return self._inverse

    def matrix(self, values: torch.Tensor) -> torch.Tensor:
        return _originals.sparse_csr_tensor(
            self.crow, self.col, values, (self.r * self.n_out, self.c * self.n_in),
            dtype=values.dtype, device=values.device, check_invariants=False)

    def product(self, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(the oriented matrix) @ ``x``, ``x`` of shape (n_in * c, k): (n_out * r, k).
        ``values``: the stored block values (nb, ., .)."""
        flat, flipped = _flat(values)
        return torch.mm(self.matrix(flat.index_select(0, self.perm(flipped))), x)

    def sampled(self, gy: torch.Tensor, x: torch.Tensor,
                values_shape: torch.Size) -> torch.Tensor:
        """The gradient of the stored values for ``y = product(values, x)``."""
        pattern = self.matrix(gy.new_zeros(self.col.numel()))
        s: torch.Tensor = torch.sparse.sampled_addmm(pattern, gy, x.mT, beta=0.0).values()
        return s.index_select(0, self.inverse()).view(values_shape)


def _coordinates(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Where each stored block (element, for CSR/CSC) of the compressed tensor ``t`` sits, in
    stored order: its block row and block column within its batch (int64, flat over the
    batches), the number of batches and the stored blocks per batch."""
    row = t.layout in (torch.sparse_csr, torch.sparse_bsr)
    compressed = t.crow_indices() if row else t.ccol_indices()
    plain = t.col_indices() if row else t.row_indices()
    n_batch = compressed.numel() // compressed.shape[-1]
    compressed, plain = compressed.reshape(n_batch, -1), plain.reshape(n_batch, -1)
    nnz = plain.shape[1]
    lines = torch.repeat_interleave(
        torch.arange(compressed.shape[1] - 1, device=plain.device).repeat(n_batch),
        compressed.diff(dim=1).reshape(-1), output_size=n_batch * nnz)
    across = plain.reshape(-1).long()
    return (lines, across, n_batch, nnz) if row else (across, lines, n_batch, nnz)


class _Structure:
    """A (batched) BSR or BSC tensor's block structure, both orientations built lazily.

    Batches are one block matrix: output blocks ``b * n_rows + R`` when ``batch_rows`` (else
    ``R``: the batches side by side), input blocks ``b * n_cols + C`` when ``batch_cols``.
    Both for a batched operand (block-diagonal); only the side the operand does not share
    when it is shared by every batch.
    """

    def __init__(self, a: torch.Tensor, batch_rows: bool, batch_cols: bool) -> None:
        r, c = a.values().shape[-2:]
        rows, cols, n_batch, nnzb = _coordinates(a)
        n_rows, n_cols = a.shape[-2] // r, a.shape[-1] // c
        dev = rows.device
        batch_rows, batch_cols = (batch_rows or n_batch == 1), (batch_cols or n_batch == 1)
        if n_batch > 1:
            batch_of = torch.arange(n_batch, device=dev).repeat_interleave(nnzb)
            rows = rows + batch_of * n_rows if batch_rows else rows
            cols = cols + batch_of * n_cols if batch_cols else cols
        self.rows, self.cols = rows, cols
        self.n_rows = n_batch * n_rows if n_batch > 1 and batch_rows else n_rows
        self.n_cols = n_batch * n_cols if n_batch > 1 and batch_cols else n_cols
        self.r, self.c = int(r), int(c)
        bsr = a.layout == torch.sparse_bsr
        # the compressed side's blocks come in order, unless batches are put side by side
        self.rows_sorted = bsr and batch_rows
        self.cols_sorted = not bsr and batch_cols
        self._sides: dict[bool, _Side] = {}

    def block_grad(self, gy: torch.Tensor, x: torch.Tensor, transpose: bool) -> torch.Tensor:
        """The gradient of the stored block values for ``y = op(A) @ x``, as one batched
        product of the blocks' rows of the output gradient and of ``x`` (faster than
        ``sampled_addmm`` for large blocks: see :data:`_BMM_MIN`)."""
        k = gy.shape[1]
        if transpose:  # y[C] += V_b^T x[R]: dV_b = x[R] gy[C]^T
            left = x.reshape(self.n_rows, self.r, k).index_select(0, self.rows)
            right = gy.reshape(self.n_cols, self.c, k).index_select(0, self.cols)
        else:  # y[R] += V_b x[C]: dV_b = gy[R] x[C]^T
            left = gy.reshape(self.n_rows, self.r, k).index_select(0, self.rows)
            right = x.reshape(self.n_cols, self.c, k).index_select(0, self.cols)
        return torch.bmm(left, right.mT)

    def side(self, transpose: bool) -> _Side:
        """``A`` (``transpose=False``) or ``A^T`` as an element CSR matrix."""
        s = self._sides.get(transpose)
        if s is None:
            if transpose:
                s = _Side.build(self.cols, self.rows, self.n_cols, self.n_rows, self.c, self.r,
                                blocks_t=True, is_sorted=self.cols_sorted)
            else:
                s = _Side.build(self.rows, self.cols, self.n_rows, self.n_cols, self.r, self.c,
                                blocks_t=False, is_sorted=self.rows_sorted)
            self._sides[transpose] = s
        return s


def structure(a: torch.Tensor, batch_rows: bool, batch_cols: bool) -> _Structure:
    """``a``'s block structure, kept with its index data's proof
    (:func:`safesparse.state.checked.proof_cache`: dropped whenever that proof drops, shared by
    every tensor on the same proven index data); built afresh when it cannot be kept."""
    cache = checked.proof_cache(a)
    if cache is None:
        return _Structure(a, batch_rows, batch_cols)
    key = ("blocks", a.layout, a.shape, a.values().shape[-2:], batch_rows, batch_cols)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _Structure(a, batch_rows, batch_cols)
    assert isinstance(found, _Structure)
    return found


def pattern_positions(t: torch.Tensor) -> torch.Tensor:
    """For a checked, non-hybrid compressed tensor ``t`` (CSR, CSC, BSR, BSC, batched or not):
    the flat position in ``t``'s dense form (row-major, shape ``t.shape``) of every stored
    value, shaped as ``t.values()``: ``dense.reshape(-1)[pattern_positions(t)]`` are
    ``dense``'s entries at ``t``'s pattern, in ``t``'s values order. Kept with the index
    data's proof, as :func:`structure`."""
    cache = checked.proof_cache(t)
    values_shape = t.values().shape
    key = ("positions", t.layout, t.shape, values_shape)
    found = None if cache is None else cache.get(key)
    if found is not None:
        assert isinstance(found, torch.Tensor)
        return found
    block = t.layout in BLOCK_LAYOUTS
    r, c = (int(values_shape[-2]), int(values_shape[-1])) if block else (1, 1)
    rows, cols, n_batch, nnz = _coordinates(t)
    dev = rows.device
    m, n = int(t.shape[-2]), int(t.shape[-1])
    start = (torch.arange(n_batch, device=dev).repeat_interleave(nnz) * (m * n)
             + rows * (r * n) + cols * c)
    pos = (start[:, None, None] + torch.arange(r, device=dev)[None, :, None] * n
           + torch.arange(c, device=dev)[None, None, :]).reshape(values_shape)
    if cache is not None:
        cache[key] = pos
    return pos


#: Blocks of at least this many elements get their values' gradient from one batched matmul
#: (:meth:`_Structure.block_grad`) rather than ``sampled_addmm`` over the element pattern
#: (CPU, torch 2.13, 64 columns: sampled_addmm ~1.1 ms whatever the blocks; bmm 0.65 ms for
#: 16 x 16 blocks, 1.6 ms for 8 x 8, 2.7 ms for 4 x 4).
_BMM_MIN = 144


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
            if structure.r * structure.c >= _BMM_MIN:
                g_values = structure.block_grad(gy, x, transpose)
            else:
                g_values = structure.side(transpose).sampled(gy, x, values.shape)
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
    """A call that takes the block route: ``a`` the block-sparse operand, ``x`` the dense one;
    ``form`` ``"left"`` (``a @ x``), ``"right"`` (``x @ a``) or ``"linear"`` (``x @ a.mT``);
    ``bias`` (addmm's dense ``input`` or linear's bias, or None), ``beta`` and ``alpha``."""

    a: torch.Tensor
    x: torch.Tensor
    form: str
    bias: torch.Tensor | None = None
    beta: Any = 1
    alpha: Any = 1

    @property
    def sparse_left(self) -> bool:
        return self.form == "left"


_MM = (torch.mm, T.mm)
_MATMUL = (torch.matmul, T.matmul, T.__matmul__)
_ADDMM = (torch.addmm, T.addmm)
FUNCS = (*_MM, *_MATMUL, T.__rmatmul__, *_ADDMM, T.addmm_, torch.sparse.mm,
         torch.sparse.addmm, F.linear)


def _is_block(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout in BLOCK_LAYOUTS


def _is_dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _takes(a: torch.Tensor, x: torch.Tensor) -> bool:
    """``a`` (a checked, non-hybrid block tensor) and ``x`` (dense) share a dtype and device
    this route computes on."""
    return (_is_checked(a) and a.dense_dim() == 0 and x.dtype == a.dtype
            and x.device == a.device and a.dtype in _DTYPES
            and (a.device.type != "cpu" or a.dtype in _CPU_DTYPES))


def _fits(a: torch.Tensor, x: torch.Tensor, sparse_left: bool, matmul: bool) -> bool:
    """``a`` and ``x`` multiply on this route (see :func:`_takes`); for ``matmul`` shapes
    that cannot be multiplied as batches raise a clear ``RuntimeError``."""
    if not _takes(a, x):
        return False
    if not matmul:
        side = int(sparse_left)
        return a.dim() == 2 and x.dim() == 2 and a.shape[side] == x.shape[1 - side]
    if x.dim() == 0:
        return False
    inner = x.shape[0] if x.dim() == 1 else x.shape[-2 if sparse_left else -1]
    if a.shape[-1 if sparse_left else -2] != inner:
        return False
    if a.dim() == 2 or x.dim() <= 2 or x.shape[:-2] == a.shape[:-2]:
        return True
    raise RuntimeError(
        f"matmul: a batched block-sparse {a.layout} tensor of shape {tuple(a.shape)} and a "
        f"dense tensor of shape {tuple(x.shape)}: the block product takes equal batch shapes, "
        "or one operand unbatched (expand the other to the same batch shape)")


def route(p: Product) -> BlockCall | None:
    """The block route for the bound product ``p``, or None: torch's own kernel runs.

    Taken for ``mm`` / ``matmul`` / ``@`` / ``addmm`` / ``torch.sparse.mm`` /
    ``torch.sparse.addmm`` where one factor is a checked, non-hybrid BSR or BSC tensor and the
    other a dense tensor of the same dtype and device (float32 / float64; half types off CPU),
    addmm's ``input`` dense; for ``F.linear`` a 2-D such weight, a dense input and a dense bias
    or none. ``out=`` and in-place forms are bound here too; writing the result is the
    caller's (:mod:`safesparse.tensor.ops`).
    """
    if p.extra:
        return None
    if p.op == "linear":
        w, x, bias = p.mat2, p.mat1, p.input
        if (_is_block(w) and _is_dense(x) and (bias is None or _is_dense(bias))
                and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
                and _takes(w, x)):
            return BlockCall(w, x, "linear", bias)
        return None
    bias = None
    if p.op == "addmm":
        if not _is_dense(p.input):
            return None
        bias = p.input
    matmul = p.op == "matmul"
    m1, m2 = p.mat1, p.mat2
    if _is_block(m1) and _is_dense(m2) and _fits(m1, m2, True, matmul):
        return BlockCall(m1, m2, "left", bias, p.beta, p.alpha)
    if _is_dense(m1) and _is_block(m2) and _fits(m2, m1, False, matmul):
        return BlockCall(m2, m1, "right", bias, p.beta, p.alpha)
    return None


def block_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall | None:
    """:func:`route` for ``func(*args, **kwargs)`` (bound by
    :func:`safesparse.tensor.binding.bind`)."""
    p = bind(func, args, kwargs)
    return None if p is None else route(p)


def _torch_is_faster(a: torch.Tensor, x: torch.Tensor) -> bool:
    """torch's own kernel for ``a @ x`` where it has one and beats this route
    (benchmarks/group_blocks.py): MKL's square-block BSR @ dense on CPU, when no gradient
    is needed."""
    return (a.device.type == "cpu" and a.layout == torch.sparse_bsr
            and a.dim() == 2 and x.dim() == 2
            and a.values().shape[-1] == a.values().shape[-2]
            and not (torch.is_grad_enabled() and (a.requires_grad or x.requires_grad)))


def _left(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, x) if _torch_is_faster(a, x) else _product(a, x, True)


def block_product(call: BlockCall) -> torch.Tensor:
    """The dense result of ``call`` (its product, plus ``addmm``'s / ``linear``'s terms)."""
    a, x = call.a, call.x
    if call.form == "linear":  # x @ a^T == (a @ x^T)^T, x flattened to (M, in)
        x2 = x.reshape(-1, x.shape[-1])
        y = _left(a, x2.mT).mT.reshape(*x.shape[:-1], a.shape[0])
        return y if call.bias is None else torch.add(y, call.bias)
    y = _left(a, x) if call.form == "left" else _product(a, x, False)
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
    """``op(a) @ x``, ``x`` of shape (inner,), (inner, k), or batched (*batch, inner, k); a
    batched ``a`` with an unbatched ``x`` multiplies every batch by the same ``x``."""
    vector = x.dim() == 1
    if vector:
        x = x.unsqueeze(1)
    flat = values.reshape(-1, *values.shape[-2:])
    out_rows = a.shape[-1] if transpose else a.shape[-2]
    k = x.shape[-1]
    if x.dim() > 2 and not batch:  # one matrix, many operands: (inner, B * k)
        lead = x.shape[:-2]
        x2 = x.movedim(-2, 0).reshape(inner, lead.numel() * k)
        y2 = _apply(flat, x2, target, structure(a, True, True), transpose)
        return y2.reshape(out_rows, *lead, k).movedim(0, -2)
    x2 = x.reshape(x.shape[:-1].numel(), k)
    # the output side is always per batch; the input side only for a batched operand
    shared = x.dim() == 2 and len(batch) > 0
    rows, cols = (not shared or not transpose), (not shared or transpose)
    y = _apply(flat, x2, target, structure(a, rows, cols), transpose)
    y = y.reshape(*batch, out_rows, k)
    return y.squeeze(-1) if vector else y


def _apply(values: torch.Tensor, x: torch.Tensor, target: torch.Tensor | None,
           structure: _Structure, transpose: bool) -> torch.Tensor:
    y: torch.Tensor = _BlockProduct.apply(  # type: ignore[no-untyped-call]
        values, x, target, structure, transpose)
    return y


__all__ = [
    "BLOCK_LAYOUTS",
    "FUNCS",
    "BlockCall",
    "block_call",
    "block_product",
    "pattern_positions",
    "route",
    "structure",
]

"""The element route of block products (see :mod:`safesparse.tensor.products`): a BSR / BSC tensor,
batched or not, as a CSR matrix of its elements, read either way, kept with its index data's
proof; and where each stored value sits in the dense form (:func:`pattern_positions`).

A block matrix with blocks ``(r, c)`` is a CSR matrix of its elements: row ``R * r + i`` holds
line ``i`` of every block of block row ``R``, in block-column order. Its index data follows
from the block index data (no per-element search), its values are the block values gathered
in that order (one ``index_select`` through a precomputed permutation): :class:`Side`. One
``torch.mm`` of that CSR matrix with the dense operand is the block product, rows in order.

Reading the blocks by block row needs them sorted by block row: free for a BSR tensor, one
stable sort for a BSC tensor (or for the transpose of a BSR tensor). That structure depends
on the index data alone and is kept with its proof (:func:`structure`, through
:func:`safesparse.state.checked.proof_cache`): built once per index state, dropped whenever the
state drops, so a write through any alias of the indices is never read through a stale one.
"""

from __future__ import annotations

import torch

from ..base import originals as _originals
from ..base.layouts import BLOCK_LAYOUTS, ROW_LAYOUTS, compressed_members
from ..state import checked

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


class Side:
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
              r: int, c: int, *, blocks_t: bool, is_sorted: bool) -> Side:
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
        return Side(crow.to(index), col, perm, n_out, n_in, r, c, blocks_t)

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
    batches, new tensors), the number of batches and the stored blocks per batch."""
    row = t.layout in ROW_LAYOUTS
    compressed, plain = compressed_members(t)
    n_batch = compressed.numel() // compressed.shape[-1]
    compressed, plain = compressed.reshape(n_batch, -1), plain.reshape(n_batch, -1)
    nnz = plain.shape[1]
    lines = torch.repeat_interleave(
        torch.arange(compressed.shape[1] - 1, device=plain.device).repeat(n_batch),
        compressed.diff(dim=1).reshape(-1), output_size=n_batch * nnz)
    # a copy, never an alias of the member: a structure built on it is read by backward
    # passes after the member may have been written
    across = plain.reshape(-1).to(torch.long, copy=True)
    return (lines, across, n_batch, nnz) if row else (across, lines, n_batch, nnz)


class Structure:
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
        self._sides: dict[bool, Side] = {}

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

    def side(self, transpose: bool) -> Side:
        """``A`` (``transpose=False``) or ``A^T`` as an element CSR matrix."""
        s = self._sides.get(transpose)
        if s is None:
            if transpose:
                s = Side.build(self.cols, self.rows, self.n_cols, self.n_rows, self.c, self.r,
                                blocks_t=True, is_sorted=self.cols_sorted)
            else:
                s = Side.build(self.rows, self.cols, self.n_rows, self.n_cols, self.r, self.c,
                                blocks_t=False, is_sorted=self.rows_sorted)
            self._sides[transpose] = s
        return s


def structure(a: torch.Tensor, batch_rows: bool, batch_cols: bool) -> Structure:
    """``a``'s block structure, kept with its index data's proof
    (:func:`safesparse.state.checked.proof_cache`: dropped whenever that proof drops, shared by
    every tensor on the same proven index data); built afresh when it cannot be kept."""
    cache = checked.proof_cache(a)
    if cache is None:
        return Structure(a, batch_rows, batch_cols)
    key = ("blocks", a.layout, a.shape, a.values().shape[-2:], batch_rows, batch_cols)
    found = cache.get(key)
    if found is None:
        found = cache[key] = Structure(a, batch_rows, batch_cols)
    assert isinstance(found, Structure)
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
#: (:meth:`Structure.block_grad`) rather than ``sampled_addmm`` over the element pattern
#: (CPU, torch 2.13, 64 columns: sampled_addmm ~1.1 ms whatever the blocks; bmm 0.65 ms for
#: 16 x 16 blocks, 1.6 ms for 8 x 8, 2.7 ms for 4 x 4).
_BMM_MIN = 144

"""CPU kernels for products with a compressed sparse matrix given by its dense members.

Pure functions for trusted callers (the ``safesparse`` operators): the members are an already
validated CSR / CSC / BSR / BSC matrix (2-D, any block shape, square or not); nothing here
validates or reads safesparse state, and no sparse tensor is ever built (results are plain
tensors, so enforce mode has nothing to check). ``linear*`` compute ``x @ W.T`` and its two
gradients, ``matmul*`` ``A @ x`` and its two. Each takes an optional ``cache``: a dict tied to
the members' proof (the operators pass ``safesparse.state.checked.members_cache``), where the
pattern-derived data (int64 copies, the grouping by the other dimension, block coordinates)
is kept; None computes it per call. One argument order everywhere: the matrix
(:class:`~safesparse.kernels.pattern.Matrix`, built by :func:`~safesparse.kernels.pattern.matrix`),
then the dense operands, then keywords.

Where the native library runs (:mod:`safesparse.kernels.native`: CPU, float32 / float64 /
float16 / bfloat16 operands), every product is one call into it, one parallel region; the
torch-op kernels below are the fallback (no library, ``SAFESPARSE_NATIVE=0``, other devices)
and give the same results. The rest of this docstring describes the torch-op kernels.

Products (the variant for every layout, block shape and density): a *row-grouped bag sum*.
A matrix ``M`` stored block row by block row (BSR order; CSR is ``r = c = 1``) times a dense
``src`` whose rows are ``M``'s element columns: output row ``i * r + a`` is the sum over the
blocks ``p`` of block row ``i`` and their columns ``b`` of ``values[p, a, b] * src[col[p] * c +
b]``. With the values read as ``(r, nnzb, c)`` (one copy) the terms of output row ``(i, a)`` are
one contiguous run, so ``torch.nn.functional.embedding_bag`` (mode ``sum``, per-sample weights,
offsets ``a * nnzb * c + crow[i] * c``) computes the product in one fused gather-scale-add
pass, rows in ``(a, i)`` order, 64 batch columns per call: no gathered copy of the dense
operand is written. Measured against the alternatives (1024 x 1024, 16 x 16 blocks, batch
256, this project's CPU): torch's MKL BSR kernel 1.2-1.8x dense at 25 % (this one ~0.9x),
gather + ``bmm`` variants 1.1-2x (their gathered operand outgrows the caches), MKL CSR on the
elements 1.4-1.9x. Details: ``benchmarks/bench_blockkernels.py``. One exception: batch-major
products (``linear``, ``linear_grad_input``) with blocks of ``_SEGMENT_FROM_BLOCK`` elements or
more and under ``_SEGMENT_BELOW`` of the matrix stored go block by block
(:func:`_segment_product`: no transposed copies of the batch, which cost more than the bag
sums themselves at 5 %).

The transposed product (gradient to ``x`` of a BSR / CSR weight, ``A.T @ g`` of a BSR / CSR
matrix, the forward of a BSC / CSC weight) groups the blocks by block column first: one stable
sort of the block column indices per call (:func:`_by_rows`; cheap for blocks, ~1-4 ms at
50 000-100 000 CSR elements).

Gradient to the values (:func:`_values_grad`), chosen by the stored fraction and block size
(the measured crossovers are the module constants below): at least ``_DENSE_GRAD_FROM`` of the
matrix stored, one dense GEMM read at the pattern; else blocks of ``_BMM_FROM_BLOCK`` elements
or more, ``torch.bmm`` over the row and column blocks gathered batch-major (runs of r / c
elements, no transposed copies), in batch chunks whose gathered blocks stay in cache; else
(CSR / CSC elements) one dot product per stored element, torch's per-sample-weight gradient
of ``embedding_bag``.

dtypes: float32 and float64 run natively; bfloat16 products of block layouts run in bfloat16
where the CPU has AVX512_BF16 (:func:`native.reads_bf16`: the operands are handed in as they
are, sums in float32, no float32 copy); otherwise float16 and bfloat16 are computed in float32
and the result is cast back (one code path for every dtype, sums accumulated in float32, which
is the more accurate; torch's MKL sparse kernels have no half kernels at all); the casts are
O(inputs + nnz), small beside the products (but three times the step's memory floor).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..base.forking import serial_in_forked_child
from . import native
from .pattern import Matrix, blocks, by_rows, checked_copy, checked_pointers, coordinates
from .pattern import block_rows as _block_rows
from .pattern import compute_dtype as _compute_dtype

T = torch.Tensor
#: What a caller may hand in to keep pattern-derived data across calls: a dict tied to the
#: members' proof (``safesparse.state.checked.members_cache``), or None.
Cache = dict[Hashable, Any] | None
#: Fraction of the matrix stored from which the gradient to the values is one dense GEMM read
#: at the pattern (measured, 16 x 16 blocks, 1024 x 1024, batch 256, one thread: the chunked
#: batched GEMM below costs 0.2 / 0.47 / 0.65 / 0.82 / 1.16 / 1.8x the dense product at
#: 5 / 10 / 15 / 20 / 25 / 35 %, the dense GEMM 1.1-1.2x at any fraction).
_DENSE_GRAD_FROM = 0.22
#: Smallest block (elements) whose values gradient below that fraction is one batched GEMM of
#: gathered row / column blocks (``torch.bmm``); smaller blocks (CSR / CSC elements) take one
#: dot product per stored element (torch's per-sample-weight gradient of ``embedding_bag``).
_BMM_FROM_BLOCK = 16
#: Fraction of the matrix stored below which batch-major products of blocks of at least
#: ``_SEGMENT_FROM_BLOCK`` elements go block by block (:func:`_segment_product`; measured 16 x 16,
#: 1024 x 1024, batch 256: 0.18-0.30x dense at 5 % where the bag sum takes 0.28-0.36x with
#: its two transposed copies, but 0.64x against 0.40-0.55x at 10 %).
_SEGMENT_BELOW = 0.075
_SEGMENT_FROM_BLOCK = 16
#: Bytes of one gathered operand per chunk in :func:`_block_grads` (about the L2 cache).
_GATHER_BYTES = 1 << 20
#: Batch columns per ``embedding_bag`` call (:func:`_bag_product`).
_CHUNK = 64


# ---------------------------------------------------------------------------------------------
# Pattern helpers (index data only)


def _index_dtype(crow: T, r: int, c: int, n_src: int) -> torch.dtype:
    """int32 for the per-term index arrays where every value fits (half the memory traffic of
    int64: these arrays have one entry per stored element), int64 otherwise."""
    terms = int(crow[-1]) * r * c
    return torch.int32 if max(terms, n_src * c, r * crow.numel()) < 2**31 else torch.int64


def _runs(crow: T, col: T, r: int, c: int, dtype: torch.dtype) -> tuple[T, T]:
    """Indices and offsets of the bag layout (module docstring): element columns of the terms
    in ``(a, p, b)`` order and the start of each output row's run, rows in ``(a, i)`` order."""
    nnzb = col.numel()
    first = (col.to(dtype) * c).view(1, nnzb, 1).expand(r, nnzb, c)
    idx = torch.add(first, torch.arange(c, dtype=dtype).view(1, 1, c))
    starts = (torch.arange(r, dtype=dtype) * (nnzb * c)).view(r, 1)
    offsets = torch.add(starts, (crow[:-1].to(dtype) * c).view(1, -1))
    return idx.view(-1), offsets.view(-1)


def _bag_ids(crow: T, r: int, c: int, dtype: torch.dtype) -> T:
    """For each term of the bag layout, its output row's position in ``(a, i)`` order."""
    n_br = crow.numel() - 1
    nnzb = int(crow[-1])
    rows = _block_rows(crow, nnzb).to(dtype)
    first = (torch.arange(r, dtype=dtype) * n_br).view(r, 1, 1).expand(r, nnzb, c)
    return torch.add(first, rows.view(1, nnzb, 1)).view(-1)


# ---------------------------------------------------------------------------------------------
# The two kernels, over a matrix stored by block rows


def _bag_product(crow: T, col: T, weights: T, r: int, c: int, operand: T,
                 batch_major: bool, n_out: int) -> T:
    """``M @ operand.T`` as (N, n_out) for a batch-major ``operand`` (N, n_in), else
    ``M @ operand`` as (n_out, N) for ``operand`` (n_in, N); ``weights``: the values flat in
    ``(a, p, b)`` order (module docstring).

    The batch is cut into chunks of ``_CHUNK`` columns: ``embedding_bag`` accumulates one
    output row of that width in registers (measured 1.4-1.5x faster per term at 64 than at 256
    columns of float32)."""
    n = operand.shape[0] if batch_major else operand.shape[1]
    n_in = operand.shape[1] if batch_major else operand.shape[0]
    n_br = crow.numel() - 1
    idx, offsets = _runs(crow, col, r, c, _index_dtype(crow, r, c, n_in))
    result = operand.new_empty((n, n_out) if batch_major else (n_out, n))
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        part = operand[start:stop].t() if batch_major else operand[:, start:stop]
        out = torch.nn.functional.embedding_bag(
            idx, part.contiguous(), offsets, mode="sum", per_sample_weights=weights)
        # rows into natural order (whole rows move), then a 2-D transpose where batch-major:
        # one 3-D permute copy measured 2-3x slower than both together
        rows = out.view(r, n_br, stop - start).transpose(0, 1).reshape(n_out, stop - start)
        if batch_major:
            result[start:stop].copy_(rows.t())
        else:
            result[:, start:stop].copy_(rows)
    return result


def _sampled(crow: T, col: T, r: int, c: int, left: T, right_t: T) -> T:
    """For each stored block ``p`` at block (i, j): ``left[i-rows] @ right_t[j-cols].T`` as
    (nnzb, r, c); ``left`` (n_rows of M, K), ``right_t`` (n_cols of M, K).

    This is the gradient of :func:`_bag_product` to its per-sample weights (one dot product of
    length K per stored element, nothing gathered into a copy), torch's own kernel for it."""
    nnzb = col.numel()
    n_br = crow.numel() - 1
    dtype = _index_dtype(crow, r, c, right_t.shape[0])
    idx, offsets = _runs(crow, col, r, c, dtype)
    bag_of = _bag_ids(crow, r, c, dtype)
    k = left.shape[1]
    # whole rows move (a 2-D transpose first where ``left`` is one, e.g. ``g.T``)
    left_p = left.contiguous().view(n_br, r, k).transpose(0, 1).reshape(r * n_br, k)
    flat: T = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        left_p, right_t.contiguous(), idx, offsets, bag_of, 0, -1)
    return flat.view(r, nnzb, c).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------------
# Orientation: any stored layout, read as "M stored by block rows"


def _rowwise(m: Matrix, transposed: bool) -> tuple[T, T, T]:
    """``M = A`` (or ``A.T`` when ``transposed``) by block rows: (crow, col, blocks of ``M`` as
    (nnzb, r, c), possibly a strided view) for the matrix ``A``."""
    a_blocks = blocks(m)
    # private, checked pointers: embedding_bag trusts its offsets (the indices it checks)
    compressed, plain = checked_pointers(m.compressed, int(a_blocks.shape[0])), m.plain.long()
    row_major = m.row_major
    if row_major != transposed:
        # the stored compressed dimension is M's rows
        return compressed, plain, a_blocks if row_major else a_blocks.transpose(1, 2)
    crow, col, order = by_rows(compressed, plain, m.n_plain)
    gathered = a_blocks.index_select(0, order)
    return crow, col, gathered.transpose(1, 2) if row_major else gathered


def _weights(m_blocks: T, dtype: torch.dtype) -> T:
    """The values flat in ``(a, p, b)`` order (module docstring)."""
    return m_blocks.to(dtype).transpose(0, 1).reshape(-1)


def _segment_product(crow: T, col: T, m_blocks: T, operand: T, n_out: int) -> T:
    """``operand @ M.T`` (N, n_out) for a batch-major ``operand`` (N, n_in), block by block:
    the column blocks of ``operand`` gathered batch-major (runs of c elements), one ``bmm``
    with the blocks, the products summed per block row (``embedding_bag`` over whole rows).
    No transposed copies; its gathered operand grows with nnzb * N, so it pays only for few
    blocks (``_SEGMENT_BELOW``)."""
    nnzb, r, c = (int(s) for s in m_blocks.shape)
    n = operand.shape[0]
    n_br = crow.numel() - 1
    xg = operand.contiguous().view(n, operand.shape[1] // c, c).index_select(1, col)
    prod = torch.bmm(xg.transpose(0, 1), m_blocks.transpose(1, 2))        # (nnzb, N, r)
    seg = torch.nn.functional.embedding_bag(
        torch.arange(nnzb), prod.view(nnzb, n * r), crow[:-1], mode="sum")
    return seg.view(n_br, n, r).transpose(0, 1).reshape(n, n_out)


def _batch_product(m: Matrix, transposed: bool, operand: T) -> T:
    """``operand @ M.T`` for ``M = A`` or ``A.T`` and a batch-major ``operand``, in the
    operand's (float32 / float64) dtype: the variant chosen by block size and stored
    fraction."""
    crow, col, m_blocks = _rowwise(m, transposed)
    nnzb, r, c = (int(s) for s in m_blocks.shape)
    n_out = m.n_cols if transposed else m.n_rows
    if r * c >= _SEGMENT_FROM_BLOCK and nnzb * r * c < _SEGMENT_BELOW * m.n_rows * m.n_cols:
        return _segment_product(crow, col, m_blocks.to(operand.dtype), operand, n_out)
    return _bag_product(crow, col, _weights(m_blocks, operand.dtype), r, c, operand, True,
                        n_out)


def _apply(m: Matrix, transposed: bool, src: T) -> T:
    """``M @ src`` for ``M = A`` or ``A.T``, ``src`` (n_cols of M, N): (n_rows of M, N)."""
    m_rows = m.n_cols if transposed else m.n_rows
    n = src.shape[1]
    if n == 0 or m.plain.numel() == 0:
        return src.new_zeros(m_rows, n)
    crow, col, m_blocks = _rowwise(m, transposed)
    r, c = int(m_blocks.shape[1]), int(m_blocks.shape[2])
    return _bag_product(crow, col, _weights(m_blocks, src.dtype), r, c, src, False, m_rows)


# ---------------------------------------------------------------------------------------------
# Public kernels


@serial_in_forked_child
def linear(w: Matrix, x: T, *, cache: Cache = None, bias: T | None = None) -> T:
    """``x @ W.T`` (``+ bias``, added in the product where native) for the ``out_features x
    in_features`` matrix ``w`` and ``x`` (N, in_features): (N, out_features), dtype of
    ``x``."""
    return _linear_product(w, x, False, cache, bias)


@serial_in_forked_child
def linear_grad_input(w: Matrix, g: T, *, cache: Cache = None,
                      dtype: torch.dtype | None = None, rounded: bool = False) -> T:
    """``g @ W`` for ``g`` (N, out_features): (N, in_features), dtype of ``g``, or ``dtype``
    (float32 for a bfloat16 ``g``: the float32 sums unrounded, no bfloat16 result cast after;
    with ``rounded``, the bits of ``linear_grad_input(w, g).to(dtype)`` without that pass: a
    float32 layer's gradient to its input under bfloat16 autocast)."""
    if rounded and dtype is not None and dtype != g.dtype:
        return _rounded(g.dtype, dtype,
                        lambda: _native_linear_product(w, g, True, cache, None, dtype, True),
                        lambda: _linear_product(w, g, True, cache))
    return _linear_product(w, g, True, cache, out_dtype=dtype)


def _rounded(src: torch.dtype, out: torch.dtype, direct: Callable[[], T | None],
             rounded_then_cast: Callable[[], T]) -> T:
    """A product in ``src``'s dtype cast to ``out``: ``direct()`` (the bfloat16 kernels
    writing the rounded result widened, float32) where they run it, else the product in
    ``src``'s dtype cast."""
    if src == torch.bfloat16 and out == torch.float32:
        got = direct()
        if got is not None:
            return got
    return rounded_then_cast().to(out)


def _linear_product(w: Matrix, src: T, transposed: bool, cache: Cache = None,
                    bias: T | None = None, out_dtype: torch.dtype | None = None) -> T:
    """``src @ W.T`` (``transposed`` False) or ``src @ W`` (True), in ``src``'s dtype (or
    ``out_dtype``), plus ``bias`` (forward only)."""
    out = src.dtype if out_dtype is None else out_dtype
    y = _native_linear_product(w, src, transposed, cache, bias, out)
    return _torch_linear_product(w, src, transposed, bias, out) if y is None else y


def _native_linear_product(w: Matrix, src: T, transposed: bool, cache: Cache, bias: T | None,
                           out: torch.dtype, rounded: bool = False) -> T | None:
    """:func:`_linear_product` by the native kernels, into ``out``; None where they do not
    run it. ``rounded`` (a bfloat16 ``src``, ``out`` float32): by the bfloat16 kernels only,
    their rounded result written widened (:func:`safesparse.kernels.native.product`)."""
    n = src.shape[0]
    if n == 0 or w.plain.numel() == 0 or not native.usable(src, w.values):
        return None
    in_bf16 = native.reads_bf16(src.dtype, w.layout)
    if rounded and not in_bf16:
        return None
    n_out = w.n_cols if transposed else w.n_rows
    y = src.new_empty(n, n_out, dtype=out)
    # half types: the operand converted once (the kernels read it in place, float32)
    work = src if in_bf16 else src.to(_compute_dtype(src.dtype))
    ok = native.product(w, transposed, work, work.stride(1), work.stride(0), n, y, 1, n_out,
                        bias=bias, cache=cache, rounded=rounded)
    return y if ok else None


def _torch_linear_product(w: Matrix, src: T, transposed: bool, bias: T | None = None,
                          out: torch.dtype | None = None) -> T:
    """:func:`_linear_product` with torch ops; the bias added in the compute dtype, before
    the one rounding to ``src``'s dtype or ``out`` (as the native kernels add it inside their
    sums)."""
    n = src.shape[0]
    out = src.dtype if out is None else out
    if n == 0 or w.plain.numel() == 0:
        y = src.new_zeros(n, w.n_cols if transposed else w.n_rows, dtype=out)
        return y if bias is None else y.add_(bias)
    y = _batch_product(w, transposed, src.to(_compute_dtype(src.dtype)))
    if bias is not None:
        y = y.add_(bias.to(y.dtype))
    return y.to(out)


def _gather_rows(left: T, rows: T, r: int) -> T:
    """The (r, K) row blocks ``rows`` of ``left`` (n_rows, K) as (nnzb, r, K), gathered along
    the dimension that keeps whole memory runs (``left`` may be the transpose of a batch-major
    tensor: then the gather takes r-element runs of each batch row, no transpose copy)."""
    k = left.shape[1]
    if left.stride(0) == 1 and left.stride(1) != 1:
        gathered = left.t().view(k, left.shape[0] // r, r).index_select(1, rows)     # (K, nnzb, r)
        return gathered.permute(1, 2, 0)
    return left.contiguous().view(left.shape[0] // r, r, k).index_select(0, rows)


def _gather_cols(right: T, cols: T, c: int) -> T:
    """The (K, c) column blocks ``cols`` of ``right`` (K, n_cols) as (nnzb, K, c)."""
    k = right.shape[0]
    if right.stride(0) == 1 and right.stride(1) != 1:
        gathered = right.t().view(right.shape[1] // c, c, k).index_select(0, cols)    # (nnzb, c, K)
        return gathered.transpose(1, 2)
    return right.contiguous().view(k, right.shape[1] // c, c).index_select(1, cols).transpose(0, 1)


def _block_grads(left: T, right: T, rows: T, cols: T, r: int, c: int) -> T:
    """``left[rows_p] @ right[:, cols_p]`` for every block ``p`` as (nnzb, r, c): ``bmm`` of the
    gathered blocks, summed over chunks of the contracted (batch) dimension sized so that one
    chunk's gathered operands stay about ``_GATHER_BYTES`` (measured at 15 % of 16 x 16 blocks:
    0.54x dense in 32-column chunks, 1.3x unchunked)."""
    k = left.shape[1]
    per_column = rows.numel() * max(r, c) * left.element_size()
    step = max(8, _GATHER_BYTES // max(per_column, 1))
    grads: T | None = None
    for start in range(0, k, step):
        stop = min(k, start + step)
        lhs = _gather_rows(left[:, start:stop], rows, r)
        rhs = _gather_cols(right[start:stop], cols, c)
        grads = torch.bmm(lhs, rhs) if grads is None else grads.baddbmm_(lhs, rhs)
    return left.new_zeros(rows.numel(), r, c) if grads is None else grads


def _values_grad(m: Matrix, left: T, right: T, dtype: torch.dtype) -> T:
    """Per stored block (i, j): ``left[i-rows] @ right[:, j-cols]`` in the values' shape and
    stored order, for ``left`` (n_rows, K) and ``right`` (K, n_cols)."""
    r, c = m.r, m.c
    values_shape = m.values.shape
    if m.plain.numel() == 0:
        return torch.zeros(values_shape, dtype=dtype)
    work = _compute_dtype(dtype)
    left, right = left.to(work), right.to(work)
    n_rows, n_cols = left.shape[0], right.shape[1]
    nnzb = int(values_shape[0])
    # private, checked copies: torch's per-sample-weight gradient trusts its indices and offsets
    compressed = checked_pointers(m.compressed, nnzb)
    plain = checked_copy(m.plain, m.n_plain)
    rows, cols = coordinates(m, compressed, plain)
    if nnzb * r * c >= _DENSE_GRAD_FROM * n_rows * n_cols:
        # dense enough: one GEMM, then the stored blocks read out of it
        grads = (left @ right).view(n_rows // r, r, n_cols // c, c)[rows, :, cols, :]
    elif r * c >= _BMM_FROM_BLOCK:
        grads = _block_grads(left, right, rows, cols, r, c)
    elif m.row_major:
        grads = _sampled(compressed, plain, r, c, left, right.t())
    else:
        # BSC / CSC: stored by block columns, i.e. A.T by block rows, blocks transposed
        grads = _sampled(compressed, plain, c, r, right.t(), left).transpose(1, 2)
    # contiguous whatever the path (the BSC / CSC one is transposed): the operators' fakes
    # promise contiguous gradients
    return grads.reshape(values_shape).to(dtype).contiguous()


#: Rows from which :func:`bias_grad` of a bfloat16 gradient sums natively
NATIVE_SUM_ROWS = 128
#: Rows below which it sums natively too, rounded to bfloat16: torch sums fewer than 16
#: bfloat16 rows in order from zero in float32 (its cascade sum starts a level at 16), the
#: bits of the native pass, whose call costs less than torch's reduction
#: (tests/kernels/test_bf16.py checks both agree; torch's float32 sums, ``dtype`` float32,
#: are not in that order)
NATIVE_SUM_BELOW = 16


def native_bias_sum(rows: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`bias_grad` sums a bfloat16 gradient of ``rows`` rows natively into
    ``dtype`` (where the library runs): the callers that sum in the library themselves (the
    eager fast path's packed backward) ask, so that their bits are :func:`bias_grad`'s."""
    return rows >= NATIVE_SUM_ROWS or (0 < rows < NATIVE_SUM_BELOW and dtype == torch.bfloat16)


@serial_in_forked_child
def bias_grad(g: T, *, dtype: torch.dtype | None = None) -> T:
    """The gradient of :func:`linear`'s bias, ``g.sum(0)`` (in a forked child with one
    thread, as every product here: a reduction of a batch is one of torch's parallel ops), in
    ``g``'s dtype or ``dtype``. bfloat16 on a CPU with the bfloat16 kernels, from
    :data:`NATIVE_SUM_ROWS` rows and below :data:`NATIVE_SUM_BELOW`
    (:func:`native_bias_sum`): one native pass (float32 sums; ``dtype`` float32: unrounded),
    about half torch's time at 4096 rows; between them: torch's. (Measured inside
    a bfloat16 layer's fwd+bwd after a dense layer's step, where it runs after the gradient
    products: 24 against torch's 33 us at 128 rows, 36-45 against 54-63 at 256, equal at
    1024; alone after a dense step, 77-85 against 102-154 us at 256 rows.)"""
    out = g.dtype if dtype is None else dtype
    if g.dim() == 2 and not g.is_contiguous():
        # (summed as laid out in rows: the order of torch's sums depends on the strides; the
        # eager fast path sums the gradient made contiguous, to the same bits)
        g = g.contiguous()
    # (a plain tensor only: the autograd formula of the operators runs traced under
    # torch.compile, on fake tensors that have no memory)
    if type(g) is torch.Tensor and g.dtype == torch.bfloat16 and g.dim() == 2 \
            and native_bias_sum(g.shape[0], out) and native.available():
        got = native.colsum_bf16(g, out)
        if got is not None:
            return got
    return g.sum(0) if dtype is None else g.sum(0, dtype=dtype)


@serial_in_forked_child
def linear_grad_values(w: Matrix, g: T, x: T, *, cache: Cache = None,
                       dtype: torch.dtype | None = None, rounded: bool = False) -> T:
    """Gradient of ``sum(g * (x @ W.T))`` with respect to the stored values: for each stored
    block (i, j), ``g[:, rows_i].T @ x[:, cols_j]``, in the values' shape, dtype of ``g``, or
    ``dtype`` (float32 for bfloat16 operands: the float32 sums unrounded; with ``rounded``,
    the bits of ``linear_grad_values(w, g, x).to(dtype)`` without that pass: a float32 layer's
    values gradient under bfloat16 autocast)."""
    if rounded and dtype is not None and dtype != g.dtype:
        wide = dtype

        def direct() -> T | None:  # (the bfloat16 kernels only)
            if not (w.plain.numel() and native.usable(g, x) and x.dtype == g.dtype
                    and native.reads_bf16(g.dtype, w.layout)):
                return None
            return _native_values_grad(w, g.t(), x.t(), wide, cache, rounded=True)
        return _rounded(g.dtype, dtype, direct, lambda: linear_grad_values(w, g, x, cache=cache))
    out = g.dtype if dtype is None else dtype
    if w.plain.numel() and native.usable(g, x):
        got = _native_values_grad(w, g.t(), x.t(), out, cache)
        if got is not None:
            return got
    return _values_grad(w, g.t(), x, out)


def _native_values_grad(m: Matrix, left: T, right_t: T, dtype: torch.dtype,
                        cache: Cache, rounded: bool = False) -> T | None:
    """Native values gradient for ``left`` (rows of A, K) and ``right_t`` (columns of A, K),
    any strides; operands made contiguous along K where the kernels need it (``rounded``:
    :func:`safesparse.kernels.native.values_grad`'s, the bfloat16 kernels only)."""
    src = left.dtype  # (the operands' dtype: ``dtype`` may be wider, float32 from bfloat16)
    work = src if native.reads_bf16(src, m.layout) else _compute_dtype(src)
    left, right_t = left.to(work), right_t.to(work)
    k = left.shape[1]
    got = native.values_grad(m, left, left.stride(0), left.stride(1), right_t,
                             right_t.stride(0), right_t.stride(1), k, dtype, cache, rounded)
    if got is None:
        left, right_t = left.contiguous(), right_t.contiguous()
        got = native.values_grad(m, left, k, 1, right_t, k, 1, k, dtype, cache, rounded)
    return got


def _matmul_product(a: Matrix, src: T, transposed: bool, cache: Cache) -> T:
    """``M @ src`` for ``M = A`` or ``A.T`` (``transposed``), dtype of ``src``: natively
    where the library takes it, else with torch ops."""
    n = src.shape[1]
    if n and a.plain.numel() and native.usable(src, a.values):
        y = src.new_empty(a.n_cols if transposed else a.n_rows, n)
        if native.product(a, transposed, src, src.stride(0), src.stride(1), n, y, n, 1,
                          cache=cache):
            return y
    y = _apply(a, transposed, src.to(_compute_dtype(src.dtype)))
    return y.to(src.dtype)


@serial_in_forked_child
def matmul(a: Matrix, x: T, *, cache: Cache = None) -> T:
    """``A @ x`` for the ``n_rows x n_cols`` matrix ``a`` and ``x`` (n_cols, N): (n_rows, N),
    dtype of ``x``."""
    return _matmul_product(a, x, False, cache)


@serial_in_forked_child
def matmul_grad_input(a: Matrix, g: T, *, cache: Cache = None) -> T:
    """``A.T @ g`` for ``g`` (n_rows, N): (n_cols, N), dtype of ``g``."""
    return _matmul_product(a, g, True, cache)


@serial_in_forked_child
def matmul_grad_values(a: Matrix, g: T, x: T, *, cache: Cache = None) -> T:
    """Gradient of ``sum(g * (A @ x))`` with respect to the stored values: ``g @ x.T`` sampled
    at the pattern, in the values' shape, dtype of ``g``."""
    if a.plain.numel() and native.usable(g, x):
        got = _native_values_grad(a, g, x, g.dtype, cache)
        if got is not None:
            return got
    return _values_grad(a, g, x.t(), g.dtype)

"""The kernels' interface: the matrix description (:class:`Matrix`) every kernel takes, and
the pattern helpers shared by both kernel paths (:mod:`.blocks`, :mod:`.native`).

Everything here reads index data that was validated, but that memory stays writable after its
proof (a racing in-place write). So what is derived from it (the block row of each block, the
pattern grouped the other way) is computed from a private copy whose bounds are checked first:
torch's own ``repeat_interleave`` and ``bincount`` would crash or allocate what a corrupted
value claims. A bad value raises :class:`IndexDataError`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..base.layouts import BLOCK_LAYOUTS, ROW_LAYOUTS, extents

T = torch.Tensor


class Matrix(NamedTuple):
    """A 2-D CSR / CSC / BSR / BSC matrix as the kernels read it: its ``layout``, its
    ``compressed`` and ``plain`` index members, its ``values`` ((nnz,) or (nnzb, r, c), any
    strides), its size ``n_rows x n_cols`` and its block shape ``r x c`` (1 x 1 for CSR / CSC),
    derived once by :func:`matrix`. Every kernel of :mod:`.blocks` and :mod:`.native` takes
    it first, then its dense operands, then keywords. The members are trusted: the caller
    proved them (the ``safesparse`` operators build one per call, after the proof)."""

    layout: torch.layout
    compressed: T
    plain: T
    values: T
    n_rows: int
    n_cols: int
    r: int
    c: int

    @property
    def row_major(self) -> bool:
        """Whether it is stored by (block) rows (CSR / BSR)."""
        return self.layout in ROW_LAYOUTS

    @property
    def n_plain(self) -> int:
        """The number of blocks along the plain dimension (block columns of CSR / BSR, block
        rows of CSC / BSC): the bound of every plain index."""
        return extents(self.layout, self.n_rows, self.n_cols, self.r, self.c)[1]


_new = tuple.__new__


def matrix(layout: torch.layout, compressed: T, plain: T, values: T, n_rows: int,
           n_cols: int) -> Matrix:
    """The :class:`Matrix` of these members (the block shape read off ``values``). Built per
    operator call: made as ``Matrix._make`` makes one (``tuple.__new__``, no keyword
    handling: ~0.4 µs)."""
    if layout in BLOCK_LAYOUTS:
        shape = values.shape
        return _new(Matrix, (layout, compressed, plain, values, n_rows, n_cols, shape[-2],
                             shape[-1]))
    return _new(Matrix, (layout, compressed, plain, values, n_rows, n_cols, 1, 1))


class IndexDataError(RuntimeError):
    """A kernel met an index out of its bounds: index data that was validated has been written
    since (a concurrent in-place write, or memory another owner changed). Nothing was read or
    written out of bounds; the product is abandoned."""


def index_fault(what: str, pos: int, value: int, rule: str) -> IndexDataError:
    """The error for ``what[pos] = value`` breaking ``rule``."""
    return IndexDataError(
        f"{what}[{pos}] = {value} is out of bounds ({rule}): the index data changed after it "
        "was validated (a concurrent in-place write?). Nothing was read out of bounds; keep "
        "index buffers unchanged while products run, or validate them again.")


def long(t: T) -> T:
    """``t`` as contiguous int64 (itself when it already is)."""
    return t.to(torch.int64).contiguous()


def checked_pointers(crow: T, nnzb: int) -> T:
    """A private int64 copy of ``crow`` checked to rise from 0 to ``nnzb`` (one combined
    check, one sync)."""
    ptr = crow.to(torch.int64, copy=True)
    counts = ptr.diff()
    if ptr.numel() == 0:
        raise index_fault("the compressed indices", 0, 0, "at least one entry")
    bad = (ptr[0] != 0) | (ptr[-1] != nnzb) | (counts < 0).any()
    if bool(bad):
        if int(ptr[0]) != 0:
            raise index_fault("the compressed indices", 0, int(ptr[0]), "must start at 0")
        drops = torch.nonzero(counts < 0)
        if drops.numel():
            at = int(drops[0, 0]) + 1
            raise index_fault("the compressed indices", at, int(ptr[at]), "must not decrease")
        raise index_fault("the compressed indices", ptr.numel() - 1, int(ptr[-1]),
                          f"must end at the number of stored blocks, {nnzb}")
    return ptr


def block_rows(crow: T, nnzb: int) -> T:
    """The block row of each stored block of a pattern stored by block rows (from a checked
    private copy of ``crow``: torch's ``repeat_interleave`` would crash on a corrupted one)."""
    return torch.repeat_interleave(checked_pointers(crow, nnzb).diff(), output_size=nnzb)


def checked_copy(plain: T, bound: int, what: str = "the plain indices") -> T:
    """A private int64 copy of ``plain``, every value checked within ``[0, bound)``."""
    copy = plain.to(torch.int64, copy=True)
    if copy.numel():
        lo, hi = torch.aminmax(copy)
        if int(lo) < 0 or int(hi) >= bound:
            at = int(torch.nonzero((copy < 0) | (copy >= bound))[0, 0])
            raise index_fault(what, at, int(copy[at]), f"must lie in [0, {bound})")
    return copy


def by_rows(compressed: T, plain: T, n_plain: int) -> tuple[T, T, T]:
    """The pattern read the other way: for plain block ``j`` of a matrix stored by compressed
    blocks (``compressed`` / ``plain``), its compressed blocks, as (``ptr``, ``rows``,
    ``order``) where ``order[q]`` is the stored position of the ``q``-th block in plain order
    (one stable sort); all three private, checked, contiguous int64."""
    plain = checked_copy(plain, n_plain)
    order = torch.argsort(plain, stable=True)
    rows = block_rows(compressed, plain.numel())
    ptr = torch.zeros(n_plain + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(plain, minlength=n_plain), 0, out=ptr[1:])
    return ptr, rows[order].contiguous(), order


def coordinates(m: Matrix, compressed: T, plain: T) -> tuple[T, T]:
    """(block row, block column) of each stored block of ``m``, in stored order, from its
    members as the caller hands them in (``compressed``: pointers, ``plain`` int64)."""
    outer = block_rows(compressed, plain.numel())
    return (outer, plain) if m.layout in ROW_LAYOUTS else (plain, outer)


def blocks(m: Matrix) -> T:
    """``m``'s values as (nnzb, r, c) blocks; CSR / CSC elements are 1 x 1 blocks."""
    if m.layout in BLOCK_LAYOUTS:
        return m.values
    return m.values.view(-1, 1, 1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 or float32 (half types widened)."""
    return torch.float64 if dtype == torch.float64 else torch.float32

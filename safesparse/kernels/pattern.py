"""Pattern helpers shared by both kernel paths (:mod:`.blocks`, :mod:`.native`): index data only.

Everything here reads index data that was validated, but that memory stays writable after its
proof (a racing in-place write). So what is derived from it (the block row of each block, the
pattern grouped the other way) is computed from a private copy whose bounds are checked first:
torch's own ``repeat_interleave`` and ``bincount`` would crash or allocate what a corrupted
value claims. A bad value raises :class:`IndexDataError`.
"""

from __future__ import annotations

import torch

from ..base.layouts import BLOCK_LAYOUTS

T = torch.Tensor


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


def block_shape(layout: torch.layout, values_shape: torch.Size) -> tuple[int, int]:
    """The (r, c) block of ``layout`` with values of ``values_shape`` (1 x 1 for CSR / CSC)."""
    if layout in BLOCK_LAYOUTS:
        return int(values_shape[-2]), int(values_shape[-1])
    return 1, 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 or float32 (half types widened)."""
    return torch.float64 if dtype == torch.float64 else torch.float32

"""The index-data invariants as masks: one helper per invariant (5.x), shared by the fast
path (:mod:`safesparse.engine.validation`, which reduces them all with one host sync) and the
diagnostic path (:mod:`safesparse.engine.diagnose`, which looks for their first ``True``).

Every data-dependent gather or scatter index is clamped into range first, so hostile index
values cannot make the checker itself read out of bounds.
"""

from __future__ import annotations

from typing import Final

import torch

_LARGE: Final = 1 << 16  # masks at least this long are reduced through uint8 (see any_set)


# --------------------------------------------------------------------------------------------
# Index-data invariants: one mask helper per invariant, shared by fast and diagnostic paths.


def _le_bound(x: torch.Tensor, bound: int) -> torch.Tensor:
    """``x <= bound`` without the python-int overflow of narrow index dtypes."""
    if bound >= torch.iinfo(x.dtype).max:
        return torch.ones_like(x, dtype=torch.bool)
    return x <= bound


def bad_first(c: torch.Tensor) -> torch.Tensor:
    """5.1 per batch: compressed[..., 0] != 0. ``c`` is (B, n_compressed + 1)."""
    return c[:, 0] != 0


def bad_last(c: torch.Tensor, nnz: int) -> torch.Tensor:
    """5.2 per batch: compressed[..., -1] != nnz (1.3 guarantees nnz fits the index dtype)."""
    return c[:, -1] != nnz


def row_counts(c: torch.Tensor) -> torch.Tensor:
    """Entries per compressed line, in int64 so hostile int32 data cannot wrap around."""
    return c.to(torch.int64).diff(dim=1)


def bad_counts(c: torch.Tensor, n_plain: int) -> torch.Tensor:
    """5.3 as stated, per (batch, line i): compressed[i+1] - compressed[i] is < 0 or > n_plain."""
    d = row_counts(c)
    return (d < 0) | (d > n_plain)


def bad_lines(c: torch.Tensor, nnz: int, n_plain: int) -> torch.Tensor:
    """5.3 per (batch, line i): the count compressed[i+1] - compressed[i] is < 0 or > n_plain.

    Every compressed value must then lie in [0, nnz]; checking that too keeps hostile int64
    values from wrapping the differences around into range (int32 values are widened first,
    so their differences are exact).
    """
    bad = bad_counts(c, n_plain)
    if c.dtype == torch.int64:
        nxt = c[:, 1:]
        bad |= (nxt < 0) | (nxt > nnz)
    return bad


def bad_order(c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """5.6 per (batch, position j-1): p[j] <= p[j-1] with j not the start of a line.

    Shape (B, nnz); the last column is padding, the target of line starts that are not
    interior positions (empty leading/trailing lines, or hostile compressed values).
    """
    nnz = p.shape[1]
    if nnz < 2:
        return torch.zeros_like(p, dtype=torch.bool)
    bad = torch.empty_like(p, dtype=torch.bool)
    bad[:, -1] = False
    torch.le(p[:, 1:], p[:, :-1], out=bad[:, :-1])
    starts = c[:, 1:-1].to(torch.int64) - 1  # pair (j-1, j) where line starts at j
    pad = nnz - 1
    starts = torch.where((starts < 0) | (starts >= pad), pad, starts)
    rows = torch.arange(0, bad.numel(), nnz, device=p.device).unsqueeze(1)
    bad.view(-1).index_fill_(0, (starts + rows).reshape(-1), False)
    return bad


def bad_negative(p: torch.Tensor) -> torch.Tensor:
    """5.4 / COO 5.1: index < 0."""
    return p < 0


def bad_too_large(p: torch.Tensor, bound: int | torch.Tensor) -> torch.Tensor:
    """5.5 / COO 5.2: index >= bound (bound broadcast per row for COO)."""
    if isinstance(bound, int):
        return ~_le_bound(p, bound - 1) if bound > 0 else torch.ones_like(p, dtype=torch.bool)
    return p >= bound


def coo_bad_order(indices: torch.Tensor) -> torch.Tensor:
    """COO 5.3 per position j-1: index tuple j is not lexicographically after tuple j-1."""
    s, nnz = indices.shape
    if nnz < 2 or s == 0:
        # with no sparse dim every index tuple is the empty tuple: any two are duplicates
        return torch.full((max(nnz - 1, 0),), s == 0, dtype=torch.bool, device=indices.device)
    prev, nxt = indices[:, :-1], indices[:, 1:]
    after = nxt[0] > prev[0]
    tie = nxt[0] == prev[0]
    for d in range(1, s):  # loop over sparse dims, not over nnz
        after |= tie & (nxt[d] > prev[d])
        if d < s - 1:
            tie &= nxt[d] == prev[d]
    return ~after


# --------------------------------------------------------------------------------------------
# Fast path


def any_set(mask: torch.Tensor) -> torch.Tensor:
    """``mask.any()`` as a 0-dim bool tensor. Large masks go through a uint8 max: torch's bool
    ``any`` is not vectorised on CPU, and the max is ~30x faster at 1e7 elements."""
    if mask.numel() < _LARGE:
        return mask.any()
    return mask.reshape(-1).view(torch.uint8).amax() != 0


def none_set(*bad: torch.Tensor) -> torch.Tensor:
    """True when none of the 0-dim ``bad`` flags is set (one stacked reduction)."""
    if not bad:  # nothing to check (COO with sparse_dim 0, not marked coalesced)
        return torch.ones((), dtype=torch.bool)
    return ~torch.stack([b.reshape(()) for b in bad]).any()


def compressed_flags(c: torch.Tensor, p: torch.Tensor, nnz: int, n_plain: int) -> torch.Tensor:
    """All compressed index invariants as one 0-dim bool tensor (no sync).

    5.4/5.5 are violated by some plain index exactly when they are violated by the minimum or
    the maximum, so their predicates are applied to ``aminmax`` results; the other invariants
    reduce their masks (5.1-5.3 are per line: O(rows)).
    """
    bad = [any_set(bad_first(c)), any_set(bad_last(c, nnz)), any_set(bad_lines(c, nnz, n_plain))]
    if p.numel():
        bad.append(any_set(bad_order(c, p)))
        lo, hi = torch.aminmax(p)
        bad += [bad_negative(lo), bad_too_large(hi, n_plain)]
    return none_set(*bad)


__all__ = [
    "any_set",
    "bad_counts",
    "bad_first",
    "bad_last",
    "bad_lines",
    "bad_negative",
    "bad_order",
    "bad_too_large",
    "compressed_flags",
    "coo_bad_order",
    "none_set",
    "row_counts",
]

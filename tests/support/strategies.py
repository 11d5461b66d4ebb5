"""Shared helpers and hypothesis strategies: random *valid* sparse inputs for every layout.

Every generated :class:`Case` carries the raw members a user would pass to a factory, the size,
and a reference dense tensor computed here in plain Python (independently of torch's sparse
kernels). Compressed cases are built directly from a random block mask with the same number of
specified blocks in every batch, so batched, hybrid, int32-indexed, nnz=0, empty-row and
empty-batch inputs all come out valid by construction.

The module also holds a small pure-Python reference checker for the index-data invariants
(5.x), used to predict the exact id the validator must report after an index corruption.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hypothesis import strategies as st

import safesparse as ss

COMPRESSED_LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
ALL_LAYOUTS = (torch.sparse_coo, *COMPRESSED_LAYOUTS)
BLOCKED = (torch.sparse_bsr, torch.sparse_bsc)
ROW_COMPRESSED = (torch.sparse_csr, torch.sparse_bsr)
LAYOUT_IDS = {
    torch.sparse_coo: "COO",
    torch.sparse_csr: "CSR",
    torch.sparse_csc: "CSC",
    torch.sparse_bsr: "BSR",
    torch.sparse_bsc: "BSC",
}
INDEX_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float64, torch.int64, torch.complex64, torch.bool)

SS_FACTORIES: dict[torch.layout, Callable[..., Any]] = {
    torch.sparse_coo: ss.sparse_coo_tensor,
    torch.sparse_csr: ss.sparse_csr_tensor,
    torch.sparse_csc: ss.sparse_csc_tensor,
    torch.sparse_bsr: ss.sparse_bsr_tensor,
    torch.sparse_bsc: ss.sparse_bsc_tensor,
}
TORCH_FACTORIES: dict[torch.layout, Callable[..., Any]] = {
    torch.sparse_coo: torch.sparse_coo_tensor,
    torch.sparse_csr: torch.sparse_csr_tensor,
    torch.sparse_csc: torch.sparse_csc_tensor,
    torch.sparse_bsr: torch.sparse_bsr_tensor,
    torch.sparse_bsc: torch.sparse_bsc_tensor,
}

OMIT = object()  # "pass no size at all"


def layout_id(layout: torch.layout) -> str:
    return LAYOUT_IDS[layout]


@dataclass
class Case:
    """One sparse tensor given by its members, plus what it must look like densely."""

    layout: torch.layout
    indices: tuple[torch.Tensor, ...]  # (compressed, plain) or (indices,) for COO
    values: torch.Tensor
    size: tuple[int, ...]
    dense: torch.Tensor  # reference, computed without torch sparse kernels
    batch: tuple[int, ...] = ()
    blocksize: tuple[int, int] = (1, 1)
    dense_size: tuple[int, ...] = ()
    is_coalesced: bool | None = None  # COO only
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compressed(self) -> torch.Tensor:
        assert self.layout != torch.sparse_coo
        return self.indices[0]

    @property
    def plain(self) -> torch.Tensor:
        assert self.layout != torch.sparse_coo
        return self.indices[1]

    @property
    def nnz(self) -> int:
        return int(self.indices[-1].shape[-1])

    @property
    def n_plain(self) -> int:
        """Number of addressable plain slots (blocks), from the size."""
        m = len(self.batch)
        if self.layout in ROW_COMPRESSED:
            return self.size[m + 1] // self.blocksize[1]
        return self.size[m] // self.blocksize[0]

    def kwargs(self) -> dict[str, Any]:
        return {"is_coalesced": self.is_coalesced} if self.layout == torch.sparse_coo else {}

    def args(self, size: Any = None) -> tuple[Any, ...]:
        size = self.size if size is None else size
        members = (*self.indices, self.values)
        return members if size is OMIT else (*members, size)

    def clone(self) -> Case:
        return replace(
            self,
            indices=tuple(t.clone() for t in self.indices),
            values=self.values.clone(),
            extra=dict(self.extra),
        )

    def ss_build(self, size: Any = None, **kwargs: Any) -> torch.Tensor:
        return SS_FACTORIES[self.layout](*self.args(size), **self.kwargs(), **kwargs)

    def torch_build(self, size: Any = None, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("check_invariants", True)
        return TORCH_FACTORIES[self.layout](*self.args(size), **self.kwargs(), **kwargs)

    def describe(self) -> str:
        shapes = [tuple(t.shape) for t in (*self.indices, self.values)]
        return (
            f"{layout_id(self.layout)} size={self.size} members={shapes} "
            f"indices={[t.tolist() for t in self.indices]}"
        )


# ---------------------------------------------------------------------------------------------
# Reference dense tensors (plain Python loops over a handful of entries)


def _fill_compressed(
    layout: torch.layout,
    compressed: torch.Tensor,
    plain: torch.Tensor,
    values: torch.Tensor,
    size: tuple[int, ...],
    batch: tuple[int, ...],
    blocksize: tuple[int, int],
) -> torch.Tensor:
    dense = torch.zeros(size, dtype=values.dtype)
    b0, b1 = blocksize
    blocked = layout in BLOCKED
    nb = math.prod(batch)
    c = compressed.reshape(nb, compressed.shape[-1]).tolist()
    p = plain.reshape(nb, plain.shape[-1]).tolist()
    v = values.reshape((nb, *values.shape[len(batch):]))
    d = dense.reshape((nb, *size[len(batch):]))
    for b in range(nb):
        for line in range(len(c[b]) - 1):
            for j in range(c[b][line], c[b][line + 1]):
                r, col = (line, p[b][j]) if layout in ROW_COMPRESSED else (p[b][j], line)
                block = v[b, j] if blocked else v[b, j].reshape((1, 1, *v.shape[2:]))
                d[b, r * b0:(r + 1) * b0, col * b1:(col + 1) * b1] = block
    return dense


def _fill_coo(indices: torch.Tensor, values: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    dense = torch.zeros(size, dtype=values.dtype)
    for j, idx in enumerate(indices.t().tolist()):
        if values.dtype == torch.bool:
            dense[tuple(idx)] |= values[j]
        else:
            dense[tuple(idx)] += values[j]
    return dense


def random_values(seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-4, 5, tuple(shape), generator=gen)
    if dtype == torch.bool:
        return raw > 0
    if dtype.is_complex:
        imag = torch.randint(-4, 5, tuple(shape), generator=gen)
        return torch.complex(raw.double(), imag.double()).to(dtype)
    return raw.to(dtype)


# ---------------------------------------------------------------------------------------------
# Strategies

# a sparse extent: usually 1-4, sometimes 0
extent = st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.just(0))

@st.composite
def compressed_cases(
    draw: st.DrawFn,
    layouts: Sequence[torch.layout] = COMPRESSED_LAYOUTS,
    max_batch_dims: int = 2,
    max_dense_dims: int = 1,
) -> Case:
    layout = draw(st.sampled_from(list(layouts)))
    index_dtype = draw(st.sampled_from(INDEX_DTYPES))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    m = draw(st.integers(0, max_batch_dims))
    batch = tuple(draw(st.lists(
        st.integers(1, 3) | st.just(0), min_size=m, max_size=m)))
    # an empty batch (a 0 in batch) is generated, but rarely
    if 0 in batch and draw(st.integers(0, 3)) != 0:
        batch = tuple(max(b, 1) for b in batch)
    blocked = layout in BLOCKED
    blocksize = (
        (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if blocked else (1, 1)
    )
    n = draw(st.integers(0, max_dense_dims))
    dense_size = tuple(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    nrb, ncb = draw(extent), draw(extent)
    n_comp, n_plain = (nrb, ncb) if layout in ROW_COMPRESSED else (ncb, nrb)
    total = n_comp * n_plain
    nnz = draw(st.integers(0, total))
    nb = math.prod(batch)
    crows, cols = [], []
    for _ in range(nb):
        chosen = sorted(draw(st.permutations(range(total)))[:nnz])
        counts = [0] * n_comp
        for pos in chosen:
            counts[pos // n_plain] += 1
        crows.append([0, *itertools.accumulate(counts)])
        cols.append([pos % n_plain for pos in chosen])
    compressed = torch.tensor(crows, dtype=index_dtype).reshape((*batch, n_comp + 1))
    plain = torch.tensor(cols, dtype=index_dtype).reshape((*batch, nnz))
    vshape = (*batch, nnz, *(blocksize if blocked else ()), *dense_size)
    values = random_values(draw(st.integers(0, 2**31)), vshape, value_dtype)
    size = (*batch, nrb * blocksize[0], ncb * blocksize[1], *dense_size)
    dense = _fill_compressed(layout, compressed, plain, values, size, batch, blocksize)
    return Case(layout, (compressed, plain), values, size, dense, batch, blocksize, dense_size)


@st.composite
def coo_cases(draw: st.DrawFn, max_dense_dims: int = 1) -> Case:
    s = draw(st.integers(1, 3))
    sparse_size = tuple(draw(st.lists(extent, min_size=s, max_size=s)))
    n = draw(st.integers(0, max_dense_dims))
    dense_size = tuple(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    value_dtype = draw(st.sampled_from(VALUE_DTYPES))
    if math.prod(sparse_size) == 0:
        entries: list[tuple[int, ...]] = []
    else:
        entry = st.tuples(*(st.integers(0, e - 1) for e in sparse_size))
        entries = draw(st.lists(entry, max_size=6))
    coalesced = draw(st.booleans())
    if coalesced:
        entries = sorted(set(entries))
    indices = torch.tensor(entries, dtype=torch.int64).reshape(len(entries), s).t().contiguous()
    values = random_values(
        draw(st.integers(0, 2**31)), (len(entries), *dense_size), value_dtype
    )
    size = (*sparse_size, *dense_size)
    dense = _fill_coo(indices, values, size)
    return Case(
        torch.sparse_coo, (indices,), values, size, dense, (), (1, 1), dense_size,
        is_coalesced=True if coalesced else None,
    )


def cases(layouts: Sequence[torch.layout] = ALL_LAYOUTS) -> st.SearchStrategy[Case]:
    """Valid cases, the layout drawn uniformly from ``layouts``."""
    return st.sampled_from(list(layouts)).flatmap(
        lambda lay: coo_cases() if lay == torch.sparse_coo else compressed_cases([lay])
    )


# ---------------------------------------------------------------------------------------------
# Reference checker for the index-data invariants (5.x)


def expected_compressed_index_violation(
    compressed: torch.Tensor, plain: torch.Tensor, n_plain: int | None
) -> str | None:
    """The first violated index invariant (in id order, over all batches), or None.

    ``n_plain=None`` means the size was omitted (no upper bounds on plain indices or counts).
    Assumes the metadata invariants hold (the member shapes are consistent).
    """
    nc1 = compressed.shape[-1]
    c = compressed.reshape(-1, nc1).tolist() if compressed.numel() else []
    p = plain.reshape(len(c), plain.shape[-1]).tolist()
    nnz = plain.shape[-1]
    if any(row[0] != 0 for row in c):
        return "5.1"
    if any(row[-1] != nnz for row in c):
        return "5.2"
    for row in c:
        for i in range(1, nc1):
            d = row[i] - row[i - 1]
            if d < 0 or (n_plain is not None and d > n_plain):
                return "5.3"
    if any(x < 0 for row in p for x in row):
        return "5.4"
    if n_plain is not None and any(x >= n_plain for row in p for x in row):
        return "5.5"
    for crow, prow in zip(c, p, strict=True):
        for i in range(1, nc1):
            seg = prow[crow[i - 1]:crow[i]]
            if any(b <= a for a, b in itertools.pairwise(seg)):
                return "5.6"
    return None


def expected_coo_index_violation(
    indices: torch.Tensor, size: Sequence[int] | None, is_coalesced: bool
) -> str | None:
    """COO counterpart of :func:`expected_compressed_index_violation` (size None: estimated)."""
    cols = [tuple(x) for x in indices.t().tolist()]
    if any(x < 0 for col in cols for x in col):
        return "5.1"
    if size is not None and any(x >= size[d] for col in cols for d, x in enumerate(col)):
        return "5.2"
    if is_coalesced and any(b <= a for a, b in itertools.pairwise(cols)):
        return "5.3"
    return None


def estimated_plain_extent(compressed: torch.Tensor, plain: torch.Tensor) -> int:
    """Seed rule for the omitted plain extent, in exact Python integers."""
    est = 0
    if plain.numel():
        est = max(est, int(plain.max()) + 1)
    if compressed.numel() and compressed.shape[-1] > 1:
        est = max(est, int(compressed.to(torch.int64).diff(dim=-1).max()))
    return est

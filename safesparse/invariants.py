"""The invariant catalog: the single source of truth for invariant ids and statements.

Every error message, the generated table in ``docs/invariants.md`` and the per-id tests read
their wording from :data:`CATALOG`. The checks themselves live in :mod:`safesparse.validation`;
this module only says *what* must hold.

Compressed layouts (CSR, CSC, BSR, BSC) share one family of ids; "compressed" means the
``crow_indices`` of CSR/BSR or the ``ccol_indices`` of CSC/BSC, "plain" the other index member.
M is the number of batch dims, N the number of dense dims; CSR/CSC are the blocked case with
blocksize (1, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import torch

Family = Literal["compressed", "coo"]


@dataclass(frozen=True)
class Invariant:
    """One invariant of the catalog.

    Attributes:
        family: ``"compressed"`` (CSR, CSC, BSR, BSC) or ``"coo"``.
        id: the catalog id, e.g. ``"5.6"``; errors start with ``[<LAYOUT> <id>]``.
        text: the invariant in words.
        hint: how to repair data that breaks it, where there is a standard way (SciPy and torch
            spellings), else ``""``. :class:`~safesparse.InvariantError` messages end with it.
    """

    family: Family
    id: str
    text: str
    hint: str = ""


def _table(
    family: Family, rows: list[tuple[str, str]], hints: dict[str, str] | None = None
) -> dict[str, Invariant]:
    hints = hints or {}
    unknown = set(hints) - {iid for iid, _ in rows}
    if unknown:
        raise ValueError(f"hints for unknown invariants: {sorted(unknown)}")
    return {iid: Invariant(family, iid, text, hints.get(iid, "")) for iid, text in rows}


COMPRESSED: Final[dict[str, Invariant]] = _table(
    "compressed",
    [
        ("1.1", "compressed indices dtype equals the index dtype"),
        ("1.2", "plain indices dtype equals the index dtype (the two index dtypes agree)"),
        ("1.3", "the index dtype is int32 or int64 (int32 only if nnz and both block extents fit)"),
        ("1.4", "values dtype equals the requested dtype"),
        ("1.5", "values dtype is one torch supports for this layout"),
        ("2.1", "compressed indices are a strided tensor"),
        ("2.2", "plain indices are a strided tensor"),
        ("2.3", "values are a strided tensor"),
        ("2.4", "the layout is the requested sparse compressed layout"),
        (
            "3.1",
            "size == batchsize + (n_compressed * block0, n_plain * block1) + densesize, "
            "with the sparse sizes divisible by the blocksize and at most 2**63 - 1 elements",
        ),
        ("3.2", "compressed indices have M + 1 dims"),
        ("3.3", "plain indices have M + 1 dims"),
        ("3.4", "values have M + 1 + N dims (CSR/CSC) or M + 3 + N dims (BSR/BSC)"),
        ("3.5", "compressed indices are contiguous"),
        ("3.6", "plain indices are contiguous"),
        (
            "3.7",
            "values are contiguous, or (BSR/BSC) contiguous after swapping the two block dims",
        ),
        ("3.8", "compressed indices shape == batchsize + (n_compressed + 1,)"),
        ("3.9", "plain indices shape == batchsize + (nnz,)"),
        ("3.10", "values shape == batchsize + (nnz,) + blocksize + densesize"),
        ("4.1", "the device is one torch supports for the layout"),
        ("4.2", "compressed indices are on the tensor's device"),
        ("4.3", "plain indices are on the tensor's device"),
        ("4.4", "values are on the tensor's device"),
        ("5.1", "compressed[..., 0] == 0"),
        ("5.2", "compressed[..., -1] == nnz"),
        ("5.3", "0 <= compressed[..., i] - compressed[..., i-1] <= n_plain"),
        ("5.4", "plain indices are >= 0"),
        ("5.5", "plain indices are < n_plain"),
        (
            "5.6",
            "plain indices are sorted and distinct within each compressed row/column "
            "of each batch",
        ),
    ],
    {
        "5.6": (
            "canonicalise the matrix first: from SciPy, ss.from_scipy(m, canonicalize=True) "
            "or m.sum_duplicates() (or m.sort_indices() when there are no duplicates); in "
            "torch, build it as COO, call .coalesce(), then .to_sparse_csr() (or _csc(), "
            "_bsr(blocksize), _bsc(blocksize))"
        ),
    },
)

COO: Final[dict[str, Invariant]] = _table(
    "coo",
    [
        ("1.1", "indices dtype is int64"),
        ("1.2", "values dtype is one torch supports (and equals the requested dtype)"),
        ("2.1", "indices are a strided tensor"),
        ("2.2", "values are a strided tensor"),
        ("3.1", "indices have 2 dims"),
        (
            "3.2",
            "sparse_dim + dense_dim == len(size), with sparse_dim >= 1, and size is "
            "non-negative with at most 2**63 - 1 elements",
        ),
        ("3.3", "indices shape == (sparse_dim, nnz)"),
        ("3.4", "values shape == (nnz,) + size[sparse_dim:]"),
        ("4.1", "the device is one torch supports for the layout"),
        ("4.2", "indices and values are on the same device"),
        ("5.1", "indices are >= 0"),
        ("5.2", "indices[d] < size[d] for each sparse dim d"),
        (
            "5.3",
            "when the tensor is marked coalesced, indices are sorted lexicographically "
            "with no duplicates",
        ),
    ],
    {
        "5.3": (
            "build it with is_coalesced=None or False and call .coalesce() (sums duplicates "
            "and sorts the indices), or canonicalise the source first: in SciPy, "
            "m.sum_duplicates()"
        ),
    },
)

class Catalog(dict[Family, dict[str, Invariant]]):
    """The invariant catalog: ``CATALOG[family][id]`` is an :class:`Invariant`.

    ``family`` is ``"compressed"`` (CSR, CSC, BSR, BSC: 29 invariants, ``"1.1"`` to ``"5.6"``)
    or ``"coo"`` (13 invariants), each table in id order. A ``dict``, read-only by
    convention; the tables in ``docs/invariants.md`` are rendered from it.

    Example::

        ss.CATALOG["compressed"]["5.6"].text  # the statement of [CSR 5.6], [BSC 5.6], ...
        ss.CATALOG["coo"]["5.3"].hint         # how to repair data that breaks it
    """


CATALOG: Final[Catalog] = Catalog({"compressed": COMPRESSED, "coo": COO})

COMPRESSED_LAYOUTS: Final[tuple[torch.layout, ...]] = (
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)
SPARSE_LAYOUTS: Final[tuple[torch.layout, ...]] = (torch.sparse_coo, *COMPRESSED_LAYOUTS)

LAYOUT_NAMES: Final[dict[torch.layout, str]] = {
    torch.sparse_coo: "COO",
    torch.sparse_csr: "CSR",
    torch.sparse_csc: "CSC",
    torch.sparse_bsr: "BSR",
    torch.sparse_bsc: "BSC",
    torch.strided: "strided",
}


def family_of(layout: torch.layout) -> Family:
    """The catalog family that governs ``layout``."""
    if layout == torch.sparse_coo:
        return "coo"
    if layout in COMPRESSED_LAYOUTS:
        return "compressed"
    raise TypeError(f"{layout} is not a sparse layout")


def lookup(layout: torch.layout, invariant_id: str) -> Invariant:
    """The catalog entry for ``invariant_id`` under ``layout`` (KeyError if unknown)."""
    return CATALOG[family_of(layout)][invariant_id]


def layout_name(layout: torch.layout) -> str:
    return LAYOUT_NAMES.get(layout, str(layout))


def render_markdown() -> str:
    """The invariant tables as Markdown; ``docs/invariants.md`` embeds exactly this text."""
    lines: list[str] = []
    titles = {
        "compressed": "Compressed layouts (CSR, CSC, BSR, BSC)",
        "coo": "COO",
    }
    for family, table in CATALOG.items():
        lines += [f"### {titles[family]}", "", "| id | invariant |", "| --- | --- |"]
        lines += [f"| {inv.id} | {inv.text} |" for inv in table.values()]
        lines.append("")
        hinted = [inv for inv in table.values() if inv.hint]
        if hinted:
            lines += ["How to repair data that breaks:", ""]
            lines += [f"- **{inv.id}**: {inv.hint}" for inv in hinted]
            lines.append("")
    return "\n".join(lines)


__all__ = [
    "CATALOG",
    "COMPRESSED",
    "COMPRESSED_LAYOUTS",
    "COO",
    "LAYOUT_NAMES",
    "SPARSE_LAYOUTS",
    "Catalog",
    "Invariant",
    "family_of",
    "layout_name",
    "lookup",
    "render_markdown",
]

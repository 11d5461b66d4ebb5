"""The layout vocabulary: which sparse layouts there are, how they group, their transposes and
their names. One place for every layer (the bottom one: it imports nothing of safesparse);
:mod:`safesparse.catalog.invariants` re-exports the public names.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = [
    "BLOCK_LAYOUTS",
    "BY_SHORT_NAME",
    "BY_TORCH_NAME",
    "COLUMN_LAYOUTS",
    "COMPRESSED_LAYOUTS",
    "INDEX_MEMBERS",
    "LAYOUT_NAMES",
    "ROW_LAYOUTS",
    "SHORT_NAMES",
    "SPARSE_LAYOUTS",
    "SWAPPED",
    "TORCH_NAMES",
    "compressed_members",
    "index_members",
    "layout_name",
]

#: The compressed layouts, in torch's order.
COMPRESSED_LAYOUTS: Final[tuple[torch.layout, ...]] = (
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)
#: Every sparse layout safesparse handles.
SPARSE_LAYOUTS: Final[tuple[torch.layout, ...]] = (torch.sparse_coo, *COMPRESSED_LAYOUTS)
#: The blocked compressed layouts (values of shape (nnzb, r, c, ...)).
BLOCK_LAYOUTS: Final[tuple[torch.layout, ...]] = (torch.sparse_bsr, torch.sparse_bsc)
#: The compressed layouts stored by (block) rows: members ``crow_indices`` / ``col_indices``.
ROW_LAYOUTS: Final[tuple[torch.layout, ...]] = (torch.sparse_csr, torch.sparse_bsr)
#: The compressed layouts stored by (block) columns: members ``ccol_indices`` / ``row_indices``.
COLUMN_LAYOUTS: Final[tuple[torch.layout, ...]] = (torch.sparse_csc, torch.sparse_bsc)
#: The layout of a compressed tensor's transpose (its two sparse dims swapped).
SWAPPED: Final[dict[torch.layout, torch.layout]] = {
    torch.sparse_csr: torch.sparse_csc,
    torch.sparse_csc: torch.sparse_csr,
    torch.sparse_bsr: torch.sparse_bsc,
    torch.sparse_bsc: torch.sparse_bsr,
}
#: The index members of each sparse layout, by accessor name: COO ``indices``, compressed
#: (compressed, plain).
INDEX_MEMBERS: Final[dict[torch.layout, tuple[str, ...]]] = {
    torch.sparse_coo: ("indices",),
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
#: Names in messages and errors ("CSR", ...).
LAYOUT_NAMES: Final[dict[torch.layout, str]] = {
    torch.sparse_coo: "COO",
    torch.sparse_csr: "CSR",
    torch.sparse_csc: "CSC",
    torch.sparse_bsr: "BSR",
    torch.sparse_bsc: "BSC",
    torch.strided: "strided",
}
#: Lower-case names of the sparse layouts ("coo", "csr", ...): the ``layout`` strings of the
#: ``safesparse`` operators and of torch's constructor names, SciPy's format names.
SHORT_NAMES: Final[dict[torch.layout, str]] = {
    layout: LAYOUT_NAMES[layout].lower() for layout in SPARSE_LAYOUTS
}
#: :data:`SHORT_NAMES` read backwards.
BY_SHORT_NAME: Final[dict[str, torch.layout]] = {name: lay for lay, name in SHORT_NAMES.items()}
#: The compressed layouts by short name (the operators' and the compiled boundary's ``layout``
#: argument).
COMPRESSED_BY_SHORT_NAME: Final[dict[str, torch.layout]] = {
    SHORT_NAMES[lay]: lay for lay in COMPRESSED_LAYOUTS}
#: torch's own names of the sparse layouts ("sparse_coo", "sparse_csr", ...: ``torch.<name>``),
#: as files store them.
TORCH_NAMES: Final[dict[torch.layout, str]] = {
    layout: "sparse_" + SHORT_NAMES[layout] for layout in SPARSE_LAYOUTS
}
#: :data:`TORCH_NAMES` read backwards.
BY_TORCH_NAME: Final[dict[str, torch.layout]] = {name: lay for lay, name in TORCH_NAMES.items()}


def layout_name(layout: torch.layout) -> str:
    """``layout``'s name in messages ("CSR", ...; torch's spelling for any other)."""
    return LAYOUT_NAMES.get(layout, str(layout))


def extents(layout: torch.layout, rows: int, cols: int, r: int = 1, c: int = 1
            ) -> tuple[int, int]:
    """``(n_compressed, n_plain)``: the (block) rows and columns of a ``rows`` x ``cols``
    matrix of a compressed ``layout`` (blocks ``r`` x ``c``; 1 x 1 for CSR / CSC) as its
    members count them, compressed dimension first. The one place that picks the dimension
    by layout (a zero block extent gives 0)."""
    nr = rows // r if r else 0
    nc = cols // c if c else 0
    return (nr, nc) if layout in ROW_LAYOUTS else (nc, nr)


def index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index members of a sparse tensor, as its accessors hand them out: ``(indices,)`` for
    COO (``_indices()``: coalesced or not), ``(compressed, plain)`` for the compressed layouts
    (:data:`INDEX_MEMBERS`). The one place that picks the accessors by layout."""
    lay = t.layout
    if lay is torch.sparse_coo:
        return (t._indices(),)
    if lay in ROW_LAYOUTS:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def compressed_members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`index_members` of a compressed tensor: ``(compressed, plain)``."""
    compressed, plain = index_members(t)
    return compressed, plain

"""``torch.ops.safesparse.prove``: index tensors a compiled graph computed, validated there.

A compiled function that builds its matrix from index tensors it computed (a graph's edges
chosen per batch) cannot call the factories inside the graph (dynamo never traces safesparse),
and ``torch._check`` on the indices proves nothing the operators accept. ``prove`` is a custom
operator (one graph node; its real implementation runs eagerly): it copies the index tensors,
validates them with the factory (O(nnz), the catalog's invariants for the layout and
geometry: invalid data raises :class:`~safesparse.InvariantError` with the id and position,
also from compiled code) and returns the copies as members a checked tensor handed out, which
the ``safesparse`` operators confirm in O(1) (:meth:`SparseOperand.from_members`).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from ..base.layouts import (
    BLOCK_LAYOUTS,
    COMPRESSED_BY_SHORT_NAME,
    compressed_members,
)
from ..factories import sparse_compressed_tensor

__all__ = ["prove"]


@custom_op("safesparse::prove", mutates_args=())
def prove(compressed: torch.Tensor, plain: torch.Tensor, layout: str, n_rows: int, n_cols: int,
          block_rows: int = 1, block_cols: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated copies of ``compressed`` / ``plain`` as the index members of an ``n_rows x
    n_cols`` matrix of ``layout`` (``"csr"``, ``"csc"``, ``"bsr"``, ``"bsc"``, in any
    case; blocks of ``block_rows x block_cols`` for the block layouts), proven for the
    ``safesparse`` operators. Raises :class:`~safesparse.InvariantError` when they are not valid."""
    lay = _arguments(layout, block_rows, block_cols)
    nnz = plain.shape[0] if plain.dim() == 1 else 0
    # placeholder values (the members are what is proven; only their shape is read)
    shape = (nnz, block_rows, block_cols) if lay in BLOCK_LAYOUTS else (nnz,)
    values = torch.empty(shape, dtype=torch.float32, device=plain.device)
    # copies: the graph's own tensors may be written later, the proven members never are
    t = sparse_compressed_tensor(compressed.clone(), plain.clone(), values, (n_rows, n_cols),
                                 layout=lay, check_invariants=True)
    c, p = compressed_members(t)
    return c, p


def _arguments(layout: str, block_rows: int, block_cols: int) -> torch.layout:
    """The layout named by ``layout``, checked with the block shape (the real implementation
    and the fake alike; the members are the factory's to validate)."""
    lay = COMPRESSED_BY_SHORT_NAME.get(layout.lower())
    if lay is None:
        raise ValueError(f"safesparse::prove: unknown layout {layout!r} "
                         f"(one of {', '.join(COMPRESSED_BY_SHORT_NAME)})")
    blocked = lay in BLOCK_LAYOUTS
    if not blocked and (block_rows, block_cols) != (1, 1):
        raise ValueError(f"safesparse::prove: a {layout.upper()} matrix has no block shape "
                         f"(got {block_rows} x {block_cols})")
    return lay


@prove.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, layout: str, n_rows: int, n_cols: int,
      block_rows: int = 1, block_cols: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    _arguments(layout, block_rows, block_cols)
    return torch.empty_like(compressed), torch.empty_like(plain)

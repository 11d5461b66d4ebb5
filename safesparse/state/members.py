"""Members and geometries of sparse tensors: what a proof is about, read without any state.

:func:`plain_members` gives a sparse tensor's index members (aliases sharing its counter);
:func:`geometry_of` what, beyond the index tensors themselves, their validity depends on.
:mod:`safesparse.state.checked` builds its records and proofs on these.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import BLOCK_LAYOUTS, extents, index_members

__all__ = ["compressed_geometry", "coo_geometry", "geometry_of", "plain_members"]


def plain_members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(m0, m1)``: the index members of a *plain* sparse tensor (COO: ``(indices, None)``),
    as aliases sharing its version counter (:func:`~safesparse.base.layouts.index_members`)."""
    members = index_members(t)
    return members[0], (members[1] if len(members) > 1 else None)


def compressed_geometry(n_compressed: int, n_plain: int) -> Hashable:
    return ("compressed", n_compressed, n_plain)


def coo_geometry(sparse_size: Sequence[int], coalesced: bool) -> Hashable:
    return ("coo", tuple(sparse_size), bool(coalesced))


def geometry_of(t: torch.Tensor) -> Hashable:
    """What, beyond the index tensors themselves, their validity depends on. None when the
    members do not even have the dims a geometry is read from (a member reshaped in place,
    ``crow.unsqueeze_(0)``): no proof is about that, and validation names the broken id."""
    with DisableTorchFunctionSubclass():
        if t.layout is torch.sparse_coo:
            return coo_geometry(t.shape[: t.sparse_dim()], t.is_coalesced())
        compressed = index_members(t)[0]
        m = compressed.dim() - 1
        vshape = t.values().shape
        blocked = t.layout in BLOCK_LAYOUTS
        if m < 0 or t.dim() < m + 2 or len(vshape) < m + (3 if blocked else 1):
            return None
        b0, b1 = (vshape[m + 1], vshape[m + 2]) if blocked else (1, 1)
        n_plain = extents(t.layout, t.shape[m], t.shape[m + 1], b0, b1)[1]
        return compressed_geometry(compressed.shape[-1] - 1, n_plain)

"""The layout vocabulary (safesparse/base/layouts.py): one place, consistent with torch, and the
catalog's public names are its own objects."""

from __future__ import annotations

import torch

from safesparse.base import layouts
from safesparse.catalog import invariants


def test_groups_partition_the_compressed_layouts() -> None:
    assert set(layouts.ROW_LAYOUTS) | set(layouts.COLUMN_LAYOUTS) == set(
        layouts.COMPRESSED_LAYOUTS)
    assert not set(layouts.ROW_LAYOUTS) & set(layouts.COLUMN_LAYOUTS)
    assert set(layouts.BLOCK_LAYOUTS) < set(layouts.COMPRESSED_LAYOUTS)
    assert (torch.sparse_coo, *layouts.COMPRESSED_LAYOUTS) == layouts.SPARSE_LAYOUTS


def test_members_and_transposes_follow_torch() -> None:
    dense = torch.arange(1.0, 25.0).reshape(4, 6)
    for layout in layouts.COMPRESSED_LAYOUTS:
        blocked = layout in layouts.BLOCK_LAYOUTS
        t = dense.to_sparse(layout=layout, blocksize=(2, 3) if blocked else None)
        for name in layouts.INDEX_MEMBERS[layout]:
            assert isinstance(getattr(t, name)(), torch.Tensor)
        assert t.mT.layout is layouts.SWAPPED[layout]
        assert layouts.SWAPPED[layouts.SWAPPED[layout]] is layout
        row = layout in layouts.ROW_LAYOUTS
        assert layouts.INDEX_MEMBERS[layout][0] == ("crow_indices" if row else "ccol_indices")
    coo = dense.to_sparse()
    assert isinstance(getattr(coo, layouts.INDEX_MEMBERS[torch.sparse_coo][0])(), torch.Tensor)


def test_names_round_trip() -> None:
    for layout in layouts.SPARSE_LAYOUTS:
        assert getattr(torch, layouts.TORCH_NAMES[layout]) is layout
        assert layouts.BY_TORCH_NAME[layouts.TORCH_NAMES[layout]] is layout
        assert layouts.BY_SHORT_NAME[layouts.SHORT_NAMES[layout]] is layout
        assert layouts.layout_name(layout) == layouts.SHORT_NAMES[layout].upper()
    assert layouts.layout_name(torch.strided) == "strided"
    assert layouts.layout_name(torch._mkldnn) == str(torch._mkldnn)  # type: ignore[attr-defined]


def test_catalog_reexports_the_same_objects() -> None:
    for name in ("COMPRESSED_LAYOUTS", "SPARSE_LAYOUTS", "LAYOUT_NAMES", "layout_name"):
        assert getattr(invariants, name) is getattr(layouts, name)

"""The layout vocabulary (safesparse/base/layouts.py): one place, consistent with torch, read
from there by every module (one import path), and the one helper that picks a tensor's index
members by layout."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from safesparse.base import layouts
from safesparse.catalog import invariants

PACKAGE = Path(layouts.__file__).resolve().parents[1]


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


def test_one_import_path_for_the_vocabulary() -> None:
    """Every module takes the layout vocabulary from safesparse.base.layouts: none imports one
    of its objects through another module, and the catalog re-exports none of them."""
    assert not set(layouts.__all__) & set(invariants.__all__)
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = ".".join(("safesparse", *path.relative_to(PACKAGE).parent.parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or (node.module or "").endswith("layouts"):
                continue
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level else \
                node.module
            if not (module or "").startswith("safesparse"):
                continue
            source = importlib.import_module(str(module))
            wrong += [f"{path.relative_to(PACKAGE)}: {a.name} from {module}"
                      for a in node.names if a.name in layouts.__all__
                      and getattr(source, a.name, None) is getattr(layouts, a.name)]
    assert wrong == []


@pytest.mark.parametrize("layout", layouts.SPARSE_LAYOUTS,
                         ids=[layouts.layout_name(lay) for lay in layouts.SPARSE_LAYOUTS])
def test_index_members_are_the_accessors_of_the_layout(layout: torch.layout) -> None:
    dense = torch.arange(1.0, 25.0).reshape(4, 6)
    blocked = layout in layouts.BLOCK_LAYOUTS
    t = dense.to_sparse(layout=layout, blocksize=(2, 3) if blocked else None)
    got = layouts.index_members(t)
    names = ("_indices",) if layout is torch.sparse_coo else layouts.INDEX_MEMBERS[layout]
    assert len(got) == len(names)
    for member, name in zip(got, names, strict=True):
        assert member.data_ptr() == getattr(t, name)().data_ptr()
        assert torch.equal(member, getattr(t, name)())
    if layout is not torch.sparse_coo:
        assert [m.data_ptr() for m in layouts.compressed_members(t)] == [
            m.data_ptr() for m in got]


@pytest.mark.parametrize("layout", layouts.COMPRESSED_LAYOUTS,
                         ids=[layouts.layout_name(lay) for lay in layouts.COMPRESSED_LAYOUTS])
def test_extents_count_the_lines_the_members_hold(layout: torch.layout) -> None:
    dense = torch.arange(1.0, 49.0).reshape(4, 12)
    r, c = (2, 3) if layout in layouts.BLOCK_LAYOUTS else (1, 1)
    t = dense.to_sparse(layout=layout, blocksize=(r, c) if r > 1 else None)
    compressed, plain = layouts.compressed_members(t)
    n_compressed, n_plain = layouts.extents(layout, 4, 12, r, c)
    assert n_compressed == compressed.numel() - 1
    # every block (element) line of the plain dimension is stored once here: the bound is tight
    assert n_plain == int(plain.max()) + 1
    assert layouts.COMPRESSED_BY_SHORT_NAME[layouts.SHORT_NAMES[layout]] is layout


def test_extents_of_an_empty_block_extent_are_zero() -> None:
    assert layouts.extents(torch.sparse_bsr, 4, 6, 0, 3) == (0, 2)
    assert layouts.extents(torch.sparse_bsc, 4, 6, 2, 0) == (0, 2)

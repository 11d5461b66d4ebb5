"""The kernels' matrix description (safesparse.kernels.pattern.Matrix) and its pattern helpers.

Claims: :func:`matrix` derives the block shape from the values once (1 x 1 for CSR / CSC, the
values' last two sizes for BSR / BSC); ``row_major`` and ``n_plain`` (the bound of the plain
indices) follow the layout; the description is immutable and has no per-instance dict;
``coordinates`` gives the block row and column of every stored block in stored order, for
both orientations.
"""

from __future__ import annotations

import pytest
import torch

from safesparse.kernels.pattern import Matrix, coordinates, matrix


def _members() -> tuple[torch.Tensor, torch.Tensor]:
    """Three compressed lines (rows or columns) holding 1, 0 and 2 blocks; two plain ones."""
    return torch.tensor([0, 1, 1, 3]), torch.tensor([1, 0, 1])


@pytest.mark.parametrize("layout, block", [
    (torch.sparse_csr, (1, 1)), (torch.sparse_csc, (1, 1)),
    (torch.sparse_bsr, (2, 4)), (torch.sparse_bsc, (2, 4))], ids=str)
def test_matrix_derives_the_block_shape_once(layout: torch.layout,
                                             block: tuple[int, int]) -> None:
    compressed, plain = _members()
    r, c = block
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    values = torch.randn(3, r, c) if blocked else torch.randn(3)
    row_major = layout in (torch.sparse_csr, torch.sparse_bsr)
    # 3 compressed lines, 2 plain ones: the plain bound is 2 either way (3 if read wrongly)
    n_rows, n_cols = (3 * r, 2 * c) if row_major else (2 * r, 3 * c)
    m = matrix(layout, compressed, plain, values, n_rows, n_cols)
    assert isinstance(m, Matrix)
    assert (m.r, m.c) == block
    assert m.row_major is row_major
    assert m.n_plain == 2
    assert m.values is values and m.compressed is compressed and m.plain is plain
    assert (m.n_rows, m.n_cols) == (n_rows, n_cols)
    with pytest.raises(AttributeError):
        m.r = 5  # type: ignore[misc]
    assert not hasattr(m, "__dict__")


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc], ids=str)
def test_coordinates_in_stored_order(layout: torch.layout) -> None:
    compressed, plain = _members()
    m = matrix(layout, compressed, plain, torch.randn(3), 3, 3)
    rows, cols = coordinates(m, compressed, plain)
    outer, inner = [0, 2, 2], [1, 0, 1]
    if layout == torch.sparse_csr:
        assert (rows.tolist(), cols.tolist()) == (outer, inner)
    else:
        assert (rows.tolist(), cols.tolist()) == (inner, outer)

"""Block matrices for the block-product tests (tests/tensor/test_block_products.py and
test_block_engine.py): a checked BSR / BSC tensor of a fixed block pattern and its dense matrix,
random operands, members, factories and the dense-result assertion."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import safesparse as ss

BSR, BSC = torch.sparse_bsr, torch.sparse_bsc
LAYOUTS = [BSR, BSC]
NAMES = {BSR: "BSR", BSC: "BSC"}
#: block rows x block columns of the test matrices, and their block pattern
MASK = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}


def make(layout: torch.layout, block: tuple[int, int], dtype: torch.dtype = torch.float64,
         batch: tuple[int, ...] = (), seed: int = 0) -> tuple[ss.SafeSparseTensor, torch.Tensor]:
    """A checked block tensor (the same block pattern in every batch) and its dense matrix."""
    g = torch.Generator().manual_seed(seed)
    r, c = block
    full = MASK.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(*batch, *full.shape, generator=g, dtype=dtype) * full
    plain = dense.to_sparse_bsr(block) if layout == BSR else dense.to_sparse_bsc(block)
    t = ss.validate(plain)
    assert ss.is_checked(t)
    return t, dense


def rand(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.layout == BSR:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def factory(layout: torch.layout) -> Callable[..., ss.SafeSparseTensor]:
    return ss.sparse_bsr_tensor if layout == BSR else ss.sparse_bsc_tensor


def assert_dense_result(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert type(out) is torch.Tensor  # a plain strided tensor, never wrapped
    assert out.layout == torch.strided
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **_tol(dtype))


PARAMS = pytest.mark.parametrize("layout", LAYOUTS, ids=NAMES.get)

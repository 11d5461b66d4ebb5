"""Index checks before anything is built: ss.check_coo_indices, ss.check_compressed_indices.

They must report exactly what the factories report (same id, same location) for the same index
data, accept what the factories accept, and build nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safesparse as ss
import safesparse.base.originals as ss_originals

CSR, CSC, BSR, BSC, COO = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                           torch.sparse_bsc, torch.sparse_coo)
FACTORIES = {CSR: ss.sparse_csr_tensor, CSC: ss.sparse_csc_tensor,
             BSR: ss.sparse_bsr_tensor, BSC: ss.sparse_bsc_tensor}


def _error(fn: Callable[[], Any]) -> ss.InvariantError | None:
    try:
        fn()
    except ss.InvariantError as err:
        return err
    return None


def _same_error(a: ss.InvariantError | None, b: ss.InvariantError | None) -> None:
    assert (a is None) == (b is None), (a, b)
    if a is not None and b is not None:
        assert (a.layout, a.invariant, a.location) == (b.layout, b.invariant, b.location)
        assert str(a) == str(b)


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ss_originals.FACTORY_NAMES:
        def spy(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            raise AssertionError("an index check built a tensor")
        monkeypatch.setattr(ss_originals, name, spy)
        monkeypatch.setattr(torch, name, spy)
    return calls


# --- COO ------------------------------------------------------------------------------------


def test_valid_edge_index_returns_the_size(nothing_built: list[str]) -> None:
    edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    assert ss.check_coo_indices(edge_index, (3, 3)) == torch.Size([3, 3])
    assert ss.check_coo_indices(edge_index) == torch.Size([3, 3])  # estimated: max + 1
    assert ss.check_coo_indices(edge_index, (3, 3, 4)) == torch.Size([3, 3, 4])  # dense dim
    assert ss.check_coo_indices(torch.zeros(2, 0, dtype=torch.int64), (5, 5)) == (5, 5)
    assert not nothing_built


@pytest.mark.parametrize(("indices", "size", "iid"), [
    ([[0, 1, 3], [1, 0, 2]], (3, 3), "5.2"),
    ([[0, 1, 2], [1, -1, 2]], (3, 3), "5.1"),
    ([[0, 1, 2], [1, 0, 2]], (3,), "3.2"),
    ([0, 1, 2], (3,), "3.1"),
    ([[0, 1, 2], [1, 0, 2]], (3, -1), "3.2"),
], ids=["too-large", "negative", "size-too-short", "1-d", "negative-size"])
def test_violations_match_the_factory(indices: Any, size: tuple[int, ...], iid: str,
                                      nothing_built: list[str]) -> None:
    idx = torch.tensor(indices)
    ours = _error(lambda: ss.check_coo_indices(idx, size))
    assert ours is not None and ours.invariant == iid
    nnz = idx.shape[-1]
    values = torch.ones(nnz, *size[idx.shape[0]:]) if idx.dim() == 2 else torch.ones(nnz)
    factory = _error(lambda: ss.sparse_coo_tensor(idx, values, size))  # refused before building
    _same_error(ours, factory)
    assert not nothing_built


def test_coalesced_flag_checks_order() -> None:
    unsorted = torch.tensor([[1, 0], [0, 1]])
    assert ss.check_coo_indices(unsorted, (2, 2)) == (2, 2)
    err = _error(lambda: ss.check_coo_indices(unsorted, (2, 2), is_coalesced=True))
    assert err is not None and err.invariant == "5.3" and err.location["position"] == 1
    _same_error(err, _error(lambda: ss.sparse_coo_tensor(unsorted, torch.ones(2), (2, 2),
                                                         is_coalesced=True)))


def test_estimated_size_refuses_negative_indices() -> None:
    err = _error(lambda: ss.check_coo_indices(torch.tensor([[0, -3]])))
    assert err is not None and err.invariant == "5.1"


def test_indices_of_other_dtypes_and_strides_are_read_like_the_factory() -> None:
    idx = torch.tensor([[0, 2], [1, 1]], dtype=torch.int32).t().contiguous().t()
    assert ss.check_coo_indices(idx, (3, 3)) == (3, 3)
    assert ss.check_coo_indices(idx.float(), (3, 3)) == (3, 3)
    assert ss.check_coo_indices([[0, 2], [1, 1]], (3, 3)) == (3, 3)
    with pytest.raises(TypeError):
        ss.check_coo_indices(idx, (3.0, 3))


def test_counts_as_a_validation() -> None:
    ss.reset_stats()
    ss.check_coo_indices(torch.tensor([[0]]), (1,))
    ss.check_compressed_indices(torch.tensor([0, 1]), torch.tensor([0]), (1, 1))
    assert ss.stats().validations == 2


@given(st.lists(st.tuples(st.integers(-3, 8), st.integers(-3, 8)), max_size=12),
       st.integers(1, 6), st.integers(1, 6), st.booleans())
def test_coo_property_same_verdict_as_factory(pairs: list[tuple[int, int]], rows: int,
                                              cols: int, coalesced: bool) -> None:
    idx = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t()
    ours = _error(lambda: ss.check_coo_indices(idx, (rows, cols), is_coalesced=coalesced))
    theirs = _error(lambda: ss.sparse_coo_tensor(idx, torch.ones(idx.shape[1]), (rows, cols),
                                                 is_coalesced=coalesced))
    _same_error(ours, theirs)


# --- compressed -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [CSR, CSC], ids=str)
def test_compressed_valid_pairs(layout: torch.layout, nothing_built: list[str]) -> None:
    crow, col = torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1])
    assert ss.check_compressed_indices(crow, col, (2, 2), layout=layout) == (2, 2)
    assert ss.check_compressed_indices(crow, col, layout=layout) == (2, 2)  # estimated
    batched = ss.check_compressed_indices(torch.stack([crow, crow]), torch.stack([col, col]),
                                          (2, 2, 2), layout=layout)
    assert batched == (2, 2, 2)
    assert not nothing_built


def test_blocked_pairs_use_the_blocksize() -> None:
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    assert ss.check_compressed_indices(crow, col, (4, 6), layout=BSR, blocksize=(2, 3)) == (4, 6)
    err = _error(lambda: ss.check_compressed_indices(crow, col, (4, 3), layout=BSR,
                                                     blocksize=(2, 3)))
    assert err is not None and err.invariant == "5.5"
    err = _error(lambda: ss.check_compressed_indices(crow, col, (4, 5), layout=BSR,
                                                     blocksize=(2, 3)))
    assert err is not None and err.invariant == "3.1"
    with pytest.raises(ValueError):
        ss.check_compressed_indices(crow, col, (4, 6), layout=CSR, blocksize=(2, 3))
    with pytest.raises(ValueError):
        ss.check_compressed_indices(crow, col, (4, 6), layout=COO)


@pytest.mark.parametrize("blocksize", [(-2, 2), (2, -3), (-1, -1)])
@pytest.mark.parametrize("layout", [BSR, torch.sparse_bsc])
def test_a_negative_blocksize_is_refused_like_a_block_shape_the_factories_refuse(
        blocksize: tuple[int, int], layout: torch.layout) -> None:
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    with pytest.raises(ss.InvariantError) as info:
        ss.check_compressed_indices(crow, col, (4, 6), layout=layout, blocksize=blocksize)
    assert (info.value.layout, info.value.invariant) == (layout, "3.1")
    assert f"blocksize {blocksize}" in str(info.value) and "negative" in str(info.value)
    # a zero extent is refused by the factories with the same id
    with pytest.raises(ss.InvariantError) as info:
        ss.sparse_compressed_tensor(crow, col, torch.ones(2, 0, 2), (4, 6), layout=layout)
    assert info.value.invariant == "3.1"


def test_strided_batch_members_are_accepted() -> None:
    crow = torch.tensor([[0, 1, 2, 9], [0, 2, 2, 9]])[:, :3]
    col = torch.tensor([[0, 1], [0, 1]])
    assert ss.check_compressed_indices(crow, col, (2, 2, 2)) == (2, 2, 2)


@given(st.lists(st.integers(-1, 4), min_size=1, max_size=6),
       st.lists(st.integers(-2, 5), max_size=6),
       st.sampled_from([CSR, CSC, BSR, BSC]), st.integers(1, 4))
def test_compressed_property_same_verdict_as_factory(
        compressed: list[int], plain: list[int], layout: torch.layout, n_plain: int) -> None:
    c, p = torch.tensor(compressed), torch.tensor(plain, dtype=torch.int64)
    n_compressed = len(compressed) - 1
    blocked = layout in (BSR, BSC)
    block = (1, 2) if blocked else (1, 1)
    row_compressed = layout in (CSR, BSR)
    rows, cols = ((n_compressed * block[0], n_plain * block[1]) if row_compressed
                  else (n_plain * block[0], n_compressed * block[1]))
    values = torch.ones(len(plain), *(block if blocked else ()))
    ours = _error(lambda: ss.check_compressed_indices(
        c, p, (rows, cols), layout=layout, blocksize=block if blocked else None))
    theirs = _error(lambda: FACTORIES[layout](c, p, values, (rows, cols)))
    _same_error(ours, theirs)


@pytest.mark.parametrize("value", [2**64 - 1, 2**63])
@pytest.mark.parametrize("entry", ["factory", "check_coo_indices"])
def test_a_uint64_index_beyond_int64_is_reported_with_its_real_value(value: int,
                                                                      entry: str) -> None:
    np = pytest.importorskip("numpy")
    indices = np.array([[0, 1, 1], [2, 0, value]], dtype=np.uint64)
    with pytest.raises(ss.InvariantError) as info:
        if entry == "factory":
            ss.sparse_coo_tensor(indices, [1.0, 2.0, 3.0], (3, 3))
        else:
            ss.check_coo_indices(indices, (3, 3))
    err = info.value
    assert err.invariant == "5.2"  # index < size: no size holds it
    assert f"indices[1, 2] = {value}" in str(err) and "-1" not in str(err)
    assert err.location == {"position": 2, "dim": 1, "value": value}


def test_uint64_indices_that_fit_convert_and_unchecked_builds_wrap_as_in_torch() -> None:
    np = pytest.importorskip("numpy")
    ok = ss.sparse_coo_tensor(np.array([[0, 2]], dtype=np.uint64), [1.0, 2.0], (3,))
    assert ss.is_checked(ok) and ok.to_dense().tolist() == [1.0, 0.0, 2.0]
    huge = torch.tensor([[0, 2**64 - 1]], dtype=torch.uint64)
    t = ss.sparse_coo_tensor(huge, [1.0, 2.0], (3,), check_invariants=False)
    assert not ss.is_checked(t)
    assert ss.unwrap(t)._indices().tolist() == [[0, -1]]  # what torch's conversion gives

"""The SciPy bridge: ss.from_scipy / ss.to_scipy (safesparse.factories.interop).

Tests that need SciPy skip cleanly without it; the ImportError for a missing SciPy is tested
either way.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safesparse as ss

HAVE_SCIPY = importlib.util.find_spec("scipy") is not None
needs_scipy = pytest.mark.skipif(not HAVE_SCIPY, reason="SciPy is not installed")

if HAVE_SCIPY:
    import numpy as np
    import scipy.sparse as sp


def _csr(indptr: list[int], indices: list[int], data: list[float], shape: tuple[int, int],
         dtype: Any = None) -> Any:
    """A CSR matrix exactly as given (SciPy neither sorts nor merges on construction)."""
    idx = np.int32 if dtype is None else dtype
    return sp.csr_array(
        (np.array(data), np.array(indices, dtype=idx), np.array(indptr, dtype=idx)), shape=shape
    )


# --- missing SciPy -------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["from_scipy", "to_scipy"])
def test_missing_scipy_is_an_import_error_naming_the_extra(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy` now raises ImportError
    arg: Any = ss.sparse_csr_tensor([0, 1], [0], [1.0], (1, 1)) if call == "to_scipy" else None
    with pytest.raises(ImportError, match=r"safesparse\[scipy\]"):
        getattr(ss, call)(arg)


# --- from_scipy ----------------------------------------------------------------------------------


@needs_scipy
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr"])
@pytest.mark.parametrize("kind", ["array", "matrix"])
def test_from_scipy_layout_values_and_checked_state(fmt: str, kind: str) -> None:
    dense = np.array([[0, 1.5, 0, 0], [2, 0, 0, -3], [0, 0, 0, 0], [4, 0, 5, 0]])
    m = getattr(sp, f"{fmt}_{kind}")(dense)
    t = ss.from_scipy(m)
    assert isinstance(t, ss.SafeSparseTensor) and ss.is_checked(t)
    expected = {"csr": torch.sparse_csr, "csc": torch.sparse_csc, "coo": torch.sparse_coo,
                "bsr": torch.sparse_bsr}[fmt]
    assert t.layout == expected
    assert t.dtype == torch.float64
    assert torch.equal(t.to_dense(), torch.from_numpy(dense))


@needs_scipy
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("fmt", ["csr", "csc", "bsr"])
def test_from_scipy_keeps_the_index_dtype(index_dtype: str, fmt: str) -> None:
    m = sp.csr_array(np.eye(4)).asformat(fmt)
    m.indices = m.indices.astype(index_dtype)
    m.indptr = m.indptr.astype(index_dtype)
    t = ss.from_scipy(m)
    compressed = t.crow_indices() if fmt != "csc" else t.ccol_indices()
    plain = t.col_indices() if fmt != "csc" else t.row_indices()
    assert compressed.dtype == plain.dtype == getattr(torch, index_dtype)


@needs_scipy
def test_from_scipy_coo_indices_are_int64_as_in_torch() -> None:
    t = ss.from_scipy(sp.coo_array(np.eye(3)))
    assert t._indices().dtype == torch.int64


@needs_scipy
def test_from_scipy_bsr_keeps_the_blocksize() -> None:
    dense = np.arange(24.0).reshape(4, 6)
    dense[2:, :3] = 0
    m = sp.bsr_array(dense, blocksize=(2, 3))
    t = ss.from_scipy(m)
    assert t.values().shape[1:] == (2, 3)
    assert t._nnz() == 3
    assert torch.equal(t.to_dense(), torch.from_numpy(dense))


@needs_scipy
def test_from_scipy_keywords() -> None:
    m = sp.csr_array(np.eye(3))
    t = ss.from_scipy(m, dtype=torch.float32, device="cpu", requires_grad=True)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.requires_grad and t.is_leaf and ss.is_checked(t)


@needs_scipy
@pytest.mark.parametrize("np_dtype", ["float32", "float64", "complex64", "int64", "bool"])
def test_from_scipy_values_dtypes(np_dtype: str) -> None:
    dense = (np.arange(12).reshape(3, 4) % 3).astype(np_dtype)
    t = ss.from_scipy(sp.csr_array(dense))
    assert t.dtype == getattr(torch, np_dtype)
    assert torch.equal(t.to_dense(), torch.from_numpy(dense))


@needs_scipy
def test_unsorted_csr_fails_with_5_6_and_a_hint_and_sum_duplicates_fixes_it() -> None:
    m = _csr([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], (2, 3))  # row 0 lists column 2 first
    assert not m.has_sorted_indices
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.from_scipy(m)
    err = excinfo.value
    assert (err.layout, err.invariant) == (torch.sparse_csr, "5.6")
    assert "sum_duplicates()" in str(err) and "sort_indices()" in str(err)
    assert "coalesce()" in str(err)
    m.sort_indices()
    t = ss.from_scipy(m)
    assert torch.equal(t.to_dense(), torch.from_numpy(m.toarray()))


@needs_scipy
@pytest.mark.parametrize("fmt", ["csr", "csc"])
def test_duplicate_entries_fail_with_5_6_until_summed(fmt: str) -> None:
    m = _csr([0, 3, 3], [1, 1, 2], [1.0, 2.0, 3.0], (2, 3))  # (0, 1) stored twice
    if fmt == "csc":
        m = sp.csc_array((m.data, m.indices, m.indptr), shape=(3, 2))  # the transpose
    with pytest.raises(ss.InvariantError, match=r"^\[CS[RC] 5\.6\]"):
        ss.from_scipy(m)
    dense = m.toarray()
    m.sum_duplicates()
    assert torch.equal(ss.from_scipy(m).to_dense(), torch.from_numpy(dense))


@needs_scipy
@pytest.mark.parametrize("fmt", ["csr", "csc", "bsr", "coo"])
def test_canonicalize_sums_duplicates_and_sorts_a_copy(fmt: str) -> None:
    m = _csr([0, 3, 4], [2, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], (2, 3))  # unsorted, (0, 2) twice
    m = {"csr": m, "csc": sp.csc_array((m.data, m.indices, m.indptr), shape=(3, 2)),
         "bsr": sp.bsr_array((m.data.reshape(-1, 1, 1), m.indices, m.indptr), shape=(2, 3)),
         "coo": sp.coo_array(m.tocoo())}[fmt]
    if fmt == "coo":
        m.has_canonical_format = True  # a stale flag: canonicalize does not trust it
    before = (m.data.copy(), m.toarray())
    if fmt != "coo":
        with pytest.raises(ss.InvariantError) as excinfo:
            ss.from_scipy(m)  # the default stays strict
        assert excinfo.value.invariant == "5.6"
        assert "canonicalize=True" in str(excinfo.value)
    t = ss.from_scipy(m, canonicalize=True)
    assert ss.is_checked(t)
    assert torch.equal(t.to_dense(), torch.from_numpy(before[1]))  # duplicates summed
    assert t._nnz() == 3
    if fmt == "coo":
        assert t.is_coalesced()
    np.testing.assert_array_equal(m.data, before[0])  # m itself untouched


@needs_scipy
def test_canonicalize_refuses_a_structure_broken_beyond_order() -> None:
    m = _csr([0, 2, 1], [1, 0], [1.0, 2.0], (2, 2))  # indptr decreases: no sort may run on it
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.from_scipy(m, canonicalize=True)
    assert excinfo.value.invariant in {"5.2", "5.3"}
    m = _csr([0, 2, 2], [1, 0], [1.0, 2.0], (2, 2))
    m.indices[0] = 10**6  # out of range and unsorted
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.from_scipy(m, canonicalize=True)
    assert excinfo.value.invariant == "5.5"


@needs_scipy
def test_out_of_range_index_fails_with_5_5() -> None:
    m = _csr([0, 1, 2], [0, 1], [1.0, 2.0], (2, 2))
    m.indices[1] = 10**6  # SciPy does not look again after construction
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.from_scipy(m)
    assert excinfo.value.invariant == "5.5"


@needs_scipy
def test_non_canonical_coo_is_an_uncoalesced_tensor_with_the_same_sum() -> None:
    m = sp.coo_array((np.array([1.0, 2.0, 3.0]), (np.array([1, 0, 1]), np.array([0, 0, 0]))),
                     shape=(2, 2))
    assert not m.has_canonical_format
    t = ss.from_scipy(m)
    assert ss.is_checked(t) and not t.is_coalesced() and t._nnz() == 3
    assert torch.equal(t.to_dense(), torch.from_numpy(m.toarray()))


@needs_scipy
def test_canonical_coo_is_coalesced_and_a_false_flag_is_caught() -> None:
    m = sp.coo_array(np.array([[0.0, 1.0], [2.0, 0.0]]))
    assert m.has_canonical_format
    t = ss.from_scipy(m)
    assert t.is_coalesced() and ss.is_checked(t)
    m.row[:] = m.row[::-1].copy()  # no longer sorted, but SciPy keeps its flag
    m.col[:] = m.col[::-1].copy()
    m.has_canonical_format = True  # a stale flag: SciPy does not look again either
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.from_scipy(m)
    assert (excinfo.value.layout, excinfo.value.invariant) == (torch.sparse_coo, "5.3")
    assert "coalesce()" in str(excinfo.value) and "sum_duplicates()" in str(excinfo.value)


@needs_scipy
@pytest.mark.parametrize("fmt", ["dia", "dok", "lil"])
def test_formats_without_a_torch_layout_are_a_type_error(fmt: str) -> None:
    m = sp.csr_array(np.eye(3)).asformat(fmt)
    with pytest.raises(TypeError, match=r"tocsr\(\)"):
        ss.from_scipy(m)


@needs_scipy
@pytest.mark.parametrize("kind", ["ndarray", "list", "none", "tensor"])
def test_from_scipy_refuses_non_sparse_input(kind: str) -> None:
    obj = {"ndarray": np.eye(2), "list": [[1.0]], "none": None,
           "tensor": torch.eye(2).to_sparse_csr()}[kind]
    with pytest.raises(TypeError, match=r"scipy\.sparse"):
        ss.from_scipy(obj)


@needs_scipy
def test_from_scipy_shares_no_memory_with_the_matrix() -> None:
    m = sp.csr_array(np.array([[1.0, 0.0], [0.0, 2.0]]))
    t = ss.from_scipy(m)
    m.indices[0] = 10**6  # an in-place write on SciPy's side ...
    m.data[1] = 99.0
    assert ss.is_checked(t)  # ... cannot break the checked tensor
    assert torch.equal(t.to_dense(), torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64))


# --- to_scipy ------------------------------------------------------------------------------------


def _examples() -> list[torch.Tensor]:
    dense = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.0], [0.0] * 4, [4.0, 0, 5, 0]])
    return [
        ss.validate(dense.to_sparse_coo()),
        ss.validate(dense.to_sparse_csr()),
        ss.validate(dense.to_sparse_csc()),
        ss.validate(dense.to_sparse_bsr((2, 2))),
        dense.to_sparse_csr(),  # a plain torch tensor
    ]


@needs_scipy
@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("matrix", [False, True])
def test_to_scipy_format_and_values(index: int, matrix: bool) -> None:
    t = _examples()[index]
    m = ss.to_scipy(t, matrix=matrix)
    fmt = {torch.sparse_coo: "coo", torch.sparse_csr: "csr", torch.sparse_csc: "csc",
           torch.sparse_bsr: "bsr"}[t.layout]
    assert m.format == fmt
    assert isinstance(m, sp.spmatrix) == matrix
    assert np.array_equal(m.toarray(), t.to_dense().numpy())
    if fmt == "bsr":
        assert m.blocksize == (2, 2)


@needs_scipy
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_to_scipy_keeps_the_index_dtype(index_dtype: torch.dtype) -> None:
    t = ss.sparse_csr_tensor(torch.tensor([0, 1, 2], dtype=index_dtype),
                             torch.tensor([1, 0], dtype=index_dtype), [1.0, 2.0], (2, 2))
    m = ss.to_scipy(t)
    assert m.indices.dtype == m.indptr.dtype == np.dtype(str(index_dtype).removeprefix("torch."))


@needs_scipy
def test_to_scipy_marks_a_coalesced_coo_canonical() -> None:
    t = ss.validate(torch.eye(3).to_sparse_coo())
    assert t.is_coalesced()
    assert ss.to_scipy(t).has_canonical_format
    u = ss.sparse_coo_tensor([[1, 0, 1]], [1.0, 2.0, 3.0], (2,))
    m = ss.to_scipy(u)
    assert not m.has_canonical_format and np.array_equal(m.toarray(), [2.0, 4.0])


@needs_scipy
def test_to_scipy_validates_a_plain_tensor_first() -> None:
    bad = torch.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], (2, 3),
                                  check_invariants=False)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.to_scipy(bad)
    assert excinfo.value.invariant == "5.6"


@needs_scipy
def test_to_scipy_of_an_unchecked_tensor_validates_it() -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2), check_invariants=False)
    assert not ss.is_checked(t)
    ss.reset_stats()
    ss.to_scipy(t)
    assert ss.stats().validations == 1


@needs_scipy
def test_to_scipy_shares_no_memory_with_the_tensor() -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2))
    m = ss.to_scipy(t)
    m.indices[0] = 10**6
    m.data[0] = 99.0
    assert ss.is_checked(t)
    assert t.col_indices().tolist() == [1, 0] and t.values().tolist() == [1.0, 2.0]


@needs_scipy
def test_to_scipy_detaches_and_resolves_lazy_negation() -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2), requires_grad=True)
    assert np.array_equal(ss.to_scipy(t).toarray(), [[0.0, 1.0], [2.0, 0.0]])
    c = ss.sparse_csr_tensor([0, 1], [0], torch.tensor([1 + 2j]), (1, 1))
    assert ss.to_scipy(c.conj()).toarray()[0, 0] == 1 - 2j


@needs_scipy
def test_to_scipy_refusals() -> None:
    bsc = ss.validate(torch.eye(4).to_sparse_bsc((2, 2)))
    with pytest.raises(ValueError, match="BSC"):
        ss.to_scipy(bsc)
    assert ss.to_scipy(bsc.mT).format == "bsr"  # the suggested way round
    hybrid = ss.validate(torch.ones(2, 2, 3).to_sparse_csr(dense_dim=1))
    with pytest.raises(ValueError, match="hybrid"):
        ss.to_scipy(hybrid)
    batched = ss.validate(torch.eye(2).expand(3, 2, 2).to_sparse_csr())
    with pytest.raises(ValueError, match="batched"):
        ss.to_scipy(batched)
    with pytest.raises(TypeError):
        ss.to_scipy(torch.eye(2))


# --- round trips ---------------------------------------------------------------------------------


@needs_scipy
@given(
    rows=st.integers(0, 9),
    cols=st.integers(0, 9),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
    fmt=st.sampled_from(["csr", "csc", "coo", "bsr"]),
    index_dtype=st.sampled_from(["int32", "int64"]),
)
def test_round_trip(rows: int, cols: int, density: float, seed: int, fmt: str,
                    index_dtype: str) -> None:
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, cols)) * (rng.random((rows, cols)) < density)
    m = sp.csr_array(dense).asformat(fmt)
    if fmt != "coo":
        m.sort_indices()  # (SciPy's csr -> bsr can leave block columns unsorted: 5.6)
        m.indices = m.indices.astype(index_dtype)
        m.indptr = m.indptr.astype(index_dtype)
    t = ss.from_scipy(m)
    assert ss.is_checked(t)
    assert np.array_equal(t.to_dense().numpy(), m.toarray())
    back = ss.to_scipy(t)
    assert back.format == fmt
    assert np.array_equal(back.toarray(), m.toarray())
    if fmt != "coo":
        assert back.indices.dtype == np.dtype(index_dtype)


@needs_scipy
def test_from_scipy_copes_with_empty_and_reversed_index_arrays() -> None:
    empty = sp.csr_array((0, 0))
    assert ss.from_scipy(empty).shape == (0, 0)  # NumPy gives the empty arrays strides (0,)
    m = sp.coo_array((np.array([1.0, 2.0]), (np.array([0, 1]), np.array([1, 0]))), shape=(2, 2))
    m.row, m.col, m.data = m.row[::-1], m.col[::-1], m.data[::-1]  # negative strides
    t = ss.from_scipy(m)
    assert torch.equal(t.to_dense(), torch.from_numpy(m.toarray()))


@needs_scipy
def test_validate_of_a_scipy_matrix_points_to_from_scipy() -> None:
    with pytest.raises(TypeError, match=r"from_scipy"):
        ss.validate(sp.csr_array(np.eye(2)))

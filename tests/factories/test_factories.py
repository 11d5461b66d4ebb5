"""The safe factories behave like torch's for valid input; validate/unwrap/stats/checked state."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from support.strategies import SS_FACTORIES, TORCH_FACTORIES

import safesparse as ss

CSR = torch.sparse_csr
CSC = torch.sparse_csc
BSR = torch.sparse_bsr
BSC = torch.sparse_bsc
COO = torch.sparse_coo
COMPRESSED = (CSR, CSC, BSR, BSC)
IMPLICIT_WARNING = "Sparse invariant checks are implicitly disabled"


def _members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index members and values of a torch sparse tensor (plain tensors)."""
    t = ss.unwrap(t)
    if t.layout == COO:
        return t._indices(), t._values()
    if t.layout in (CSR, BSR):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def _example(layout: torch.layout, *, batch: tuple[int, ...] = (), hybrid: bool = False,
             index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A torch-built sparse tensor with empty rows, to use as a reference."""
    if 0 in batch:  # torch cannot convert an empty batch: slice a batch of one instead
        ones = tuple(max(b, 1) for b in batch)
        full = _example(layout, batch=ones, hybrid=hybrid, index_dtype=index_dtype)
        cut = tuple(slice(0, b) for b in batch)
        c, p, v = (m[cut] for m in _members(full))
        return torch.sparse_compressed_tensor(
            c, p, v, (*batch, *full.shape[len(batch):]), layout=layout, check_invariants=True
        )
    g = torch.Generator().manual_seed(0)
    dense = torch.randint(1, 9, (*batch, 6, 4, *((2,) if hybrid else ())), generator=g).float()
    mask = torch.tensor([[1, 0, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0],
                         [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    dense = dense * mask.reshape(6, 4, *((1,) if hybrid else ()))
    dense_dim = 1 if hybrid else 0
    if layout == COO:
        return dense.to_sparse(sparse_dim=dense.dim() - dense_dim)
    if layout == CSR:
        t = dense.to_sparse_csr(dense_dim=dense_dim)
    elif layout == CSC:
        t = dense.to_sparse_csc(dense_dim=dense_dim)
    elif layout == BSR:
        t = dense.to_sparse_bsr((2, 2), dense_dim=dense_dim)
    else:
        t = dense.to_sparse_bsc((2, 2), dense_dim=dense_dim)
    if index_dtype != torch.int64:
        c, p, v = _members(t)
        t = torch.sparse_compressed_tensor(
            c.to(index_dtype), p.to(index_dtype), v, t.shape, layout=layout,
            check_invariants=True,
        )
    return t


def _assert_same(result: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(result, ss.SafeSparseTensor)
    assert isinstance(result, torch.Tensor)
    assert ss.is_checked(result)
    assert result.layout == expected.layout
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype
    assert result.device == expected.device
    for got, want in zip(_members(result), _members(expected), strict=True):
        assert got.dtype == want.dtype
    assert torch.equal(result.to_dense(), expected.to_dense())


LAYOUT_PARAMS = pytest.mark.parametrize(
    "layout", [COO, CSR, CSC, BSR, BSC], ids=["COO", "CSR", "CSC", "BSR", "BSC"]
)
COMPRESSED_PARAMS = pytest.mark.parametrize(
    "layout", COMPRESSED, ids=["CSR", "CSC", "BSR", "BSC"]
)


# --- parity with torch for valid input ---------------------------------------------------------


def _layouts_and_batches(batches: list[tuple[int, ...]]) -> list[Any]:
    """(layout, batch) pairs; COO has no batch dims."""
    return [
        pytest.param(layout, batch, id=f"{name}-{batch}")
        for layout, name in zip((COO, CSR, CSC, BSR, BSC), ("COO", "CSR", "CSC", "BSR", "BSC"),
                                strict=True)
        for batch in batches
        if layout != COO or not batch
    ]


@pytest.mark.parametrize(("layout", "batch"), _layouts_and_batches([(), (2,), (2, 3), (0,)]))
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_parity_from_tensors(layout: torch.layout, batch: tuple[int, ...], hybrid: bool) -> None:
    ref = _example(layout, batch=batch, hybrid=hybrid)
    members = _members(ref)
    result = SS_FACTORIES[layout](*members, ref.shape)
    _assert_same(result, ref)
    via_torch = TORCH_FACTORIES[layout](*members, ref.shape, check_invariants=True)
    assert torch.equal(result.to_dense(), via_torch.to_dense())


@COMPRESSED_PARAMS
def test_parity_int32_indices(layout: torch.layout) -> None:
    ref = _example(layout, batch=(2,), index_dtype=torch.int32)
    result = SS_FACTORIES[layout](*_members(ref), ref.shape)
    _assert_same(result, ref)
    assert _members(result)[0].dtype == torch.int32
    assert _members(result)[1].dtype == torch.int32


@LAYOUT_PARAMS
def test_parity_from_lists_and_numpy(layout: torch.layout) -> None:
    ref = _example(layout)
    members = _members(ref)
    as_lists = [m.tolist() for m in members]
    as_numpy = [m.numpy() for m in members]
    for inputs in (as_lists, as_numpy):
        result = SS_FACTORIES[layout](*inputs, tuple(ref.shape))
        expected = TORCH_FACTORIES[layout](*inputs, tuple(ref.shape), check_invariants=True)
        _assert_same(result, expected)


def test_int_lists_give_int64_values_like_torch() -> None:
    result = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1, 2, 3])
    expected = torch.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1, 2, 3], check_invariants=True)
    _assert_same(result, expected)
    assert result.dtype == torch.int64


def test_numpy_int32_indices_keep_their_dtype() -> None:
    crow = np.array([0, 1, 2], dtype=np.int32)
    col = np.array([0, 1], dtype=np.int32)
    vals = np.array([1.0, 2.0], dtype=np.float32)
    result = ss.sparse_csr_tensor(crow, col, vals, (2, 2))
    expected = torch.sparse_csr_tensor(crow, col, vals, (2, 2), check_invariants=True)
    _assert_same(result, expected)
    assert result.crow_indices().dtype == torch.int32


def test_coo_int32_indices_are_converted_like_torch() -> None:
    idx = torch.tensor([[0, 1, 1], [2, 0, 1]], dtype=torch.int32)
    vals = torch.tensor([1.0, 2.0, 3.0])
    result = ss.sparse_coo_tensor(idx, vals, (2, 3))
    expected = torch.sparse_coo_tensor(idx, vals, (2, 3), check_invariants=True)
    _assert_same(result, expected)
    assert result._indices().dtype == torch.int64


@LAYOUT_PARAMS
def test_non_contiguous_values_are_accepted(layout: torch.layout) -> None:
    ref = _example(layout, hybrid=True)
    *index, values = _members(ref)
    # same values, every other element of a wider buffer
    wide = torch.stack([values, torch.full_like(values, -7)], dim=-1)
    strided = wide[..., 0]
    assert not strided.is_contiguous()
    assert torch.equal(strided, values)
    result = SS_FACTORIES[layout](*index, strided, ref.shape)
    _assert_same(result, ref)
    if layout != COO:  # 3.7 is a compressed-layout invariant
        out_values = _members(result)[-1]
        blocked = layout in (BSR, BSC)
        assert out_values.is_contiguous() or (
            blocked and out_values.transpose(1, 2).is_contiguous()
        )


@pytest.mark.parametrize("layout", [BSR, BSC], ids=["BSR", "BSC"])
def test_block_transposed_values_are_kept_as_given(layout: torch.layout) -> None:
    ref = _example(layout)
    c, p, values = _members(ref)
    column_major = values.transpose(1, 2).contiguous().transpose(1, 2)
    assert not column_major.is_contiguous()
    result = SS_FACTORIES[layout](c, p, column_major, ref.shape)
    _assert_same(result, ref)


@LAYOUT_PARAMS
def test_dtype_and_device_conversion(layout: torch.layout) -> None:
    ref = _example(layout)
    members = _members(ref)
    result = SS_FACTORIES[layout](*members, ref.shape, dtype=torch.float64, device="cpu")
    expected = TORCH_FACTORIES[layout](
        *members, ref.shape, dtype=torch.float64, device="cpu", check_invariants=True
    )
    _assert_same(result, expected)
    assert result.dtype == torch.float64
    result = SS_FACTORIES[layout](*members, ref.shape, device=torch.device("cpu"))
    assert result.device == torch.device("cpu")


def test_dtype_conversion_from_lists() -> None:
    result = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1, 2], (2, 2), dtype=torch.float16)
    expected = torch.sparse_csr_tensor(
        [0, 1, 2], [1, 0], [1, 2], (2, 2), dtype=torch.float16, check_invariants=True
    )
    _assert_same(result, expected)


def test_sparse_compressed_tensor_with_layout() -> None:
    for layout in COMPRESSED:
        ref = _example(layout, batch=(2,), hybrid=True)
        result = ss.sparse_compressed_tensor(*_members(ref), ref.shape, layout=layout)
        _assert_same(result, ref)
        estimated = ss.sparse_compressed_tensor(*_members(ref), layout=layout)
        expected = torch.sparse_compressed_tensor(
            *_members(ref), layout=layout, check_invariants=True
        )
        _assert_same(estimated, expected)


# --- size estimation ---------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "batch"), _layouts_and_batches([(), (2,), (0,), (0, 2)]))
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_size_estimation_matches_torch(
    layout: torch.layout, batch: tuple[int, ...], hybrid: bool, index_dtype: torch.dtype
) -> None:
    if layout == COO and index_dtype == torch.int32:
        return  # COO indices are always int64
    members = _members(_example(layout, batch=batch, hybrid=hybrid, index_dtype=index_dtype))
    assert not batch or members[1].shape[-1] > 0  # nnz > 0, even in an empty batch
    result = SS_FACTORIES[layout](*members)
    expected = TORCH_FACTORIES[layout](*members, check_invariants=True)
    _assert_same(result, expected)


def test_csr_estimate_uses_largest_column_plus_one() -> None:
    t = ss.sparse_csr_tensor([0, 1, 3], [4, 0, 2], [1.0, 2.0, 3.0])
    assert t.shape == (2, 5)


def test_bsr_estimate_follows_the_seed_rule() -> None:
    # ncols = max(col.max() + 1, crow.diff().max()) blocks, times the block width
    values = torch.ones(3, 2, 3)
    t = ss.sparse_bsr_tensor([0, 2, 3], [0, 1, 0], values)
    assert t.shape == (4, 6)
    t = ss.sparse_bsr_tensor([0, 1, 3], [2, 0, 1], values)
    assert t.shape == (4, 9)


def test_batched_bsc_estimate() -> None:
    ccol = torch.tensor([[0, 1, 2], [0, 0, 2]])
    row = torch.tensor([[3, 0], [0, 1]])
    values = torch.ones(2, 2, 2, 1)
    t = ss.sparse_bsc_tensor(ccol, row, values)
    assert t.shape == (2, 8, 2)
    assert t.shape == torch.sparse_bsc_tensor(ccol, row, values, check_invariants=True).shape


def test_coo_estimate_is_max_plus_one() -> None:
    t = ss.sparse_coo_tensor([[0, 3, 1], [2, 0, 5]], torch.ones(3, 4))
    assert t.shape == (4, 6, 4)


@LAYOUT_PARAMS
def test_size_estimation_with_nnz_zero(layout: torch.layout) -> None:
    if layout == COO:
        members: tuple[Any, ...] = (torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, 3))
    else:
        blocked = layout in (BSR, BSC)
        members = (
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, 2, 3) if blocked else torch.zeros(0),
        )
    result = SS_FACTORIES[layout](*members)
    expected = TORCH_FACTORIES[layout](*members, check_invariants=True)
    _assert_same(result, expected)
    assert result._nnz() == 0


# --- result type, checked state, warnings, autograd --------------------------------------------


@LAYOUT_PARAMS
def test_results_are_checked_safe_sparse_tensors(layout: torch.layout) -> None:
    ref = _example(layout)
    for check in (None, True):
        t = SS_FACTORIES[layout](*_members(ref), ref.shape, check_invariants=check)
        assert type(t) is ss.SafeSparseTensor
        assert isinstance(t, torch.Tensor)
        assert ss.is_checked(t)


@LAYOUT_PARAMS
def test_check_invariants_false_builds_unchecked(layout: torch.layout) -> None:
    ref = _example(layout)
    t = SS_FACTORIES[layout](*_members(ref), ref.shape, check_invariants=False)
    assert isinstance(t, ss.SafeSparseTensor)
    assert not ss.is_checked(t)
    assert ss.stats().validations == 0
    assert torch.equal(t.to_dense(), ref.to_dense())  # its first operation validates it
    assert ss.stats().validations == 1 and ss.is_checked(t)


@COMPRESSED_PARAMS
def test_check_invariants_false_does_not_touch_invalid_data(layout: torch.layout) -> None:
    compressed = torch.tensor([0, 5, 1])  # 5.2 / 5.3 broken
    plain = torch.tensor([7])  # out of range
    blocked = layout in (BSR, BSC)
    values = torch.ones(1, 1, 1) if blocked else torch.ones(1)
    t = SS_FACTORIES[layout](compressed, plain, values, (2, 2), check_invariants=False)
    assert not ss.is_checked(t)
    assert ss.stats().validations == 0
    with pytest.raises(ss.InvariantError):
        ss.validate(t)


def test_check_invariants_false_coo_invalid() -> None:
    t = ss.sparse_coo_tensor([[0, 9]], [1.0, 2.0], (2,), check_invariants=False)
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert excinfo.value.invariant == "5.2"


@LAYOUT_PARAMS
@pytest.mark.parametrize("check", [None, True, False], ids=["default", "on", "off"])
def test_no_implicitly_disabled_warning(layout: torch.layout, check: bool | None) -> None:
    ref = _example(layout, batch=() if layout == COO else (2,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SS_FACTORIES[layout](*_members(ref), ref.shape, check_invariants=check)
        SS_FACTORIES[layout](*_members(ref), check_invariants=check)
    implicit = [w for w in caught if IMPLICIT_WARNING in str(w.message)]
    assert not implicit, [str(w.message) for w in implicit]


@LAYOUT_PARAMS
def test_requires_grad_gives_a_leaf(layout: torch.layout) -> None:
    ref = _example(layout)
    t = SS_FACTORIES[layout](*_members(ref), ref.shape, requires_grad=True)
    assert t.requires_grad
    assert t.is_leaf
    assert ss.is_checked(t)
    t_off = SS_FACTORIES[layout](*_members(ref), ref.shape)
    assert not t_off.requires_grad


def test_requires_grad_leaf_receives_grad_like_torch() -> None:
    crow, col, vals = [0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0]
    dense = torch.arange(6.0).reshape(3, 2)
    ours = ss.sparse_csr_tensor(crow, col, vals, (2, 3), requires_grad=True)
    theirs = torch.sparse_csr_tensor(
        crow, col, vals, (2, 3), requires_grad=True, check_invariants=True
    )
    (ours @ dense).sum().backward()
    (theirs @ dense).sum().backward()
    assert ours.grad is not None and theirs.grad is not None
    assert torch.equal(ours.grad.to_dense(), theirs.grad.to_dense())


# --- ss.validate, ss.unwrap --------------------------------------------------------------------


@LAYOUT_PARAMS
def test_validate_adopts_a_torch_tensor_on_its_own_index_members(layout: torch.layout) -> None:
    """SPEC 4: the index members are copied (values shared); ``copy_indices=False`` shares
    them too."""
    plain = _example(layout, batch=() if layout == COO else (2,))
    assert not ss.is_checked(plain)
    t = ss.validate(plain)
    assert type(t) is ss.SafeSparseTensor
    assert ss.is_checked(t)
    *index, values = _members(t)
    *theirs_index, theirs_values = _members(plain)
    for ours, theirs in zip(index, theirs_index, strict=True):
        assert ours.data_ptr() != theirs.data_ptr() and torch.equal(ours, theirs)
        assert ours.stride() == theirs.stride()
    assert values.data_ptr() == theirs_values.data_ptr()
    assert torch.equal(t.to_dense(), plain.to_dense())
    assert ss.stats().validations == 1
    shared = ss.validate(plain, copy_indices=False)
    for ours, theirs in zip(_members(shared), _members(plain), strict=True):
        assert ours.data_ptr() == theirs.data_ptr()


def test_validate_of_a_checked_tensor_is_free() -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2))
    ss.reset_stats()
    assert ss.validate(t) is t
    assert ss.stats().validations == 0
    assert ss.stats().skipped == 1


@pytest.mark.parametrize("value", [torch.eye(3), torch.tensor(1.0)], ids=["matrix", "scalar"])
def test_validate_refuses_strided(value: torch.Tensor) -> None:
    with pytest.raises(TypeError):
        ss.validate(value)


def test_validate_refuses_non_tensors() -> None:
    with pytest.raises(TypeError):
        ss.validate([[1, 0], [0, 1]])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "layout", "iid"),
    [
        (lambda: torch.sparse_csr_tensor(
            torch.tensor([0, 2, 3]), torch.tensor([2, 0, 1]), torch.ones(3), (2, 3),
            check_invariants=False), CSR, "5.6"),
        (lambda: torch.sparse_csc_tensor(
            torch.tensor([0, 1, 2]), torch.tensor([0, 4]), torch.ones(2), (3, 2),
            check_invariants=False), CSC, "5.5"),
        (lambda: torch.sparse_bsr_tensor(
            torch.tensor([1, 1, 1]), torch.tensor([0]), torch.ones(1, 2, 2), (4, 4),
            check_invariants=False), BSR, "5.1"),
        (lambda: torch.sparse_bsc_tensor(
            torch.tensor([0, 1, 1]), torch.tensor([-1]), torch.ones(1, 2, 2), (4, 4),
            check_invariants=False), BSC, "5.4"),
        (lambda: torch.sparse_coo_tensor(
            torch.tensor([[0, -1]]), torch.ones(2), (3,), check_invariants=False), COO, "5.1"),
    ],
    ids=["CSR", "CSC", "BSR", "BSC", "COO"],
)
def test_validate_refuses_invalid_torch_tensors(
    build: Callable[[], torch.Tensor], layout: torch.layout, iid: str
) -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(build())
    assert excinfo.value.layout == layout
    assert excinfo.value.invariant == iid


@LAYOUT_PARAMS
def test_unwrap_returns_the_plain_tensor(layout: torch.layout) -> None:
    ref = _example(layout)
    t = SS_FACTORIES[layout](*_members(ref), ref.shape)
    plain = ss.unwrap(t)
    assert type(plain) is torch.Tensor
    assert not ss.is_checked(plain)
    assert plain.layout == layout
    for a, b in zip(_members(plain), _members(t), strict=True):
        assert a.data_ptr() == b.data_ptr()
    assert torch.equal(plain.to_dense(), ref.to_dense())
    # unwrapping a plain tensor is the identity
    assert ss.unwrap(plain) is plain


# --- checked state: cache, stats, in-place writes ----------------------------------------------


def test_stats_start_at_zero() -> None:
    s = ss.stats()
    assert (s.validations, s.skipped) == (0, 0)
    assert isinstance(s.validations, int) and isinstance(s.skipped, int)


@LAYOUT_PARAMS
def test_rebuilding_from_validated_indices_is_skipped(layout: torch.layout) -> None:
    ref = _example(layout)
    *index, values = _members(ref)
    a = SS_FACTORIES[layout](*index, values, ref.shape)
    b = SS_FACTORIES[layout](*index, values * 2, ref.shape)
    assert ss.stats().validations == 1
    assert ss.stats().skipped == 1
    assert ss.is_checked(a) and ss.is_checked(b)
    assert torch.equal(b.to_dense(), 2 * a.to_dense())
    ss.reset_stats()
    assert (ss.stats().validations, ss.stats().skipped) == (0, 0)


def test_rebuilding_from_a_tensors_own_members_is_skipped() -> None:
    t = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], (2, 3))
    for step in range(3):
        t = ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(), t.values() + 1, t.shape)
        assert ss.is_checked(t)
        assert ss.stats().skipped == step + 1
    assert ss.stats().validations == 1


def test_clear_cache_forces_validation() -> None:
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    keep = ss.sparse_csr_tensor(crow, col, torch.ones(2), (2, 2))
    ss.clear_cache()
    ss.sparse_csr_tensor(crow, col, torch.ones(2), (2, 2))
    assert ss.stats().validations == 2
    assert ss.stats().skipped == 0
    assert ss.is_checked(keep)


def test_different_geometry_is_validated_again() -> None:
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    ss.sparse_csr_tensor(crow, col, torch.ones(2), (2, 2))
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, torch.ones(2), (2, 1))  # column 1 is now out of range
    assert excinfo.value.invariant == "5.5"


@COMPRESSED_PARAMS
def test_in_place_write_to_plain_indices_drops_checked_state(layout: torch.layout) -> None:
    ref = _example(layout)
    t = SS_FACTORIES[layout](*_members(ref), ref.shape)
    assert ss.is_checked(t)
    plain = _members(t)[1]
    plain[0] = 9
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert excinfo.value.layout == layout
    assert excinfo.value.invariant == "5.5"
    assert "9" in str(excinfo.value)


def test_in_place_write_to_col_indices_spec_example() -> None:
    t = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], (2, 3))
    t.col_indices()[0] = 9
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert (excinfo.value.layout, excinfo.value.invariant) == (CSR, "5.5")


def test_in_place_write_to_the_input_index_tensor_is_seen() -> None:
    crow, col = torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1])
    t = ss.sparse_csr_tensor(crow, col, torch.ones(3), (2, 3))
    assert ss.is_checked(t)
    col[1] = 0  # breaks 5.6 in row 0; shares storage with t.col_indices()
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, torch.ones(3), (2, 3))
    assert excinfo.value.invariant == "5.6"
    assert ss.stats().skipped == 0


def test_in_place_write_to_crow_indices_drops_checked_state() -> None:
    t = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], (2, 3))
    t.crow_indices()[1] = 3
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert excinfo.value.invariant == "5.6"  # row 0 now holds 0, 2, 1


def test_in_place_write_to_coo_indices_drops_checked_state() -> None:
    t = ss.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2))
    assert ss.is_checked(t)
    t._indices()[1, 1] = 5
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert (excinfo.value.layout, excinfo.value.invariant) == (COO, "5.2")


def test_values_write_then_validate_succeeds() -> None:
    t = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], (2, 3))
    t.values()[0] = 100.0
    # (members share one version counter, so the checked state may be dropped conservatively)
    assert ss.validate(t) is t
    assert ss.is_checked(t)
    assert t.to_dense()[0, 0] == 100.0


def test_factories_in_threads_leave_torch_s_invariant_flag_alone() -> None:
    """torch's factory with check_invariants=True sets torch's process-wide flag for the call
    and restores what it saw: two threads in it at once can leave the flag on for good. The
    factories validate without it (torch's checker is called directly)."""
    import threading

    assert not torch.sparse.check_sparse_tensor_invariants.is_enabled()
    crow, col, vals = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2)

    def build() -> None:
        for _ in range(5000):
            ss.sparse_csr_tensor(crow.clone(), col.clone(), vals, (2, 2))
            ss.sparse_bsc_tensor(crow.clone(), col.clone(), torch.ones(2, 1, 1), (2, 2))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torch.sparse.check_sparse_tensor_invariants.is_enabled()


@COMPRESSED_PARAMS
def test_a_miss_runs_the_straight_path_once(layout: torch.layout,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The four layout factories are one template: a call the straight path does not take
    (lists to convert) asks it once, then converts and validates."""
    from safesparse.factories import build

    calls: list[torch.layout | None] = []
    fast = build.fast_compressed

    def counted(*args: Any) -> Any:
        calls.append(args[4])
        return fast(*args)

    monkeypatch.setattr(build, "fast_compressed", counted)
    factory = {CSR: ss.sparse_csr_tensor, CSC: ss.sparse_csc_tensor,
               BSR: ss.sparse_bsr_tensor, BSC: ss.sparse_bsc_tensor}[layout]
    values = [[[1.0]], [[2.0]]] if layout in (BSR, BSC) else [1.0, 2.0]
    t = factory([0, 1, 2], [1, 0], values, (2, 2))
    assert ss.is_checked(t) and t.layout == layout
    assert calls == [layout]

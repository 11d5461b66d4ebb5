"""Drop-in: every input torch's factories accept is accepted, with torch's result (SPEC 1).

One test per cause found by running PyTorch's own sparse suites with safesparse swapped in
(../shared/torch_suite): per-batch-contiguous members, the size-only overload, sparse_dim 0,
transposes as views, floating COO indices, scalar values; and torch's exception type for sizes
that are not sizes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safesparse as ss
from safesparse.catalog.doctext import CHECK_INVARIANTS

CSR, CSC, BSR, BSC, COO = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                           torch.sparse_bsc, torch.sparse_coo)
TORCH_COMPRESSED = {CSR: torch.sparse_csr_tensor, CSC: torch.sparse_csc_tensor,
                    BSR: torch.sparse_bsr_tensor, BSC: torch.sparse_bsc_tensor}
SS_COMPRESSED = {CSR: ss.sparse_csr_tensor, CSC: ss.sparse_csc_tensor,
                 BSR: ss.sparse_bsr_tensor, BSC: ss.sparse_bsc_tensor}


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert isinstance(ours, ss.SafeSparseTensor)
    assert ss.is_checked(ours)
    assert ours.layout == theirs.layout and ours.shape == theirs.shape
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours.to_dense(), theirs.to_dense())


# --- per-batch contiguous index members (3.5 / 3.6) -------------------------------------------


def _strided_batch(width: int, rows: list[list[int]]) -> torch.Tensor:
    """``rows`` as a slice of a wider buffer: contiguous per batch, strided across batches."""
    wide = torch.full((len(rows), width), 99, dtype=torch.int64)
    for i, r in enumerate(rows):
        wide[i, : len(r)] = torch.tensor(r)
    out = wide[:, : len(rows[0])]
    assert not out.is_contiguous() and out.stride(-1) == 1
    return out


@pytest.mark.parametrize("layout", [CSR, CSC, BSR, BSC], ids=str)
@pytest.mark.parametrize("member", ["compressed", "plain", "both"])
def test_per_batch_contiguous_members_are_taken_as_they_are(layout: torch.layout,
                                                            member: str) -> None:
    compressed = torch.tensor([[0, 1, 2], [0, 1, 2]])
    plain = torch.tensor([[0, 1], [1, 0]])
    if member in ("compressed", "both"):
        compressed = _strided_batch(4, [[0, 1, 2], [0, 1, 2]])
    if member in ("plain", "both"):
        plain = _strided_batch(5, [[0, 1], [1, 0]])
    blocked = layout in (BSR, BSC)
    values = torch.arange(1.0, 5.0).reshape(2, 2, *((1, 1) if blocked else ()))
    size = (2, 2, 2)
    theirs = _quiet(lambda: TORCH_COMPRESSED[layout](compressed, plain, values, size,
                                                     check_invariants=True))
    ours = SS_COMPRESSED[layout](compressed, plain, values, size)
    _same(ours, theirs)
    # no copy: the result shares the caller's members, batch strides included
    if layout in (CSR, BSR):
        c, p = ours.crow_indices(), ours.col_indices()
    else:
        c, p = ours.ccol_indices(), ours.row_indices()
    assert c.data_ptr() == compressed.data_ptr() and c.stride() == compressed.stride()
    assert p.data_ptr() == plain.data_ptr() and p.stride() == plain.stride()


def test_issue_reproducer_strided_crow() -> None:
    crow = torch.tensor([[0, 1, 2, 9], [0, 1, 2, 9]])[:, :3]
    col = torch.tensor([[0, 1], [1, 0]])
    theirs = _quiet(lambda: torch.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2)))
    _same(ss.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2)), theirs)


def test_validate_accepts_torch_built_per_batch_contiguous_members() -> None:
    crow = _strided_batch(4, [[0, 1, 2], [0, 2, 2]])
    col = torch.tensor([[0, 1], [0, 1]])
    t = _quiet(lambda: torch.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2),
                                               check_invariants=True))
    checked = ss.validate(t)
    assert ss.is_checked(checked)


def test_invalid_data_in_a_strided_batch_is_still_found_with_its_location() -> None:
    crow = _strided_batch(4, [[0, 1, 2], [0, 2, 2]])
    col = torch.tensor([[0, 1], [1, 1]])  # batch 1, row 0: 1 after 1
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2))
    assert excinfo.value.invariant == "5.6"
    assert excinfo.value.location["batch"] == (1,)


@pytest.mark.parametrize("member", ["compressed", "plain"])
def test_members_with_a_non_unit_last_stride_are_copied(member: str) -> None:
    compressed, plain = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([[0, 1], [1, 0]])
    if member == "compressed":
        compressed = compressed.t().contiguous().t()  # column-major: last stride 2
    else:
        plain = plain.t().contiguous().t()
    t = ss.sparse_csr_tensor(compressed, plain, torch.ones(2, 2), (2, 2, 2))
    assert t.crow_indices().stride(-1) == 1 and t.col_indices().stride(-1) == 1
    assert ss.is_checked(t)
    expected = torch.sparse_csr_tensor(compressed.contiguous(), plain.contiguous(),
                                       torch.ones(2, 2), (2, 2, 2), check_invariants=True)
    assert torch.equal(t.to_dense(), expected.to_dense())


# --- the size-only overload ---------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda f: f((2, 3)),
    lambda f: f([2, 3]),
    lambda f: f(torch.Size([2, 3])),
    lambda f: f(size=(2, 3)),
    lambda f: f((2, 3), dtype=torch.float64),
    lambda f: f((2, 3), dtype=torch.float64, device="cpu"),
    lambda f: f((2, 3), requires_grad=True),
    lambda f: f((2, 3), check_invariants=True),
    lambda f: f((4, 0, 3)),
    lambda f: f(()),
], ids=["tuple", "list", "Size", "keyword", "dtype", "device", "grad", "checked", "zero", "0-d"])
def test_size_only_overload(call: Callable[[Callable[..., torch.Tensor]], torch.Tensor]) -> None:
    with warnings.catch_warnings():  # torch's own call warns once per process (implicit checks);
        warnings.simplefilter("ignore")  # ours must not (pyproject makes that warning an error)
        theirs = call(torch.sparse_coo_tensor)
    ours = call(ss.sparse_coo_tensor)
    _same(ours, theirs)
    assert ours.sparse_dim() == theirs.sparse_dim() and ours.dense_dim() == theirs.dense_dim()
    assert ours._nnz() == 0 and ours.requires_grad == theirs.requires_grad


def test_size_only_overload_on_the_meta_device_is_torch_s_unchecked_empty_tensor() -> None:
    ours = ss.sparse_coo_tensor(size=(4, 4), device="meta")
    theirs = torch.sparse_coo_tensor(size=(4, 4), device="meta")
    assert ours.is_meta and ours.shape == theirs.shape and ours._nnz() == 0
    assert isinstance(ours, ss.SafeSparseTensor) and not ss.is_checked(ours)


@pytest.mark.parametrize("call", [
    lambda f: f((2, 3), is_coalesced=True),
    lambda f: f(),
    lambda f: f((2.0, 3)),
], ids=["is_coalesced", "nothing", "float-size"])
def test_size_only_overload_refuses_what_torch_refuses(
        call: Callable[[Callable[..., torch.Tensor]], torch.Tensor]) -> None:
    with pytest.raises(TypeError):
        call(torch.sparse_coo_tensor)
    with pytest.raises(TypeError):
        call(ss.sparse_coo_tensor)


# --- sparse_dim 0 -------------------------------------------------------------------------------


@pytest.mark.parametrize(("nnz", "dense", "size"), [
    (1, (), ()), (2, (), ()), (0, (), ()), (1, (3,), (3,)), (2, (3,), None), (3, (2, 2), (2, 2)),
])
def test_coo_with_sparse_dim_zero(nnz: int, dense: tuple[int, ...],
                                  size: tuple[int, ...] | None) -> None:
    indices = torch.zeros(0, nnz, dtype=torch.int64)
    values = torch.arange(float(nnz * int(np.prod(dense)))).reshape(nnz, *dense)
    args = (indices, values) if size is None else (indices, values, size)
    theirs = _quiet(lambda: torch.sparse_coo_tensor(*args, check_invariants=True))
    ours = ss.sparse_coo_tensor(*args)
    _same(ours, theirs)
    assert ours.sparse_dim() == 0


def test_sparse_dim_zero_marked_coalesced_with_duplicates_is_refused() -> None:
    # every entry has the index (): two of them are duplicates (5.3)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor(torch.zeros(0, 2, dtype=torch.int64), torch.ones(2), (),
                             is_coalesced=True)
    assert excinfo.value.invariant == "5.3"
    one = ss.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.int64), torch.ones(1), (),
                               is_coalesced=True)
    assert ss.is_checked(one) and one.is_coalesced()


# --- floating and other index dtypes (COO) -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32,
                                   torch.int16, torch.uint8, torch.bool, torch.complex64])
def test_coo_indices_of_any_dtype_are_converted_like_torch(dtype: torch.dtype) -> None:
    indices = torch.tensor([[0, 1, 1], [1, 0, 1]]).to(dtype)
    values = torch.tensor([1.0, 2.0, 3.0])
    theirs = _quiet(lambda: torch.sparse_coo_tensor(indices, values, (3, 3)))
    ours = _quiet(lambda: ss.sparse_coo_tensor(indices, values, (3, 3)))
    _same(ours, theirs)
    assert ours._indices().dtype == torch.int64


def test_fractional_float_indices_truncate_like_torch() -> None:
    indices = torch.tensor([[0.5, 1.7, 2.9]])
    values = torch.tensor([1.0, 2.0, 3.0])
    _same(ss.sparse_coo_tensor(indices, values, (3,)),
          torch.sparse_coo_tensor(indices, values, (3,)))
    _same(ss.sparse_coo_tensor([[0.0, 2.0]], [1.0, 2.0]),
          torch.sparse_coo_tensor([[0.0, 2.0]], [1.0, 2.0]))


def test_float_indices_out_of_range_after_conversion_are_refused() -> None:
    for bad in (-1.0, 3.0, float("nan"), 1e30):
        with pytest.raises(ss.InvariantError) as excinfo:
            _quiet(lambda bad=bad: ss.sparse_coo_tensor(torch.tensor([[0.0, bad]]),
                                                        torch.ones(2), (3,)))
        assert excinfo.value.invariant in {"5.1", "5.2"}


# --- scalar values --------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda f: f(([0], [2]), 1.0),
    lambda f: f(([0], [2]), 7),
    lambda f: f(([0], [2]), True),
    lambda f: f(([0], [2]), torch.tensor(2.5)),
    lambda f: f(([0], [2]), 1.0, (3, 3)),
    lambda f: f(([0], [2]), 1.0, dtype=torch.float64),
    lambda f: f(torch.tensor([[1]]), torch.tensor(3.0), (4,)),
], ids=["float", "int", "bool", "0-d tensor", "size", "dtype", "1-d"])
def test_scalar_values_are_one_element(
        call: Callable[[Callable[..., torch.Tensor]], torch.Tensor]) -> None:
    _same(call(ss.sparse_coo_tensor), call(torch.sparse_coo_tensor))


def test_scalar_values_of_compressed_tensors_are_refused_as_by_torch() -> None:
    with pytest.raises(RuntimeError):
        _quiet(lambda: torch.sparse_csr_tensor([0, 1], [0], 1.0))
    with pytest.raises(ss.InvariantError):
        ss.sparse_csr_tensor([0, 1], [0], 1.0)


# --- sizes that are not sizes: torch's TypeError -------------------------------------------------

BAD_SIZES = [(1.5, 1), ("1", 1), (True, 1), "11", torch.tensor([1, 1]), 5, (None, 1),
             (torch.tensor(1.0), 1), np.array([1, 1]), range(1, 3), (np.float64(1), 1)]
GOOD_SIZES = [(1, 1), [1, 1], torch.Size([1, 1]), (np.int64(1), np.int32(1)), (1, True),
              (torch.tensor(1), 1), (torch.tensor(1, dtype=torch.int8), torch.tensor([1]))]


@pytest.mark.parametrize("size", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("layout", [CSR, CSC, BSR, BSC], ids=str)
def test_non_integral_sizes_raise_type_error_like_torch(size: Any, layout: torch.layout) -> None:
    blocked = layout in (BSR, BSC)
    values = torch.ones(1, 1, 1) if blocked else torch.ones(1)
    args = (torch.tensor([0, 1]), torch.tensor([0]), values, size)
    with pytest.raises(TypeError):
        _quiet(lambda: TORCH_COMPRESSED[layout](*args))
    with pytest.raises(TypeError, match="size"):
        SS_COMPRESSED[layout](*args)
    with pytest.raises(TypeError, match="size"):
        ss.sparse_compressed_tensor(*args, layout=layout)


@pytest.mark.parametrize("size", BAD_SIZES, ids=repr)
def test_non_integral_coo_sizes_raise_type_error_like_torch(size: Any) -> None:
    args = (torch.tensor([[0], [0]]), torch.ones(1), size)
    with pytest.raises(TypeError):
        _quiet(lambda: torch.sparse_coo_tensor(*args))
    with pytest.raises(TypeError, match="size"):
        ss.sparse_coo_tensor(*args)


@pytest.mark.parametrize("size", GOOD_SIZES, ids=repr)
def test_integral_sizes_are_accepted_like_torch(size: Any) -> None:
    args = (torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1), size)
    _same(ss.sparse_csr_tensor(*args), _quiet(lambda: torch.sparse_csr_tensor(*args)))
    coo = (torch.tensor([[0], [0]]), torch.ones(1), size)
    _same(ss.sparse_coo_tensor(*coo), _quiet(lambda: torch.sparse_coo_tensor(*coo)))


@given(st.lists(st.one_of(st.integers(0, 4), st.floats(0, 4), st.booleans(), st.text(max_size=1)),
                min_size=2, max_size=2))
def test_size_element_types_property(size: list[Any]) -> None:
    """Whatever the element types, safesparse and torch agree on TypeError or not."""
    coo = (torch.tensor([[0], [0]]), torch.ones(1), tuple(size))
    try:
        _quiet(lambda: torch.sparse_coo_tensor(*coo))
        torch_type_error = False
    except TypeError:
        torch_type_error = True
    except RuntimeError:
        torch_type_error = False
    try:
        ss.sparse_coo_tensor(*coo)
        ours = False
    except TypeError:
        ours = True
    except ss.InvariantError:
        ours = False
    assert ours == torch_type_error, size


# --- transposes are views where torch's are -----------------------------------------------------


def _csr(batch: tuple[int, ...] = ()) -> tuple[torch.Tensor, ss.SafeSparseTensor]:
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]]).expand(*batch, 2, 3).contiguous()
    plain = dense.to_sparse_csr()
    return plain, ss.validate(plain.clone())


TRANSPOSES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("transpose", lambda t: t.transpose(-2, -1)),
    ("torch.transpose", lambda t: torch.transpose(t, -1, -2)),
    ("swapaxes", lambda t: t.swapaxes(-2, -1)),
    ("swapdims", lambda t: torch.swapdims(t, -2, -1)),
    ("mT", lambda t: t.mT),
    ("mH", lambda t: t.mH),
    ("adjoint", lambda t: t.adjoint()),
]


@pytest.mark.parametrize(("name", "fn"), TRANSPOSES, ids=[n for n, _ in TRANSPOSES])
@pytest.mark.parametrize("batch", [(), (2,)], ids=str)
@pytest.mark.parametrize("layout", [CSR, CSC, BSR, BSC], ids=str)
def test_transposes_are_views_where_torch_s_are(
        name: str, fn: Callable[[torch.Tensor], torch.Tensor], batch: tuple[int, ...],
        layout: torch.layout) -> None:
    dense = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 4.0]]).expand(*batch, 2, 4)
    plain = dense.contiguous().to_sparse(layout=layout, blocksize=(1, 2) if layout in (BSR, BSC)
                                         else None)
    a = ss.validate(plain.clone())
    theirs, ours = fn(plain), fn(a)
    assert ours._is_view() == theirs._is_view()
    if theirs._is_view():
        assert ours._base is a
    assert isinstance(ours, ss.SafeSparseTensor) and ss.is_checked(ours)
    assert ours.layout == theirs.layout
    assert torch.equal(ours.to_dense(), theirs.to_dense())


def test_transpose_view_keeps_autograd_and_checked_state() -> None:
    _, a = _csr()
    a.requires_grad_(True)
    t = a.t()
    assert t._is_view() and t._base is a and ss.is_checked(t)
    (t.to_dense() * torch.arange(6.0).reshape(3, 2)).sum().backward()
    assert a.grad is not None


def test_write_through_a_transpose_view_unchecks_both() -> None:
    _, a = _csr()
    t = a.t()
    t.row_indices()[0] = 7  # a's col index, through the view
    assert not ss.is_checked(t) and not ss.is_checked(a)
    with pytest.raises(ss.InvariantError):
        ss.validate(a)


def test_coo_and_batch_transposes_are_views_like_torch() -> None:
    coo = torch.tensor([[1.0, 0.0], [2.0, 3.0]]).to_sparse()
    a = ss.validate(coo.clone())
    for fn in (lambda t: t.t(), lambda t: t.transpose(0, 1), lambda t: t.transpose(1, 1)):
        theirs, ours = fn(coo), fn(a)
        assert ours._is_view() == theirs._is_view() and (not ours._is_view() or ours._base is a)
        assert ss.is_checked(ours)
    _, b = _csr((2, 3))
    swapped = b.transpose(0, 1)
    assert swapped._is_view() and swapped._base is b and ss.is_checked(swapped)


def test_hybrid_transposes_stay_zero_copy_non_views() -> None:
    values = torch.ones(2, 3)
    a = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), values, (2, 2, 3))
    t = a.transpose(0, 1)
    assert t.layout == CSC and ss.is_checked(t) and not t._is_view()
    assert t.values().data_ptr() == values.data_ptr()


# --- check_invariants=False is documented plainly ----------------------------------------------


@pytest.mark.parametrize("factory", [ss.sparse_coo_tensor, ss.sparse_csr_tensor,
                                     ss.sparse_csc_tensor, ss.sparse_bsr_tensor,
                                     ss.sparse_bsc_tensor, ss.sparse_compressed_tensor],
                         ids=lambda f: f.__name__)
def test_factory_docstrings_say_what_check_invariants_false_means(
        factory: Callable[..., Any]) -> None:
    doc = " ".join((factory.__doc__ or "").split())
    assert " ".join(CHECK_INVARIANTS.split()) in doc  # the one text (tests/catalog/test_doctext.py)
    assert "``False`` keeps torch's meaning" in doc
    assert "*without* validation" in doc and "unchecked" in doc and "Enforce mode" in doc
    unchecked = factory(*((torch.tensor([[0, 1]]), torch.ones(2), (2,))
                          if factory is ss.sparse_coo_tensor else
                          (torch.tensor([0, 1]), torch.tensor([0]),
                           torch.ones(1, 1, 1) if "bs" in factory.__name__ else torch.ones(1),
                           (1, 1))),
                        check_invariants=False,
                        **({"layout": CSR} if factory is ss.sparse_compressed_tensor else {}))
    assert isinstance(unchecked, ss.SafeSparseTensor) and not ss.is_checked(unchecked)

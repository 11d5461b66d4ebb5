"""Zero-copy transposes of the two sparse dims (docs/ops.md): CSR <-> CSC, BSR <-> BSC.

Every transpose of the sparse dims of a checked compressed tensor must swap the layout, share
the index and values storage with its input (values of blocked layouts are the block-transposed
view), be checked without validation, and densify to the dense transpose. Batched (0-2 batch
dims) and hybrid (0-1 dense dims) tensors are covered, including hybrid transposes torch 2.13
itself refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.strategies import Case, compressed_cases

import safesparse as ss

CSR = torch.sparse_csr
CSC = torch.sparse_csc
BSR = torch.sparse_bsr
BSC = torch.sparse_bsc
COMPRESSED = (CSR, CSC, BSR, BSC)
BLOCKED = (BSR, BSC)
SWAPPED = {CSR: CSC, CSC: CSR, BSR: BSC, BSC: BSR}
NAMES = {CSR: "CSR", CSC: "CSC", BSR: "BSR", BSC: "BSC"}
BATCHES = [(), (2,), (2, 3)]
BLOCKSIZE = (2, 3)  # not square, so a block transpose that forgot to swap shows


# ---------------------------------------------------------------------------------------------
# Helpers


def members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(compressed, plain) index tensors of a compressed tensor."""
    if t.layout in (CSR, BSR):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def make_dense(
    batch: tuple[int, ...],
    n_dense: int,
    *,
    blocksize: tuple[int, int] = (1, 1),
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> torch.Tensor:
    """A dense tensor with the same block sparsity pattern in every batch (so nnz agrees)."""
    g = torch.Generator().manual_seed(seed)
    nrb, ncb = 3, 4
    b0, b1 = blocksize
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert mask.shape == (nrb, ncb)
    full = mask.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    shape = (*batch, nrb * b0, ncb * b1, *((2,) * n_dense))
    values = torch.randint(1, 9, shape, generator=g).to(torch.float64)
    if dtype.is_complex:
        imag = torch.randint(-4, 5, shape, generator=g).to(torch.float64)
        values = torch.complex(values, imag)
    return (values * full.reshape(full.shape + (1,) * n_dense)).to(dtype)


def to_layout(dense: torch.Tensor, layout: torch.layout, n_dense: int,
              blocksize: tuple[int, int] = BLOCKSIZE) -> torch.Tensor:
    if layout == CSR:
        return dense.to_sparse_csr(dense_dim=n_dense)
    if layout == CSC:
        return dense.to_sparse_csc(dense_dim=n_dense)
    if layout == BSR:
        return dense.to_sparse_bsr(blocksize, dense_dim=n_dense)
    return dense.to_sparse_bsc(blocksize, dense_dim=n_dense)


def build(layout: torch.layout, batch: tuple[int, ...], n_dense: int,
          dtype: torch.dtype = torch.float64, blocksize: tuple[int, int] = BLOCKSIZE,
          ) -> tuple[torch.Tensor, ss.SafeSparseTensor]:
    """(dense reference, checked SafeSparseTensor of ``layout``)."""
    dense = make_dense(batch, n_dense, dtype=dtype,
                       blocksize=blocksize if layout in BLOCKED else (1, 1))
    t = ss.validate(to_layout(dense, layout, n_dense, blocksize))
    assert ss.is_checked(t)
    return dense, t


Transpose = Callable[[torch.Tensor, int, int], torch.Tensor]

# (name, function of (tensor, M, N), applicable to hybrid, needs 2-D)
TRANSPOSES: list[tuple[str, Transpose, bool, bool]] = [
    ("transpose_negative", lambda t, m, n: t.transpose(-2 - n, -1 - n), True, False),
    ("transpose_positive", lambda t, m, n: t.transpose(m, m + 1), True, False),
    ("transpose_positive_reversed", lambda t, m, n: t.transpose(m + 1, m), True, False),
    ("transpose_mixed_signs", lambda t, m, n: t.transpose(m, -1 - n), True, False),
    ("torch.transpose", lambda t, m, n: torch.transpose(t, m, m + 1), True, False),
    ("torch.swapaxes", lambda t, m, n: torch.swapaxes(t, -2 - n, -1 - n), True, False),
    ("swapdims", lambda t, m, n: t.swapdims(m, m + 1), True, False),
    ("mT", lambda t, m, n: t.mT, False, False),
    ("t", lambda t, m, n: t.t(), False, True),
    ("torch.t", lambda t, m, n: torch.t(t), False, True),
]


def transpose_params() -> list[object]:
    params = []
    for layout in COMPRESSED:
        for batch in BATCHES:
            for n_dense in (0, 1):
                for name, fn, hybrid_ok, needs_2d in TRANSPOSES:
                    if (n_dense and not hybrid_ok) or (needs_2d and (batch or n_dense)):
                        continue
                    params.append(pytest.param(
                        layout, batch, n_dense, fn,
                        id=f"{NAMES[layout]}-batch{len(batch)}-dense{n_dense}-{name}",
                    ))
    return params


def assert_swapped_view(t: torch.Tensor, r: torch.Tensor, m: int) -> None:
    """``r`` is the zero-copy transpose of ``t`` (M = m batch dims)."""
    assert type(r) is ss.SafeSparseTensor
    assert r.layout == SWAPPED[t.layout]
    tc, tp = members(t)
    rc, rp = members(r)
    assert rc.data_ptr() == tc.data_ptr()
    assert rp.data_ptr() == tp.data_ptr()
    assert r.values().data_ptr() == t.values().data_ptr()
    if t.layout in BLOCKED:
        expected = t.values().transpose(m + 1, m + 2)
        assert r.values().shape == expected.shape
        assert r.values().stride() == expected.stride()
        assert r.values().shape[m + 1:m + 3] == t.values().shape[m + 1:m + 3][::-1]
        if t.values().is_contiguous() and r.values().shape[m + 1] != 1 \
                and r.values().shape[m + 2] != 1 and r.values().numel():
            assert not r.values().is_contiguous()
            assert r.values().transpose(m + 1, m + 2).is_contiguous()
    else:
        assert r.values().stride() == t.values().stride()
    size = list(t.shape)
    size[m], size[m + 1] = size[m + 1], size[m]
    assert tuple(r.shape) == tuple(size)


# ---------------------------------------------------------------------------------------------
# Every transpose spelling, every compressed layout, batched and hybrid


@pytest.mark.parametrize(("layout", "batch", "n_dense", "fn"), transpose_params())
def test_transpose_is_zero_copy_checked_view(
    layout: torch.layout, batch: tuple[int, ...], n_dense: int, fn: Transpose
) -> None:
    dense, t = build(layout, batch, n_dense)
    m = len(batch)
    ss.reset_stats()
    r = fn(t, m, n_dense)
    assert_swapped_view(t, r, m)
    assert ss.is_checked(r)
    assert ss.stats().validations == 0
    assert torch.equal(r.to_dense(), dense.transpose(m, m + 1))
    # Twice: the original layout, the original storage, the original content.
    rr = fn(r, m, n_dense)
    assert rr.layout == layout
    for a, b in zip(members(rr), members(t), strict=True):
        assert a.data_ptr() == b.data_ptr()
    assert rr.values().data_ptr() == t.values().data_ptr()
    assert rr.values().stride() == t.values().stride()
    assert torch.equal(rr.to_dense(), dense)
    assert ss.is_checked(rr)
    assert ss.stats().validations == 0


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("batch", [(), (2,)], ids=["2d", "batched"])
def test_adjoint_and_mH(layout: torch.layout, dtype: torch.dtype, batch: tuple[int, ...]) -> None:
    dense, t = build(layout, batch, 0, dtype)
    m = len(batch)
    ss.reset_stats()
    for r in (t.mH, t.adjoint(), torch.adjoint(t)):
        assert type(r) is ss.SafeSparseTensor
        assert r.layout == SWAPPED[layout]
        assert ss.is_checked(r)
        assert torch.equal(r.to_dense(), dense.mH)
        if not dtype.is_complex:
            assert_swapped_view(t, r, m)
    assert ss.stats().validations == 0
    if dtype.is_complex:
        # the values are conjugated copies; the input is untouched
        assert torch.equal(t.to_dense(), dense)


def test_complex_adjoint_shares_index_storage() -> None:
    _, t = build(CSR, (), 0, torch.complex128)
    r = t.mH
    rc, rp = members(r)
    tc, tp = members(t)
    assert rc.data_ptr() == tc.data_ptr()
    assert rp.data_ptr() == tp.data_ptr()


# ---------------------------------------------------------------------------------------------
# Results keep working


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
@pytest.mark.parametrize("batch", [(), (2,)], ids=["2d", "batched"])
@pytest.mark.parametrize("n_dense", [0, 1], ids=["plain", "hybrid"])
def test_transposed_results_keep_working(
    layout: torch.layout, batch: tuple[int, ...], n_dense: int
) -> None:
    dense, t = build(layout, batch, n_dense)
    m = len(batch)
    expected = dense.transpose(m, m + 1)
    r = t.transpose(m, m + 1)

    # 3.7 admits block-transposed values: a full validation of the plain view passes.
    ss.clear_cache()
    ss.reset_stats()
    plain = ss.unwrap(r)
    assert type(plain) is torch.Tensor
    # (sharing r's index memory: its validation proves r's view again, which the rest uses)
    v = ss.validate(plain, copy_indices=False)
    assert ss.stats().validations == 1
    assert torch.equal(v.to_dense(), expected)

    ss.reset_stats()
    c = r.clone()
    assert type(c) is ss.SafeSparseTensor
    assert ss.is_checked(c)
    assert torch.equal(c.to_dense(), expected)

    k = r.contiguous()
    assert type(k) is ss.SafeSparseTensor
    assert k.layout == r.layout
    assert k.values().is_contiguous()
    for a, b in zip(members(k), members(r), strict=True):
        assert a.data_ptr() == b.data_ptr()
    assert ss.is_checked(k)
    assert torch.equal(k.to_dense(), expected)
    if layout in BLOCKED:
        assert k.values().data_ptr() != r.values().data_ptr()  # a contiguous copy
    else:
        assert k is r  # already contiguous: nothing to do
    assert ss.stats().validations == 0


@pytest.mark.parametrize("layout", [CSR, CSC, BSC], ids=NAMES.get)  # results: CSC, CSR, BSR
def test_transposed_matmul_dense(layout: torch.layout) -> None:
    # BSC @ dense is not implemented by torch on CPU, so BSR inputs (BSC results) are skipped;
    # MKL needs square blocks.
    dense, t = build(layout, (), 0, blocksize=(2, 2))
    r = t.mT
    x = torch.randn(r.shape[-1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = r @ x
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, dense.mT @ x)


def test_bsr_transposed_twice_matmul() -> None:
    dense, t = build(BSR, (), 0, blocksize=(2, 2))
    x = torch.randn(t.shape[-1], 2, dtype=torch.float64)
    torch.testing.assert_close(t.mT.mT @ x, dense @ x)


# ---------------------------------------------------------------------------------------------
# Other dim pairs


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
@pytest.mark.parametrize("dims", [(0, 1), (0, 2), (-1, 0), (2, 0), (0, -2), (-3, -1)])
def test_batch_with_sparse_dim_is_refused(layout: torch.layout, dims: tuple[int, int]) -> None:
    _, t = build(layout, (2,), 0)
    with pytest.raises(RuntimeError, match=r"can only transpose dimensions of the same type"):
        t.transpose(*dims)


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
def test_batch_with_batch_keeps_torch_behaviour(layout: torch.layout) -> None:
    dense, t = build(layout, (2, 3), 0)
    plain = to_layout(dense, layout, 0)
    r = t.transpose(0, 1)
    expected = plain.transpose(0, 1)
    assert type(r) is ss.SafeSparseTensor
    assert r.layout == expected.layout == layout
    assert torch.equal(r.to_dense(), dense.transpose(0, 1))
    assert ss.is_checked(r)


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
def test_same_dim_transpose_is_identity(layout: torch.layout) -> None:
    dense, t = build(layout, (2,), 0)
    r = t.transpose(1, 1)
    assert r.layout == layout
    assert torch.equal(r.to_dense(), dense)


@pytest.mark.parametrize("layout", COMPRESSED, ids=NAMES.get)
def test_hybrid_transposes_that_torch_refuses(layout: torch.layout) -> None:
    dense, t = build(layout, (2,), 1)
    with pytest.raises(RuntimeError):
        ss.unwrap(t).transpose(1, 2)  # torch 2.13 itself: hybrid not supported
    r = t.transpose(1, 2)
    assert r.layout == SWAPPED[layout]
    assert torch.equal(r.to_dense(), dense.transpose(1, 2))


@pytest.mark.parametrize("dims", [
    (-3, -1),
    (2, 1),
    (0, 5),
    (0, -3),
])
def test_out_of_range_dims_raise_index_error_like_torch(dims: tuple[int, int]) -> None:
    _, t = build(CSR, (), 0)
    with pytest.raises(IndexError):
        ss.unwrap(t).transpose(*dims)
    with pytest.raises(IndexError):
        t.transpose(*dims)


# ---------------------------------------------------------------------------------------------
# COO


def test_coo_transpose_stays_checked() -> None:
    dense = make_dense((), 0)
    t = ss.validate(dense.to_sparse_coo())
    ss.reset_stats()
    for r in (t.t(), t.transpose(0, 1), t.mT, torch.transpose(t, -1, -2)):
        assert type(r) is ss.SafeSparseTensor
        assert r.layout == torch.sparse_coo
        assert ss.is_checked(r)
        assert torch.equal(r.to_dense(), dense.t())
    assert ss.stats().validations == 0


def test_coo_hybrid_transpose_of_sparse_dims() -> None:
    dense = make_dense((), 1)
    t = ss.validate(dense.to_sparse(sparse_dim=2))
    r = t.transpose(0, 1)
    assert ss.is_checked(r)
    assert torch.equal(r.to_dense(), dense.transpose(0, 1))


def test_unchecked_input_is_validated_before_the_transpose() -> None:
    dense, t = build(CSR, (), 0)
    c, p = members(t)
    u = ss.sparse_csr_tensor(c.clone(), p.clone(), t.values(), t.shape, check_invariants=False)
    assert not ss.is_checked(u)
    r = u.mT  # the guard validated u first
    assert type(r) is ss.SafeSparseTensor
    assert r.layout == CSC
    assert ss.is_checked(u) and ss.is_checked(r)
    assert torch.equal(r.to_dense(), dense.mT)
    bad_p = p.clone()
    bad_p[0] = 10**6
    bad = ss.sparse_csr_tensor(c.clone(), bad_p, t.values(), t.shape, check_invariants=False)
    with pytest.raises(ss.InvariantError, match="argument 0"):
        _ = bad.mT


# ---------------------------------------------------------------------------------------------
# Properties


@given(
    blocks=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    blocksize=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    batch=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**31 - 1),
    density=st.floats(0.0, 1.0),
)
def test_block_conversion_and_transpose_commute(
    blocks: tuple[int, int], blocksize: tuple[int, int], batch: tuple[int, ...],
    seed: int, density: float,
) -> None:
    """Seed 000: BSR((a, b)) then transpose == transpose then BSC((b, a))."""
    (nrb, ncb), (a, b) = blocks, blocksize
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(nrb, ncb, generator=g) < density)  # one pattern for every batch
    full = mask.repeat_interleave(a, 0).repeat_interleave(b, 1)
    dense = torch.randint(1, 9, (*batch, nrb * a, ncb * b), generator=g).double() * full
    t = ss.validate(dense.to_sparse_bsr((a, b)))
    ss.reset_stats()
    r = t.transpose(-2, -1)
    reference = dense.transpose(-2, -1).to_sparse_bsc((b, a))
    assert r.layout == BSC
    assert r.values().shape[-2:] == (b, a)
    assert torch.equal(r.to_dense(), reference.to_dense())
    assert torch.equal(r.to_dense(), dense.transpose(-2, -1))
    assert ss.is_checked(r)
    assert ss.stats().validations == 0


@given(
    layout=st.sampled_from(COMPRESSED),
    batch=st.sampled_from([(), (1,), (2,), (2, 1)]),
    n_dense=st.integers(0, 1),
    blocks=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    blocksize=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dtype=st.sampled_from([torch.float32, torch.int64, torch.complex64, torch.bool]),
    seed=st.integers(0, 2**31 - 1),
    density=st.floats(0.0, 1.0),
)
def test_transpose_property(
    layout: torch.layout, batch: tuple[int, ...], n_dense: int, blocks: tuple[int, int],
    blocksize: tuple[int, int], dtype: torch.dtype, seed: int, density: float,
) -> None:
    (nrb, ncb), (a, b) = blocks, (blocksize if layout in BLOCKED else (1, 1))
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(nrb, ncb, generator=g) < density)
    full = mask.repeat_interleave(a, 0).repeat_interleave(b, 1)
    full = full.reshape(full.shape + (1,) * n_dense)
    dense = (torch.randint(1, 9, (*batch, nrb * a, ncb * b, *((2,) * n_dense)), generator=g)
             * full).to(dtype)
    m = len(batch)
    t = ss.validate(to_layout(dense, layout, n_dense, (a, b)))
    ss.reset_stats()
    r = t.transpose(m, m + 1)
    assert_swapped_view(t, r, m)
    assert ss.is_checked(r)
    assert ss.stats().validations == 0
    assert torch.equal(r.to_dense(), dense.transpose(m, m + 1))
    back = r.transpose(m, m + 1)
    assert back.layout == layout
    assert torch.equal(back.to_dense(), dense)


@given(case=compressed_cases(max_batch_dims=2, max_dense_dims=1))
def test_transpose_property_on_factory_cases(case: Case) -> None:
    """int32/int64 indices, empty batches, nnz = 0, built by the safe factories."""
    t = case.ss_build()
    m = len(case.batch)
    ss.reset_stats()
    r = t.transpose(-2 - len(case.dense_size), -1 - len(case.dense_size))
    assert_swapped_view(t, r, m)
    assert ss.is_checked(r)
    assert ss.stats().validations == 0
    assert torch.equal(r.to_dense(), case.dense.transpose(m, m + 1))
    assert members(r)[0].dtype == case.compressed.dtype

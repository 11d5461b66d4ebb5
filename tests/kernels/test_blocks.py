"""The block kernels (safesparse.kernels.blocks) compute what the dense products compute.

Claims: for every compressed layout (CSR, CSC, BSR, BSC), square and non-square blocks, and
float32 / float64 / float16 / bfloat16, ``linear`` is ``x @ W.T``, ``linear_grad_input`` is
``g @ W`` (both variants of these batch-major products), ``linear_grad_values`` is the gradient
of ``sum(g * (x @ W.T))`` to the stored values (all three variants), and the ``matmul`` three
are ``A @ x``, ``A.T @ g`` and ``g @ x.T`` at the pattern; empty batches, empty patterns and
empty block rows / columns included; the formulas pass ``gradcheck`` in float64; results are
plain tensors, also in enforce mode. Each claim holds on both paths: the native kernels (where
built) and the torch-op kernels (``native.disabled()``); the variants of the torch-op kernels
are selected with the native path off.
Members are built here from a block mask (no torch sparse kernel in the reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import safesparse as ss
from safesparse.kernels import blocks as bk
from safesparse.kernels import native
from safesparse.kernels.pattern import Matrix, matrix

#: the kernel paths this machine has (the native one where the library was built)
PATHS = ["torch ops", *(["native"] if native.status().native else [])]

LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: relative tolerance of a result against the float64 product of the same (rounded) inputs
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class Pattern:
    """The members of a matrix of shape (n_rows, n_cols) with blocks (r, c), and its dense
    copy (float64)."""

    layout: torch.layout
    compressed: torch.Tensor
    plain: torch.Tensor
    values: torch.Tensor
    n_rows: int
    n_cols: int
    dense: torch.Tensor

    def matrix(self, values: torch.Tensor | None = None) -> Matrix:
        """The kernels' description of this matrix (with ``values`` instead of its own)."""
        return matrix(self.layout, self.compressed, self.plain,
                      self.values if values is None else values, self.n_rows, self.n_cols)


def pattern(layout: torch.layout, mask: torch.Tensor, block: tuple[int, int],
            dtype: torch.dtype = torch.float64, seed: int = 0) -> Pattern:
    """Members of the matrix whose stored blocks are ``mask``'s True entries."""
    r, c = block if layout in (torch.sparse_bsr, torch.sparse_bsc) else (1, 1)
    nbr, nbc = mask.shape
    gen = torch.Generator().manual_seed(seed)
    by_rows = layout in (torch.sparse_csr, torch.sparse_bsr)
    stored = mask if by_rows else mask.T
    compressed = torch.zeros(stored.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(stored.sum(1), 0, out=compressed[1:])
    nz = stored.nonzero()
    plain = nz[:, 1].clone()
    nnzb = nz.shape[0]
    blocks = torch.randn(nnzb, r, c, generator=gen, dtype=torch.float64).to(dtype)
    dense = torch.zeros(nbr, r, nbc, c, dtype=torch.float64)
    rows, cols = (nz[:, 0], nz[:, 1]) if by_rows else (nz[:, 1], nz[:, 0])
    dense[rows, :, cols, :] = blocks.double()
    values = blocks if layout in (torch.sparse_bsr, torch.sparse_bsc) else blocks.view(-1)
    return Pattern(layout, compressed, plain, values, nbr * r, nbc * c,
                   dense.view(nbr * r, nbc * c))


def random_mask(nbr: int, nbc: int, density: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(nbr, nbc, generator=gen) < density


def values_grad_reference(p: Pattern, full: torch.Tensor) -> torch.Tensor:
    """``full`` (a dense gradient of the whole matrix) read at the stored entries, in the
    values' order and shape."""
    r, c = (p.values.shape[1], p.values.shape[2]) if p.values.dim() == 3 else (1, 1)
    nbr, nbc = p.n_rows // r, p.n_cols // c
    by_rows = p.layout in (torch.sparse_csr, torch.sparse_bsr)
    counts = p.compressed.diff()
    outer = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    rows, cols = (outer, p.plain) if by_rows else (p.plain, outer)
    blocks = full.view(nbr, r, nbc, c)[rows, :, cols, :]
    return blocks.reshape(p.values.shape)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert type(actual) is torch.Tensor
    assert actual.dtype == dtype
    assert actual.shape == expected.shape
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=0.0, atol=RTOL[dtype] * scale * 8)


def check_all(p: Pattern, batch: int, dtype: torch.dtype, seed: int = 1) -> None:
    """Every kernel of ``p`` against the dense float64 products of the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, p.n_cols, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(batch, p.n_rows, generator=gen, dtype=torch.float64).to(dtype)
    w, xd, gd = p.dense, x.double(), g.double()
    m = p.matrix()
    close(bk.linear(m, x), xd @ w.T, dtype)
    close(bk.linear_grad_input(m, g), gd @ w, dtype)
    close(bk.linear_grad_values(m, g, x), values_grad_reference(p, gd.T @ xd), dtype)
    xm, gm = x.T.contiguous(), g.T.contiguous()
    close(bk.matmul(m, xm), w @ xm.double(), dtype)
    close(bk.matmul_grad_input(m, gm), w.T @ gm.double(), dtype)
    close(bk.matmul_grad_values(m, gm, xm),
          values_grad_reference(p, gm.double() @ xm.double().T), dtype)


#: the thresholds (_DENSE_GRAD_FROM, _BMM_FROM_BLOCK) that select each values-gradient variant
GRAD_VARIANTS = {"dot products": (2.0, 10**9), "batched GEMM": (2.0, 1), "dense GEMM": (0.0, 1)}


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on each kernel path."""
    if request.param == "native":
        yield "native"
    else:
        with native.disabled():
            yield "torch ops"


@pytest.fixture(params=list(GRAD_VARIANTS))
def grad_variant(request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test under each variant of the torch-op values gradient (chosen by stored
    fraction and block size), the native path off."""
    dense_from, bmm_from = GRAD_VARIANTS[request.param]
    monkeypatch.setattr(bk, "_DENSE_GRAD_FROM", dense_from)
    monkeypatch.setattr(bk, "_BMM_FROM_BLOCK", bmm_from)
    with native.disabled():
        yield str(request.param)


SHAPES = [(torch.sparse_csr, (1, 1)), (torch.sparse_csc, (1, 1))] + [
    (layout, block) for layout in (torch.sparse_bsr, torch.sparse_bsc)
    for block in [(2, 2), (2, 3), (3, 1), (1, 1)]]


#: the thresholds (_SEGMENT_BELOW, _SEGMENT_FROM_BLOCK) that select each batch-major product
PRODUCT_VARIANTS = {"bag sums": (0.0, 1), "block segments": (2.0, 1)}


@pytest.fixture(params=list(PRODUCT_VARIANTS))
def product_variant(request: pytest.FixtureRequest,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test under each variant of the torch-op batch-major products (``linear``, its
    gradient to the input), the native path off."""
    below, from_block = PRODUCT_VARIANTS[request.param]
    monkeypatch.setattr(bk, "_SEGMENT_BELOW", below)
    monkeypatch.setattr(bk, "_SEGMENT_FROM_BLOCK", from_block)
    with native.disabled():
        yield str(request.param)


def mask_with_empty_lines() -> torch.Tensor:
    mask = random_mask(5, 4, 0.45, seed=3)
    mask[2, :] = False      # an empty block row
    mask[:, 1] = False      # an empty block column
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("layout", "block"), SHAPES, ids=str)
def test_every_kernel_matches_dense(layout: torch.layout, block: tuple[int, int],
                                    dtype: torch.dtype, path: str) -> None:
    check_all(pattern(layout, mask_with_empty_lines(), block, dtype), batch=7, dtype=dtype)


@pytest.mark.parametrize(("layout", "block"), SHAPES, ids=str)
def test_every_variant_matches_dense(layout: torch.layout, block: tuple[int, int],
                                     grad_variant: str, product_variant: str) -> None:
    check_all(pattern(layout, mask_with_empty_lines(), block), batch=7, dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_empty_batch_and_empty_pattern(layout: torch.layout, path: str) -> None:
    block = (2, 3)
    full = pattern(layout, random_mask(3, 2, 0.6, seed=4), block)
    check_all(full, batch=0, dtype=torch.float32)
    empty = pattern(layout, torch.zeros(3, 2, dtype=torch.bool), block)
    assert empty.plain.numel() == 0
    check_all(empty, batch=5, dtype=torch.float32)
    check_all(empty, batch=0, dtype=torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_batch_in_chunks(layout: torch.layout, monkeypatch: pytest.MonkeyPatch,
                        product_variant: str) -> None:
    """The batch is cut into chunks (``_CHUNK`` columns); partial last chunks included."""
    monkeypatch.setattr(bk, "_CHUNK", 3)
    p = pattern(layout, random_mask(4, 3, 0.5, seed=9), (2, 3))
    for batch in (3, 7):
        check_all(p, batch=batch, dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_int32_indices(layout: torch.layout, path: str) -> None:
    p = pattern(layout, random_mask(4, 4, 0.5, seed=5), (2, 2), torch.float32)
    p.compressed, p.plain = p.compressed.int(), p.plain.int()
    check_all(p, batch=3, dtype=torch.float32)


class _Linear(torch.autograd.Function):
    """``x @ W.T`` through the kernels, backward through the kernels: what gradcheck checks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, values: torch.Tensor, p: Pattern) -> torch.Tensor:
        ctx.save_for_backward(x, values)
        ctx.p = p
        return bk.linear(p.matrix(values), x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, values = ctx.saved_tensors
        p = ctx.p
        m = p.matrix(values)
        return bk.linear_grad_input(m, g), bk.linear_grad_values(m, g, x), None


class _Matmul(torch.autograd.Function):
    """``A @ x`` through the kernels, backward through the kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, values: torch.Tensor, p: Pattern) -> torch.Tensor:
        ctx.save_for_backward(x, values)
        ctx.p = p
        return bk.matmul(p.matrix(values), x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, values = ctx.saved_tensors
        p = ctx.p
        m = p.matrix(values)
        return bk.matmul_grad_input(m, g), bk.matmul_grad_values(m, g, x), None


@pytest.mark.parametrize("block", [(2, 2), (1, 3)], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_gradcheck_float64(layout: torch.layout, block: tuple[int, int],
                           grad_variant: str) -> None:
    check_gradients(layout, block)


def check_gradients(layout: torch.layout, block: tuple[int, int]) -> None:
    """gradcheck of both products (x and the values) of a float64 matrix of ``layout``."""
    p = pattern(layout, random_mask(3, 3, 0.5, seed=6), block)
    values = p.values.clone().requires_grad_(True)
    x = torch.randn(4, p.n_cols, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, v: _Linear.apply(a, v, p), (x, values),
                                    fast_mode=True)
    xm = torch.randn(p.n_cols, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, v: _Matmul.apply(a, v, p), (xm, values),
                                    fast_mode=True)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_gradients_equal_dense_autograd(layout: torch.layout, path: str) -> None:
    p = pattern(layout, random_mask(4, 3, 0.5, seed=7), (3, 2))
    x = torch.randn(5, p.n_cols, dtype=torch.float64, requires_grad=True)
    values = p.values.clone().requires_grad_(True)
    _Linear.apply(x, values, p).pow(2).sum().backward()
    # dense autograd: the same weight built from the values with differentiable indexing
    r, c = (3, 2) if values.dim() == 3 else (1, 1)
    counts = p.compressed.diff()
    outer = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    by_rows = layout in (torch.sparse_csr, torch.sparse_bsr)
    rows, cols = (outer, p.plain) if by_rows else (p.plain, outer)
    x2 = x.detach().clone().requires_grad_(True)
    v2 = p.values.clone().requires_grad_(True)
    w = torch.zeros(p.n_rows // r, r, p.n_cols // c, c, dtype=torch.float64)
    w[rows, :, cols, :] = v2.view(-1, r, c)
    (x2 @ w.view(p.n_rows, p.n_cols).T).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(values.grad, v2.grad)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_plain_results_in_enforce_mode(layout: torch.layout, path: str) -> None:
    p = pattern(layout, random_mask(3, 3, 0.5, seed=8), (2, 2), torch.float32)
    with ss.enforce():
        check_all(p, batch=4, dtype=torch.float32)


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), r=st.integers(1, 3), c=st.integers(1, 3),
       nbr=st.integers(1, 4), nbc=st.integers(1, 4), batch=st.integers(0, 3),
       density=st.sampled_from([0.0, 0.3, 0.7, 1.0]), seed=st.integers(0, 2**16),
       variant=st.sampled_from(list(GRAD_VARIANTS)),
       product=st.sampled_from(list(PRODUCT_VARIANTS)))
def test_random_patterns(layout: torch.layout, r: int, c: int, nbr: int, nbc: int, batch: int,
                         density: float, seed: int, variant: str, product: str) -> None:
    names = ("_DENSE_GRAD_FROM", "_BMM_FROM_BLOCK", "_SEGMENT_BELOW", "_SEGMENT_FROM_BLOCK")
    old = [getattr(bk, name) for name in names]
    for name, value in zip(names, GRAD_VARIANTS[variant] + PRODUCT_VARIANTS[product],
                           strict=True):
        setattr(bk, name, value)
    try:
        p = pattern(layout, random_mask(nbr, nbc, density, seed), (r, c), seed=seed)
        check_all(p, batch=batch, dtype=torch.float64, seed=seed + 1)      # native, where built
        with native.disabled():
            check_all(p, batch=batch, dtype=torch.float64, seed=seed + 1)
    finally:
        for name, value in zip(names, old, strict=True):
            setattr(bk, name, value)

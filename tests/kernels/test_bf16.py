"""bfloat16 computed in bfloat16 (csrc/kern_bf16.h, issue 45 item 3).

Claims: on a CPU with AVX512_BF16 the three products of a ``SparseLinear`` (forward with and
without bias, gradient to the input, gradient to the values: batch-major operands) and of a
``SparseMatmul`` (``A @ x``, ``A.T @ g``, the values gradient: feature-major operands) of a BSR
or BSC matrix run in the bfloat16 kernels, with no float32 copy of the values, the input or the
gradient (the float32 entry points and the float32 widening are never called), for every block
shape (16 x 16, 32 x 32, 8 x 8, odd and non-square, a block taller than 16 rows and not a
multiple of 16) and batches 1, 2, 3, 8, 16, 17, 31, 32, 33, 255, 1100 and 4096 (the values
gradient in several passes of batch rows, its sums carried in float32 between them). On every
path (the bfloat16 kernels, the float32 native route where the instruction set has no bfloat16
dot products, the torch-op kernels of ``SAFESPARSE_NATIVE=0``) each result equals the float64
dense product of the same bfloat16 inputs within bfloat16 rounding (half a unit in the last
place of the result, plus float32 accumulation). A bfloat16 layer's eager fast path runs the
same bfloat16 kernel through ``ss_product_packed`` (no float32 copy of its input per call), and
reads values trained in place without a new plan. A block index out of range (index members
written while a product runs) makes the bfloat16 kernels raise, never read out of bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from test_blocks import Pattern, pattern, values_grad_reference
from test_native import _mask

from safesparse.kernels import blocks as bk
from safesparse.kernels import native

ROOT = Path(__file__).resolve().parents[2]
BUILT = native.status().native
BF16 = BUILT and native.reads_bf16(torch.bfloat16, torch.sparse_bsr)
needs_bf16 = pytest.mark.skipif(not BF16, reason="no AVX512_BF16 kernels on this machine "
                                f"({native.status().describe()})")
BATCHES = (1, 2, 3, 8, 16, 17, 31, 32, 33, 255, 1100, 4096)
LAYOUTS = (torch.sparse_bsr, torch.sparse_bsc)
BLOCKS = [(16, 16), (32, 32), (8, 8), (16, 8), (5, 17), (2, 3), (24, 20)]


def _avx512_without_bf16() -> AbstractContextManager[None]:
    """The float32 native route (the instruction set limited to AVX2: no bfloat16 dot
    products), restored after."""
    from contextlib import contextmanager

    @contextmanager
    def limited() -> Iterator[None]:
        lib = native._lib
        saved = int(lib.ss_isa())
        lib.ss_select_isa(1)
        try:
            yield
        finally:
            lib.ss_select_isa(saved)
    return limited()


PATHS: dict[str, Callable[[], AbstractContextManager[None]]] = {"torch ops": native.disabled}
if BUILT:
    PATHS["native"] = nullcontext
    PATHS["native, no bf16 instructions"] = _avx512_without_bf16


def _within_bf16(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor,
                 rounded: torch.Tensor | None = None) -> None:
    """``actual`` (bfloat16) is ``expected`` (float64) rounded to bfloat16: within half a unit
    in the last place (2^-9 relative, 2^-8 allowed) plus the float32 sums' error (bounded by
    2^-20 times the sum of the terms' magnitudes), plus half a unit of ``rounded`` where an
    intermediate result was rounded to bfloat16 too."""
    assert type(actual) is torch.Tensor
    assert actual.dtype == torch.bfloat16
    assert actual.shape == expected.shape
    err = (actual.double() - expected).abs()
    bound = expected.abs() * 2.0**-8 + magnitude * 2.0**-20 + 1e-30
    if rounded is not None:
        bound = bound + rounded.abs() * 2.0**-8
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"off by {worst:.2f}x bf16 rounding"


def _check_products(p: Pattern, batch: int, seed: int = 1, bias_after: bool = False) -> None:
    """SparseLinear's and SparseMatmul's products against float64; ``bias_after``: the bias is
    added to the product rounded to bfloat16 (the torch-op kernels), not in its float32 sums."""
    gen = torch.Generator().manual_seed(seed + batch)
    x = torch.randn(batch, p.n_cols, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    g = torch.randn(batch, p.n_rows, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    b = torch.randn(p.n_rows, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    w, xd, gd, bd = p.dense, x.double(), g.double(), b.double()
    aw, ax, ag = w.abs(), xd.abs(), gd.abs()
    m = p.matrix()
    _within_bf16(bk.linear(m, x), xd @ w.T, ax @ aw.T)
    _within_bf16(bk.linear(m, x, bias=b), xd @ w.T + bd, ax @ aw.T + bd.abs(),
                 xd @ w.T if bias_after else None)
    _within_bf16(bk.linear_grad_input(m, g), gd @ w, ag @ aw)
    _within_bf16(bk.linear_grad_values(m, g, x),
                 values_grad_reference(p, gd.T @ xd), values_grad_reference(p, ag.T @ ax))
    # SparseMatmul's products: feature-major operands (n_cols, N), (n_rows, N)
    xm, gm = x.T.contiguous(), g.T.contiguous()
    _within_bf16(bk.matmul(m, xm), w @ xd.T, aw @ ax.T)
    _within_bf16(bk.matmul_grad_input(m, gm), w.T @ gd.T, aw.T @ ag.T)
    _within_bf16(bk.matmul_grad_values(m, gm, xm),
                 values_grad_reference(p, gd.T @ xd), values_grad_reference(p, ag.T @ ax))


@pytest.fixture
def no_float32_copies(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The float32 entry points, the float32 widening and the torch-op kernels fail if called;
    counts the bfloat16 kernels' calls."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a float32 route ran")
    for name in ("_batch_product", "_apply", "_values_grad"):
        monkeypatch.setattr(bk, name, refuse)
    monkeypatch.setattr(native, "_widened", refuse)
    monkeypatch.setattr(native._lib, "ss_product", refuse)
    monkeypatch.setattr(native._lib, "ss_values_grad", refuse)
    calls = {"ss_product_bf16": 0, "ss_values_grad_bf16": 0}
    for name in calls:
        entry = getattr(native._lib, name)

        def counted(*args: Any, _entry: Any = entry, _name: str = name) -> Any:
            calls[_name] += 1
            return _entry(*args)
        monkeypatch.setattr(native._lib, name, counted)
    return calls


@needs_bf16
@pytest.mark.parametrize(("block"), BLOCKS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bf16_kernels_no_float32_copy(layout: torch.layout, block: tuple[int, int],
                                      no_float32_copies: dict[str, int]) -> None:
    p = pattern(layout, _mask(block), block, torch.bfloat16)
    for batch in BATCHES:
        _check_products(p, batch)
    assert no_float32_copies["ss_product_bf16"] == 5 * len(BATCHES)
    assert no_float32_copies["ss_values_grad_bf16"] == 2 * len(BATCHES)


@needs_bf16
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_small_batch_tiles_every_batch(layout: torch.layout,
                                       no_float32_copies: dict[str, int]) -> None:
    """16 x 16 blocks at every batch from 1 to 33 (the small-batch tiles: the forward's, M's
    rows contiguous; the gradient to the input's, M = W.T read in place, its pairs interleaved
    in registers; each with 1 to 16 batch rows per tile and the pairs split over chains), then
    the larger tiles at 255 and 4096: a pattern with an empty block row and column, and one
    with many blocks per row."""
    from test_blocks import random_mask

    for mask in (_mask((16, 16)), random_mask(6, 9, 0.6, seed=11)):
        p = pattern(layout, mask, (16, 16), torch.bfloat16, seed=9)
        for batch in (*range(1, 34), 255, 4096):
            _check_products(p, batch, seed=2)
    assert no_float32_copies["ss_product_bf16"] == 5 * 2 * 35


@needs_bf16
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_row_tiles_and_block_row_groups(layout: torch.layout,
                                        no_float32_copies: dict[str, int]) -> None:
    """The row-tiled product (batch-major, past the small-batch tiles): blocks packed by groups
    of block rows of at most 512 KiB (32 x 32 blocks, ~340 of them: two groups, the second
    starting mid-matrix), tiles of 32 batch rows with a short last one, and with two threads
    tiles of 8 to 32 rows (few tiles for two threads at 40 rows)."""
    from test_blocks import random_mask

    p = pattern(layout, random_mask(24, 20, 0.7, seed=5), (32, 32), torch.bfloat16, seed=3)
    assert p.values.shape[0] * 32 * 32 * 2 > 512 << 10
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            native._lib.ss_reset_backoff()
            for batch in (33, 40, 100):
                _check_products(p, batch, seed=4)
    finally:
        torch.set_num_threads(saved)
    assert no_float32_copies["ss_product_bf16"] == 5 * 2 * 3


@pytest.mark.parametrize("path", list(PATHS), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_path_within_bf16_rounding(layout: torch.layout, path: str) -> None:
    for block in ((16, 16), (5, 17)):
        p = pattern(layout, _mask(block), block, torch.bfloat16, seed=3)
        with PATHS[path]():
            for batch in BATCHES:
                _check_products(p, batch, seed=5, bias_after=path == "torch ops")


def _within_f32(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> None:
    """``actual`` (float32) is ``expected`` (float64) up to float32 sums: within 2^-16 of the
    terms' magnitudes, far inside a bfloat16 rounding (2^-9 of the result): not rounded to
    bfloat16 on the way."""
    assert type(actual) is torch.Tensor
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    err = (actual.double() - expected).abs()
    worst = float((err / (magnitude * 2.0**-16 + 1e-30)).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"off by {worst:.2f}x float32 sums"


@pytest.mark.parametrize("path", list(PATHS), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_gradients_in_float32_from_bf16(layout: torch.layout, path: str) -> None:
    """``linear_grad_input`` / ``linear_grad_values`` of bfloat16 operands with ``dtype``
    float32 (a float32 layer's gradients under bfloat16 autocast): the float32 sums as they
    are, not a bfloat16 result widened, on every path (the bfloat16 kernels write float32
    directly), every tile (small batches, the packed tiles, several passes of the values
    gradient); and the packed forward entry writes float32 too."""
    for block in ((16, 16), (5, 17)):
        p = pattern(layout, _mask(block), block, torch.bfloat16, seed=4)
        m, w = p.matrix(), p.dense
        with PATHS[path]():
            for batch in (1, 2, 3, 8, 16, 17, 31, 32, 33, 255, 1100):
                gen = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, p.n_cols, generator=gen).to(torch.bfloat16)
                g = torch.randn(batch, p.n_rows, generator=gen).to(torch.bfloat16)
                xd, gd = x.double(), g.double()
                _within_f32(bk.linear_grad_input(m, g, dtype=torch.float32), gd @ w,
                            gd.abs() @ w.abs())
                _within_f32(bk.linear_grad_values(m, g, x, dtype=torch.float32),
                            values_grad_reference(p, gd.T @ xd),
                            values_grad_reference(p, gd.abs().T @ xd.abs()))
                assert bk.linear_grad_input(m, g).dtype == torch.bfloat16


@pytest.mark.parametrize("path", list(PATHS), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rounded_gradients_are_the_cast_bits(layout: torch.layout, path: str) -> None:
    """``rounded=True`` with ``dtype`` float32 (a float32 layer's gradients under bfloat16
    autocast, as the fast path computes them): bit for bit the bfloat16 result cast to
    float32, on every path (the bfloat16 kernels round and widen in their stores; elsewhere
    the cast), every tile (small batches, the packed tiles, several passes of the values
    gradient), an empty batch; and the rounding is not a no-op (it differs from the float32
    sums)."""
    for block in ((16, 16), (5, 17)):
        p = pattern(layout, _mask(block), block, torch.bfloat16, seed=6)
        m = p.matrix()
        with PATHS[path]():
            for batch in (0, 1, 2, 3, 8, 16, 17, 31, 32, 33, 255, 1100):
                gen = torch.Generator().manual_seed(batch)
                x = torch.randn(batch, p.n_cols, generator=gen).to(torch.bfloat16)
                g = torch.randn(batch, p.n_rows, generator=gen).to(torch.bfloat16)
                f32 = torch.float32
                for got, want, sums in (
                        (bk.linear_grad_input(m, g, dtype=f32, rounded=True),
                         bk.linear_grad_input(m, g).to(f32), bk.linear_grad_input(m, g, dtype=f32)),
                        (bk.linear_grad_values(m, g, x, dtype=f32, rounded=True),
                         bk.linear_grad_values(m, g, x).to(f32),
                         bk.linear_grad_values(m, g, x, dtype=f32))):
                    assert got.dtype == f32 and got.shape == want.shape
                    assert torch.equal(got, want)
                    if batch >= 8:
                        assert not torch.equal(got, sums)


@needs_bf16
def test_packed_bf16_product_writes_float32() -> None:
    """``pack_product`` of a bfloat16 product with a float32 output: ``ss_product_packed``
    writes the float32 sums (slot 18: float32)."""
    import ctypes

    p = pattern(torch.sparse_bsr, _mask((16, 16)), (16, 16), torch.bfloat16, seed=6)
    b = torch.randn(p.n_rows).to(torch.bfloat16)
    packed = native.pack_product(p.matrix(), True, torch.bfloat16, torch.float32, bias=b)
    assert packed is not None
    args, _keep = packed
    for batch in (1, 9, 40):
        x = torch.randn(batch, p.n_cols).to(torch.bfloat16)
        y = torch.empty(batch, p.n_rows)
        args[native.SLOT_X], args[native.SLOT_N] = x.data_ptr(), batch
        args[native.SLOT_Y] = y.data_ptr()
        assert native.packed_entry()(ctypes.addressof(args)) == 0
        xd = x.double()
        _within_f32(y, xd @ p.dense.T + b.double(), xd.abs() @ p.dense.abs().T + b.double().abs())


@pytest.mark.parametrize("path", list(PATHS), ids=str)
def test_bias_grad_sums_columns(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bias_grad`` of a bfloat16 gradient (the native column sums from 2048 rows where the
    bfloat16 kernels run, here from 1 row): ``g.sum(0)`` within bfloat16 rounding of float64,
    or within float32 sums with ``dtype`` float32; widths with masked tails and several
    256-column tasks, row strides wider than a row, every batch from the list."""
    calls = 0
    entry = native.colsum_bf16

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return entry(*args)
    monkeypatch.setattr(native, "colsum_bf16", counted)
    monkeypatch.setattr(bk, "NATIVE_SUM_ROWS", 1)
    with PATHS[path]():
        for batch in (0, 1, 2, 3, 8, 16, 17, 31, 32, 33, 64, 255, 4096):
            for width, pad in ((1024, 0), (1000, 24), (5, 0), (300, 3)):
                gen = torch.Generator().manual_seed(batch + width)
                g = torch.randn(batch, width + pad, generator=gen).to(torch.bfloat16)
                g = g[:, pad:]
                gd = g.double()
                ref, mag = gd.sum(0), gd.abs().sum(0)
                _within_bf16(bk.bias_grad(g), ref, mag)
                _within_f32(bk.bias_grad(g, dtype=torch.float32), ref, mag)
    if path == "torch ops":
        assert calls == 0
    elif path == "native" and BF16:
        assert calls == 12 * 4 * 2  # (every batch but 0 x 4 widths x 2 dtypes)


@needs_bf16
def test_bias_grad_of_few_rows_is_torch_sum() -> None:
    """Below ``NATIVE_SUM_BELOW`` rows ``bias_grad`` sums natively (the eager fast path's packed
    backward too): torch's ``g.sum(0)`` of so few rows adds them in order from zero in float32,
    so the bits are torch's (rounded to bfloat16 once; the rounded float32 output, the bfloat16
    sums widened; with ``dtype`` float32, torch's unrounded sums). Data whose sums depend on the
    order
    (magnitudes over many octaves): a torch whose sum changed order would fail here."""
    for n in range(1, bk.NATIVE_SUM_BELOW):
        assert bk.native_bias_sum(n)
        for seed in range(20):
            gen = torch.Generator().manual_seed(seed * 100 + n)
            scale = torch.exp(torch.randn(n, 300, generator=gen) * 4)
            g = (torch.randn(n, 300, generator=gen) * scale).to(torch.bfloat16)
            assert torch.equal(bk.bias_grad(g), g.sum(0))
            assert torch.equal(bk.bias_grad(g, dtype=torch.float32),
                               g.sum(0, dtype=torch.float32))
            rounded = native.colsum_bf16(g, torch.float32, rounded=True)
            assert rounded is not None and torch.equal(rounded, g.sum(0).float())
    assert not bk.native_bias_sum(0) and not bk.native_bias_sum(bk.NATIVE_SUM_BELOW)


@needs_bf16
def test_strided_operands_and_two_threads() -> None:
    """Operands that are views (rows of a larger tensor, a transposed copy's transpose: the
    latter not batch-major, so the float32 route), values with a stride, two threads."""
    p = pattern(torch.sparse_bsr, _mask((16, 16)), (16, 16), torch.bfloat16, seed=7)
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(300, p.n_cols + 16, generator=gen).to(torch.bfloat16)
    x = big[:, 16:]                                  # rows with a larger stride
    xt = x.t().contiguous().t()                      # features strided: not batch-major
    wide = torch.randn(p.values.shape[0], 16, 32, generator=gen).to(torch.bfloat16)
    wide[:, :, ::2] = p.values
    values = wide[:, :, ::2]                         # a strided view of the same values
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            native._lib.ss_reset_backoff()
            for operand in (x, xt):
                for vals in (p.values, values):
                    xd = operand.double()
                    _within_bf16(bk.linear(p.matrix(vals), operand), xd @ p.dense.T,
                                 xd.abs() @ p.dense.abs().T)
    finally:
        torch.set_num_threads(saved)


def test_sparse_linear_trains_in_bf16() -> None:
    """A bfloat16 ``SparseLinear``'s gradients (input, values, bias) are dense autograd's of the
    same bfloat16 weight, within bfloat16 rounding."""
    from torch import nn

    from safesparse.nn import SparseLinear

    torch.manual_seed(0)
    dense = nn.Linear(64, 48).to(torch.bfloat16)
    layer = SparseLinear.from_dense(dense, 16, 0.5)
    w = layer.weight.to_dense().detach().double()
    x = torch.randn(37, 64).to(torch.bfloat16).requires_grad_()
    g = torch.randn(37, 48).to(torch.bfloat16)
    y = layer(x)
    y.backward(g)
    xd, gd = x.detach().double(), g.double()
    assert layer.bias is not None and layer.values.grad is not None and x.grad is not None
    _within_bf16(y.detach(), xd @ w.T + layer.bias.detach().double(),
                 xd.abs() @ w.abs().T + layer.bias.detach().double().abs())
    _within_bf16(x.grad, gd @ w, gd.abs() @ w.abs())
    full = (gd.T @ xd).view(3, 16, 4, 16).transpose(1, 2)
    fabs = (gd.abs().T @ xd.abs()).view(3, 16, 4, 16).transpose(1, 2)
    rows = torch.repeat_interleave(layer.compressed_indices.diff())
    cols = layer.plain_indices
    _within_bf16(layer.values.grad, full[rows, cols], fabs[rows, cols])


@needs_bf16
def test_eager_fast_path_runs_the_bf16_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 ``SparseLinear``'s plan packs the bfloat16 product (slot 23: bfloat16): its
    forward equals the proving path's bit for bit, never widens the input, and keeps holding
    (reading the new values) after an in-place update of the values."""
    from torch import nn

    from safesparse.nn import SparseLinear, eager
    from safesparse.nn import plan as plan_mod

    torch.manual_seed(4)
    layer = SparseLinear.from_dense(nn.Linear(96, 80).to(torch.bfloat16), 16, 0.4)
    x = torch.randn(33, 96).to(torch.bfloat16)
    with torch.no_grad():
        first = layer(x)                          # the proving call, then a plan
        plan = eager.plan_of(layer)
        assert plan is not None and plan.x_dtype == torch.bfloat16 and plan.kind == plan_mod._DIRECT
        assert plan.args[23] == native._DTYPES[torch.bfloat16]
        monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("a copy per call"))
        fast = layer(x)
        monkeypatch.undo()
        assert torch.equal(fast, first)
        layer.values.mul_(2)                      # an optimizer's in-place step
        again = layer(x)
        assert eager.plan_of(layer) is plan
    w = layer.weight.to_dense().detach().double()
    b = layer.bias.detach().double()
    xd = x.double()
    _within_bf16(again, xd @ w.T + b, xd.abs() @ w.abs().T + b.abs())


OUT_OF_RANGE = r"""
import sys, torch
sys.path.insert(0, sys.argv[1] + "/tests/kernels")
from test_blocks import pattern, random_mask
from safesparse.kernels import blocks as bk, native
from safesparse.kernels.pattern import matrix
p = pattern(torch.sparse_bsr, random_mask(4, 4, 0.6, seed=1), (16, 16), torch.bfloat16)
x = torch.randn(20, p.n_cols).to(torch.bfloat16)
g = torch.randn(20, p.n_rows).to(torch.bfloat16)
nnzb = p.plain.numel()

def run(name, what, call):
    try:
        call()
    except RuntimeError as exc:
        print(name, what, "refused", "out of range" in str(exc))
    except Exception as exc:
        print(name, what, "other", type(exc).__name__)
    else:
        print(name, what, "computed")

bad_plain = {"column": p.plain.clone().fill_(10**9), "negative column": p.plain.clone().fill_(-1)}
for name, plain in bad_plain.items():
    m = matrix(p.layout, p.compressed, plain, p.values, p.n_rows, p.n_cols)
    run(name, "forward", lambda: bk.linear(m, x))
    run(name, "values", lambda: bk.linear_grad_values(m, g, x))
    xm, gm = x.T.contiguous(), g.T.contiguous()  # SparseMatmul's (feature-major) products
    run(name, "matmul", lambda: bk.matmul(m, xm))
    run(name, "matmul values", lambda: bk.matmul_grad_values(m, gm, xm))
crow = p.compressed.clone()
crow[2] = 10**6
run("row pointer", "forward", lambda: bk.linear(
    matrix(p.layout, crow, p.plain, p.values, p.n_rows, p.n_cols), x))
crow = p.compressed.clone()
crow[2], crow[3] = crow[3], crow[2] - 1
run("decreasing row pointer", "forward", lambda: bk.linear(
    matrix(p.layout, crow, p.plain, p.values, p.n_rows, p.n_cols), x))
# the gradient to the input reads the pattern grouped by block columns (cached with the
# proof): crafted groupings, as a writer racing the grouping could leave them
key = ("native", "by_plain", p.n_cols // 16)
for name, change in (("block row", lambda rows, order: rows.fill_(99)),
                     ("stored position", lambda rows, order: order.fill_(nnzb))):
    cache = {}
    bk.linear_grad_input(p.matrix(), g, cache=cache)
    ptr, rows, order = cache[key]
    rows, order = rows.clone(), order.clone()
    change(rows, order)
    cache[key] = (ptr, rows, order)
    run(name, "input", lambda: bk.linear_grad_input(p.matrix(), g, cache=cache))
"""


@needs_bf16
def test_index_out_of_range_is_an_error_not_a_read() -> None:
    """Crafted index members (what a racing writer could leave) reach the bfloat16 kernels
    directly (no proof in between, on purpose): each kernel refuses with an error."""
    done = subprocess.run([sys.executable, "-c", OUT_OF_RANGE, str(ROOT)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted([
        "column forward refused True", "column values refused True",
        "column matmul refused True", "column matmul values refused True",
        "negative column forward refused True", "negative column values refused True",
        "negative column matmul refused True", "negative column matmul values refused True",
        "row pointer forward refused True", "decreasing row pointer forward refused True",
        "block row input refused True", "stored position input refused True"])


def test_info_says_how_bf16_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from safesparse.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    expected = "in bfloat16 (AVX512_BF16" if BF16 else "in float32 ("
    assert f"bfloat16 products on CPU: {expected}" in out
    with native.disabled():
        assert native.bf16_describe() == "in float32 (torch ops)"

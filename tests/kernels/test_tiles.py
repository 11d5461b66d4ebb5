"""Every tile of the kernels at every batch size, on both paths, against float64 dense.

Claims: at batches 1, 2, 3, 8, 15, 16, 17, 31, 32, 33 (the whole-block small-batch tiles, up to 15
rows, and their edges), 255 (one batch-major row tile and a partial one) and 4096 (many row
tiles of the batch-major products and of the values gradient, the blocks packed once), the six
products (``linear`` with and without a bias, ``linear_grad_input``, ``linear_grad_values``,
``matmul``, ``matmul_grad_input``, ``matmul_grad_values``) equal the float64 dense products of
the same inputs, for every layout, whole-vector blocks (16 x 16) and blocks that need masks
(5 x 17, 8 x 4), float32 and float64, with each instruction set this CPU has (native) and
with the torch-op kernels (whose batch chunks are 64 rows: up to 255 there). Matrices are small
so that the large batches stay fast.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.spies import in_threads
from test_blocks import check_all, close, pattern, random_mask

from safesparse.kernels import blocks as bk
from safesparse.kernels import native

BUILT = native.status().native
LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
BATCHES = (1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 255, 4096)


def _paths() -> list[str]:
    out = ["torch ops"]
    if BUILT:
        best = int(native._lib.ss_cpu_isa())
        out += [{1: "avx2", 2: "avx512"}[i] for i in range(1, best + 1)]
    return out


@pytest.fixture(params=_paths())
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The torch-op kernels, or the native ones with one instruction set (restored after)."""
    if request.param == "torch ops":
        with native.disabled():
            yield "torch ops"
        return
    lib = native._lib
    saved = int(lib.ss_isa())
    want = {"avx2": 1, "avx512": 2}[request.param]
    assert int(lib.ss_select_isa(want)) == want
    try:
        yield request.param
    finally:
        lib.ss_select_isa(saved)


def _blocks(layout: torch.layout) -> list[tuple[int, int]]:
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        return [(16, 16), (5, 17), (8, 4)]
    return [(1, 1)]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread: the tiles are the same with two (tests/kernels/test_native.py runs those),
    and a loaded machine's spinning second thread made this file 3x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_batch_and_tile(layout: torch.layout, dtype: torch.dtype, path: str) -> None:
    for block in _blocks(layout):
        mask = random_mask(3, 4, 0.6, seed=block[0] + block[1])
        mask[1, :] = False                       # an empty block row
        p = pattern(layout, mask, block, dtype)
        gen = torch.Generator().manual_seed(7)
        bias = torch.randn(p.n_rows, generator=gen, dtype=torch.float64).to(dtype)
        for batch in BATCHES:
            if batch == 4096 and (path == "torch ops" or block == (8, 4)):
                continue  # the torch-op kernels have no row tiles (their 64-row chunks: 255)
            check_all(p, batch, dtype, seed=batch)
            x = torch.randn(batch, p.n_cols, generator=gen, dtype=torch.float64).to(dtype)
            close(bk.linear(p.matrix(), x, bias=bias),
                  x.double() @ p.dense.T + bias.double(), dtype)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("layout", (torch.sparse_bsr, torch.sparse_bsc), ids=str)
def test_blocks_of_several_vectors(layout: torch.layout, path: str) -> None:
    """32 x 32 and 16 x 32 blocks: the batch-major product packs (transposes) them in whole
    16 x 16 tiles (AVX-512) or element by element; every batch size, float32."""
    for block in ((32, 32), (16, 32), (32, 16)):
        mask = random_mask(3, 4, 0.5, seed=block[0] * 3 + block[1])
        mask[0, 0] = True
        p = pattern(layout, mask, block, torch.float32)
        for batch in (1, 8, 17, 33, 255, 1000):
            check_all(p, batch, torch.float32, seed=batch)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("shape", ((768, 768), (3072, 768), (768, 3072)), ids=str)
def test_encoder_shapes(shape: tuple[int, int], path: str) -> None:
    """The encoder layer's linears (benchmarks/group_models.py: 10 % of 16 x 16 blocks, BSR)
    at one 128-token sequence and a batch of several row tiles with a partial one (the
    batch-major tile's rows follow the operands' width), float32, against float64 dense."""
    n_rows, n_cols = shape
    mask = random_mask(n_rows // 16, n_cols // 16, 0.1, seed=n_rows + 2 * n_cols)
    p = pattern(torch.sparse_bsr, mask, (16, 16), torch.float32)
    for batch in (128, 300):
        check_all(p, batch, torch.float32, seed=batch)


@pytest.mark.skipif(not BUILT, reason="the native library is not built")
def test_packed_buffer_across_threads() -> None:
    """The batch-major product keeps one buffer of packed blocks across calls, taken by one
    product at a time: products of different matrices in several threads at once (ctypes lets
    the GIL go) each get their own blocks, equal to a float64 dense reference."""
    pats = [pattern(torch.sparse_bsr, random_mask(24, 12, 0.3, seed=s), (16, 16),
                    torch.float32, seed=s) for s in range(4)]
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(300, p.n_cols, generator=gen) for p in pats]
    want = [x.double() @ p.dense.T for x, p in zip(xs, pats, strict=True)]
    bad: list[int] = []

    def run(t: int) -> None:
        for _ in range(20):
            got = bk.linear(pats[t].matrix(), xs[t])
            if not torch.allclose(got.double(), want[t], rtol=0.0, atol=1e-3):
                bad.append(t)
    in_threads(run, len(pats))
    assert bad == []


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("layout", (torch.sparse_bsr, torch.sparse_bsc), ids=str)
def test_values_grad_of_strided_operands(layout: torch.layout, path: str) -> None:
    """The values gradient copies its row tiles block by block from operands whose batch rows
    are wider than the matrix (column slices of wider tensors: the copy reads each row's first
    n_rows / n_cols elements only), float32 and float64, against float64 dense: 29 of 30
    blocks stored (29 * 256 products per batch row against 96 + 80 operand elements: over the
    copy's 40 to 1 from 257 rows), batches without the copy (63, 64) and with it (300, one
    region and a partial one; 1000)."""
    from test_blocks import values_grad_reference

    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3] = False
    for dtype in (torch.float32, torch.float64):
        p = pattern(layout, mask, (16, 16), dtype)
        gen = torch.Generator().manual_seed(5)
        for batch in (63, 64, 300, 1000):
            gw = torch.randn(batch, p.n_rows + 13, generator=gen, dtype=torch.float64).to(dtype)
            xw = torch.randn(batch, p.n_cols + 16, generator=gen, dtype=torch.float64).to(dtype)
            g, x = gw[:, 3:3 + p.n_rows], xw[:, :p.n_cols]
            want = values_grad_reference(p, g.double().T @ x.double())
            close(bk.linear_grad_values(p.matrix(), g, x), want, dtype)


@pytest.mark.skipif(not BUILT, reason="the native library is not built")
def test_values_grad_and_product_share_the_kept_buffer() -> None:
    """The values gradient's row-tile copy takes the buffer the batch-major product keeps
    (one user at a time, the others allocate their own): both in several threads at once
    equal their float64 dense references."""
    from test_blocks import values_grad_reference

    # (dense enough for the copy at 300 rows: ~108 blocks * 256 against 192 + 160)
    pats = [pattern(torch.sparse_bsr, random_mask(12, 10, 0.9, seed=s), (16, 16),
                    torch.float32, seed=s) for s in range(4)]
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(300, p.n_cols, generator=gen) for p in pats]
    gs = [torch.randn(300, p.n_rows, generator=gen) for p in pats]
    want_y = [x.double() @ p.dense.T for x, p in zip(xs, pats, strict=True)]
    want_v = [values_grad_reference(p, g.double().T @ x.double())
              for g, x, p in zip(gs, xs, pats, strict=True)]
    bad: list[int] = []

    def run(t: int) -> None:
        for _ in range(10):
            m = pats[t].matrix()
            y = bk.linear(m, xs[t])
            v = bk.linear_grad_values(m, gs[t], xs[t])
            if not (torch.allclose(y.double(), want_y[t], rtol=0.0, atol=1e-3)
                    and torch.allclose(v.double(), want_v[t], rtol=0.0, atol=1e-2)):
                bad.append(t)
    in_threads(run, len(pats))
    assert bad == []

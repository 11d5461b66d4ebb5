"""The native block kernels (safesparse/kernels/csrc, safesparse.kernels.native).

Claims: where the library is built, every product (``linear``, ``linear_grad_input``,
``linear_grad_values``, ``matmul``, ``matmul_grad_input``, ``matmul_grad_values``) runs natively
(the torch-op kernels are never called) and equals the float64 dense product of the same
inputs, for every layout, block shapes 1 x 1 to 32 x 32 (odd and non-square included), float32,
float64, float16 and bfloat16, batches 0, 1, a few and several chunks, empty patterns, int32 and
int64 indices and non-contiguous operands and values, with each instruction set this CPU has and
with one and two threads. The pattern data the operators cache with the proof is keyed by what
it depends on (a CSR and a CSC matrix on the same members get their own). ``SAFESPARSE_NATIVE=0``
forces the torch-op kernels and ``python -m safesparse info`` says so; a forked child computes on
one thread (no hang); the process holds one OpenMP runtime (torch's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_blocks import Pattern, check_all, pattern, random_mask, values_grad_reference

from safesparse.kernels import blocks as bk
from safesparse.kernels import native

ROOT = Path(__file__).resolve().parents[2]
BUILT = native.status().native
needs_native = pytest.mark.skipif(not BUILT, reason=f"native kernels: {native.status().reason}")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
BLOCKS = [(1, 1), (2, 3), (3, 5), (8, 8), (16, 16), (32, 32), (16, 8), (5, 17)]


def _isas() -> list[int]:
    if not BUILT:
        return []
    best = int(native._lib.ss_cpu_isa())
    return list(range(1, best + 1))


@pytest.fixture(params=_isas(), ids=lambda i: {1: "avx2", 2: "avx512"}[i])
def isa(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each instruction set this CPU has (restored after)."""
    lib = native._lib
    saved = int(lib.ss_isa())
    assert int(lib.ss_select_isa(request.param)) == request.param
    try:
        yield int(request.param)
    finally:
        lib.ss_select_isa(saved)


@pytest.fixture
def native_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch-op kernels fail if called: what passes ran natively."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the torch-op kernels ran")
    for name in ("_batch_product", "_apply", "_values_grad"):
        monkeypatch.setattr(bk, name, refuse)


def _layouts_blocks() -> list[tuple[torch.layout, tuple[int, int]]]:
    out = []
    for layout in LAYOUTS:
        blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
        for block in BLOCKS:
            if blocked or block == (1, 1):
                out.append((layout, block))
    return out


def _mask(block: tuple[int, int]) -> torch.Tensor:
    """A few block rows and columns (more for small blocks), one empty row and column."""
    n = 3 if max(block) >= 16 else 6
    mask = random_mask(n, n + 1, 0.5, seed=sum(block))
    mask[1, :] = False
    mask[:, 2] = False
    return mask


@needs_native
@pytest.mark.usefixtures("native_only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("layout", "block"), _layouts_blocks(), ids=str)
def test_every_product_natively(layout: torch.layout, block: tuple[int, int],
                                dtype: torch.dtype, isa: int) -> None:
    p = pattern(layout, _mask(block), block, dtype)
    for batch in (1, 3, 37):
        check_all(p, batch=batch, dtype=dtype)


@needs_native
@pytest.mark.usefixtures("native_only")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_batch_over_several_chunks_and_threads(layout: torch.layout, dtype: torch.dtype,
                                               isa: int) -> None:
    """Batches larger than one task's chunk (64) with a partial last chunk, one and two
    threads."""
    p = pattern(layout, random_mask(5, 4, 0.5, seed=2), (16, 16) if layout in (
        torch.sparse_bsr, torch.sparse_bsc) else (1, 1), dtype)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            native._lib.ss_reset_backoff()  # threads, even if a busy machine backed off
            check_all(p, batch=130, dtype=dtype)
    finally:
        torch.set_num_threads(saved)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_empty_batch_pattern_and_int32(layout: torch.layout) -> None:
    block = (2, 3)
    check_all(pattern(layout, random_mask(3, 2, 0.6, seed=4), block), 0, torch.float32)
    empty = pattern(layout, torch.zeros(3, 2, dtype=torch.bool), block, torch.float32)
    check_all(empty, 5, torch.float32)
    p = pattern(layout, random_mask(4, 4, 0.5, seed=5), (8, 8), torch.float32)
    p.compressed, p.plain = p.compressed.int(), p.plain.int()
    check_all(p, 9, torch.float32)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor (every other element of a wider one)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@needs_native
@pytest.mark.usefixtures("native_only")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_non_contiguous_operands_and_values(layout: torch.layout, dtype: torch.dtype) -> None:
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    p = pattern(layout, random_mask(4, 3, 0.6, seed=11), (8, 16) if blocked else (1, 1), dtype)
    values = p.values.transpose(1, 2).contiguous().transpose(1, 2) if blocked else _strided(
        p.values.view(1, -1)).view(-1)
    assert not values.is_contiguous()
    p.values = values
    gen = torch.Generator().manual_seed(3)
    for batch in (1, 2, 19):
        # batch-major operands given as transposes, feature-major ones as strided slices
        x = torch.randn(p.n_cols, batch, generator=gen).to(dtype).T
        g = _strided(torch.randn(batch, p.n_rows, generator=gen).to(dtype))
        w, xd, gd = p.dense, x.double(), g.double()
        m = p.matrix()
        _close(bk.linear(m, x), xd @ w.T, dtype)
        _close(bk.linear_grad_input(m, g), gd @ w, dtype)
        _close(bk.linear_grad_values(m, g, x), values_grad_reference(p, gd.T @ xd), dtype)
        xm, gm = x.T, g.T        # (features, batch) views with the batch strided
        _close(bk.matmul(m, xm), w @ xm.double(), dtype)
        _close(bk.matmul_grad_input(m, gm), w.T @ gm.double(), dtype)
        _close(bk.matmul_grad_values(m, gm, xm),
               values_grad_reference(p, gm.double() @ xm.double().T), dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    from test_blocks import close

    close(actual, expected, dtype)


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_gradcheck_native(layout: torch.layout) -> None:
    from test_blocks import check_gradients

    check_gradients(layout, (2, 3))


@needs_native
def test_cache_keeps_each_orientation_apart() -> None:
    """The same members proven for a square CSR and a square CSC matrix: each reads its own
    block coordinates from the proof's cache (a shared entry would swap rows and columns)."""
    import safesparse as ss
    from safesparse.operators import library as ops

    dense = torch.zeros(6, 6)
    dense[0, 5], dense[1, 0], dense[4, 2], dense[5, 5] = 1.0, 2.0, 3.0, 4.0
    plain = dense.to_sparse_csr()
    a = ss.sparse_csr_tensor(plain.crow_indices(), plain.col_indices(), plain.values(), (6, 6))
    crow, col, vals = a.crow_indices(), a.col_indices(), a.values()
    g, x = torch.randn(6, 3), torch.randn(6, 3)
    for name, layout in (("csr", torch.sparse_csr), ("csc", torch.sparse_csc),
                         ("csr", torch.sparse_csr)):
        got = ops.matmul_grad_values(crow, col, vals, name, 6, 6, g, x)
        p = Pattern(layout, crow, col, vals, 6, 6, torch.zeros(6, 6, dtype=torch.float64))
        want = values_grad_reference(p, g.double() @ x.double().T)
        # float32 products against float64: float32's tolerance (random inputs)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ)
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=240, check=False)


def test_environment_forces_the_torch_op_kernels() -> None:
    done = _child("import sys; from safesparse.cli import main; sys.exit(main(['info']))",
                  SAFESPARSE_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert "block kernels on CPU: torch ops (SAFESPARSE_NATIVE=0" in done.stdout


def test_info_says_which_path_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from safesparse.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    expected = "native (" if BUILT else "torch ops ("
    assert f"block kernels on CPU: {expected}" in out


FORK_AND_RUNTIME = r"""
import os, sys, torch
torch.set_num_threads(2)
from safesparse.kernels import blocks as bk
sys.path.insert(0, sys.argv[1] + "/tests/kernels")
from test_blocks import pattern, random_mask
p = pattern(torch.sparse_bsr, random_mask(8, 8, 0.5, seed=1), (16, 16), torch.float32)
x, g = torch.randn(200, p.n_cols), torch.randn(200, p.n_rows)
def products():
    return (bk.linear(p.matrix(), x), bk.linear_grad_input(p.matrix(), g),
            bk.linear_grad_values(p.matrix(), g, x))
before = products()                                   # the parent's pool runs
runtimes = {line.split()[-1] for line in open("/proc/self/maps")
            if os.path.basename(line.split()[-1]).startswith(("libgomp", "libiomp", "libomp"))}
print("runtimes", len(runtimes))
pid = os.fork()
if pid == 0:                                          # would hang on the parent's pool
    same = all(torch.equal(a, b) for a, b in zip(products(), before))
    os._exit(0 if same else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@needs_native
def test_forked_child_and_one_runtime() -> None:
    with subprocess.Popen([sys.executable, "-c", FORK_AND_RUNTIME, str(ROOT)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the forked child too
            proc.communicate()
            pytest.fail("the forked child hung")
    assert proc.returncode == 0, err
    assert "runtimes 1" in out
    assert "child 0" in out


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bias_in_the_product_on_both_paths(layout: torch.layout, dtype: torch.dtype) -> None:
    """``linear(..., bias=b)`` is ``x @ W.T + b`` (empty block rows get the bias alone), and
    ``SparseLinear``'s gradients to the input, the values and the bias are dense autograd's."""
    from torch import nn

    from safesparse.nn import SparseLinear

    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    mask = random_mask(4, 3, 0.5, seed=12)
    mask[2, :] = False
    p = pattern(layout, mask, (16, 8) if blocked else (1, 1), dtype)
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(p.n_rows, generator=gen).to(dtype)
    for batch in (1, 2, 40):
        x = torch.randn(batch, p.n_cols, generator=gen).to(dtype)
        want = x.double() @ p.dense.T + b.double()
        for path in PATHS_HERE:
            with path():
                _close(bk.linear(p.matrix(), x, bias=b), want, dtype)
    weight = torch.sparse_compressed_tensor(p.compressed, p.plain, p.values.float(),
                                            (p.n_rows, p.n_cols), layout=layout,
                                            check_invariants=True)
    layer = SparseLinear(weight, b.float())
    ref = nn.Linear(p.n_cols, p.n_rows)
    with torch.no_grad():
        ref.weight.copy_(p.dense.float())
        ref.bias.copy_(b.float())
    x = torch.randn(5, p.n_cols, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    for path in PATHS_HERE:
        layer.zero_grad()
        x.grad = None
        with path():
            (layer(x) ** 2).sum().backward()
        ref.zero_grad()
        x2.grad = None
        (ref(x2) ** 2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
        assert layer.bias is not None and layer.bias.grad is not None
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)


def _native_path() -> Any:
    from contextlib import nullcontext

    return nullcontext()


PATHS_HERE = [native.disabled, *([_native_path] if BUILT else [])]


def test_concurrent_calls_from_threads() -> None:
    """Products from several Python threads at once (the library releases the GIL and each
    call opens its own parallel region): every result equals the one computed alone, and the
    pattern data cached with the proof is shared without harm."""
    import threading

    from torch import nn

    from safesparse.nn import SparseLinear

    torch.manual_seed(3)
    layer = SparseLinear.from_dense(nn.Linear(64, 96), (16, 16), 0.4)
    x = torch.randn(50, 64)
    expected = layer(x).detach()
    results: list[bool] = []

    def work() -> None:
        for _ in range(20):
            results.append(torch.equal(layer(x).detach(), expected))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 80 and all(results)

"""The kernels never read out of bounds, whatever their indices (issue 47.2).

Claims: the native library checks every index as it reads it (block columns or rows, the
stored order, the row pointers: within [0, bound), rising, at most nnzb), on every route of
``ss_product`` (few rows, batch-major, feature-major in place and through a tile) and of
``ss_values_grad`` (outer and dot forms), and stops with ``IndexDataError`` naming the array,
its position and the value; the torch-op kernels refuse the same data with an error. A thread
writing invalid indices into a ``SparseLinear``'s buffers while another runs 1,500 forwards
(some with a backward) gives errors or correct results, never a crash, on both paths, and the
layer is correct again once valid data is back. Crash-prone runs happen in a child process with
a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from safesparse.kernels import native

ROOT = Path(__file__).resolve().parents[2]
BUILT = native.status().native


def _run(code: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env,
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")])}
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=timeout, check=False)


CRAFTED = r"""
import torch
from safesparse.kernels import blocks as bk, native
from test_blocks import pattern, random_mask
from safesparse.kernels.pattern import matrix

def attempt(what, fn):
    try:
        fn()
    except (native.IndexDataError, RuntimeError, IndexError, ValueError) as exc:
        print("refused", what, type(exc).__name__, str(exc).splitlines()[0][:160])
        return
    print("ACCEPTED", what)

CASES = [("plain", 10**12), ("plain", -1), ("plain", None), ("compressed", 10**12),
         ("compressed", -1), ("compressed", None), ("compressed decreasing", None)]
for layout, block in ((torch.sparse_bsr, (16, 16)), (torch.sparse_bsr, (8, 4)),
                      (torch.sparse_csr, (1, 1)), (torch.sparse_bsc, (4, 8)),
                      (torch.sparse_csc, (1, 1))):
    for member, value in CASES:
        p = pattern(layout, random_mask(5, 6, 0.6, seed=3), block, torch.float32)
        comp, plain = p.compressed.clone(), p.plain.clone()
        if member == "plain":  # None: the number of plain blocks, one past the last
            n_plain = (p.n_cols // block[1] if layout in (torch.sparse_bsr, torch.sparse_csr)
                       else p.n_rows // block[0])
            plain[plain.numel() // 2] = n_plain if value is None else value
        elif member == "compressed":  # None: one past the number of stored blocks
            comp[2] = plain.numel() + 1 if value is None else value
        else:
            first, second = int(comp[1]), int(comp[2])
            comp[1], comp[2] = second + 1, first
        m = matrix(p.layout, comp, plain, p.values, p.n_rows, p.n_cols)
        tag = f"{layout} {block} {member} {value}"
        for batch in (1, 3, 40):       # rowdot, batch-major tiles, several tiles
            x = torch.randn(batch, p.n_cols)
            g = torch.randn(batch, p.n_rows)
            attempt(f"{tag} linear {batch}", lambda: bk.linear(m, x))
            attempt(f"{tag} linear_grad_input {batch}", lambda: bk.linear_grad_input(m, g))
            attempt(f"{tag} linear_grad_values {batch}",
                    lambda: bk.linear_grad_values(m, g, x))
            attempt(f"{tag} matmul {batch}", lambda: bk.matmul(m, x.T.contiguous()))
            attempt(f"{tag} matmul strided {batch}", lambda: bk.matmul(m, x.T))
            attempt(f"{tag} matmul_grad_input {batch}",
                    lambda: bk.matmul_grad_input(m, g.T.contiguous()))
            attempt(f"{tag} matmul_grad_values {batch}",
                    lambda: bk.matmul_grad_values(m, g.T.contiguous(), x.T.contiguous()))
print("done")
"""


@pytest.mark.parametrize("native_path", ["1", "0"], ids=["native", "torch-ops"])
def test_crafted_indices_are_refused_on_every_route(native_path: str) -> None:
    if native_path == "1" and not BUILT:
        pytest.skip(f"native kernels: {native.status().reason}")
    done = _run(CRAFTED, SAFESPARSE_NATIVE=native_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "done"
    accepted = [line for line in lines if line.startswith("ACCEPTED")]
    assert not accepted, accepted[:10]
    if native_path == "1":
        assert any("IndexDataError" in line for line in lines)


RACE = r"""
import sys, threading, torch
from torch import nn
from safesparse.nn import SparseLinear
torch.manual_seed(0)
torch.set_num_threads(2)
layer = SparseLinear.from_dense(nn.Linear(192, 256), (16, 16), 0.3)
x = torch.randn(8, 192)
with torch.no_grad():
    want = layer(x).clone()
plain, crow = layer.plain_indices, layer.compressed_indices
good_p, good_c = plain.clone(), crow.clone()
stop = False

def writer():
    i = 0
    while not stop:
        i += 1
        plain[(7 * i) % plain.numel()] = (10**9, -(10**6), 12, -1)[i % 4]
        if i % 3 == 0:
            crow[1 + i % (crow.numel() - 1)] = (10**7, -5, plain.numel() + 1)[i % 3]
        plain.copy_(good_p)
        crow.copy_(good_c)

t = threading.Thread(target=writer)
t.start()
ok = errors = wrong = 0
for k in range(1500):
    try:
        if k % 10 == 0:          # a backward now and then: the transposed and values products
            layer.zero_grad()
            y = layer(x.requires_grad_(k % 20 == 0))
            y.square().sum().backward()
            y = y.detach()
        else:
            with torch.no_grad():
                y = layer(x)
        if torch.allclose(y, want, atol=1e-4):
            ok += 1
        else:
            wrong += 1
    except Exception as exc:
        errors += 1
stop = True
t.join()
plain.copy_(good_p)
crow.copy_(good_c)
with torch.no_grad():
    after = torch.allclose(layer(x), want, atol=1e-4)
print("ok", ok, "errors", errors, "wrong", wrong, "after", after)
"""


@pytest.mark.parametrize("native_path", ["1", "0"], ids=["native", "torch-ops"])
def test_racing_invalid_writer_gives_errors_never_a_crash(native_path: str) -> None:
    done = _run(RACE, timeout=600, SAFESPARSE_NATIVE=native_path)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    words = done.stdout.split()
    counts = dict(zip(words[::2], words[1::2], strict=False))
    assert counts["after"] == "True", done.stdout
    assert int(counts["ok"]) + int(counts["errors"]) == 1500, done.stdout
    assert counts["wrong"] == "0", done.stdout

"""A layer's backward packed once (``native.pack_linear_backward``, ``ss_linear_backward_packed``).

Claims: one call computes ``G @ W``, the values gradient and (bfloat16) the bias gradient with
the bits of the kernels it packs (``blocks.linear_grad_input``, ``linear_grad_values``,
``bias_grad``; under ``rounded`` their bfloat16 results widened), within rounding of a float64
dense reference; outputs whose address is 0 are skipped; a float32 ``X`` is rounded in the
call; an index out of range read through the array ends the call with an error code, never a
read out of bounds.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch
from test_blocks import Pattern, pattern
from test_native import _mask

from safesparse.kernels import blocks as bk
from safesparse.kernels import native

BUILT = native.status().native
BF16 = BUILT and native.reads_bf16(torch.bfloat16, torch.sparse_bsr)
pytestmark = pytest.mark.skipif(not BUILT, reason="the packed backward is native")


def _dtypes() -> list[tuple[torch.dtype, bool]]:
    out = [(torch.float32, False), (torch.float64, False)]
    return out + ([(torch.bfloat16, False), (torch.bfloat16, True)] if BF16 else [])


def _call(p: Pattern, dtype: torch.dtype, rounded: bool, g: torch.Tensor, x: torch.Tensor,
          want: tuple[bool, bool, bool] = (True, True, True), x_round: bool = False
          ) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    packed = native.pack_linear_backward(p.matrix(), dtype, rounded)
    assert packed is not None
    args, _keep = packed
    n = g.shape[0]
    wide = torch.float32 if rounded else dtype
    gx = torch.empty(n, p.n_cols, dtype=wide) if want[0] else None
    gv = torch.empty(p.values.shape, dtype=wide) if want[1] else None
    gb = torch.empty(p.n_rows, dtype=wide) if want[2] and dtype == torch.bfloat16 else None
    args[native.BWD_G] = args[native.BWD_L] = g.data_ptr()
    args[native.BWD_N] = args[native.BWD_VN] = n
    args[native.BWD_X] = x.data_ptr()
    args[native.BWD_X_ROUND] = int(x_round)
    args[native.BWD_GX_DT] = native.grad_input_code(dtype, rounded)
    args[native.BWD_GX] = 0 if gx is None else gx.data_ptr()
    args[native.BWD_GV] = 0 if gv is None else gv.data_ptr()
    args[native.BWD_GB] = 0 if gb is None else gb.data_ptr()
    rc = native.backward_entry()(ctypes.addressof(args))
    return int(rc), gx, gv, gb


@pytest.mark.parametrize("layout", [torch.sparse_bsr, torch.sparse_bsc], ids=str)
@pytest.mark.parametrize(("dtype", "rounded"), _dtypes(), ids=str)
def test_the_kernels_bits_in_one_call(layout: torch.layout, dtype: torch.dtype,
                                      rounded: bool) -> None:
    p = pattern(layout, _mask((16, 16)), (16, 16), dtype, seed=3)
    w = p.matrix()
    for n in (1, 2, 17, 130, 300):
        gen = torch.Generator().manual_seed(n)
        g = torch.randn(n, p.n_rows, generator=gen).to(dtype)
        x = torch.randn(n, p.n_cols, generator=gen).to(dtype)
        rc, gx, gv, gb = _call(p, dtype, rounded, g, x)
        assert rc == 0 and gx is not None and gv is not None
        kw = {"dtype": torch.float32, "rounded": True} if rounded else {}
        assert torch.equal(gx, bk.linear_grad_input(w, g, **kw))  # type: ignore[arg-type]
        assert torch.equal(gv, bk.linear_grad_values(w, g, x, **kw))  # type: ignore[arg-type]
        if dtype == torch.bfloat16:
            assert gb is not None
            assert torch.equal(gb, native.colsum_bf16(g, gb.dtype, rounded=rounded))
            if bk.native_bias_sum(n):  # (bias_grad's bits where it sums natively too)
                assert torch.equal(gb, bk.bias_grad(g).to(gb.dtype))
        # within the rounding of a float64 reference
        gd, xd = g.double(), x.double()
        tol = {torch.bfloat16: {"atol": 0.1, "rtol": 0.05}, torch.float32: {
            "atol": 1e-4, "rtol": 1e-4}}.get(dtype, {})
        torch.testing.assert_close(gx.double(), gd @ p.dense, **tol)  # type: ignore[arg-type]
        full = gd.T @ xd
        r, c = p.values.shape[1], p.values.shape[2]
        ref = torch.stack([full[i * r:(i + 1) * r, j * c:(j + 1) * c]
                           for i, j in _coordinates(p)])
        torch.testing.assert_close(gv.double(), ref, **tol)  # type: ignore[arg-type]


def _coordinates(p: Pattern) -> list[tuple[int, int]]:
    """Each stored block's block row and column, in stored order."""
    out = []
    for major in range(p.compressed.numel() - 1):
        for q in range(int(p.compressed[major]), int(p.compressed[major + 1])):
            minor = int(p.plain[q])
            out.append((major, minor) if p.layout == torch.sparse_bsr else (minor, major))
    return out


@pytest.mark.parametrize(("dtype", "rounded"), _dtypes(), ids=str)
def test_outputs_skipped(dtype: torch.dtype, rounded: bool) -> None:
    p = pattern(torch.sparse_bsr, _mask((16, 16)), (16, 16), dtype, seed=4)
    g = torch.randn(5, p.n_rows).to(dtype)
    x = torch.randn(5, p.n_cols).to(dtype)
    _, gx, gv, gb = _call(p, dtype, rounded, g, x)
    for want in ((True, False, False), (False, True, False), (False, False, True)):
        rc, gx1, gv1, gb1 = _call(p, dtype, rounded, g, x, want)
        assert rc == 0
        for got, full in ((gx1, gx), (gv1, gv), (gb1, gb)):
            assert got is None or (full is not None and torch.equal(got, full))


@pytest.mark.skipif(not BF16, reason="no AVX512_BF16 kernels on this machine")
def test_float32_input_rounded_in_the_call() -> None:
    p = pattern(torch.sparse_bsc, _mask((16, 16)), (16, 16), torch.bfloat16, seed=5)
    for n in (1, 9, 64):
        g = torch.randn(n, p.n_rows).to(torch.bfloat16)
        x = torch.randn(n, p.n_cols)
        _, _, want, _ = _call(p, torch.bfloat16, True, g, x.to(torch.bfloat16))
        rc, _, got, _ = _call(p, torch.bfloat16, True, g, x, x_round=True)
        assert rc == 0 and got is not None and want is not None and torch.equal(got, want)
        # (float32 and float64 arrays take no float32 X to round: refused)
        q = pattern(torch.sparse_bsr, _mask((16, 16)), (16, 16), torch.float32, seed=5)
        rc, *_ = _call(q, torch.float32, False, g.float(), x, x_round=True)
        assert rc == native.E_NOKERNEL


def test_an_index_out_of_range_is_an_error_not_a_read() -> None:
    """The array's pattern data written out of range after packing (as a racing writer
    would): the call ends with the index error code for every dtype, in a child process (a
    read out of bounds would crash it, not fail an assertion)."""
    code = textwrap.dedent("""
        import ctypes, sys, torch
        sys.path[:0] = sys.argv[1:]
        from test_blocks import pattern
        from test_native import _mask
        from safesparse.kernels import native
        dtypes = [torch.float32, torch.float64]
        if native.reads_bf16(torch.bfloat16, torch.sparse_bsr):
            dtypes.append(torch.bfloat16)
        for dtype in dtypes:
            for which in (0, 1, 2, 3):
                p = pattern(torch.sparse_bsr, _mask((16, 16)), (16, 16), dtype, seed=6)
                args, keep = native.pack_linear_backward(p.matrix(), dtype, False)
                crow, col, values, rows, cols = (keep[0], keep[1], keep[-3], keep[-2],
                                                 keep[-1])
                target = (col, rows, cols, crow)[which]
                target[-1 if which == 3 else 0] = 10 ** 9
                n = 4
                g = torch.randn(n, p.n_rows).to(dtype)
                x = torch.randn(n, p.n_cols).to(dtype)
                gx = torch.empty(n, p.n_cols, dtype=dtype)
                gv = torch.empty(values.shape, dtype=dtype)
                args[native.BWD_G] = args[native.BWD_L] = g.data_ptr()
                args[native.BWD_N] = args[native.BWD_VN] = n
                args[native.BWD_X] = x.data_ptr()
                args[native.BWD_GX] = gx.data_ptr() if which in (0, 3) else 0
                args[native.BWD_GV] = gv.data_ptr() if which in (1, 2) else 0
                rc = native.backward_entry()(ctypes.addressof(args))
                assert rc == -3, (dtype, which, rc)
        print("ok")
    """)
    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    root = str(__import__("pathlib").Path(here).parents[1])
    out = subprocess.run([sys.executable, "-c", code, here, root], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

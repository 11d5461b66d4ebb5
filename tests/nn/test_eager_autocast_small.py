"""Small forwards of a float32 layer under bfloat16 autocast (issue 45): at most
``_SMALL_ROWS`` rows that record no gradient read the float32 values and bias in place, rounded
to bfloat16 by the kernel as it reads them (``native.rounding_values``), with the bits of the
product over the plan's bfloat16 copy; no copy is read there, so no fingerprint is taken."""

from __future__ import annotations

import ctypes

import pytest
import torch
from support.spies import Spy
from torch import nn

from safesparse.kernels import native
from safesparse.nn import SparseLinear, eager
from safesparse.nn import forward as fwd
from safesparse.nn.plan import _SMALL_ROWS

BF16 = native.available() and native.reads_bf16(torch.bfloat16, torch.sparse_bsr)
pytestmark = pytest.mark.skipif(not BF16, reason="no AVX512_BF16 kernels on this machine")

#: float32 bit patterns at the edges of bfloat16's rounding: zeros, the smallest normal, ties
#: and their neighbours, subnormals (read as zero: vdpbf16ps flushes the subnormal bfloat16 torch
#: rounds them to, and vcvtne2ps2bf16 flushes them before)
_EDGES = [0x00000000, 0x80000000, 0x00800000, 0x80800000, 0x00808000, 0x3F808000, 0x3F818000,
          0x3F808001, 0xBF808000, 0x3F807FFF, 0x007F7FFF, 0x00400000, 0x00000001, 0x807F7FFF,
          0x80000001, 0x4B808000]
#: subnormals within 2^-134 below 2^-126: torch rounds them up to the smallest normal bfloat16
#: (what the copy holds), the small route reads them as zero (csrc/kern_bf16.h, bf_round_pairs)
_BAND = [0x007F8000, 0x007FFFFF, 0x807F8000, 0x807FC000]


def _bits(words: list[int]) -> torch.Tensor:
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32).view(torch.float32)


def make(out: int = 64, bias: bool = True, layout: str = "bsr") -> SparseLinear:
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(nn.Linear(96, out, bias=bias), 16, 0.5)
    if layout == "bsc":  # (read by block rows through a permutation of the stored blocks)
        w = layer.weight.detach().to_dense().to_sparse_bsc((16, 16))
        layer = SparseLinear(w, layer.bias.detach() if bias else None)  # type: ignore[union-attr]
    return layer


def copy_route(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    """The plan's product over its bfloat16 copy of the values (what larger batches read)."""
    plan = eager.plan_of(layer)
    n = x.numel() // 96
    y = plan.run(x.reshape(n, 96), n, (n, layer.out_features), False)
    assert y is not None
    return y.view(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 31, 32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["bsr", "bsc"])
def test_rounded_in_registers_equals_the_copy(rows: int, bias: bool, layout: str) -> None:
    """Values and bias at the edges of the rounding, each one multiplied by a large input
    where it is alone in its output's sum: the bits the bfloat16 copy gives, and the proving
    path's (float32 input rounded in the call, and a bfloat16 input read in place); the bias's
    subnormals are kept, as the copy keeps them."""
    layer = make(bias=bias, layout=layout)
    edges = _bits(_EDGES)
    with torch.no_grad():
        v = layer.values  # (nnzb, 16, 16): block 0's row a, column a holds edge a
        v[0].zero_()
        v[0].diagonal().copy_(edges)
        v[1:].view(-1)[: 50 * len(_EDGES)] = edges.repeat(50)
        if bias:
            layer.bias[:16] = edges  # type: ignore[index]
    # (block 0's column; BSC: its row, which is what the forward's rows read by columns)
    col = int(layer.plain_indices[0]) * 16 if layout == "bsr" else 0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 96)
        x[:, col:col + 16] = 2.0 ** 100  # (edge * 2^100: kept by the sum, finite)
        x[0, :col], x[0, col + 16:] = 0.0, 0.0  # (row 0: block 0 alone in block row 0)
        x = x.to(dtype)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            layer(x)
            plan = eager.plan_of(layer)
            assert plan is not None and plan.small is not None
            got = layer(x)
            want = copy_route(layer, x)
            ref = fwd.linear_operators(layer, x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
        if not bias and layout == "bsr":  # (row 0's output a: edge a times 2^100 alone)
            first = got[0, :16].float()
            want_first = (edges.to(torch.bfloat16).float() * 2.0 ** 100).to(torch.bfloat16)
            want_first[10:15] = 0.0  # (subnormals: zero)
            assert torch.equal(first, want_first.float())


def test_subnormals_rounded_up_by_torch_read_as_zero() -> None:
    """The one place the small route and the copy differ: a float32 subnormal that torch rounds
    up to the smallest normal bfloat16 is zero in the small route (documented in
    csrc/kern_bf16.h); the copy route reads it as 2^-126."""
    layer = make(bias=False)
    band = _bits(_BAND)
    with torch.no_grad():
        layer.values[0].zero_()
        layer.values[0].diagonal()[:4] = band
    col = int(layer.plain_indices[0]) * 16
    x = torch.zeros(1, 96)
    x[0, col:col + 16] = 2.0 ** 100
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        layer(x)
        small = layer(x)[0, :4].float()
        copied = copy_route(layer, x)[0, :4].float()
    assert torch.equal(small, torch.zeros(4))
    assert torch.equal(copied, torch.tensor([1.0, 1.0, -1.0, -1.0]) * 2.0 ** -26)


def test_small_forward_takes_no_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``_SMALL_ROWS`` rows with no gradient recorded: no fingerprint, the values read
    in place (a write through ``.data`` is read at once); more rows, or a gradient recorded:
    the copy, keyed on the fingerprint."""
    layer = make()
    prints = Spy(monkeypatch, native, "fingerprint")
    with torch.autocast("cpu", torch.bfloat16):
        with torch.no_grad():
            layer(torch.randn(2, 96))  # (the proving call, then the plan's fingerprints)
            layer(torch.randn(2, 96))
            before = prints.calls
            for rows in (1, 5, _SMALL_ROWS):
                layer(torch.randn(rows, 96))
            assert prints.calls == before
            layer.values.data.mul_(-2.0)  # (moves no counter)
            x = torch.randn(3, 96)
            assert torch.equal(layer(x), fwd.linear_operators(layer, x))
            assert prints.calls == before
            layer(torch.randn(_SMALL_ROWS + 1, 96))
            assert prints.calls > before
        before = prints.calls
        layer(torch.randn(1, 96))  # (grad enabled, parameters requiring it: the copy)
        assert prints.calls > before


def test_values_written_between_small_and_large_calls_are_read() -> None:
    """Small calls (values in place) then a large one (the copy): a write through ``.data``
    in between is read by both; the copy made before it is never read."""
    layer = make()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        for rows in (40, 40, 1):
            layer(torch.randn(rows, 96))
        layer.values.data.add_(1.0)
        layer.bias.data.mul_(3.0)  # type: ignore[union-attr]
        for rows in (1, 40, 2, 40):
            x = torch.randn(rows, 96)
            assert torch.equal(layer(x), fwd.linear_operators(layer, x))


def test_refused_where_the_tile_does_not_apply() -> None:
    """``rounding_values`` makes no array for blocks other than 16 x 16, and the library
    refuses a rounding array past the small-batch tile (the caller's plan never asks it: the
    operators would run)."""
    torch.manual_seed(0)
    for block in ((16, 32), (32, 16), (8, 8)):
        layer = SparseLinear.from_dense(nn.Linear(96, 64), block, 0.5)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            layer(torch.randn(2, 96))
            plan = eager.plan_of(layer)
            assert plan is not None and plan.small is None
    layer = make()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        layer(torch.randn(2, 96))
        plan = eager.plan_of(layer)
        x = torch.randn(_SMALL_ROWS + 1, 96).to(torch.bfloat16)
        args = type(plan.small[0]).from_buffer_copy(plan.small[0])
        y = torch.empty(_SMALL_ROWS + 1, 64, dtype=torch.bfloat16)
        args[native.SLOT_X], args[native.SLOT_N] = x.data_ptr(), _SMALL_ROWS + 1
        args[native.SLOT_Y] = y.data_ptr()
        assert plan.entry(ctypes.addressof(args)) == native.E_NOKERNEL

"""The eager plan's pre-packed values (``_Plan.prepacked``): a float32 / float64 block layer's
plan from 16 rows reads a copy of its values with each block's columns contiguous,
made where two calls in a row saw the same version counter of the values, read only while the
counter is unmoved. Every result equals the proving path's bit for bit; a write, a replaced
buffer, a dtype change, autocast, a training loop or another thread never read a stale copy."""
# ruff: noqa: F811
# (the ``calls`` fixture is imported from test_eager_fast_path, and requested by name)

from __future__ import annotations

import threading

import pytest
import torch
from test_eager_fast_path import Calls, calls, fell_back, make, proving, warm  # noqa: F401

from safesparse.kernels import native
from safesparse.nn import SparseLinear, eager

ROWS = 40  # (above the small-batch tiles: native.PREPACKED_FROM)


def held(layer: SparseLinear) -> bool:
    plan = eager.plan_of(layer)
    return plan is not None and plan.pre_held is not None


def fast_equal(layer: SparseLinear, x: torch.Tensor, calls: Calls) -> torch.Tensor:
    """One call on the plan, equal to the proving path's result."""
    before = calls.fast
    with torch.no_grad():
        y = layer(x)
        assert calls.fast == before + 1
        assert torch.equal(y, proving(layer, x))
    return y


@pytest.mark.skipif(not native.available(), reason="no native kernels")
@pytest.mark.parametrize("layout", ["bsr", "bsc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(16, 96), (32, 96), (ROWS, 96), (3, 20, 96), (300, 96)])
def test_prepacked_equal_to_the_proving_path(calls: Calls, layout: str, dtype: torch.dtype,
                                             shape: tuple[int, ...]) -> None:
    layer = make(layout, dtype=dtype)
    x = torch.randn(shape, dtype=dtype)
    warm(layer, x, calls)
    y = fast_equal(layer, x, calls)
    if layout == "bsr":  # (BSC's blocks are read by rows of A.T: contiguous already)
        assert held(layer)
    dense = x.double() @ layer.weight.to_dense().double().T + layer.bias.double()  # type: ignore[union-attr]
    torch.testing.assert_close(y.double(), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available(), reason="no native kernels")
def test_small_batches_read_the_values_in_place(calls: Calls) -> None:
    layer = make()
    for rows in (1, 8, 15):
        x = torch.randn(rows, 96)
        warm(layer, x, calls)
        fast_equal(layer, x, calls)
        assert not held(layer)


@pytest.mark.skipif(not native.available(), reason="no native kernels")
def test_a_write_to_the_values_never_reads_a_stale_copy(calls: Calls) -> None:
    """A write through the parameter, through an alias sharing its counter, by an optimizer:
    the next call reads the values in place (the copy dropped), the one after a new copy."""
    layer = make()
    x = torch.randn(ROWS, 96)
    warm(layer, x, calls)
    y0 = fast_equal(layer, x, calls)
    assert held(layer)
    plan = eager.plan_of(layer)
    with torch.no_grad():
        layer.values.mul_(2)
    y1 = fast_equal(layer, x, calls)
    assert not torch.equal(y0, y1) and not held(layer)
    y2 = fast_equal(layer, x, calls)
    assert torch.equal(y1, y2) and held(layer)
    layer.values.detach().add_(1)  # (an alias sharing the counter)
    y3 = fast_equal(layer, x, calls)
    assert not torch.equal(y2, y3)
    fast_equal(layer, x, calls)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).sum().backward()
    opt.step()
    y4 = fast_equal(layer, x, calls)
    assert not torch.equal(y3, y4)
    assert eager.plan_of(layer) is plan  # (never a trip through the operators)


@pytest.mark.skipif(not native.available(), reason="no native kernels")
def test_keyed_changes_fall_back(calls: Calls) -> None:
    """A replaced values buffer, a dtype change, autocast on: the proving path, then a plan
    of their own; never the old copy."""
    layer = make()
    x = torch.randn(ROWS, 96)
    warm(layer, x, calls)
    fast_equal(layer, x, calls)
    assert held(layer)
    layer.values.data = torch.randn_like(layer.values)  # replaced values
    fell_back(layer, x, calls)
    fast_equal(layer, x, calls)
    assert held(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: the bfloat16 kernels
        y = fell_back(layer, x, calls)
        with torch.no_grad():
            y2 = layer(x)
        assert torch.equal(y, y2) and eager.plan_of(layer).kind == eager._AUTOCAST
        assert not held(layer)
    fell_back(layer, x, calls)  # autocast off: a float32 plan again
    fast_equal(layer, x, calls)
    assert held(layer)
    layer.double()  # a dtype change
    xd = x.double()
    fell_back(layer, xd, calls)
    fast_equal(layer, xd, calls)
    assert held(layer)


@pytest.mark.skipif(not native.available(), reason="no native kernels")
def test_a_training_loop_never_copies(calls: Calls) -> None:
    """The optimizer writes the values between calls: every call reads them in place (no
    copy made), with gradients equal to the proving path's."""
    layer = make()
    x = torch.randn(ROWS, 96)
    warm(layer, x, calls)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.zero_grad()
    layer(x).sum().backward()
    opt.step()
    for _ in range(3):
        opt.zero_grad()
        before = calls.fast
        y = layer(x)
        assert calls.fast == before + 1 and not held(layer)
        assert torch.equal(y, proving(layer, x))
        y.sum().backward()
        opt.step()


@pytest.mark.skipif(not native.available(), reason="no native kernels")
def test_threads_share_the_copy(calls: Calls) -> None:
    """Calls from several threads, with writes to the values between rounds: each result the
    proving path's for the values of its round."""
    layer = make()
    x = torch.randn(ROWS, 96)
    warm(layer, x, calls)
    for _ in range(3):
        with torch.no_grad():
            want = proving(layer, x)
        got: list[torch.Tensor] = []

        def work(out: list[torch.Tensor] = got) -> None:
            with torch.no_grad():
                for _ in range(5):
                    out.append(layer(x))

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 15 and all(torch.equal(y, want) for y in got)
        with torch.no_grad():
            layer.values.add_(0.25)

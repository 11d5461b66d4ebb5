"""The eager fast path's packed backward (safesparse/nn/eager.py ``_FastLinear``, issue 45).

After a proving call, ``SparseLinear``'s backward computes its three gradients in one call over
an array packed once per plan (``native.pack_linear_backward``, ``ss_linear_backward_packed``).
Its results are the operators path's, bit for bit (every dtype, autocast, batch, with and
without bias, BSR and BSC); where the plan's key does not hold at the backward (a member
written, the values replaced, the thread count changed) the gradient operators run, which
validate; another thread reads its own copy of the array; operands the library refuses take
the gradient kernels from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.spies import Spy, in_threads
from torch import nn

import safesparse as ss
from safesparse.kernels import native
from safesparse.nn import SparseLinear, eager
from safesparse.nn import forward as fwd

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the fast path runs on the native kernels")

BF16 = native.available() and native.reads_bf16(torch.bfloat16, torch.sparse_bsr)
BATCHES = (1, 2, 3, 8, 16, 17, 31, 32, 33, 255)
#: (the layer's dtype, autocast, the input's dtype)
MODES = {"float32": (torch.float32, False, torch.float32),
         "float64": (torch.float64, False, torch.float64),
         "bfloat16": (torch.bfloat16, False, torch.bfloat16),
         "autocast": (torch.float32, True, torch.float32),
         "autocast, bfloat16 input": (torch.float32, True, torch.bfloat16)}


@pytest.fixture
def packed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    """Counts the packed backward's calls (``calls``) and those that computed the gradients
    (``done``)."""
    yield Spy(monkeypatch, eager, "_packed_backward")


def make(layout: str = "bsr", bias: bool = True, dtype: torch.dtype = torch.float32,
         size: tuple[int, int] = (64, 96), block: int = 16) -> SparseLinear:
    torch.manual_seed(0)
    dense = nn.Linear(size[1], size[0], bias=bias).to(dtype)
    layer = SparseLinear.from_dense(dense, block, 0.3)
    if layout == "bsc":
        w = layer.weight.detach().to_dense().to_sparse_bsc((block, block))
        layer = SparseLinear(w, layer.bias.detach() if bias else None)  # type: ignore[union-attr]
    return layer


def grads(layer: SparseLinear, x: torch.Tensor, g: torch.Tensor, autocast: bool = False,
          proving: bool = False) -> tuple[torch.Tensor, ...]:
    """The gradients to the input and every parameter, through the layer (the fast path once
    it has a plan) or through the operators (``proving``)."""
    xg = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = fwd.linear_operators(layer, xg) if proving else layer(xg)
    return torch.autograd.grad(y, [xg, *layer.parameters()], g)


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bsr", "bsc"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
def test_packed_backward_is_the_operators_backward(packed: Spy, mode: str, bias: bool,
                                                    layout: str) -> None:
    dtype, autocast, x_dtype = MODES[mode]
    layer = make(layout, bias, dtype)
    y_dtype = torch.bfloat16 if autocast else dtype
    for n in BATCHES:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, 96, generator=gen).to(x_dtype)
        g = torch.randn(n, 64, generator=gen).to(y_dtype)
        grads(layer, x, g, autocast)  # (the proving call: the plan)
        before = packed.done
        got = grads(layer, x, g, autocast)
        if dtype is not torch.bfloat16 or BF16:
            assert packed.done == before + 1, n
        assert_same(got, grads(layer, x, g, autocast, proving=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_expanded_gradient(packed: Spy, mode: str) -> None:
    """A gradient that is one row expanded (``y.sum()``'s): the fast path sums it made
    contiguous, the operators' ``bias_grad`` too (the order of torch's sums depends on the
    strides): the same bits."""
    dtype, autocast, x_dtype = MODES[mode]
    layer = make(dtype=dtype)
    for n in (1, 3, 8, 17, 40, 130):
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, 96, generator=gen).to(x_dtype)
        row = torch.randn(1, 64, generator=gen) * torch.exp(torch.randn(1, 64, generator=gen) * 4)
        g = row.to(torch.bfloat16 if autocast else dtype).expand(n, 64)
        grads(layer, x, g, autocast)
        before = packed.done
        got = grads(layer, x, g, autocast)
        if dtype is not torch.bfloat16 or BF16:
            assert packed.done == before + 1
        assert_same(got, grads(layer, x, g, autocast, proving=True))


def test_large_autocast_input_and_other_dimensions(packed: Spy) -> None:
    """An input above the size the library rounds in its call (torch rounds it in the forward),
    a 3-D and a 1-D input, under autocast and not."""
    layer = make(size=(64, 512))
    for shape, autocast in (((300, 512), True), ((2, 5, 512), True), ((2, 5, 512), False),
                            ((512,), True), ((512,), False)):
        x = torch.randn(*shape)
        g = torch.randn(*shape[:-1], 64).to(torch.bfloat16 if autocast else torch.float32)
        grads(layer, x, g, autocast)
        before = packed.done
        got = grads(layer, x, g, autocast)
        assert packed.done == before + 1
        assert_same(got, grads(layer, x, g, autocast, proving=True))


def test_built_at_the_first_backward_and_kept(packed: Spy) -> None:
    layer = make()
    x, g = torch.randn(4, 96), torch.randn(4, 64)
    grads(layer, x, g)
    plan = eager.plan_of(layer)
    with torch.no_grad():
        layer(x)
    assert plan is not None and eager.plan_of(layer) is plan and plan.bwd is None
    grads(layer, x, g)
    held = plan.bwd
    assert isinstance(held, tuple)
    grads(layer, x, g)
    assert plan.bwd is held and packed.done == 2


def test_only_the_gradients_asked_for(packed: Spy) -> None:
    """An input that needs no gradient, frozen values, a frozen bias: the same results."""
    layer = make()
    x, g = torch.randn(5, 96), torch.randn(5, 64)
    grads(layer, x, g)
    for frozen in ("values", "bias"):
        getattr(layer, frozen).requires_grad_(False)
        y = layer(x)
        got = torch.autograd.grad(y, [p for p in layer.parameters() if p.requires_grad], g)
        want = torch.autograd.grad(fwd.linear_operators(layer, x),
                                   [p for p in layer.parameters() if p.requires_grad], g)
        assert_same(got, want)
        getattr(layer, frozen).requires_grad_(True)
    assert packed.done == 2


def test_index_write_between_forward_and_backward_falls_back(packed: Spy) -> None:
    """A write through an alias of the index memory voids the proof: the gradient operators
    run and validate (a valid rewrite: the same results; an invalid one: refused)."""
    layer = make()
    x, g = torch.randn(3, 96, requires_grad=True), torch.randn(3, 64)
    grads(layer, x, g)
    want = grads(layer, x, g, proving=True)
    y = layer(x)
    cols = layer.weight.col_indices()
    with torch.no_grad():
        cols.copy_(cols.clone())
    before = packed.calls
    got = torch.autograd.grad(y, [x, *layer.parameters()], g)
    assert packed.calls == before
    assert_same(got[1:], want[1:])
    grads(layer, x, g)  # (a new plan, proven again)
    y = layer(x)
    before = packed.calls
    with torch.no_grad():
        layer.weight.col_indices()[0] = 10 ** 6
    with pytest.raises(ss.InvariantError, match="plain_indices"):
        torch.autograd.grad(y, [x, *layer.parameters()], g)
    assert packed.calls == before


def test_values_replaced_between_forward_and_backward_falls_back(packed: Spy) -> None:
    layer = make()
    x, g = torch.randn(3, 96), torch.randn(3, 64)
    grads(layer, x, g)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    layer.values.data = layer.values.data * 2
    before = packed.calls
    got = torch.autograd.grad(y, [xg, *layer.parameters()], g)
    assert packed.calls == before
    assert_same(got, grads(layer, x, g, proving=True))  # (the new values)


def test_thread_count_changed_between_forward_and_backward(packed: Spy) -> None:
    layer = make()
    x, g = torch.randn(3, 96), torch.randn(3, 64)
    grads(layer, x, g)
    want = grads(layer, x, g, proving=True)
    threads = torch.get_num_threads()
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    torch.set_num_threads(threads + 1)
    try:
        before = packed.calls
        got = torch.autograd.grad(y, [xg, *layer.parameters()], g)
    finally:
        torch.set_num_threads(threads)
    assert packed.calls == before
    assert_same(got, want)


def test_other_threads_read_their_own_array(packed: Spy) -> None:
    """Backwards racing in several threads (the plan built in this one): each its results."""
    layer = make()
    xs = [torch.randn(n, 96) for n in (1, 3, 8, 17)]
    gs = [torch.randn(x.shape[0], 64) for x in xs]
    grads(layer, xs[0], gs[0])
    want = [grads(layer, x, g, proving=True) for x, g in zip(xs, gs, strict=True)]
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(50):
            got = grads(layer, xs[i], gs[i])
            if not all(torch.equal(a, b) for a, b in zip(got, want[i], strict=True)):
                bad.append(i)

    in_threads(work, len(xs))
    assert not bad and packed.done >= 200


def test_backward_in_another_thread() -> None:
    """The forward here, the backward in another thread (its own copy of the array)."""
    layer = make()
    x, g = torch.randn(5, 96), torch.randn(5, 64)
    grads(layer, x, g)
    want = grads(layer, x, g, proving=True)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(
        torch.autograd.grad(y, [xg, *layer.parameters()], g)))
    t.start()
    t.join()
    assert out
    assert_same(out[0], want)


def test_refused_operands_take_the_gradient_kernels(packed: Spy) -> None:
    """Blocks narrower than the library's values-gradient kernels take (2 x 2, float32): the
    packed call is refused once, then the gradient kernels run; the same results."""
    layer = make(block=2)
    x, g = torch.randn(4, 96), torch.randn(4, 64)
    grads(layer, x, g)
    got = grads(layer, x, g)
    plan = eager.plan_of(layer)
    assert plan is not None and plan.bwd is False
    assert_same(got, grads(layer, x, g, proving=True))
    calls = packed.calls
    assert_same(grads(layer, x, g), grads(layer, x, g, proving=True))
    assert packed.calls == calls  # (not asked again)

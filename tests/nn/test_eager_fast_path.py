"""The eager fast path of ``SparseLinear`` / ``SparseMatmul`` (safesparse/nn/eager.py, issue 45).

Every change the plan keys on makes the call fall back to the proving path (the operators),
which validates what it cannot prove and refuses invalid data; results equal the proving path's.
"""

from __future__ import annotations

import copy
import os
import pickle
import select
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.spies import Spy
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import safesparse as ss
from safesparse.kernels import native
from safesparse.nn import SparseLinear, SparseMatmul, eager
from safesparse.nn import forward as fwd

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the fast path runs on the native kernels")


class Calls:
    """Counts the fast path's products (``fast``) and the proving path's calls (``proving``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._run = Spy(monkeypatch, eager._Plan, "run")
        self._proving = (Spy(monkeypatch, fwd, "linear_operators"),
                         Spy(monkeypatch, fwd, "matmul_operators"))

    @property
    def fast(self) -> int:
        return self._run.calls

    @property
    def proving(self) -> int:
        return sum(spy.calls for spy in self._proving)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    yield Calls(monkeypatch)


def make(layout: str = "bsr", bias: bool = True, dtype: torch.dtype = torch.float32,
         size: tuple[int, int] = (64, 96)) -> SparseLinear:
    torch.manual_seed(0)
    dense = nn.Linear(size[1], size[0], bias=bias).to(dtype)
    layer = SparseLinear.from_dense(dense, 16 if layout in ("bsr", "bsc") else None, 0.3)
    if layout in ("bsc", "csc"):
        w = layer.weight.detach()
        w = (w.to_dense().to_sparse_bsc((16, 16)) if layout == "bsc"
             else w.to_dense().to_sparse_csc())
        layer = SparseLinear(w, layer.bias.detach() if bias else None)  # type: ignore[union-attr]
    return layer


def proving(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    fn = fwd.linear_operators if isinstance(layer, SparseLinear) else fwd.matmul_operators
    return fn(layer, x)  # type: ignore[no-any-return]


def warm(layer: nn.Module, x: torch.Tensor, calls: Calls) -> None:
    """One proving call builds the plan; the next takes it."""
    with torch.no_grad():
        layer(x)
    assert eager.plan_of(layer) is not None
    before = calls.fast
    with torch.no_grad():
        layer(x)
    assert calls.fast == before + 1


# ---------------------------------------------------------------------------------------------
# Equal results


@pytest.mark.parametrize("layout", ["bsr", "bsc", "csr", "csc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96,), (1, 96), (8, 96), (3, 5, 96)])
def test_equal_to_the_proving_path(calls: Calls, layout: str, dtype: torch.dtype,
                                   shape: tuple[int, ...]) -> None:
    layer = make(layout, dtype=dtype)
    x = torch.randn(shape, dtype=dtype)
    warm(layer, x, calls)
    with torch.no_grad():
        fast = layer(x)
        ref = proving(layer, x)
    assert fast.dtype == ref.dtype and fast.shape == ref.shape
    assert torch.equal(fast, ref)
    dense = x.double() @ layer.weight.to_dense().double().T + layer.bias.double()  # type: ignore[union-attr]
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fast.double(), dense, rtol=tol, atol=tol)


@pytest.mark.parametrize("default", [torch.float64, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_dtype_whatever_the_default_dtype(calls: Calls, default: torch.dtype,
                                                 dtype: torch.dtype) -> None:
    # (the fast path allocates its output without a dtype argument where the default dtype is
    # the layer's: a default set between two calls must not change the output's dtype)
    layer = make(dtype=dtype)
    x = torch.randn(2, 96, dtype=dtype)
    warm(layer, x, calls)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        with torch.no_grad():
            fast = layer(x)
        ref = proving(layer, x)
    finally:
        torch.set_default_dtype(before)
    assert calls.fast >= 2
    assert fast.dtype == dtype and torch.equal(fast, ref.detach())


def test_without_bias(calls: Calls) -> None:
    layer = make(bias=False)
    x = torch.randn(4, 96)
    warm(layer, x, calls)
    with torch.no_grad():
        assert torch.equal(layer(x), proving(layer, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96)])
def test_gradients_equal_to_the_proving_path(calls: Calls, shape: tuple[int, ...],
                                             dtype: torch.dtype) -> None:
    layer = make(dtype=dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    warm(layer, x.detach(), calls)
    before = calls.fast
    y = layer(x)
    assert calls.fast == before + 1 and y.grad_fn is not None
    g = torch.randn_like(y)
    y.backward(g)
    grads = (x.grad, layer.values.grad, layer.bias.grad)  # type: ignore[union-attr]
    x2 = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    proving(layer, x2).backward(g)
    for got, want in zip(grads, (x2.grad, layer.values.grad, layer.bias.grad),  # type: ignore[union-attr]
                         strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want)


def test_backward_after_a_write_through_another_counter_is_refused(calls: Calls) -> None:
    """The backward re-checks the plan too: a write that voids the proof between forward and
    backward (no counter of the saved buffers moves) sends it to the gradient operators,
    which validate and refuse."""
    layer = make()
    x = torch.randn(3, 96, requires_grad=True)
    warm(layer, x.detach(), calls)
    before = calls.fast
    y = layer(x)
    assert calls.fast == before + 1
    with torch.no_grad():
        layer.weight.col_indices()[0] = 10 ** 6
    with pytest.raises(ss.InvariantError, match="plain_indices"):
        y.sum().backward()


def test_values_trained_in_place_are_read(calls: Calls) -> None:
    layer = make()
    x = torch.randn(2, 96)
    warm(layer, x, calls)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).sum().backward()
    opt.step()
    before = calls.fast
    with torch.no_grad():
        y = layer(x)
    assert calls.fast == before + 1  # (the plan reads the values in place: no rebuild)
    with torch.no_grad():
        assert torch.equal(y, proving(layer, x))


def test_sparse_matmul(calls: Calls) -> None:
    torch.manual_seed(1)
    a = (torch.rand(48, 32) < 0.2).float() * torch.randn(48, 32)
    m = SparseMatmul(a.to_sparse_bsr((16, 16)))
    for x in (torch.randn(32), torch.randn(32, 5)):
        m(x)
        before = calls.fast
        y = m(x)
        assert calls.fast == before + 1
        assert torch.equal(y, proving(m, x))
        torch.testing.assert_close(y, a @ x)


def test_threads_racing_get_their_own_results(calls: Calls) -> None:
    layer = make()
    xs = [torch.randn(n, 96) for n in (1, 3, 8, 17)]
    warm(layer, xs[0], calls)
    with torch.no_grad():
        want = [proving(layer, x) for x in xs]
    bad: list[int] = []

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(200):
                if not torch.equal(layer(xs[i]), want[i]):
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and calls.fast >= 800


def test_copies_and_pickles_build_their_own_plan(calls: Calls) -> None:
    layer = make()
    x = torch.randn(2, 96)
    warm(layer, x, calls)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert eager.plan_of(other) is None
        with torch.no_grad():
            assert torch.equal(other(x), layer(x))
        assert eager.plan_of(other) is not None and eager.plan_of(other) is not eager.plan_of(layer)


# ---------------------------------------------------------------------------------------------
# Falling back on every change the plan keys on


def fell_back(layer: nn.Module, x: torch.Tensor, calls: Calls) -> torch.Tensor:
    """Calls ``layer(x)`` (no grad) and asserts it took the proving path."""
    fast, slow = calls.fast, calls.proving
    with torch.no_grad():
        y = layer(x)
    assert calls.fast == fast and calls.proving == slow + 1
    return y  # type: ignore[no-any-return]


def test_valid_write_to_a_member(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    old = eager.plan_of(layer)
    with torch.no_grad():
        layer.plain_indices.copy_(layer.plain_indices.clone())  # valid: the same pattern
    y = fell_back(layer, x, calls)
    assert eager.plan_of(layer) is not old  # proven again, a new plan
    with torch.no_grad():
        assert torch.equal(y, layer(x))


@pytest.mark.parametrize("how", ["member", "weight_alias", "data", "replaced"])
def test_invalid_write_is_refused_never_read(calls: Calls, how: str) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    bad = layer.plain_indices.clone()
    bad[0] = 10 ** 6
    with torch.no_grad():
        if how == "member":
            layer.plain_indices[0] = 10 ** 6
        elif how == "weight_alias":  # another counter on the same memory: no buffer counter moves
            before = layer.plain_indices._version
            w = layer.weight
            plain = w.col_indices()
            plain[0] = 10 ** 6
            assert layer.plain_indices._version == before
        elif how == "data":
            layer.plain_indices.data = bad
        else:
            layer._buffers["plain_indices"] = bad
    fast = calls.fast
    with pytest.raises(ss.InvariantError, match="plain_indices"), torch.no_grad():
        layer(x)
    assert calls.fast == fast
    plan = eager.plan_of(layer)
    assert plan is None or not plan.holds(layer._buffers, layer._parameters, torch.float32)


def test_replaced_valid_buffer(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    layer._buffers["compressed_indices"] = layer.compressed_indices.clone()
    y = fell_back(layer, x, calls)
    with torch.no_grad():
        assert torch.equal(y, layer(x))
    assert calls.fast >= 2


@pytest.mark.parametrize("member", ["compressed_indices", "plain_indices"])
def test_index_storage_resized_falls_back(calls: Calls, member: str) -> None:
    """A member's storage resized through a storage object of its own (state/records.holds
    keeps the storage objects of the proof's members and reads their size at each call: the
    same storage, resized, is seen): the plan does not hold, the operators run (and prove the
    moved memory again), then a plan is built on it."""
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with torch.no_grad():
        want = layer(x)
    st = getattr(layer, member).untyped_storage()
    st.resize_(st.nbytes() + 4096)
    y = fell_back(layer, x, calls)
    assert torch.equal(y, want)
    fast = calls.fast
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    assert calls.fast == fast + 1


def test_values_replaced_with_data(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    layer.values.data = torch.randn_like(layer.values)
    y = fell_back(layer, x, calls)
    torch.testing.assert_close(y, x @ layer.weight.to_dense().T + layer.bias)


def test_dtype_change(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    layer.double()
    y = fell_back(layer, x.double(), calls)
    assert y.dtype == torch.float64
    warm(layer, x.double(), calls)


def test_thread_count_change(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        warm(layer, x, calls)
        torch.set_num_threads(2)
        y = fell_back(layer, x, calls)
        with torch.no_grad():
            assert torch.equal(y, layer(x))
    finally:
        torch.set_num_threads(saved)


def test_autocast(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fell_back(layer, x, calls)  # the float32 plan does not hold under autocast
        assert y.dtype == torch.bfloat16
        before = calls.fast
        with torch.no_grad():
            y2 = layer(x)  # an autocast plan (a cached bfloat16 copy of the values)
        assert calls.fast == before + 1 and torch.equal(y2, y)
        assert eager.plan_of(layer).kind == eager._AUTOCAST
    y4 = fell_back(layer, x, calls)  # autocast off: the float32 plan again, after a proving call
    assert y4.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(layer(x), y4)


def autocast_reference(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` under bfloat16 autocast with the dense weight."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.linear(x, layer.weight.to_dense(), layer.bias)


def autocast_warm(layer: nn.Module, x: torch.Tensor, calls: Calls) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        layer(x)
        assert eager.plan_of(layer).kind == eager._AUTOCAST
        before = calls.fast
        layer(x)
        assert calls.fast == before + 1


@pytest.mark.parametrize("layout", ["bsr", "bsc"])
@pytest.mark.parametrize("shape", [(96,), (1, 96), (8, 96), (3, 5, 96), (700, 96)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_plan_numerics(calls: Calls, layout: str, shape: tuple[int, ...],
                                x_dtype: torch.dtype) -> None:
    """bfloat16 kernels from the plan's copy of the values: the proving path's result exactly
    (a float32 input rounded in the library's call or by torch: the same rounding), and
    ``F.linear`` under autocast within bfloat16 rounding; a bfloat16 input (an earlier layer's
    output under autocast) is read in place."""
    layer = make(layout)
    x = torch.randn(shape).to(x_dtype)
    autocast_warm(layer, x, calls)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        before = calls.fast
        y = layer(x)
        assert calls.fast == before + 1
        ref = proving(layer, x)
    want = autocast_reference(layer, x)
    assert y.dtype == want.dtype == torch.bfloat16 and y.shape == want.shape
    assert torch.equal(y, ref)
    torch.testing.assert_close(y.float(), want.float(), rtol=1.6e-2, atol=2e-2)


def test_autocast_rounds_as_torch() -> None:
    """A float32 input rounded to bfloat16 in the library's call (round to nearest even,
    ties, infinities, NaN) equals ``x.to(torch.bfloat16)``: through an identity layer."""
    eye = SparseLinear(torch.eye(64).to_sparse_bsr((16, 16)))
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1, 64), dtype=torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(x.abs() < 1e-30, torch.ones_like(x), x)  # (vdpbf16ps flushes subnormals)
    x[0, :6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), float("inf"),
                             -float("inf"), 3.0e38])
    x = x.clamp(-3e38, 3e38).nan_to_num(0.0)  # (the product of a finite x and 1 stays finite)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        eye(x)
        assert eager.plan_of(eye) is not None
        y = eye(x)
    finite = x.isfinite()
    assert torch.equal(y[finite], x.to(torch.bfloat16)[finite])


def test_autocast_write_to_values_never_reads_a_stale_copy(calls: Calls) -> None:
    """A write to the values (or bias) between calls under autocast: the next call reads a
    fresh bfloat16 copy (the plan is rebuilt on the same proof), never the stale one. (40
    rows: up to 32 the plan reads the float32 values in place, tests/nn/
    test_eager_autocast_small.py.)"""
    layer = make()
    x = torch.randn(40, 96)
    autocast_warm(layer, x, calls)
    old = eager.plan_of(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y1 = layer(x)
        layer.values.mul_(2)  # a write: the cached copy is stale
        y2 = layer(x)
        assert eager.plan_of(layer) is not old
        assert torch.equal(y2, proving(layer, x)) and not torch.equal(y1, y2)
        layer.bias.add_(1)  # type: ignore[union-attr]
        y3 = layer(x)
        assert torch.equal(y3, proving(layer, x)) and not torch.equal(y2, y3)
        opt_step = layer.values.detach()
        opt_step.sub_(0.5)  # through an alias sharing the counter
        y4 = layer(x)
        assert torch.equal(y4, proving(layer, x)) and not torch.equal(y3, y4)
    torch.testing.assert_close(y4.float(), autocast_reference(layer, x).float(), rtol=1.6e-2,
                               atol=5e-2)


def test_autocast_keyed_changes_fall_back(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    autocast_warm(layer, x, calls)
    with torch.autocast("cpu", dtype=torch.float16):  # another autocast dtype
        y = fell_back(layer, x, calls)
        assert y.dtype == torch.float16
    autocast_warm(layer, x, calls)
    layer.values.data = torch.randn_like(layer.values)  # replaced values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fell_back(layer, x, calls)
    with torch.no_grad():
        layer.plain_indices.copy_(layer.plain_indices.clone())  # a write to a member
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fell_back(layer, x, calls)
    layer.double()  # a dtype change: autocast leaves float64 alone
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fell_back(layer, x.double(), calls)
    assert y.dtype == torch.float64


def test_sparse_matmul_under_autocast(calls: Calls) -> None:
    """``A @ x`` (feature-major) under bfloat16 autocast: the plan's bfloat16 product equals
    the proving path's, for a float32 x rounded in the call, a large one rounded by torch, and a
    bfloat16 one; and a bfloat16 ``SparseMatmul`` reads its values in place."""
    torch.manual_seed(1)
    a = (torch.rand(48, 32) < 0.3).float() * torch.randn(48, 32)
    m = SparseMatmul(a.to_sparse_bsr((16, 16)))
    for x in (torch.randn(32), torch.randn(32, 5), torch.randn(32, 2100),
              torch.randn(32, 3).bfloat16()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)
            before = calls.fast
            y = m(x)
            assert calls.fast == before + 1 and y.dtype == torch.bfloat16
            assert torch.equal(y, proving(m, x))
            want = a.bfloat16() @ x.bfloat16()
        torch.testing.assert_close(y.float(), want.float(), rtol=1.6e-2, atol=3e-2)
    half = SparseMatmul(a.bfloat16().to_sparse_bsr((16, 16)))
    x = torch.randn(32, 4).bfloat16()
    half(x)
    before = calls.fast
    y = half(x)
    assert calls.fast == before + 1 and torch.equal(y, proving(half, x))


@pytest.mark.parametrize("layout", ["bsr", "bsc"])
@pytest.mark.parametrize("batch", [1, 7, 33, 300])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_gradients(calls: Calls, x_dtype: torch.dtype, batch: int, layout: str
                            ) -> None:
    """With grad under autocast the plan's product and a bfloat16 backward: the proving
    path's gradients bit for bit (float32 parameters, the input's dtype: the bfloat16 kernels
    write the rounded gradients widened, the bits autocast's casts give on the proving
    path)."""
    layer = make(layout)
    x = torch.randn(batch, 96).to(x_dtype).requires_grad_(True)
    autocast_warm(layer, x.detach(), calls)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = calls.fast
        y = layer(x)
        assert calls.fast == before + 1 and y.dtype == torch.bfloat16
        g = torch.randn_like(y)
        y.backward(g)
        grads = (x.grad, layer.values.grad, layer.bias.grad)  # type: ignore[union-attr]
        x2 = x.detach().clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y2 = proving(layer, x2)
        y2.backward(g)
    assert torch.equal(y, y2)
    for got, want in zip(grads, (x2.grad, layer.values.grad, layer.bias.grad),  # type: ignore[union-attr]
                         strict=True):
        assert got is not None and want is not None and got.dtype == want.dtype
        assert torch.equal(got, want)
    assert grads[0].dtype == x_dtype and grads[1].dtype == torch.float32
    # against F.linear under autocast with the dense weight (bf16 rounding)
    w = layer.weight.to_dense().detach().requires_grad_(True)
    x3 = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x3, w, layer.bias).backward(g)
    torch.testing.assert_close(grads[0].float(), x3.grad.float(), rtol=2e-2, atol=5e-2)  # type: ignore[union-attr]


class Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


class SeenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_modes_pushed(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with Seen() as mode:
        fell_back(layer, x, calls)
    assert mode.n > 0
    with SeenOps() as ops:
        fell_back(layer, x, calls)
    assert any("safesparse.linear_bias" in op for op in ops.ops)


def test_functorch_and_subclasses(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    fast = calls.fast
    torch.func.vmap(layer)(torch.randn(2, 3, 96))
    torch.func.grad(lambda v: torch.func.functional_call(layer, {"values": v}, (x,)).sum())(
        layer.values.detach())
    assert calls.fast == fast

    class Sub(torch.Tensor):
        pass

    fell_back(layer, x.as_subclass(Sub), calls)
    fell_back(layer, x.t().contiguous().t(), calls)  # not contiguous


def test_dead_functorch_wrapper_takes_the_operators(calls: Calls) -> None:
    """A tensor that escaped a ``torch.func`` transform (a dead wrapper: a plain
    ``torch.Tensor`` without storage) is not read by the plan; the operators run it (the grad
    path calls ``autograd.Function``'s C ``apply``, without the Python layer that unwraps
    such tensors), with and without gradients."""
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    leaked: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        leaked.append(t)
        return t.sum()

    torch.func.grad(keep)(x.clone())
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    with torch.no_grad():
        want = proving(layer, x)
    slow = calls.proving
    with torch.no_grad():
        got = layer(dead)
    assert calls.proving == slow + 1
    torch.testing.assert_close(got, want)
    y = layer(dead)  # (the parameters require grad)
    assert calls.proving == slow + 2 and y.grad_fn is not None
    torch.testing.assert_close(y.detach(), want)


@pytest.mark.parametrize("warmed", [False, True])
def test_activation_checkpointing_takes_the_operators(calls: Calls, warmed: bool) -> None:
    """Non-reentrant checkpointing recomputes the forward in the backward and hands the graph
    the tensors saved then: the original run and the recomputation must save the same ones
    (the first call builds a plan; its recomputation must not take it)."""
    from torch.utils.checkpoint import checkpoint

    layer = make()
    x = torch.randn(2, 3, 96, requires_grad=True)
    if warmed:
        warm(layer, x.detach(), calls)
    fast = calls.fast
    checkpoint(layer, x, use_reentrant=False).pow(2).sum().backward()
    assert calls.fast == fast
    x2 = x.detach().clone().requires_grad_(True)
    grads = (x.grad, layer.values.grad)
    layer.zero_grad(set_to_none=True)
    proving(layer, x2).pow(2).sum().backward()
    for got, want in zip(grads, (x2.grad, layer.values.grad), strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want)


def test_debug_mode(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with ss.debug():
        fell_back(layer, x, calls)


def test_native_disabled_takes_the_torch_op_kernels(calls: Calls,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Within ``native.disabled()`` the torch-op kernels run, also for a layer holding a plan
    (which calls the library directly), forward and backward."""
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    packed = eager._packed_backward
    seen: list[int] = []

    def counted(*args: Any) -> Any:
        seen.append(1)
        return packed(*args)

    monkeypatch.setattr(eager, "_packed_backward", counted)
    xg = x.clone().requires_grad_(True)
    layer(xg).sum().backward()
    assert seen == [1]  # (outside the block: the plan's one backward call)
    y = layer(xg)  # (the plan's forward; its backward runs under disabled() below)
    with native.disabled():
        fell_back(layer, x, calls)
        fast = calls.fast
        y.sum().backward()
        layer(xg).sum().backward()
        assert calls.fast == fast and seen == [1]
    assert eager.plan_of(layer) is not None
    with torch.no_grad():
        before = calls.fast
        layer(x)
        assert calls.fast == before + 1  # (and the plan again after the block)


def test_inference_mode(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with torch.inference_mode():
        before = calls.fast
        y = layer(x)  # an ordinary layer under inference mode: the plan holds
        assert calls.fast == before + 1 and y.is_inference()
        assert torch.equal(y, proving(layer, x))
        made = make()  # members made under inference mode cannot be watched: never a plan
        made(x)
        made(x)
        assert eager.plan_of(made) is None


def test_shared_memory_never_gets_a_plan(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    layer.share_memory()
    with torch.no_grad():
        layer(x)
        layer(x)
    assert eager.plan_of(layer) is None and calls.fast == 0


def test_compiled_calls_never_take_it(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    fast = calls.fast
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        y = compiled(x)
        assert torch.equal(y, layer(x))
    assert calls.fast == fast + 1  # (the eager call only)


def test_forked_child_takes_the_proving_path(calls: Calls) -> None:
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    with torch.no_grad():
        want = layer(x)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once
        try:
            fast = calls.fast
            with torch.no_grad():
                y = layer(x)
            ok = torch.equal(y, want) and calls.fast == fast
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        got = os.read(read, 2) if ready else b"hang"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert got == b"ok"

"""Attacks on the eager fast path of ``SparseLinear`` / ``SparseMatmul`` (safesparse/nn/eager.py,
issue 46) that the tests beside it do not make: tensors whose memory is not what they hold
(torch's negative-bit views, zero tensors without memory), as the input of a layer holding a
plan and as the gradient its backward is given, and gradients differentiated again
(``create_graph=True``).

Claims: a negative view is read as the values it stands for (the result is the operators'); a
zero tensor is never handed to a kernel as an address (a crash before: the kernels read address
0; run in a child process with a timeout); the plan's gradients differentiated again raise the
operators' error, also where ``torch.autograd.grad(..., allow_unused=True)`` would otherwise
return None for a second derivative that is not zero; a write to the values that moves no
counter (through ``.data``) is never answered from a copy of the values made before it.
"""
# ruff: noqa: F811
# (the ``calls`` fixture is imported from test_eager_fast_path, and requested by name)

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_eager_fast_path import Calls, calls, make, proving, warm  # noqa: F401
from torch import nn

from safesparse.kernels import native
from safesparse.nn import SparseLinear, SparseMatmul, eager

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the fast path runs on the native kernels")

ROOT = Path(__file__).resolve().parents[2]
AGAIN = "differentiating the gradient of a safesparse product again is not supported"


def negative_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor equal to ``t`` (contiguous, of an even number of elements) whose
    memory holds ``-t``: torch's negative bit set, made with public torch only (``z.conj()
    .imag`` sets the bit, ``as_strided`` keeps it)."""
    z = torch.view_as_complex((-t).contiguous().reshape(-1, 2))
    neg = z.conj().imag.as_strided(t.shape, t.stride(), 0)
    assert neg.is_neg() and neg.is_contiguous() and type(neg) is torch.Tensor
    assert torch.equal(neg.resolve_neg(), t)
    return neg


# ---------------------------------------------------------------------------------------------
# Tensors whose memory is not what they hold


def test_negative_view_input_is_read_as_its_values(calls: Calls) -> None:
    """A layer holding a plan given a negative view reads the values it stands for (before:
    the plan read the memory, ``-x``, and returned ``-x @ W.T + b`` silently)."""
    layer = make()
    x = torch.randn(4, 96)
    warm(layer, x, calls)
    with torch.no_grad():
        want = layer(x)
        assert torch.equal(layer(negative_view(x)), want)
    torch.manual_seed(2)
    a = (torch.rand(48, 32) < 0.3).float() * torch.randn(48, 32)
    m = SparseMatmul(a.to_sparse_bsr((16, 16)))
    xm = torch.randn(32, 6)
    warm(m, xm, calls)
    with torch.no_grad():
        assert torch.equal(m(negative_view(xm)), m(xm))


def test_negative_view_gradient_is_read_as_its_values(calls: Calls) -> None:
    """The backward given a negative view as the output's gradient (``grad_outputs``) reads
    the values it stands for, as the operators' backward does."""
    layer = make()
    x, g = torch.randn(4, 96), torch.randn(4, 64)
    warm(layer, x, calls)
    xg = x.clone().requires_grad_(True)
    fast = calls.fast
    got = torch.autograd.grad(layer(xg), [xg, *layer.parameters()], negative_view(g))
    assert calls.fast == fast + 1
    want = torch.autograd.grad(proving(layer, xg), [xg, *layer.parameters()], g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


ZERO = r"""
import sys, torch
from torch import nn
from safesparse.nn import SparseLinear, SparseMatmul, eager
torch.manual_seed(0)
layer = SparseLinear.from_dense(nn.Linear(96, 64), 16, 0.3)
x = torch.randn(3, 96)
with torch.no_grad():
    layer(x)
assert eager.plan_of(layer) is not None
zero = torch._efficientzerotensor((3, 96))
assert zero._is_zerotensor() and type(zero) is torch.Tensor and zero.data_ptr() == 0
with torch.no_grad():
    y = layer(zero)
print("forward", torch.equal(y, layer.bias.detach().expand(3, 64)), flush=True)
with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
    layer(x)
    y = layer(zero)
print("autocast", torch.equal(y.float(), layer.bias.detach().bfloat16().float().expand(3, 64)),
      flush=True)
xg = x.clone().requires_grad_(True)
g = torch._efficientzerotensor((3, 64))
got = torch.autograd.grad(layer(xg), [xg, *layer.parameters()], g)
print("backward", all(not t.any() for t in got), flush=True)
a = SparseMatmul(torch.eye(32)[:, :32].to_sparse_bsr((16, 16)))
with torch.no_grad():
    a(torch.randn(32, 2))
    y = a(torch._efficientzerotensor((32, 2)))
print("matmul", not y.any(), flush=True)
"""


def test_zero_tensor_is_never_read_as_an_address() -> None:
    """A zero tensor (torch's ``_efficientzerotensor``: no memory, address 0, as autograd
    makes for some gradients) as a planned layer's input, under autocast too, as its
    backward's gradient and as a planned ``SparseMatmul``'s operand: the results of zeros
    (before: the kernels read address 0, a crash). In a child process, with a timeout."""
    done = subprocess.run([sys.executable, "-c", ZERO], capture_output=True, text=True,
                          timeout=240, check=False, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.split() == ["forward", "True", "autocast", "True", "backward", "True",
                                   "matmul", "True"], done.stdout


# ---------------------------------------------------------------------------------------------
# Gradients differentiated again


@pytest.mark.parametrize("wrt", ["input", "values"])
@pytest.mark.parametrize("loss", ["square", "linear"])
def test_gradient_differentiated_again_raises(calls: Calls, wrt: str, loss: str) -> None:
    """``create_graph=True`` through a planned layer, then a gradient of that gradient: the
    operators' error, as through the operators, also with ``allow_unused=True`` (before: the
    plan's gradients held no graph, so ``torch.autograd.grad`` found the input or the values
    unused and returned None for a second derivative that is not zero). A loss linear in the
    output (its gradient needs no graph) and a square one (it does)."""
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    for route in ("plan", "operators"):
        xg = x.clone().requires_grad_(True)
        fast = calls.fast
        y = layer(xg) if route == "plan" else proving(layer, xg)
        assert calls.fast == fast + (route == "plan")
        out = y.square().sum() if loss == "square" else (y * 3).sum()
        gx, gv = torch.autograd.grad(out, [xg, layer.values], create_graph=True)
        target = xg if wrt == "input" else layer.values
        with pytest.raises(RuntimeError, match=AGAIN):
            torch.autograd.grad((gx.square().sum() + gv.square().sum()), target,
                                allow_unused=True)
    # (the first-order gradients computed with create_graph=True are the plan's)
    xg = x.clone().requires_grad_(True)
    got = torch.autograd.grad(layer(xg).square().sum(), [xg, layer.values], create_graph=True)
    want = torch.autograd.grad(proving(layer, xg).square().sum(), [xg, layer.values])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.detach(), b)


# ---------------------------------------------------------------------------------------------
# Members of a tensor subclass


class Doubled(torch.Tensor):
    """A subclass whose ``safesparse`` products compute with twice its memory (as a
    dequantizing or masking subclass changes what the product reads)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if "safesparse" in str(func):
            args = tuple(a.as_subclass(torch.Tensor) * 2 if isinstance(a, Doubled) else a
                         for a in args)
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("member", ["values", "bias"])
def test_subclass_members_take_the_operators(calls: Calls, member: str) -> None:
    """A parameter of a ``__torch_function__`` subclass decides what the product reads
    (through the operators): no plan is built over it, every call takes the operators (before:
    the first call computed with the subclass, the plan's calls after it read the memory,
    silently another result)."""
    layer = make()
    x = torch.randn(3, 96)
    old = getattr(layer, member)
    setattr(layer, member, nn.Parameter(old.detach().clone().as_subclass(Doubled)))
    with torch.no_grad():
        want = proving(layer, x).as_subclass(torch.Tensor)
        got = [layer(x).as_subclass(torch.Tensor) for _ in range(3)]
    assert eager.plan_of(layer) is None and calls.fast == 0
    for y in got:
        assert torch.equal(y, want)



def test_strided_bias_written_in_place_is_read(calls: Calls) -> None:
    """A bias that is a strided view (``nn.Parameter(big[::2])``, a ``.data =``) is written
    in place (an optimizer step): the next call adds the new bias (before: the plan's array
    pointed at a contiguous copy of it made when the plan was built, and a plan that reads
    its members in place keys no counter of theirs: the old bias, silently)."""
    layer = make()
    strided = torch.zeros(128)[::2]
    strided.copy_(layer.bias.detach())  # type: ignore[union-attr]
    layer.bias = nn.Parameter(strided)
    assert not layer.bias.is_contiguous()
    for n in (1, 3, 40):
        x = torch.randn(n, 96)
        with torch.no_grad():
            for _ in range(3):
                layer(x)
            layer.bias.add_(1)
            torch.testing.assert_close(layer(x), proving(layer, x))



def test_plan_dropped_when_moved_to_shared_memory(calls: Calls) -> None:
    """A layer holding a plan, then ``share_memory()`` (a DataLoader or ``mp.Queue`` hand-off):
    another process may now write the index memory without moving a counter here, so the
    plan never holds again and no plan is built on it (the members are validated at each
    use); the results are the operators'."""
    layer = make()
    x = torch.randn(3, 96)
    warm(layer, x, calls)
    layer.share_memory()
    assert layer.plain_indices.is_shared()
    fast = calls.fast
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(layer(x), proving(layer, x))
    assert calls.fast == fast and eager.plan_of(layer) is None



@pytest.mark.parametrize("layout", ["bsr", "bsc"])
def test_checkpoint_loaded_into_a_planned_layer(calls: Calls, layout: str) -> None:
    """``load_state_dict`` of another pattern with as many blocks (copied into the buffers in
    place) into a layer holding a plan: the next calls compute with the loaded pattern, on a
    plan again (a BSC plan reads a row-wise copy of its pattern, made from the proof: it must
    be the loaded pattern's, never the old one's)."""
    layer = make(layout)
    x = torch.randn(5, 96)
    warm(layer, x, calls)
    dense = layer.weight.to_dense().roll(16, dims=1)  # (the same blocks, other columns)
    w = dense.to_sparse_bsr((16, 16)) if layout == "bsr" else dense.to_sparse_bsc((16, 16))
    other = SparseLinear(w, layer.bias.detach() * 2)  # type: ignore[union-attr]
    assert other.plain_indices.shape == layer.plain_indices.shape
    assert not torch.equal(other.plain_indices, layer.plain_indices)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        want = x @ dense.T + other.bias
        for _ in range(3):
            torch.testing.assert_close(layer(x), want)
        fast = calls.fast
        torch.testing.assert_close(layer(x), want)
    assert calls.fast == fast + 1


# ---------------------------------------------------------------------------------------------
# Writes to the values that move no counter


@pytest.mark.parametrize("kind", ["pre-packed", "autocast", "float16"])
def test_values_written_through_data_are_read(calls: Calls, kind: str) -> None:
    """``p.data.mul_(...)`` (an EMA update, a hand-written SGD step, ``_init_weights``) moves
    no counter of ``p``: a plan reading a copy of the values made before (pre-packed from 16
    rows, autocast's bfloat16 copy, a float16 layer's float32 copy) does not return the old
    values' product: it compares their fingerprint with the one taken before the copy (before:
    every output was the old values', with no error). The plan reading the values in place
    (batch 1, float32) is right."""
    layer = make()
    if kind == "float16":
        layer = layer.half()
    x = torch.randn(40, 96, dtype=torch.float16 if kind == "float16" else torch.float32)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=kind == "autocast"):
        for _ in range(3):  # (the pre-packed copy: made at the second call, read at the third)
            layer(x)
        fast = calls.fast
        layer.values.data.mul_(3)
        layer.bias.data.add_(1)
        got = layer(x)
        assert calls.fast == fast + 1
        want = proving(layer, x)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# What nn.Module.__call__ would run besides the forward


@pytest.mark.parametrize("where", ["subclass", "instance"])
def test_call_impl_overridden_runs(where: str) -> None:
    """``nn.Module.__call__`` calls ``self._call_impl``: one a subclass defines, or one set on
    the instance, runs at every call as through ``nn.Module.__call__`` (before: the layers'
    own ``__call__`` went to the forward directly, skipping it)."""
    seen: list[int] = []

    class Counted(SparseLinear):
        def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(1)
            return super()._call_impl(*args, **kwargs)

    base = make()
    layer = (Counted if where == "subclass" else SparseLinear)(
        base.weight.detach(), base.bias.detach())  # type: ignore[union-attr]
    if where == "instance":
        impl = layer._call_impl

        def counted(*args: Any, **kwargs: Any) -> Any:
            seen.append(1)
            return impl(*args, **kwargs)

        layer._call_impl = counted  # type: ignore[method-assign]
    x = torch.randn(3, 96)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(layer(x), base(x))
    assert seen == [1, 1, 1]
    assert not eager.forward_only(layer, type(layer).forward)


def test_training_through_data_never_reads_a_stale_copy(calls: Calls) -> None:
    """A training loop at 40 rows whose hand-written SGD step writes ``p.data`` (no counter
    moves): every forward computes with the values as they are now, as the operators do, and
    after the first write the copy seen stale the plan stops making pre-packed copies (such a
    loop would drop each one at the next call)."""
    layer = make()
    x = torch.randn(40, 96)
    warm(layer, x, calls)
    with torch.no_grad():
        layer(x)  # (the pre-packed copy made here)
    plan = eager.plan_of(layer)
    assert plan is not None and plan.pre_held is not None
    for _ in range(4):
        fast = calls.fast
        y = layer(x)
        assert calls.fast == fast + 1
        with torch.no_grad():
            torch.testing.assert_close(y, proving(layer, x), rtol=0, atol=0)
        y.square().sum().backward()
        for p in layer.parameters():
            p.data.add_(p.grad, alpha=-0.1)  # (an old-style step: no counter moves)
            p.grad = None
    assert eager.plan_of(layer) is plan and plan.pre_held is None and not plan.pre

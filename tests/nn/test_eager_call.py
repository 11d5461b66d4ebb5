"""``SparseLinear.__call__`` / ``SparseMatmul.__call__`` (safesparse/nn/forward.py): the eager
path directly where ``nn.Module.__call__`` would call nothing but the forward; everything else
``nn.Module.__call__`` does (hooks, ``module.compile()``, ``torch.jit.trace``, ``torch.fx``)
still happens."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

from safesparse.nn import SparseLinear, SparseMatmul, eager
from safesparse.nn import forward as fwd


@pytest.fixture
def module_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many calls went through ``nn.Module.__call__`` (its ``_call_impl``)."""
    seen = [0]
    impl = nn.Module._call_impl

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return impl(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counted)
    yield seen


def layer(bias: bool = True) -> SparseLinear:
    torch.manual_seed(0)
    return SparseLinear.from_dense(nn.Linear(32, 48, bias=bias), 16, 0.5)


X = torch.randn(3, 32)


def test_plain_call_skips_module_call(module_calls: list[int]) -> None:
    m = layer()
    want = fwd.linear_operators(m, X)
    for _ in range(3):
        assert torch.equal(m(X), want)
    a = SparseMatmul(m.weight.detach())
    assert torch.equal(a(X.T.contiguous()), fwd.matmul_operators(a, X.T.contiguous()))
    assert module_calls[0] == 0
    assert eager.forward_only(m, fwd.linear_forward)


def _hooked(kind: str, m: nn.Module, seen: list[str]) -> Callable[[], Any]:
    """Registers a hook of ``kind`` that records its call; returns its remover."""
    if kind == "forward_pre":
        h = m.register_forward_pre_hook(lambda mod, args: seen.append(kind))
    elif kind == "forward_pre_kwargs":
        h = m.register_forward_pre_hook(lambda mod, args, kw: seen.append(kind),
                                        with_kwargs=True)
    elif kind == "forward":
        h = m.register_forward_hook(lambda mod, args, out: seen.append(kind))
    elif kind == "backward":
        h = m.register_full_backward_hook(lambda mod, gi, go: seen.append(kind))
    elif kind == "backward_pre":
        h = m.register_full_backward_pre_hook(lambda mod, go: seen.append(kind))
    elif kind == "global_forward_pre":
        h = nn.modules.module.register_module_forward_pre_hook(
            lambda mod, args: seen.append(kind))
    elif kind == "global_forward":
        h = nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: seen.append(kind))
    elif kind == "global_backward":
        h = nn.modules.module.register_module_full_backward_hook(
            lambda mod, gi, go: seen.append(kind))
    else:
        h = nn.modules.module.register_module_full_backward_pre_hook(
            lambda mod, go: seen.append(kind))
    return h.remove


@pytest.mark.parametrize("kind", ["forward_pre", "forward_pre_kwargs", "forward", "backward",
                                  "backward_pre", "global_forward_pre", "global_forward",
                                  "global_backward", "global_backward_pre"])
@pytest.mark.parametrize("cls", [SparseLinear, SparseMatmul])
def test_hooks_run(module_calls: list[int], kind: str, cls: type) -> None:
    m = layer()
    x = X.clone().requires_grad_(True)
    if cls is SparseMatmul:
        m = SparseMatmul(m.weight.detach(), trainable=True)
        x = X.T.contiguous().requires_grad_(True)
    m(x)
    m(x)  # (warm: the plan is built)
    seen: list[str] = []
    remove = _hooked(kind, m, seen)
    try:
        y = m(x)
        y.sum().backward()
    finally:
        remove()
    assert seen == [kind]
    assert module_calls[0] >= 1
    assert eager.forward_only(m, type(m).forward)  # (the hook removed: the direct call again)


def test_forward_overridden_by_a_subclass_runs(module_calls: list[int]) -> None:
    class Doubled(SparseLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    m = layer()
    d = Doubled(m.weight.detach(), m.bias.detach())  # type: ignore[union-attr]
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(d(X), 2 * m(X))


def test_forward_set_on_the_instance_runs() -> None:
    m = layer()
    m(X)
    m.forward = lambda x: torch.zeros(1)  # type: ignore[method-assign]
    assert torch.equal(m(X), torch.zeros(1))
    del m.forward
    assert m(X).shape == (3, 48)


def test_keyword_and_extra_arguments_reach_module_call(module_calls: list[int]) -> None:
    m = layer()
    assert torch.equal(m(x=X), fwd.linear_operators(m, X))
    assert module_calls[0] == 1
    with pytest.raises(TypeError):
        m(X, X)


def test_compiled_call_impl_runs() -> None:
    m = layer()
    m(X)
    m._compiled_call_impl = lambda *a, **k: "compiled"  # (what module.compile() sets)
    assert m(X) == "compiled"


def test_profiler_sees_the_module_call(module_calls: list[int]) -> None:
    m = layer()
    m(X)
    with torch.profiler.profile():
        assert not eager.forward_only(m, fwd.linear_forward)
        m(X)
    assert module_calls[0] == 1


def test_jit_trace_records_the_module() -> None:
    m = nn.Sequential(nn.Linear(32, 32), layer())
    m(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, X)
    assert torch.equal(traced(X), m(X))


def test_fx_leaf_module_is_a_call_module_node() -> None:
    """torch.fx's symbolic trace replaces ``nn.Module.__call__``: a tracer keeping the layer as
    a leaf sees it called."""
    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, SparseLinear) or super().is_leaf_module(m, name)

    m = nn.Sequential(nn.Linear(32, 32), layer())
    graph = Leaves().trace(m)
    assert [n.op for n in graph.nodes] == ["placeholder", "call_module", "call_module", "output"]
    assert torch.equal(torch.fx.GraphModule(m, graph)(X), m(X))


def test_global_hook_dicts_are_torchs() -> None:
    """The hooks forward_only reads are the dicts torch's Module.__call__ reads."""
    torchs = (module_globals._global_forward_pre_hooks, module_globals._global_forward_hooks,
              module_globals._global_backward_pre_hooks, module_globals._global_backward_hooks)
    assert all(a is b for a, b in zip(eager._GLOBAL_HOOKS, torchs, strict=True))


def test_compiled_model_has_no_graph_break() -> None:
    import torch._dynamo

    m = nn.Sequential(nn.Linear(32, 32), layer(), nn.ReLU())
    explained = torch._dynamo.explain(m)(X)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(X), m(X))

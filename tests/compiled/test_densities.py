"""One compile for every density (SPEC 10): a layer's index members and values are dynamic in
their stored length under ``torch.compile``.

``nn.Module`` buffers and parameters get static shapes under dynamo, so each new number of
stored blocks recompiled, and the ninth model in one process hit the recompile limit (and ran
eagerly, or failed under ``fullgraph=True``). Twelve models of different densities compiled
in one process give eager's results, forward and backward, in at most three graphs; a layer
loading a checkpoint of another density runs the graph it has.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from safesparse.nn import SparseLinear, SparseMatmul

pytestmark = pytest.mark.slow  # (compiles)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    yield
    dynamo.reset()


def model(density: float, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(),
        SparseLinear.from_dense(nn.Linear(32, 32), 4, density), nn.ReLU(),
        SparseLinear.from_dense(nn.Linear(32, 8, bias=False), 4, 1.0 - density))


def test_twelve_densities_compile_in_at_most_three_graphs() -> None:
    counter = CompileCounterWithBackend("aot_eager")  # (the fakes and the backward traced)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    stored = set()
    for i in range(12):
        m = model(0.05 + 0.075 * i, seed=i)
        stored.add(tuple(int(mod.values.shape[0]) for mod in m if isinstance(mod, SparseLinear)))
        compiled = torch.compile(m, backend=counter, fullgraph=True)
        got = compiled(x)
        want = m(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        want.square().sum().backward()
        for g, p in zip(grads, m.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad)
    assert len(stored) == 12  # (twelve different numbers of stored blocks)
    assert counter.frame_count <= 3, counter.frame_count


def test_a_checkpoint_of_another_density_runs_the_same_graph() -> None:
    counter = CompileCounterWithBackend("aot_eager")
    layer = SparseLinear.from_dense(nn.Linear(32, 16), (4, 2), 0.2)
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(3, 32)
    compiled(x)
    for density in (0.4, 0.6, 0.9):
        other = SparseLinear.from_dense(nn.Linear(32, 16), (4, 2), density)
        layer.load_state_dict(other.state_dict())
        assert layer.values.shape == other.values.shape
        torch.testing.assert_close(compiled(x), other(x))
    assert counter.frame_count == 1


def test_sparse_matmul_of_other_densities_runs_the_same_graph() -> None:
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(12, 3)

    def run(a: SparseMatmul, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(a(x))

    compiled = torch.compile(run, backend=counter, fullgraph=True)
    for density in (0.2, 0.4, 0.6, 0.8):
        g = torch.Generator().manual_seed(int(density * 10))
        dense = torch.randn(12, 12, generator=g) * (torch.rand(12, 12, generator=g) < density)
        dense[0, 0] = 1.0
        a = SparseMatmul(dense.to_sparse_csr())
        torch.testing.assert_close(compiled(a, x), torch.relu(dense @ x))
    assert counter.frame_count == 1

"""Compiled and exported model code (SPEC 10): ``safesparse.nn`` modules compile and export.

A model (Linear, ReLU, SparseLinear, ReLU, Linear) traces as one graph with no break
(``torch._dynamo.explain``) for every compressed layout and block shape, with and without
bias; compiled with ``fullgraph=True`` and exported with ``torch.export`` it computes what
eager computes, forward and backward; a two-layer graph convolution written with
``SparseMatmul`` compiles the same way. The operator receives the module's very buffers in
compiled and exported programs, validates index members that are not the proven ones
(once: proven after) and refuses invalid ones.
Compiling is slow on small machines: most cases use the ``aot_eager`` backend (the same
graphs and autograd, no code generation), one case goes through inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

import safesparse as ss
from safesparse.nn import SparseLinear, SparseMatmul

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
CASES = [(CSR, None), (CSC, None), (BSR, (2, 3)), (BSR, (4, 4)), (BSC, (4, 3)), (BSC, (4, 4))]
IDS = [f"{str(lay).split('_')[-1]}-{b}" for lay, b in CASES]
OUT, IN = 16, 24


def weight(layout: torch.layout, blocksize: tuple[int, int] | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    r, c = blocksize or (1, 1)
    mask = torch.rand(OUT // r, IN // c, generator=g) < 0.5
    mask[0, 0] = True
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    return (torch.randn(OUT, IN, generator=g) * full).to_sparse(layout=layout,
                                                                blocksize=blocksize)


def model(layout: torch.layout, blocksize: tuple[int, int] | None, bias: bool
          ) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, IN), nn.ReLU(),
                         SparseLinear(weight(layout, blocksize), bias or None), nn.ReLU(),
                         nn.Linear(OUT, 4))


def grads(m: nn.Module, run: object, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    m.zero_grad()
    x = x.detach().requires_grad_(True)
    y = run(x)  # type: ignore[operator]
    y.pow(2).sum().backward()
    assert x.grad is not None
    return (y.detach(), x.grad, *(p.grad.clone() for p in m.parameters()
                                  if p.grad is not None))


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_one_graph_compiled_and_exported_match_eager(layout: torch.layout,
                                                     blocksize: tuple[int, int] | None,
                                                     bias: bool) -> None:
    m = model(layout, blocksize, bias)
    x = torch.randn(5, 8)
    explained = dynamo.explain(m)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    eager = grads(m, m, x)
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    assert_same(grads(m, compiled, x), eager)
    exported = torch.export.export(m, (x,))
    assert any("safesparse.linear" in str(n.target) for n in exported.graph.nodes)
    assert_same(grads(m, exported.module(), x), eager)


def test_inductor_compiles_the_model_with_its_dense_layers() -> None:
    m = model(BSR, (2, 3), True)
    x = torch.randn(5, 8)
    eager = grads(m, m, x)
    dynamo.reset()
    assert_same(grads(m, torch.compile(m, fullgraph=True), x), eager)


class GCN(nn.Module):
    """Two graph convolutions, ``A @ (x W)``, over a fixed normalised adjacency."""

    def __init__(self, adjacency: torch.Tensor) -> None:
        super().__init__()
        self.propagate = SparseMatmul(adjacency)
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.propagate(self.lin1(x)))
        return self.propagate(self.lin2(h))


@pytest.mark.parametrize("layout", [CSR, CSC], ids=["csr", "csc"])
def test_gcn_with_sparse_matmul_compiles_fullgraph(layout: torch.layout) -> None:
    torch.manual_seed(0)
    n = 10
    a = (torch.rand(n, n) < 0.3).float() + torch.eye(n)
    a = a / a.sum(1, keepdim=True)
    gcn = GCN(a.to_sparse(layout=layout))
    x = torch.randn(n, 6)
    torch.testing.assert_close(gcn(x), a @ gcn.lin2(torch.relu(a @ gcn.lin1(x))))
    explained = dynamo.explain(gcn)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    eager = grads(gcn, gcn, x)
    dynamo.reset()
    assert_same(grads(gcn, torch.compile(gcn, fullgraph=True, backend="aot_eager"), x), eager)
    assert_same(grads(gcn, torch.export.export(gcn, (x,)).module(), x), eager)


def test_trainable_sparse_matmul_values_get_gradients() -> None:
    a = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    mm = SparseMatmul(a.to_sparse_csr(), trainable=True)
    x = torch.randn(2, 3, requires_grad=True)
    (mm(x) * torch.arange(6.0).reshape(2, 3)).sum().backward()
    g = torch.arange(6.0).reshape(2, 3) @ x.detach().T  # d/dA of sum(G * (A @ x))
    torch.testing.assert_close(mm.values.grad, g[a != 0])
    assert not SparseMatmul(a.to_sparse_csr()).values.requires_grad


def test_compiled_program_receives_the_module_buffers() -> None:
    """What the O(1) confirmation rests on: the operator sees the module's buffer objects
    (their claims) in compiled programs, forward and backward, and in exported ones."""
    from safesparse.state import members_proof

    m = model(CSR, None, True)
    seen: list[bool] = []
    original = members_proof.proof

    def spy(c: torch.Tensor, p: torch.Tensor, geometry: object) -> tuple[bool, object]:
        seen.append(c is m[2].compressed_indices and p is m[2].plain_indices)
        return original(c, p, geometry)

    x = torch.randn(5, 8)
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    members_proof.proof = spy  # type: ignore[assignment]
    try:
        grads(m, compiled, x)
        grads(m, torch.export.export(m, (x,)).module(), x)
    finally:
        members_proof.proof = original
    assert len(seen) == 6 and all(seen)  # forward, grad to x, grad to values; twice


@pytest.mark.parametrize("how", ["data-swapped", "written", "assigned", "unvalidated"])
def test_operator_validates_members_that_are_not_the_proven_ones(how: str) -> None:
    """Valid members that are not the proven ones are validated once (O(nnz)) and proven for
    the next call, never refused (SPEC 9); the same members written with invalid data are
    refused before any kernel reads them, naming the key, eager and compiled."""
    m = model(CSR, None, True)
    layer = m[2]
    x = torch.randn(5, 8)
    want = m(x)
    if how == "data-swapped":
        layer.plain_indices.data = layer.plain_indices.clone()
    elif how == "written":
        with torch.no_grad():
            layer.plain_indices[0] = layer.plain_indices[0]
    elif how == "assigned":
        layer.plain_indices = layer.plain_indices.clone()
    else:
        c, p = layer.compressed_indices.clone(), layer.plain_indices.clone()
        ss.reset_stats()
        for _ in range(2):
            got = torch.ops.safesparse.linear(torch.randn(2, IN), c, p, layer.values.detach(),
                                              "csr", OUT, IN)
            assert got.shape == (2, OUT)
        assert ss.stats().validations == 1  # validated once, then proven
        with torch.no_grad():
            p[0] = IN + 5
        with pytest.raises(ss.InvariantError, match=r"plain_indices.*safesparse::linear"):
            torch.ops.safesparse.linear(torch.randn(2, IN), c, p, layer.values.detach(),
                                        "csr", OUT, IN)
        return
    ss.reset_stats()
    torch.testing.assert_close(m(x), want)
    assert ss.stats().validations == 1
    torch.testing.assert_close(m(x), want)
    assert ss.stats().validations == 1  # proven by the first call: O(1)
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), want)
    with torch.no_grad():
        layer.plain_indices[0] = IN + 5  # invalid data in place
    with pytest.raises(ss.InvariantError, match=r"\(at 2\.plain_indices\)"):
        m(x)
    with pytest.raises(ss.InvariantError, match="plain_indices"):
        compiled(x)
    # the way back: a new weight, validated where it enters
    layer.weight = weight(CSR, None)
    assert ss.is_checked(layer.weight)
    m(x)


def test_operator_checks_shapes_against_the_proof() -> None:
    layer = SparseLinear(weight(BSR, (4, 4)))
    ss.reset_stats()  # a geometry the members were not proven for: validated for it
    torch.ops.safesparse.linear(torch.randn(2, IN * 2), layer.compressed_indices,
                                layer.plain_indices, layer.values.detach(), "bsr", OUT, IN * 2)
    assert ss.stats().validations == 1
    with pytest.raises(ValueError, match="x must have shape"):
        torch.ops.safesparse.linear(torch.randn(2, IN + 1), layer.compressed_indices,
                                    layer.plain_indices, layer.values.detach(), "bsr", OUT, IN)

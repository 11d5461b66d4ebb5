"""torch's own tools around ``SparseLinear`` as around ``nn.Linear`` (issue 39, items 4 and 5):
``torch.func.grad`` / ``jacrev`` / ``vmap`` over ``functional_call`` (a batching rule: no
fallback warning), autocast, ``torch.jit.script`` (a clear error naming ``torch.export``),
activation checkpointing; the layer's edges (wrong width, dtype and device mismatches,
``in_features=0``, an int block size) behave as ``nn.Linear``'s.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.utils.checkpoint import checkpoint

from safesparse.nn import SparseLinear, SparseMatmul


def layer(bias: bool = True) -> SparseLinear:
    torch.manual_seed(0)
    out = SparseLinear.from_dense(nn.Linear(8, 4), (2, 2), 0.5)
    if not bias:
        out.bias = None
    return out


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def loss(m: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = functional_call(m, params, (x,)).pow(2).sum()
    return out


def test_func_grad_and_per_sample_grads() -> None:
    m = layer()
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = grad(lambda p: loss(m, p, X))(params)
    want = torch.autograd.grad(loss(m, dict(m.named_parameters()), X), [m.values, m.bias])
    torch.testing.assert_close(got["values"], want[0])
    torch.testing.assert_close(got["bias"], want[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no vmap fallback warning: a batching rule
        per_sample = vmap(grad(lambda p, xi: loss(m, p, xi[None])), in_dims=(None, 0))(
            params, X)
    assert per_sample["values"].shape == (3, *m.values.shape)
    torch.testing.assert_close(per_sample["values"].sum(0), want[0])


def test_vmap_and_jacrev_over_the_input() -> None:
    m = layer(bias=False)
    params = {k: v.detach() for k, v in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = vmap(lambda xi: functional_call(m, params, (xi,)))(X)
        j = jacrev(lambda xi: functional_call(m, params, (xi,)))(X[0])
    torch.testing.assert_close(y, m(X))
    torch.testing.assert_close(j, m.weight.to_dense().detach())


def test_vmap_over_sparse_matmul() -> None:
    a = torch.tensor([[1.0, 0, 2], [0, 3, 0]]).to_sparse_csr()
    m = SparseMatmul(a)
    xs = torch.randn(4, 3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = vmap(m)(xs)
    torch.testing.assert_close(y, a.to_dense() @ xs)


def test_autocast_cpu_bfloat16_computes_in_bfloat16() -> None:
    m = layer()
    dense = nn.Linear(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(X)
        assert dense(X).dtype == torch.bfloat16
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), m(X).detach(), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert m.values.grad is not None and m.values.grad.dtype == torch.float32


def test_activation_checkpointing() -> None:
    m = layer()
    x = X.clone().requires_grad_(True)
    checkpoint(m, x, use_reentrant=False).pow(2).sum().backward()
    x2 = X.clone().requires_grad_(True)
    m2 = layer()
    m2(x2).pow(2).sum().backward()
    assert x.grad is not None and x2.grad is not None
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_jit_script_names_torch_export() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.export\.export"):
        torch.jit.script(nn.Sequential(nn.Linear(4, 8), layer()))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_linear_shaped_edges() -> None:
    m = layer()
    with pytest.raises(RuntimeError, match=r"in_features=8, got 5"):
        m(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="float64"):
        m(torch.randn(2, 8, dtype=torch.float64))
    empty = SparseLinear.from_dense(nn.Linear(0, 4), None, 0.5)
    dense = nn.Linear(0, 4)
    with torch.no_grad():
        dense.bias.copy_(torch.arange(4.0))
        assert empty.bias is not None
        empty.bias.copy_(torch.arange(4.0))
    torch.testing.assert_close(empty(torch.randn(3, 0)), dense(torch.randn(3, 0)))
    square = SparseLinear.from_dense(nn.Linear(32, 32), 16, 0.5)
    assert square.blocksize == (16, 16)


@pytest.mark.parametrize("shape", [(4, 2), (4,), (2, 3, 1), ()], ids=str)
def test_matmul_shaped_edges_are_runtime_errors_naming_n_cols(shape: tuple[int, ...]) -> None:
    """``SparseMatmul`` at its edges as ``A @ x`` (torch: a ``RuntimeError``), never the
    operator's ``ValueError``; the right shapes still run."""
    m = SparseMatmul(torch.eye(3).to_sparse_csr())
    with pytest.raises(RuntimeError, match=r"n_cols=3, got "):
        m(torch.ones(shape))
    torch.testing.assert_close(m(torch.ones(3, 2)), torch.ones(3, 2))
    torch.testing.assert_close(m(torch.ones(3)), torch.ones(3))

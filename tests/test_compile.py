"""torch.compile with SafeSparseTensor arguments (default settings).

Validation and checked-state bookkeeping are compile boundaries (``torch.compiler.disable``):
they graph-break and run eagerly, so compiled functions get the same results, the same checked
state and the same errors as eager ones.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import safesparse as ss


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def sparse() -> ss.SafeSparseTensor:
    dense = torch.tensor([[1.0, 0.0, -2.0, 0.0], [0.0, 0.0, 3.0, 0.0], [4.0, -5.0, 0.0, 6.0]])
    return ss.validate(dense.to_sparse_csr())


def test_compiled_spmm_matches_eager() -> None:
    def f(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (a @ x).relu() * 2

    a = sparse()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(f)
    out = compiled(a, x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, f(a, x))
    torch.testing.assert_close(out, (a.to_dense() @ x).relu() * 2)
    x2 = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(compiled(a, x2), f(a, x2))  # a second call, new data
    assert ss.is_checked(a)


def test_compiled_validate_is_not_traced() -> None:
    def g(a: torch.Tensor) -> torch.Tensor:
        return ss.validate(a).t()

    compiled = torch.compile(g)
    a = sparse()
    plain = torch.sparse_csr_tensor(
        a.crow_indices().clone(), a.col_indices().clone(), a.values().clone(), a.shape,
        check_invariants=False,
    )
    ss.reset_stats()
    r = compiled(plain)
    assert type(r) is ss.SafeSparseTensor
    assert r.layout == torch.sparse_csc
    assert ss.is_checked(r)
    assert ss.stats().validations == 1  # really ran, once
    assert torch.equal(r.to_dense(), a.to_dense().t())

    # Validation runs on every call, with the data of that call.
    bad = torch.sparse_csr_tensor(
        torch.tensor([0, 2, 3, 4]), torch.tensor([0, 9, 2, 0]), torch.ones(4), (3, 4),
        check_invariants=False,
    )
    with pytest.raises(ss.InvariantError) as info:
        compiled(bad)
    assert info.value.invariant == "5.5"

    # An already checked argument is skipped, as in eager mode.
    ss.reset_stats()
    r2 = compiled(a)
    assert ss.is_checked(r2)
    assert ss.stats().validations == 0
    assert ss.stats().skipped == 1


def test_compiled_factory_validates() -> None:
    def build(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
              x: torch.Tensor) -> torch.Tensor:
        t = ss.sparse_csr_tensor(crow, col, values, (2, 2))
        return t @ x

    compiled = torch.compile(build)
    crow, x = torch.tensor([0, 1, 2]), torch.ones(2, 1)
    out = compiled(crow, torch.tensor([1, 0]), torch.tensor([2.0, 3.0]), x)
    torch.testing.assert_close(out, torch.tensor([[2.0], [3.0]]))
    with pytest.raises(ss.InvariantError) as info:
        compiled(crow, torch.tensor([1, 5]), torch.tensor([2.0, 3.0]), x)
    assert info.value.invariant == "5.5"


def test_import_does_not_load_dynamo_and_compile_arms_the_boundary() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, safesparse as ss\n"
        "from safesparse import _compile\n"
        "assert 'torch._dynamo' not in sys.modules, 'import safesparse loaded dynamo'\n"
        "assert not _compile._armed\n"
        "torch.compile(lambda x: x + 1)\n"
        "assert _compile._armed, 'importing dynamo did not arm the compile boundary'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

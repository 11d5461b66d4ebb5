"""torch.compile with SafeSparseTensor arguments (default settings).

Validation and checked-state bookkeeping are compile boundaries (``torch.compiler.disable``):
they graph-break and run eagerly, so compiled functions get the same results, the same checked
state and the same errors as eager ones. What dynamo compiles around sparse tensors is counted
with a counting backend (``CompileCounter``), so that docs/models.md says exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

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
        "from safesparse.base import compiling as _compile\n"
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


# --------------------------------------------------------------------------------------------
# What compiles (docs/models.md, "torch.compile"): graphs counted with a counting backend


def frames_compiled(fn: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    """(graphs compiled over two calls, the result) of ``torch.compile(fn)`` on ``args``."""
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter)
    compiled(*args)
    return counter.frame_count, compiled(*args)


def smooth(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ h) * 2 + h.sum()


def dense_tail(y: torch.Tensor) -> torch.Tensor:
    return torch.relu(y) * 2 + 1


def test_dense_function_compiles_one_graph() -> None:
    h = torch.randn(4, 3)
    assert frames_compiled(lambda x: torch.relu(x) * 2 + x, h)[0] == 1


@pytest.mark.parametrize("kind", ["safesparse", "plain torch"])
def test_sparse_argument_runs_the_whole_frame_eagerly(kind: str) -> None:
    a = sparse() if kind == "safesparse" else ss.unwrap(sparse())
    h = torch.randn(4, 3)
    graphs, out = frames_compiled(smooth, a, h)
    assert graphs == 0  # the dense relu / * / + around a @ h are not compiled either
    torch.testing.assert_close(out, smooth(a, h))


@pytest.mark.parametrize("kind", ["safesparse", "plain torch"])
def test_sparse_buffer_runs_forward_eagerly(kind: str) -> None:
    class Layer(torch.nn.Module):
        def __init__(self, a: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("a", a)
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.a @ h))

    a = sparse() if kind == "safesparse" else ss.unwrap(sparse())
    layer = Layer(a)
    h = torch.randn(4, 3)
    graphs, out = frames_compiled(layer, h)
    assert graphs == 0
    torch.testing.assert_close(out, layer(h))


def test_sparse_closure_runs_eagerly() -> None:
    a = sparse()
    h = torch.randn(4, 3)
    graphs, out = frames_compiled(lambda x: torch.relu(a @ x) * 2, h)
    assert graphs == 0
    torch.testing.assert_close(out, torch.relu(a @ h) * 2)


def test_dense_function_called_from_the_eager_frame_compiles() -> None:
    def outer(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return dense_tail(a @ h)

    a, h = sparse(), torch.randn(4, 3)
    counter = CompileCounter()
    compiled = torch.compile(outer, backend=counter)
    out = compiled(a, h)
    assert counter.frame_count == 1  # dense_tail, on its own
    assert counter.op_count == 3  # relu, *, +
    torch.testing.assert_close(out, dense_tail(a @ h))


def test_dense_code_before_the_first_sparse_value_compiles() -> None:
    def build(crow: torch.Tensor, col: torch.Tensor, v: torch.Tensor,
              h: torch.Tensor) -> torch.Tensor:
        h2 = torch.relu(h) * 2
        return ss.sparse_csr_tensor(crow, col, v, (3, 4)) @ h2

    a = sparse()
    members = (a.crow_indices().clone(), a.col_indices().clone(), a.values().clone())
    h = torch.randn(4, 3)
    counter = CompileCounter()
    compiled = torch.compile(build, backend=counter)
    out = compiled(*members, h)
    assert counter.frame_count == 1  # the graph of relu and * before the factory
    assert counter.op_count == 2
    torch.testing.assert_close(out, a @ (torch.relu(h) * 2))


# --------------------------------------------------------------------------------------------
# Errors reach the caller as in eager mode, debug mode included


def bad_checked_state() -> ss.SafeSparseTensor:
    """A SafeSparseTensor built unchecked on an out-of-range column (invariant 5.5)."""
    return ss.sparse_csr_tensor(torch.tensor([0, 2, 3, 4]), torch.tensor([0, 9, 2, 0]),
                                torch.ones(4), (3, 4), check_invariants=False)


FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "a @ x": lambda a, x: (a @ x) * 2,
    "a * 2": lambda a, x: (a * 2).to_dense() + 1,
    "a.mT": lambda a, x: a.mT.to_dense().sum() + x.sum(),
    "validate": lambda a, x: ss.validate(a) @ x,
    "dense first": lambda a, x: a @ (x.relu() * 3),
}


def eager_error(fn: Callable[..., Any], *args: Any) -> ss.InvariantError:
    with pytest.raises(ss.InvariantError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_debug_mode_invariant_error_reaches_the_caller_as_in_eager_mode(name: str) -> None:
    # dynamo reads attributes of the argument while it converts the frame; in debug mode that
    # validates it, and the error must not turn into dynamo's InternalTorchDynamoError
    fn = FUNCTIONS[name]
    x = torch.ones(4, 2)
    bad, bad2 = bad_checked_state(), bad_checked_state()  # (debug mode would refuse to build)
    with ss.debug():
        eager = eager_error(fn, bad, x)
        compiled = torch.compile(fn, backend="eager")
        with pytest.raises(ss.InvariantError) as info:
            compiled(bad2, x)
    assert type(info.value) is type(eager)
    assert info.value.invariant == "5.5"
    assert str(info.value) == str(eager)


def test_validate_in_compiled_code_raises_invariant_error_outside_debug_mode() -> None:
    fn = FUNCTIONS["validate"]
    x = torch.ones(4, 2)
    eager = eager_error(fn, bad_checked_state(), x)
    with pytest.raises(ss.InvariantError) as info:
        torch.compile(fn, backend="eager")(bad_checked_state(), x)
    assert str(info.value) == str(eager)


def test_debug_mode_errors_are_invariant_errors_on_every_call() -> None:
    compiled = torch.compile(FUNCTIONS["a @ x"], backend="eager")
    good = sparse()
    x = torch.ones(4, 2)
    bad = [bad_checked_state(), bad_checked_state()]
    with ss.debug():
        torch.testing.assert_close(compiled(good, x), (good @ x) * 2)
        for b in bad:
            with pytest.raises(ss.InvariantError):
                compiled(b, x)
        torch.testing.assert_close(compiled(good, x), (good @ x) * 2)

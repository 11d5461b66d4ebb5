"""The ``safesparse`` operators as torch sees them (SPEC 10, issue 48): every operator passes
``torch.library.opcheck`` (schema, autograd registration, fake against real, AOT dispatch with
dynamic shapes), and each fake runs its operator's O(1) checks, so a wrong width raises at
trace time as it does at run time.

Sample inputs come from small valid layers of every compressed layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from safesparse.nn import SparseLinear, UnprovenMembersError

pytestmark = pytest.mark.slow  # (AOT tracing)

ops = torch.ops.safesparse
OUT, IN, N = 8, 12, 3
CASES = [(torch.sparse_csr, None), (torch.sparse_csc, None), (torch.sparse_bsr, (2, 3)),
         (torch.sparse_bsc, (4, 2))]
IDS = ["csr", "csc", "bsr", "bsc"]


def members(layout: torch.layout, blocksize: tuple[int, int] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    g = torch.Generator().manual_seed(0)
    r, c = blocksize or (1, 1)
    mask = torch.rand(OUT // r, IN // c, generator=g) < 0.5
    mask[0, 0] = True
    dense = torch.randn(OUT, IN, generator=g, dtype=torch.float64) * mask.repeat_interleave(
        r, 0).repeat_interleave(c, 1)
    layer = SparseLinear(dense.to_sparse(layout=layout, blocksize=blocksize))
    name = layer._layout_name
    return layer.compressed_indices, layer.plain_indices, layer.values.detach(), name


def samples(layout: torch.layout, blocksize: tuple[int, int] | None
            ) -> dict[str, tuple[Any, ...]]:
    """Valid arguments of every operator over one layer's members (values and dense
    operands requiring gradients where the operator has a formula)."""
    c, p, v, name = members(layout, blocksize)
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    vg = v.clone().requires_grad_()
    return {
        "linear": (rand(N, IN, grad=True), c, p, vg, name, OUT, IN),
        "linear_bias": (rand(N, IN, grad=True), c, p, vg, rand(OUT, grad=True), name, OUT, IN),
        "linear_grad_input": (rand(N, OUT), c, p, v, name, OUT, IN),
        "linear_grad_values": (rand(N, OUT), rand(N, IN), c, p, v, name, OUT, IN),
        "matmul": (c, p, vg, name, OUT, IN, rand(IN, N, grad=True)),
        "matmul_grad_input": (c, p, v, name, OUT, IN, rand(OUT, N)),
        "matmul_grad_values": (c, p, v, name, OUT, IN, rand(OUT, N), rand(IN, N)),
        "prove": (c.clone(), p.clone(), name, OUT, IN, *(blocksize or (1, 1))),
    }


OPERATORS = ["linear", "linear_bias", "linear_grad_input", "linear_grad_values", "matmul",
             "matmul_grad_input", "matmul_grad_values", "prove"]


def test_every_operator_of_the_namespace_has_samples() -> None:
    import safesparse.enforcement.conversions  # noqa: F401  (registers its two operators)

    registered = {name for name in dir(ops) if isinstance(getattr(ops, name),
                                                          torch._ops.OpOverloadPacket)}
    conversions = {"checked_coo_to_csr", "checked_csr_to_coo"}  # (test_conversion_operators)
    assert registered == set(OPERATORS) | conversions


@pytest.mark.parametrize("op", OPERATORS)
@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_opcheck(op: str, layout: torch.layout, blocksize: tuple[int, int] | None) -> None:
    args = samples(layout, blocksize)[op]
    torch.library.opcheck(getattr(ops, op).default, args)


def test_conversion_operators_pass_opcheck() -> None:
    import safesparse.enforcement.conversions  # noqa: F401

    row = torch.tensor([0, 0, 2, 3])
    torch.library.opcheck(ops.checked_coo_to_csr.default, (row, 4), {"out_int32": False})
    crow = torch.tensor([0, 2, 2, 3, 4])
    col = torch.tensor([1, 3, 0, 2])
    torch.library.opcheck(ops.checked_csr_to_coo.default, (crow, col),
                          {"out_int32": False, "transpose": False})


def _wrong(op: str, args: tuple[Any, ...]) -> list[tuple[str, tuple[Any, ...]]]:
    """``args`` with one size wrong at a time: a dense operand's width (its height for
    ``A @ x``), the plain member's length, the compressed member's length."""
    out = []
    dim = 0 if op.startswith("matmul") else 1
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        if a.dim() == 2:  # a dense operand: one more column (row)
            shape = list(a.shape)
            shape[dim] += 1
            bad = torch.zeros(shape, dtype=a.dtype)
            out.append((f"arg {i} wider", (*args[:i], bad, *args[i + 1:])))
        elif a.dim() == 1 and a.dtype == torch.int64:  # an index member
            bad = torch.zeros(a.shape[0] + 1, dtype=a.dtype)
            out.append((f"arg {i} longer", (*args[:i], bad, *args[i + 1:])))
    return out


@pytest.mark.parametrize("op", OPERATORS[:-1])
def test_a_fake_given_a_wrong_size_raises_as_the_real_one(op: str) -> None:
    args = samples(torch.sparse_bsr, (2, 3))[op]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    cases = _wrong(op, args)
    assert cases
    for what, bad in cases:
        with pytest.raises((ValueError, UnprovenMembersError)) as real:
            getattr(ops, op)(*bad)
        mode = FakeTensorMode()
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in bad)
        with mode, pytest.raises(type(real.value)) as traced:
            getattr(ops, op)(*fake)
        assert str(traced.value).splitlines()[0] == str(real.value).splitlines()[0], what


def test_a_compiled_call_with_a_wrong_width_raises_at_trace_time() -> None:
    c, p, v, name = members(torch.sparse_csr, None)
    fn: Callable[..., torch.Tensor] = torch.compile(
        lambda x: ops.linear(x, c, p, v, name, OUT, IN), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    # raised by the fake while tracing (dynamo's TorchRuntimeError), before any kernel ran
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="x must have shape"):
        fn(torch.randn(N, IN + 1, dtype=torch.float64))


def test_inductor_caches_operand_graphs_without_a_pickling_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 46: ``ss.compile`` with inductor and dynamic shapes printed "Failed to pickle
    cache key" tracebacks (results right): torch's default cache key for a tensor subclass
    pickles its inner tensors' sizes, symbolic there. ``SparseOperand`` has its own key."""
    import safesparse as ss

    dense = torch.randn(16, 16, dtype=torch.float64)
    dense[dense.abs() < 0.8] = 0
    a = ss.validate(dense.to_sparse_csr())

    def f(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ x) * 2

    torch._dynamo.reset()
    compiled = ss.compile(f, dynamic=True)
    with caplog.at_level("WARNING"):
        for n in (3, 5):
            x = torch.randn(16, n, dtype=torch.float64)
            torch.testing.assert_close(compiled(a, x), torch.relu(dense @ x) * 2)
    assert not [r for r in caplog.records if "pickle" in r.getMessage()], caplog.text
    torch._dynamo.reset()


def test_the_operands_cache_key_tells_what_the_graph_depends_on() -> None:
    import safesparse as ss

    c, p, v, _ = members(torch.sparse_bsr, (2, 3))
    s = ss.sparse_bsr_tensor(c, p, v, (OUT, IN))
    plain = ss.as_operand(s)._stable_hash_for_caching()
    assert plain == ss.as_operand(s)._stable_hash_for_caching()
    trained = ss.sparse_bsr_tensor(c, p, v.clone().requires_grad_(), (OUT, IN))
    assert ss.as_operand(trained)._stable_hash_for_caching() != plain
    assert ss.as_operand(s).mT._stable_hash_for_caching() != plain
    assert ss.as_operand(s.to(torch.float32))._stable_hash_for_caching() != plain

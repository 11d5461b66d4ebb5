"""Sparse inputs of compiled code (SPEC 10): ``ss.compile`` and ``ss.as_operand``.

Every compressed layout and block shape traces as one graph with no break
(``torch._dynamo.explain``), and the compiled function (``fullgraph=True``) computes what eager
and a dense float64 reference compute, forward and backward (gradients to the dense operands
and to the values). Compiling is slow on small machines: most cases use ``aot_eager`` (the same
graphs and autograd, no code generation); one inductor compile runs every product of every
layout, transposed or not, forward and backward. With ``dynamic=True`` three numbers of
stored elements compile once; members written after compiling are refused; matrices proven
inside a graph by ``torch.ops.safesparse.prove`` compute, and invalid indices raise
``InvariantError`` from the compiled call.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import safesparse as ss
from safesparse import InvariantError, SparseOperand
from safesparse.base.layouts import compressed_members as members
from safesparse.nn import UnprovenMembersError

pytestmark = pytest.mark.slow  # (compiles)

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
NAMES = {CSR: "csr", CSC: "csc", BSR: "bsr", BSC: "bsc"}
CASES = [(CSR, None), (CSC, None), (BSR, (2, 3)), (BSR, (4, 1)), (BSC, (2, 3)),
         (BSC, (1, 2))]
IDS = [f"{NAMES[lay]}-{b}" for lay, b in CASES]
ROWS, COLS, D = 8, 6, torch.float64


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    dynamo.reset()
    yield
    dynamo.reset()


def matrix(layout: torch.layout, blocksize: tuple[int, int] | None, seed: int = 0
           ) -> ss.SafeSparseTensor:
    g = torch.Generator().manual_seed(seed)
    r, c = blocksize or (1, 1)
    mask = torch.rand(ROWS // r, COLS // c, generator=g) < 0.5
    mask[0, 0] = True
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(ROWS, COLS, generator=g, dtype=D) * full
    return ss.validate(dense.to_sparse(layout=layout, blocksize=blocksize))


def step(a: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Every kind of route: products on both sides, a transpose, F.linear, scalar values."""
    h = torch.relu(a @ (x @ w))                       # (ROWS, k)
    back = (a.t() * 0.5) @ h                          # (COLS, k)
    side = F.linear(h.T, a.mT, None) + h.T @ a        # (k, COLS)
    return back.square().sum() + torch.sparse.addmm(x, a.mT, h, beta=0.5).sum() \
        + side.sum()


def reference(dense: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(dense @ (x @ w))
    back = (dense.t() * 0.5) @ h
    side = h.T @ dense.mT.T + h.T @ dense
    return back.square().sum() + (0.5 * x + dense.mT @ h).sum() + side.sum()


def _inputs(s: ss.SafeSparseTensor) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    values = s.values().detach().clone().requires_grad_()
    x = torch.randn(COLS, 4, dtype=D, requires_grad=True)
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    return values, x, w


def _grads(out: torch.Tensor, *wrt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, wrt)


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_one_graph_equal_to_eager_and_dense(layout: torch.layout,
                                            blocksize: tuple[int, int] | None) -> None:
    s = matrix(layout, blocksize)
    values, x, w = _inputs(s)
    c, p = members(s)

    def operand() -> SparseOperand:
        return SparseOperand.from_members(c, p, values, NAMES[layout], s.shape)

    explained = dynamo.explain(step)(operand(), x, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(operand(), x, w)
    eager = step(operand(), x, w)
    dense_values = values.detach().clone().requires_grad_()
    dense = torch.sparse_compressed_tensor(c, p, dense_values, s.shape, layout=layout,
                                           check_invariants=True).to_dense()
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    ref = reference(dense, x_ref, w_ref)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(out, ref)
    got = _grads(out, values, x, w)
    for g, e, r in zip(got, _grads(eager, values, x, w),
                       _grads(ref, dense_values, x_ref, w_ref), strict=True):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize(("layout", "blocksize"), [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_ss_compile_takes_the_safesparse_tensor(layout: torch.layout,
                                                blocksize: tuple[int, int] | None) -> None:
    """``ss.compile``: SafeSparseTensor arguments, anywhere in the arguments' pytree."""
    s = matrix(layout, blocksize)
    _, x, w = _inputs(s)

    def batch_step(batch: dict[str, Any], w: torch.Tensor) -> torch.Tensor:
        return step(batch["adjacency"][0], batch["x"], w)

    explained = dynamo.explain(batch_step)({"adjacency": [ss.as_operand(s)], "x": x}, w)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    dynamo.reset()
    compiled = ss.compile(batch_step, fullgraph=True, backend="aot_eager")
    out = compiled({"adjacency": [s], "x": x}, w)
    torch.testing.assert_close(out, reference(s.to_dense(), x, w))
    torch.testing.assert_close(_grads(out, x, w),
                               _grads(reference(s.to_dense(), x, w), x, w))


def test_inductor_compiles_every_product_forward_and_backward() -> None:
    """One inductor compile over operands of the four layouts (blocks 2 x 3), each used
    as is and transposed (BSC / BSR with transposed blocks), gradients to every input."""
    cases = [(CSR, None), (CSC, None), (BSR, (2, 3)), (BSC, (2, 3))]
    mats = [matrix(lay, b, seed=i) for i, (lay, b) in enumerate(cases)]
    values = [m.values().detach().clone().requires_grad_() for m in mats]
    torch.manual_seed(2)
    x = torch.randn(COLS, 3, dtype=D, requires_grad=True)

    def f(ops: list[Any], x: torch.Tensor) -> torch.Tensor:
        total = x.sum() * 0
        for a in ops:
            y = a @ x                                  # matmul
            total = total + (a.t() @ y).square().sum()  # matmul, transposed layout
            total = total + (y.T @ a).sum()            # linear over the transpose
            total = total + F.linear(x.T, a).square().sum()  # linear
        return total

    def operands() -> list[SparseOperand]:
        return [SparseOperand.from_members(*members(m), v, NAMES[m.layout], m.shape)
                for m, v in zip(mats, values, strict=True)]

    out = torch.compile(f, fullgraph=True, backend="inductor")(operands(), x)
    eager = f(operands(), x)
    torch.testing.assert_close(out, eager)
    for g, e in zip(_grads(out, x, *values), _grads(eager, x, *values), strict=True):
        torch.testing.assert_close(g, e)


def test_dynamic_shapes_compile_once_over_three_nnz(monkeypatch: pytest.MonkeyPatch) -> None:
    """One compile serves every nnz, also with torch's structured trace on (a handler on its
    log: it prints the operand's repr while tracing, and an int() of the nnz there
    specialized the size: 3 compiles)."""
    dynamo.reset()  # (no cache entries or recorded failures from earlier tests)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = ss.compile(lambda a, x: torch.relu(a @ x).sum(), fullgraph=True,
                          dynamic=True, backend=counter)
    g = torch.Generator().manual_seed(0)
    from torch._logging._internal import trace_log

    monkeypatch.setattr(trace_log, "handlers", [logging.NullHandler()])
    for nnz in (30, 60, 90):
        index = torch.randint(0, 40, (2, nnz), generator=g)
        a = ss.sparse_coo_tensor(index, torch.rand(nnz, generator=g), (40, 40)).coalesce()
        a = a.to_sparse_csr()
        x = torch.randn(40, 5, generator=g)
        torch.testing.assert_close(compiled(a, x), torch.relu(a.to_dense() @ x).sum())
    failures = {code.co_name: reasons for code, reasons in
                torch._dynamo.utils.guard_failures.items()}
    assert counter.frame_count == 1, f"recompiled; guard failures: {failures}"


def test_members_written_after_compiling_are_refused() -> None:
    s = matrix(CSR, None)
    x = torch.randn(COLS, 2, dtype=D, requires_grad=True)
    a = ss.as_operand(s)
    f = torch.compile(lambda a, x: (a @ x).sum(), fullgraph=True, backend="aot_eager")
    out = f(a, x)
    out.backward()
    s.col_indices()[0] = COLS + 5  # invalid, written after the proof
    with pytest.raises((UnprovenMembersError, InvariantError)):
        f(a, x)  # the compiled forward confirms the members
    with pytest.raises(InvariantError):  # ss.compile validates again at the boundary
        ss.compile(lambda a, x: (a @ x).sum(), fullgraph=True, backend="aot_eager")(s, x)


def test_members_written_between_forward_and_backward_are_refused() -> None:
    s = matrix(BSR, (2, 3))
    v = s.values().detach().clone().requires_grad_()
    a = SparseOperand.from_members(*members(s), v, "bsr", s.shape)
    x = torch.randn(COLS, 2, dtype=D, requires_grad=True)
    out = torch.compile(lambda a, x: (a @ x).sum(), fullgraph=True, backend="aot_eager")(a, x)
    a.plain[0] = COLS  # invalid block column
    # (autograd's own check of the saved members' versions refuses first here; the compiled
    # backward's operators confirm them too)
    with pytest.raises((RuntimeError, InvariantError)):
        out.backward()


def _build(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
           x: torch.Tensor) -> torch.Tensor:
    c, p = torch.ops.safesparse.prove(compressed, plain, "bsr", 4, 6, 2, 3)
    a = SparseOperand.from_members(c, p, values, "bsr", (4, 6))
    return torch.relu(a @ x)


@pytest.mark.parametrize("name", ["bsr", "BSR", "Bsr"])
def test_prove_takes_the_layout_name_in_any_case(name: str) -> None:
    compressed, plain = torch.tensor([0, 1, 3]), torch.tensor([1, 0, 1])
    c, p = torch.ops.safesparse.prove(compressed, plain, name, 4, 6, 2, 3)
    assert torch.equal(c, compressed) and torch.equal(p, plain)
    with pytest.raises(ValueError, match="unknown layout"):
        torch.ops.safesparse.prove(compressed, plain, "bsx", 4, 6, 2, 3)


def test_prove_inside_a_graph() -> None:
    compressed, plain = torch.tensor([0, 1, 3]), torch.tensor([1, 0, 1])
    values = torch.randn(3, 2, 3, dtype=D, requires_grad=True)
    x = torch.randn(6, 2, dtype=D)
    explained = dynamo.explain(_build)(compressed, plain, values, x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    dynamo.reset()
    compiled = torch.compile(_build, fullgraph=True, backend="aot_eager")
    out = compiled(compressed, plain, values, x)
    dense_values = values.detach().clone().requires_grad_()
    dense = torch.sparse_bsr_tensor(compressed, plain, dense_values, (4, 6),
                                    check_invariants=True).to_dense()
    ref = torch.relu(dense @ x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(_grads(out.sum(), values), _grads(ref.sum(), dense_values))
    with pytest.raises(InvariantError, match=r"\[BSR 5\.5\]"):  # block column 2 of 2
        compiled(compressed, torch.tensor([1, 0, 2]), values, x)
    with pytest.raises(InvariantError, match=r"\[BSR"):  # not non-decreasing
        compiled(torch.tensor([0, 3, 1]), plain, values, x)


def test_exported_operand_keeps_the_values_an_input() -> None:
    class Layer(torch.nn.Module):
        def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(a @ x) + (x.T @ a.mT).T

    s = matrix(BSC, (2, 3))
    x = torch.randn(COLS, 3, dtype=D)
    program = torch.export.export(Layer(), (ss.as_operand(s), x)).module()
    s2 = s * 2  # other values on the same members
    want = torch.relu(s2.to_dense() @ x) + s2.to_dense() @ x
    torch.testing.assert_close(program(ss.as_operand(s2), x), want)


def test_values_gradients_after_a_compile_without_them() -> None:
    """The compile cache tells an operand whose values need a gradient from one whose values
    do not (a key without ``requires_grad`` once returned no gradient: a cached graph compiled
    without it)."""
    s = matrix(CSR, None)
    c, p = members(s)
    x = torch.randn(COLS, 3, dtype=D)

    def f(a: Any, x: torch.Tensor) -> torch.Tensor:
        return (a @ x).square().sum()

    frozen = SparseOperand.from_members(c, p, s.values().detach().clone(), "csr", s.shape)
    torch.compile(f, fullgraph=True, backend="inductor")(frozen, x)
    dynamo.reset()  # (the next compile looks in the on-disk caches)
    values = s.values().detach().clone().requires_grad_()
    trained = SparseOperand.from_members(c, p, values, "csr", s.shape)
    torch.compile(f, fullgraph=True, backend="inductor")(trained, x).backward()
    assert values.grad is not None
    ref_values = values.detach().clone().requires_grad_()
    f(SparseOperand.from_members(c, p, ref_values, "csr", s.shape), x).backward()
    torch.testing.assert_close(values.grad, ref_values.grad)


def test_ss_compile_takes_a_module() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, dtype=D)

        def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(a @ self.lin(x))

    layer = Layer()
    s = matrix(BSR, (2, 3))
    x = torch.randn(COLS, 4, dtype=D)
    compiled = ss.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(s, x)
    torch.testing.assert_close(out, torch.relu(s.to_dense() @ layer.lin(x)))
    out.sum().backward()
    assert layer.lin.weight.grad is not None

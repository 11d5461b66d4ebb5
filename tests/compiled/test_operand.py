"""``SparseOperand`` in eager code (SPEC 10, sparse inputs): every supported op equals a dense
float64 reference, forward and backward, for every compressed layout and block shape; every
other op is refused with its name; ``as_operand`` / ``from_operand`` keep the proof; the
operators' fakes give the real kernels' output strides. Compiled programs:
tests/compiled/test_compiled.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import safesparse as ss
from safesparse import InvariantError, SparseOperand
from safesparse.base.layouts import compressed_members as members
from safesparse.compiled import UnsupportedOperandOp
from safesparse.nn import UnprovenMembersError

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
CASES = [(CSR, None), (CSC, None), (BSR, (2, 3)), (BSR, (4, 1)), (BSC, (2, 3)),
         (BSC, (1, 2))]
IDS = [f"{str(lay).split('_')[-1]}-{b}" for lay, b in CASES]
ROWS, COLS = 8, 6
D = torch.float64


def dense(blocksize: tuple[int, int] | None, density: float = 0.5, seed: int = 0
          ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r, c = blocksize or (1, 1)
    mask = torch.rand(ROWS // r, COLS // c, generator=g) < density
    mask[0, 0] = True
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    return torch.randn(ROWS, COLS, generator=g, dtype=D) * full


def operand_with_values(d: torch.Tensor, layout: torch.layout,
                        blocksize: tuple[int, int] | None
                        ) -> tuple[SparseOperand, torch.Tensor, ss.SafeSparseTensor]:
    s = ss.validate(d.to_sparse(layout=layout, blocksize=blocksize))
    values = s.values().detach().clone().requires_grad_()
    name = {CSR: "csr", CSC: "csc", BSR: "bsr", BSC: "bsc"}[layout]
    return SparseOperand.from_members(*members(s), values, name, s.shape), values, s


def dense_of(values: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The dense matrix of ``s``'s pattern with ``values`` (differentiable in ``values``)."""
    c, p = members(s)
    plain = torch.sparse_compressed_tensor(c, p, values, s.shape, layout=s.layout,
                                           check_invariants=True)
    return plain.to_dense()


#: (name, f(A, x-like inputs)) pairs: every supported route, on operand or dense matrix
def _routes() -> list[tuple[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]]]:
    return [
        ("A @ x", lambda a, x, z: a @ x),
        ("A @ x[:, 0]", lambda a, x, z: a @ x[:, 0]),
        ("torch.mm", lambda a, x, z: torch.mm(a, x)),
        ("torch.matmul", lambda a, x, z: torch.matmul(a, x)),
        ("torch.sparse.mm", lambda a, x, z: torch.sparse.mm(a, x)),
        ("torch.sparse.addmm", lambda a, x, z: torch.sparse.addmm(z.T[:, :3], a, x,
                                                                  beta=0.5, alpha=2.0)),
        ("torch.addmm", lambda a, x, z: torch.addmm(z.T[:, :3], a, x)),
        ("x @ A", lambda a, x, z: z @ a),
        ("x @ A.mT", lambda a, x, z: x.T @ a.mT),
        ("F.linear", lambda a, x, z: F.linear(x.T, a, z[0])),
        ("A.t() @ z", lambda a, x, z: a.t() @ z.T),
        ("A.T @ z", lambda a, x, z: a.T @ z.T),
        ("A.mT.mT @ x", lambda a, x, z: a.mT.mT @ x),
        ("transpose(0, 1)", lambda a, x, z: a.transpose(0, 1) @ z.T),
        ("(2 * A / 4) @ x", lambda a, x, z: (2 * a / 4) @ x),
        ("(-A * 3) @ x", lambda a, x, z: (-a * 3) @ x),
    ]


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_every_route_equals_dense_forward_and_backward(
        layout: torch.layout, blocksize: tuple[int, int] | None) -> None:
    d = dense(blocksize)
    for name, f in _routes():
        a, values, s = operand_with_values(d, layout, blocksize)
        x = torch.randn(COLS, 3, dtype=D, requires_grad=True)
        z = torch.randn(3, ROWS, dtype=D, requires_grad=True)
        out = f(a, x, z)
        assert type(out) is torch.Tensor, name
        grads = torch.autograd.grad(out.square().sum(), (x, z, values), allow_unused=True)
        v_ref = values.detach().clone().requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        z_ref = z.detach().clone().requires_grad_()
        ref = f(dense_of(v_ref, s), x_ref, z_ref)
        torch.testing.assert_close(out, ref, msg=name)
        want = torch.autograd.grad(ref.square().sum(), (x_ref, z_ref, v_ref),
                                   allow_unused=True)
        for got, exp in zip(grads, want, strict=True):
            if exp is None:
                assert got is None or not got.any(), name
            else:
                assert got is not None, name
                torch.testing.assert_close(got, exp, msg=name)


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_values_and_round_trip(layout: torch.layout, blocksize: tuple[int, int] | None
                               ) -> None:
    d = dense(blocksize)
    s = ss.validate(d.to_sparse(layout=layout, blocksize=blocksize))
    a = ss.as_operand(s)
    assert a.layout == torch.strided and a.sparse_layout == layout and a.shape == s.shape
    torch.testing.assert_close(a.values(), s.values())
    back = a.t().to_sparse()
    assert isinstance(back, ss.SafeSparseTensor)
    assert ss.is_checked(back)
    torch.testing.assert_close(back.to_dense(), d.T)
    ss.reset_stats()
    assert ss.is_checked(ss.from_operand(a)) and ss.stats().validations == 0


def test_as_operand_validates_what_is_not_checked() -> None:
    plain = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 5]),
                                    torch.ones(2), (2, 2), check_invariants=False)
    with pytest.raises(InvariantError, match=r"\[CSR 5\.5\]"):
        ss.as_operand(plain)
    good = torch.eye(3).to_sparse_csr()
    torch.testing.assert_close(ss.as_operand(good) @ torch.ones(3, 1), torch.ones(3, 1))
    with pytest.raises(TypeError, match="CSR, CSC, BSR or BSC"):
        ss.as_operand(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="CSR, CSC, BSR or BSC"):
        ss.as_operand(torch.eye(3))


def test_gradients_reach_the_sparse_tensors_values() -> None:
    w = torch.rand(4, dtype=D, requires_grad=True)
    s = ss.sparse_csr_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]), w, (2, 2))
    x = torch.randn(2, 3, dtype=D)
    (ss.as_operand(s) @ x).sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(1).repeat(2))


REFUSED: list[tuple[str, Callable[[SparseOperand], Any]]] = [
    ("aten.sin", lambda a: torch.sin(a)),
    ("aten.add", lambda a: a + 1),
    ("mul with SparseOperand and Tensor", lambda a: a * torch.ones(())),
    ("aten.relu", lambda a: torch.relu(a)),
    ("to_dense", lambda a: a.to_dense()),
    ("aten.add", lambda a: torch.add(a, a, alpha=2)),
    ("aten.sum", lambda a: a.sum()),
    ("aten.select", lambda a: a[0]),
    ("aten.abs", lambda a: a.abs()),
    ("aten.exp", lambda a: a.exp()),
    ("aten.copy_", lambda a: a.copy_(torch.zeros(8, 6))),
    ("another SparseOperand", lambda a: a @ a),
    ("a 3-D", lambda a: a @ torch.zeros(2, 6, 1, dtype=D)),
    ("torch.sparse.mm with reduce='max'", lambda a: torch.sparse.mm(a, torch.zeros(6, 1),
                                                                    "max")),
    ("torch.mm with out=", lambda a: torch.mm(a, torch.zeros(6, 1, dtype=D),
                                              out=torch.zeros(8, 1, dtype=D))),
]


@pytest.mark.parametrize(("name", "f"), REFUSED, ids=[n for n, _ in REFUSED])
def test_every_other_op_is_refused_with_its_name(name: str,
                                                 f: Callable[[SparseOperand], Any]) -> None:
    a = ss.as_operand(ss.validate(dense(None).to_sparse_csr()))
    with pytest.raises(UnsupportedOperandOp, match=f"{name}.*\n.*\n.*ss.from_operand"):
        f(a)


def test_a_write_through_the_members_is_refused() -> None:
    s = ss.validate(dense(None).to_sparse_csr())
    a = ss.as_operand(s)
    x = torch.randn(COLS, 2, dtype=D)
    a.plain[0] = COLS + 3  # invalid, written after the proof
    with pytest.raises((UnprovenMembersError, InvariantError)):
        a @ x
    with pytest.raises((UnprovenMembersError, InvariantError)):
        x.T @ a.mT


# ---------------------------------------------------------------------------------------------
# The operators' fakes (what compiled code allocates) agree with the real kernels' strides


@pytest.mark.parametrize("density", [0.3, 1.0])
@pytest.mark.parametrize(("layout", "blocksize"),
                         [*CASES, (BSR, (4, 6)), (BSC, (4, 6))],
                         ids=[*IDS, "bsr-(4, 6)", "bsc-(4, 6)"])
@pytest.mark.parametrize("transposed", [False, True], ids=["", "t"])
def test_fakes_give_the_real_strides(layout: torch.layout, blocksize: tuple[int, int] | None,
                                     transposed: bool, density: float) -> None:
    s = ss.validate(dense(blocksize, density).to_sparse(layout=layout, blocksize=blocksize))
    if transposed:
        s = s.t()  # BSR <-> BSC with transposed (non-contiguous) blocks
    name = {CSR: "csr", CSC: "csc", BSR: "bsr", BSC: "bsc"}[s.layout]
    c, p = members(s)
    v0 = s.values()
    v = torch.empty_strided(v0.shape, v0.stride(), dtype=D).copy_(v0)
    n, m = s.shape
    x, g = torch.randn(m, 5, dtype=D), torch.randn(n, 5, dtype=D)
    xl, gl = torch.randn(5, m, dtype=D), torch.randn(5, n, dtype=D)
    ops = torch.ops.safesparse
    calls: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "matmul": (ops.matmul, (c, p, v, name, n, m, x)),
        "matmul_grad_input": (ops.matmul_grad_input, (c, p, v, name, n, m, g)),
        "matmul_grad_values": (ops.matmul_grad_values, (c, p, v, name, n, m, g, x)),
        "linear": (ops.linear, (xl, c, p, v, name, n, m)),
        "linear_grad_input": (ops.linear_grad_input, (gl, c, p, v, name, n, m)),
        "linear_grad_values": (ops.linear_grad_values, (gl, xl, c, p, v, name, n, m)),
    }
    for op_name, (op, args) in calls.items():
        real = op(*args)
        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with mode:
            fake = op(*fake_args)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(),
                                                           real.dtype), op_name


# ---------------------------------------------------------------------------------------------
# As an attacker: members that are not the proven ones never reach a kernel


def _refused_or_right(f: Callable[[], torch.Tensor], expected: torch.Tensor) -> None:
    """Valid members that are not the proven ones are refused, or validated and used (the
    operators may validate what they cannot confirm): never a wrong result."""
    try:
        got = f()
    except (UnprovenMembersError, InvariantError):
        return
    torch.testing.assert_close(got, expected)


def test_members_never_proven_are_refused_or_validated() -> None:
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    a = SparseOperand.from_members(crow, col, torch.ones(2), "csr", (2, 2))
    _refused_or_right(lambda: a @ torch.ones(2, 1), torch.ones(2, 1))
    bad = SparseOperand.from_members(crow, torch.tensor([1, 7]), torch.ones(2), "csr", (2, 2))
    with pytest.raises((UnprovenMembersError, InvariantError)):
        bad @ torch.ones(2, 1)


def test_a_geometry_other_than_the_proven_one_is_not_trusted() -> None:
    s = ss.validate(torch.eye(3).to_sparse_csr())
    c, p = members(s)
    narrow = SparseOperand.from_members(c, p, torch.ones(3), "csr", (3, 2))  # column 2 of 2
    with pytest.raises((UnprovenMembersError, InvariantError)):
        narrow @ torch.ones(2, 1)
    wide = SparseOperand.from_members(c, p, torch.ones(3), "csr", (3, 10))  # valid, unproven
    x = torch.randn(10, 1)
    _refused_or_right(lambda: wide @ x, x[:3])
    flipped = SparseOperand.from_members(c, p, torch.ones(3, 1, 1), "bsr", (3, 3))
    torch.testing.assert_close(flipped @ torch.ones(3, 1), torch.ones(3, 1))  # 1x1 blocks


def test_members_replaced_on_the_operand_are_not_trusted() -> None:
    a = ss.as_operand(ss.validate(torch.eye(3).to_sparse_csr()))
    a.plain = a.plain.clone()  # the same data, but not the proven members
    _refused_or_right(lambda: a @ torch.ones(3, 1), torch.ones(3, 1))
    a.plain = torch.tensor([0, 1, 9])  # invalid
    with pytest.raises((UnprovenMembersError, InvariantError)):
        a @ torch.ones(3, 1)


def test_a_sum_of_operands_needs_one_pattern() -> None:
    a = ss.as_operand(ss.validate(torch.eye(3).to_sparse_csr()))
    torch.testing.assert_close((a + a) @ torch.ones(3, 1), 2 * torch.ones(3, 1))
    b = ss.as_operand(ss.validate(torch.eye(3).flip(0).to_sparse_csr()))  # same nnz
    with pytest.raises(UnsupportedOperandOp, match=r"aten\.add"):
        a + b


def test_with_values_trains_other_values_on_the_same_members() -> None:
    s = ss.validate(dense((2, 3)).to_sparse_bsr((2, 3)))
    a = ss.as_operand(s)
    v = torch.randn_like(s.values()).requires_grad_()
    x = torch.randn(COLS, 2, dtype=D)
    (a.with_values(v) @ x).square().sum().backward()
    v_ref = v.detach().clone().requires_grad_()
    (dense_of(v_ref, s) @ x).square().sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad)
    with pytest.raises(ValueError, match="values of shape"):
        a.with_values(v[:-1])


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_from_members_takes_the_layout_as_a_torch_layout_or_any_case_name(
        layout: torch.layout, blocksize: tuple[int, int] | None) -> None:
    d = dense(blocksize)
    s = ss.validate(d.to_sparse(layout=layout, blocksize=blocksize))
    short = {CSR: "csr", CSC: "csc", BSR: "bsr", BSC: "bsc"}[layout]
    x = torch.randn(COLS, 2, dtype=D)
    for spelling in (layout, short, short.upper()):
        a = SparseOperand.from_members(*members(s), s.values(), spelling, s.shape)
        assert a.sparse_layout == layout
        torch.testing.assert_close(a @ x, d @ x)
    for wrong in ("coo", torch.sparse_coo, torch.strided, 3):
        with pytest.raises(ValueError, match="unknown layout"):
            SparseOperand.from_members(*members(s), s.values(), wrong, s.shape)  # type: ignore[arg-type]

"""Autograd through SafeSparseTensor (docs/models.md, "Autograd").

``requires_grad=True`` factories give leaves whose ``.grad`` backward fills; values that require
grad pass their gradients through the wrapper, through preserving ops and transposes, and
through ``ss.unwrap``; gradcheck passes for ``values -> factory(..., values, ...) @ dense``.
Every gradient is compared with the same computation on plain torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import safesparse as ss

CROW = torch.tensor([0, 2, 3, 4])
COL = torch.tensor([0, 2, 1, 2])
COO_IDX = torch.tensor([[0, 0, 1, 2], [0, 2, 1, 2]])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dense_operand(rows: int, cols: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=_gen(1), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Leaves


@pytest.mark.parametrize("layout", ["CSR", "CSC", "COO"])
def test_requires_grad_factory_gives_a_leaf(layout: str) -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    if layout == "COO":
        args: tuple[Any, ...] = (COO_IDX, values, (3, 3))
        t = ss.sparse_coo_tensor(*args, requires_grad=True)
        ref = torch.sparse_coo_tensor(*args, requires_grad=True, check_invariants=True)
    else:
        ss_factory = ss.sparse_csr_tensor if layout == "CSR" else ss.sparse_csc_tensor
        torch_factory = torch.sparse_csr_tensor if layout == "CSR" else torch.sparse_csc_tensor
        args = (CROW, COL, values, (3, 3))
        t = ss_factory(*args, requires_grad=True)
        ref = torch_factory(*args, requires_grad=True, check_invariants=True)
    assert type(t) is ss.SafeSparseTensor
    assert t.is_leaf
    assert t.requires_grad
    assert t.grad_fn is None
    assert ss.is_checked(t)
    assert not values.requires_grad  # the caller's values are not touched
    x = dense_operand(3)
    (t @ x).sum().backward()
    (ref @ x).sum().backward()
    assert t.grad is not None and ref.grad is not None
    assert t.grad.layout == ref.grad.layout
    torch.testing.assert_close(t.grad.to_dense(), ref.grad.to_dense())


def test_requires_grad_false_by_default() -> None:
    t = ss.sparse_csr_tensor(CROW, COL, torch.ones(4), (3, 3))
    assert not t.requires_grad
    assert t.is_leaf


def test_requires_grad_with_check_invariants_false() -> None:
    t = ss.sparse_csr_tensor(CROW, COL, torch.ones(4), (3, 3), requires_grad=True,
                             check_invariants=False)
    assert t.is_leaf and t.requires_grad
    (t @ dense_operand(3)).sum().backward()
    assert t.grad is not None


def test_requires_grad_underscore_on_a_wrapper() -> None:
    t = ss.sparse_csr_tensor(CROW, COL, torch.ones(4), (3, 3))
    t.requires_grad_()
    assert t.is_leaf and t.requires_grad
    assert ss.is_checked(t)
    (t @ dense_operand(3)).sum().backward()
    assert t.grad is not None


# ---------------------------------------------------------------------------------------------
# Values that require grad


Op = Callable[[torch.Tensor], torch.Tensor]

# (dtype moves are left out: torch 2.13 cannot backpropagate through .to() of a sparse CSR)
VALUE_OPS: list[tuple[str, Op]] = [
    ("identity", lambda t: t),
    ("mul_scalar", lambda t: t * 2),
    ("rmul_scalar", lambda t: 3 * t),
    ("neg", lambda t: -t),
    ("clone", lambda t: t.clone()),
    ("t", lambda t: t.t()),
    ("mT", lambda t: t.mT),
    ("transpose", lambda t: t.transpose(0, 1)),
    ("transpose_twice", lambda t: t.transpose(-2, -1).transpose(-2, -1)),
    ("mul_then_t", lambda t: (t * 2).t()),
]


@pytest.mark.parametrize(("name", "op"), VALUE_OPS, ids=[n for n, _ in VALUE_OPS])
def test_values_gradients_match_plain_torch(name: str, op: Op) -> None:
    base = torch.tensor([1.0, -2.0, 3.0, 0.5])
    x = dense_operand(3)

    v_ss = base.clone().requires_grad_()
    t = ss.sparse_csr_tensor(CROW, COL, v_ss, (3, 3))
    assert t.requires_grad and not t.is_leaf
    r = op(t)
    assert type(r) is ss.SafeSparseTensor
    out = r @ x
    assert type(out) is torch.Tensor
    (out * out).sum().backward()

    v_ref = base.clone().requires_grad_()
    ref = torch.sparse_csr_tensor(CROW, COL, v_ref, (3, 3), check_invariants=True)
    out_ref = op(ref) @ x
    (out_ref * out_ref).sum().backward()

    # and a dense reference that does not use sparse autograd at all
    v_dense = base.clone().requires_grad_()
    rows = torch.tensor([0, 0, 1, 2])
    dense = torch.zeros(3, 3).index_put((rows, COL), v_dense)
    out_dense = op(dense) @ x
    (out_dense * out_dense).sum().backward()

    torch.testing.assert_close(out.detach(), out_ref.detach())
    assert v_ss.grad is not None and v_ref.grad is not None
    torch.testing.assert_close(v_ss.grad, v_ref.grad)
    torch.testing.assert_close(v_ss.grad, v_dense.grad)
    assert v_ss.grad.abs().sum() > 0


@pytest.mark.parametrize("blocked", [False, True], ids=["CSR", "BSR"])
def test_values_gradients_through_zero_copy_transpose(blocked: bool) -> None:
    g = _gen(3)
    if blocked:
        base = torch.randn(4, 2, 2, generator=g)
        factory = ss.sparse_bsr_tensor
        size = (6, 6)
    else:
        base = torch.randn(4, generator=g)
        factory = ss.sparse_csr_tensor
        size = (3, 3)
    x = torch.randn(size[0], 3, generator=g)

    v = base.clone().requires_grad_()
    t = factory(CROW, COL, v, size)
    r = t.mT
    assert r.layout in (torch.sparse_csc, torch.sparse_bsc)
    out = r.to_dense() @ x
    out.pow(2).sum().backward()

    v_ref = base.clone().requires_grad_()
    plain = ss.unwrap(factory(CROW, COL, v_ref, size))
    out_ref = plain.to_dense().mT @ x
    out_ref.pow(2).sum().backward()

    torch.testing.assert_close(out, out_ref)
    assert v.grad is not None
    torch.testing.assert_close(v.grad, v_ref.grad)


def test_unwrap_stays_connected() -> None:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    t = ss.sparse_csr_tensor(CROW, COL, v, (3, 3))
    plain = ss.unwrap(t)
    assert type(plain) is torch.Tensor
    assert plain.requires_grad
    assert plain.grad_fn is not None
    x = dense_operand(3)
    (plain @ x).sum().backward()
    assert v.grad is not None
    torch.testing.assert_close(v.grad, x.sum(1)[COL])  # d/dv_k sum(A @ x) = sum_j x[col_k, j]


def test_unwrap_of_a_leaf_passes_grad_to_the_leaf() -> None:
    t = ss.sparse_csr_tensor(CROW, COL, torch.ones(4), (3, 3), requires_grad=True)
    plain = ss.unwrap(t)
    assert type(plain) is torch.Tensor
    assert plain.requires_grad and not plain.is_leaf
    (plain @ dense_operand(3)).sum().backward()
    assert t.grad is not None


def test_unwrap_without_grad_is_the_same_data() -> None:
    t = ss.sparse_csr_tensor(CROW, COL, torch.ones(4), (3, 3))
    plain = ss.unwrap(t)
    assert type(plain) is torch.Tensor
    assert not plain.requires_grad
    assert plain.values().data_ptr() == t.values().data_ptr()


def test_validate_keeps_the_graph() -> None:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    plain = torch.sparse_csr_tensor(CROW, COL, v, (3, 3), check_invariants=False)
    t = ss.validate(plain)
    assert t.requires_grad
    (t @ dense_operand(3)).sum().backward()
    assert v.grad is not None


def test_no_grad_results_do_not_require_grad() -> None:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    t = ss.sparse_csr_tensor(CROW, COL, v, (3, 3))
    with torch.no_grad():
        r = t * 2
    assert not r.requires_grad
    assert ss.is_checked(r)
    d = t.detach()
    assert not d.requires_grad
    assert ss.is_checked(d)


# ---------------------------------------------------------------------------------------------
# gradcheck


def _gradcheck(fn: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> None:
    assert torch.autograd.gradcheck(fn, (values.requires_grad_(),))


def test_gradcheck_csr() -> None:
    x = dense_operand(3, 2, torch.float64)
    _gradcheck(lambda v: ss.sparse_csr_tensor(CROW, COL, v, (3, 3)) @ x,
               torch.randn(4, dtype=torch.float64, generator=_gen()))


def test_gradcheck_csc() -> None:
    x = dense_operand(3, 2, torch.float64)
    _gradcheck(lambda v: ss.sparse_csc_tensor(CROW, COL, v, (3, 3)) @ x,
               torch.randn(4, dtype=torch.float64, generator=_gen()))


def test_gradcheck_bsr_square_blocks() -> None:
    x = dense_operand(6, 3, torch.float64)
    _gradcheck(lambda v: ss.sparse_bsr_tensor(CROW, COL, v, (6, 6)) @ x,
               torch.randn(4, 2, 2, dtype=torch.float64, generator=_gen()))


def test_gradcheck_coo() -> None:
    x = dense_operand(3, 2, torch.float64)
    _gradcheck(lambda v: ss.sparse_coo_tensor(COO_IDX, v, (3, 3)) @ x,
               torch.randn(4, dtype=torch.float64, generator=_gen()))


def test_gradcheck_coo_uncoalesced() -> None:
    idx = torch.tensor([[0, 2, 0, 1], [2, 1, 2, 0]])  # a duplicate, unsorted
    x = dense_operand(3, 2, torch.float64)
    _gradcheck(lambda v: ss.sparse_coo_tensor(idx, v, (3, 3)) @ x,
               torch.randn(4, dtype=torch.float64, generator=_gen()))


def test_gradcheck_through_preserving_ops_and_transpose() -> None:
    x = dense_operand(3, 2, torch.float64)
    _gradcheck(lambda v: (ss.sparse_csr_tensor(CROW, COL, v, (3, 3)) * 2).mT @ x,
               torch.randn(4, dtype=torch.float64, generator=_gen()))


def test_gradcheck_bsc_to_bsr_transpose() -> None:
    # BSC @ dense is not implemented on CPU; its transpose (a BSR view) is.
    x = dense_operand(6, 2, torch.float64)
    _gradcheck(lambda v: ss.sparse_bsc_tensor(CROW, COL, v, (6, 6)).mT @ x,
               torch.randn(4, 2, 2, dtype=torch.float64, generator=_gen()))

"""Sparse weights in model code (SPEC 9): ``F.linear``, ``torch.sparse.mm`` and
``torch.sparse.addmm`` with a checked sparse weight of every compressed layout and block shape.

torch 2.13 on CPU has no kernel for most of them (non-square BSR blocks: "MKL Sparse doesn't
support matrices with non-square blocks"; BSC, and ``F.linear`` with a BSR weight: "addmm:
computation on CPU is not implemented for Strided + Strided @ SparseBsr"), while ``W @ x``
works: every form is compared with the same computation on the dense matrix, and gradients for
the weight's values, the dense operand and the bias are checked with ``gradcheck`` (float64).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import safesparse as ss

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
#: block rows x block columns of the test weights, and their block pattern
MASK = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
CASES = ([(layout, block) for layout in (BSR, BSC)
          for block in [(2, 3), (3, 2), (1, 4), (4, 4)]]
         + [(CSR, (1, 1)), (CSC, (1, 1))])
NAMES = {CSR: "CSR", CSC: "CSC", BSR: "BSR", BSC: "BSC"}
CASE_PARAMS = pytest.mark.parametrize(
    ("layout", "block"), CASES, ids=[f"{NAMES[lay]}-{b[0]}x{b[1]}" for lay, b in CASES])


def weight(layout: torch.layout, block: tuple[int, int], dtype: torch.dtype = torch.float64
           ) -> tuple[ss.SafeSparseTensor, torch.Tensor]:
    """A checked weight of ``layout`` and its dense matrix (3 x 4 blocks, 7 of them stored)."""
    g = torch.Generator().manual_seed(0)
    r, c = block
    full = MASK.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(*full.shape, generator=g, dtype=dtype) * full
    blocksize = block if layout in (BSR, BSC) else None
    w = ss.validate(dense.to_sparse(layout=layout, blocksize=blocksize))
    return w, dense


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.layout in (CSR, BSR):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def rebuild(w: torch.Tensor) -> Callable[[torch.Tensor], ss.SafeSparseTensor]:
    """``values -> the weight with those values`` (on ``w``'s checked index tensors)."""
    compressed, plain = members(w)
    return lambda v: ss.sparse_compressed_tensor(compressed, plain, v, w.shape, layout=w.layout)


#: (name, f(W, x, y, bias), reference(D, x, y, bias), x's shape given W's (out, in))
FORMS: list[tuple[str, Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                  Callable[[int, int], tuple[int, ...]]]] = [
    ("F.linear", lambda w, x, y, b: F.linear(x, w), lambda d, x, y, b: x @ d.T,
     lambda o, i: (5, i)),
    ("F.linear+bias", lambda w, x, y, b: F.linear(x, w, b), lambda d, x, y, b: x @ d.T + b,
     lambda o, i: (5, i)),
    ("F.linear-batched", lambda w, x, y, b: F.linear(x, w, b),
     lambda d, x, y, b: x @ d.T + b, lambda o, i: (2, 3, i)),
    ("F.linear-vector", lambda w, x, y, b: F.linear(x, w, b), lambda d, x, y, b: d @ x + b,
     lambda o, i: (i,)),
    ("sparse.mm", lambda w, x, y, b: torch.sparse.mm(w, x), lambda d, x, y, b: d @ x,
     lambda o, i: (i, 5)),
    ("sparse.addmm", lambda w, x, y, b: torch.sparse.addmm(y, w, x),
     lambda d, x, y, b: y + d @ x, lambda o, i: (i, 5)),
    ("sparse.addmm-scaled", lambda w, x, y, b: torch.sparse.addmm(y, w, x, beta=0.5, alpha=2.0),
     lambda d, x, y, b: 0.5 * y + 2.0 * (d @ x), lambda o, i: (i, 5)),
]
FORM_PARAMS = pytest.mark.parametrize(("name", "form", "ref", "xshape"), FORMS,
                                      ids=[f[0] for f in FORMS])


@CASE_PARAMS
@FORM_PARAMS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_forward_matches_dense(layout: torch.layout, block: tuple[int, int], name: str,
                               form: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor],
                               xshape: Callable[[int, int], tuple[int, ...]],
                               dtype: torch.dtype) -> None:
    w, dense = weight(layout, block, dtype)
    out, inn = dense.shape
    x = rand(*xshape(out, inn)).to(dtype)
    y = rand(out, 5, seed=2).to(dtype)
    b = rand(out, seed=3).to(dtype)
    got = form(w, x, y, b)
    assert type(got) is torch.Tensor and got.layout == torch.strided
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, ref(dense, x, y, b), **tol)
    assert ss.is_checked(w)


@CASE_PARAMS
@FORM_PARAMS
def test_gradcheck(layout: torch.layout, block: tuple[int, int], name: str,
                   form: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor],
                   xshape: Callable[[int, int], tuple[int, ...]]) -> None:
    """Gradients for the weight's values, the dense operand and the bias (or addend)."""
    w, dense = weight(layout, block)
    out, inn = dense.shape
    build = rebuild(w)
    values = w.values().detach().clone().requires_grad_()
    x = rand(*xshape(out, inn)).requires_grad_()
    y = rand(out, 5, seed=2).requires_grad_()
    b = rand(out, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda v, x, y, b: form(build(v), x, y, b),
                                    (values, x, y, b), fast_mode=True)


@CASE_PARAMS
def test_linear_gradients_match_dense(layout: torch.layout, block: tuple[int, int]) -> None:
    """The values' gradient is the dense weight's gradient at the stored positions."""
    w, dense = weight(layout, block)
    values = w.values().detach().clone().requires_grad_()
    x = rand(6, dense.shape[1]).requires_grad_()
    b = rand(dense.shape[0], seed=3).requires_grad_()
    g = rand(6, dense.shape[0], seed=4)
    F.linear(x, rebuild(w)(values), b).backward(g)
    d = dense.clone().requires_grad_()
    xd, bd = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    F.linear(xd, d, bd).backward(g)
    grad_w = rebuild(w)(values.grad).to_dense()
    mask = dense != 0
    torch.testing.assert_close(grad_w[mask], d.grad[mask])
    torch.testing.assert_close(x.grad, xd.grad)
    torch.testing.assert_close(b.grad, bd.grad)


def test_keyword_forms() -> None:
    """``F.linear(input=, weight=, bias=)`` and the keyword forms of ``torch.sparse.mm`` /
    ``addmm``: bound by name, the same route."""
    w, dense = weight(BSC, (2, 3))
    x, y, b = rand(5, dense.shape[1]), rand(dense.shape[0], 5, seed=2), rand(dense.shape[0])
    torch.testing.assert_close(F.linear(input=x, weight=w, bias=b), x @ dense.T + b)
    torch.testing.assert_close(torch.sparse.mm(w, dense=x.T.contiguous()), dense @ x.T)
    torch.testing.assert_close(torch.sparse.addmm(y, w, mat2=x.T, beta=2.0), 2 * y + dense @ x.T)
    torch.testing.assert_close(torch.sparse.addmm(input=y, mat1=w, mat2=x.T), y + dense @ x.T)


def test_square_bsr_linear_without_grad_uses_torch_kernel() -> None:
    """Square blocks, no gradient: ``F.linear`` is torch's own BSR kernel on ``x^T`` (the
    figure of benchmarks/group_linear.py rests on it); the result equals the route's."""
    w, dense = weight(BSR, (4, 4), torch.float32)
    x = rand(7, dense.shape[1]).float()
    with torch.no_grad():
        fast = F.linear(x, w)
    routed = F.linear(x.requires_grad_(), w)
    torch.testing.assert_close(fast, routed.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, x.detach() @ dense.T, rtol=1e-5, atol=1e-5)


def test_unchecked_weight_is_validated_first() -> None:
    """The guard: an unchecked weight is validated before any kernel reads it."""
    w, dense = weight(BSR, (2, 3))
    compressed, plain = members(w)
    bad_plain = plain.clone()
    bad_plain[0] = 99
    bad = ss.sparse_bsr_tensor(compressed, bad_plain, w.values(), w.shape,
                               check_invariants=False)
    with pytest.raises(ss.InvariantError) as err:
        F.linear(rand(5, dense.shape[1]), bad)
    assert "linear" in str(err.value)


def test_mismatched_shapes_are_torch_errors() -> None:
    w, dense = weight(BSC, (2, 3))
    with pytest.raises(RuntimeError):
        F.linear(rand(5, dense.shape[1] + 1), w)
    with pytest.raises(RuntimeError):
        torch.sparse.mm(w, rand(dense.shape[1] + 1, 2))

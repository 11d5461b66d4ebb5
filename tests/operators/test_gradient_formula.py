"""One gradient formula per product (issue 48, "one door to the kernels"): each of the four
products the kernels compute (``operators.autograd.PRODUCTS``) and the gradients
``operators.autograd.gradients`` gives it, through the ``safesparse`` operators, equal dense
autograd's, for every compressed layout; the tensor layer's block products take their
gradients from the same formula.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import safesparse as ss
from safesparse.base.layouts import SHORT_NAMES, compressed_members
from safesparse.operators.autograd import PRODUCTS, SparseProduct, gradients
from safesparse.tensor import products

ops = torch.ops.safesparse
ROWS, COLS, N = 8, 12, 3
CASES = [(torch.sparse_csr, None), (torch.sparse_csc, None), (torch.sparse_bsr, (2, 3)),
         (torch.sparse_bsc, (4, 2))]
IDS = ["csr", "csc", "bsr", "bsc"]
DENSE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": lambda a, x: x @ a.T,
    "linear_grad_input": lambda a, x: x @ a,
    "matmul": lambda a, x: a @ x,
    "matmul_grad_input": lambda a, x: a.T @ x,
}
Matrix = tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, int, int]


def _matrix(layout: torch.layout, blocksize: tuple[int, int] | None
            ) -> tuple[Matrix, torch.Tensor, torch.Tensor]:
    """The operators' matrix arguments of a checked matrix, its dense form and its pattern
    (ones where a block is stored)."""
    g = torch.Generator().manual_seed(0)
    r, c = blocksize or (1, 1)
    mask = torch.rand(ROWS // r, COLS // c, generator=g) < 0.5
    mask[0, 0] = True
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(ROWS, COLS, generator=g, dtype=torch.float64) * full
    a = ss.validate(dense.to_sparse(layout=layout, blocksize=blocksize))
    compressed, plain = compressed_members(a)
    name = SHORT_NAMES[layout]
    return (compressed, plain, a.values(), name, ROWS, COLS), dense, full.double()


def _run(product: SparseProduct, operand: torch.Tensor, m: Matrix) -> torch.Tensor:
    op = getattr(ops, product.name)
    out: torch.Tensor = op(operand, *m) if product.batch_major else op(*m, operand)
    return out


def _values_grad(product: SparseProduct, left: torch.Tensor, right: torch.Tensor,
                 m: Matrix) -> torch.Tensor:
    op = getattr(ops, product.values_grad)
    out: torch.Tensor = (op(left, right, *m) if product.batch_major
                         else op(*m, left, right))
    return out


def test_each_product_has_the_other_transpose_as_its_dual() -> None:
    assert len(PRODUCTS) == 4
    for (batch_major, transpose), product in PRODUCTS.items():
        assert (product.batch_major, product.transpose) == (batch_major, transpose)
        assert product.dual.dual is product and product.dual.transpose is not transpose
        assert hasattr(ops, product.name) and hasattr(ops, product.values_grad)


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
@pytest.mark.parametrize("key", sorted(PRODUCTS), ids=lambda k: PRODUCTS[k].name)
def test_the_formula_gives_dense_autograds_gradients(layout: torch.layout,
                                                     blocksize: tuple[int, int] | None,
                                                     key: tuple[bool, bool]) -> None:
    product = PRODUCTS[key]
    m, dense, pattern = _matrix(layout, blocksize)
    n_in = ROWS if product.transpose else COLS
    g = torch.Generator().manual_seed(1)
    x = torch.randn((N, n_in) if product.batch_major else (n_in, N), generator=g,
                    dtype=torch.float64)
    y = _run(product, x, m)
    ad, xd = dense.clone().requires_grad_(), x.clone().requires_grad_()
    yd = DENSE[product.name](ad, xd)
    torch.testing.assert_close(y, yd.detach())
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    yd.backward(gy)
    gx, gv = gradients(product, gy, x, True, True, lambda p, o: _run(p, o, m),
                       lambda left, right: _values_grad(product, left, right, m))
    assert gx is not None and gv is not None
    torch.testing.assert_close(gx, xd.grad)
    got = torch.sparse_compressed_tensor(m[0], m[1], gv, dense.shape, layout=layout,
                                         check_invariants=False).to_dense()
    assert ad.grad is not None
    torch.testing.assert_close(got, ad.grad * pattern)
    # what is not asked for is not computed
    assert gradients(product, gy, x, False, False, lambda p, o: _run(p, o, m),
                     lambda left, right: _values_grad(product, left, right, m)) == (None, None)


def test_the_tensor_layers_block_products_take_the_same_formula(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``A @ x`` of a checked 2-D BSR tensor on CPU: its backward asks the operators' formula
    for the same product (the kernels compute it over the tensor's kept pattern)."""
    asked: list[str] = []
    formula = products.gradients

    def spy(product: SparseProduct, *args: object) -> object:
        asked.append(product.name)
        return formula(product, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(products, "gradients", spy)
    _, dense, _ = _matrix(torch.sparse_bsr, (4, 4))
    a = ss.validate(dense.to_sparse_bsr((4, 4)))
    x = torch.randn(COLS, N, dtype=torch.float64, requires_grad=True)
    (a @ x).sum().backward()
    assert asked == ["matmul"]
    assert x.grad is not None
    torch.testing.assert_close(x.grad, dense.T @ torch.ones(ROWS, N, dtype=torch.float64))

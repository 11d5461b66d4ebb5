"""Block products (docs/ops.md, "Block products"): checked BSR / BSC tensors times dense ones.

torch 2.13 on CPU multiplies only square-block BSR tensors, forward, and has no kernel for the
gradient with respect to the dense operand, for non-square blocks, for BSC or for ``A.mT @ g``
(the BSC view of a BSR ``A``). safesparse computes all of them (safesparse/tensor/products.py).
Every result is compared with the same computation on the dense matrix; gradients with ``gradcheck``
(float64) and with the dense gradients (float32 and float64).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.block_matrices import (
    BSC,
    BSR,
    PARAMS,
    _tol,
    assert_dense_result,
    factory,
    make,
    members,
    rand,
)

import safesparse as ss
from safesparse.tensor import products

BLOCKS = [(2, 2), (2, 3), (3, 2), (1, 4), (4, 4)]
DTYPES = [torch.float32, torch.float64]
BLOCK_PARAMS = pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
DTYPE_PARAMS = pytest.mark.parametrize("dtype", DTYPES, ids=str)


# ---------------------------------------------------------------------------------------------
# Forward: every form of the product


FORMS: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
    ("matmul_operator", lambda a, x: a @ x),
    ("torch.mm", torch.mm),
    ("Tensor.mm", lambda a, x: a.mm(x)),
    ("torch.matmul", torch.matmul),
    ("Tensor.matmul", lambda a, x: a.matmul(x)),
    ("torch.addmm", lambda a, x: torch.addmm(torch.ones(x.shape[1], dtype=x.dtype), a, x)),
    ("Tensor.addmm", lambda a, x: torch.ones(a.shape[0], x.shape[1], dtype=x.dtype).addmm(a, x)),
]


@PARAMS
@BLOCK_PARAMS
@DTYPE_PARAMS
@pytest.mark.parametrize(("name", "form"), FORMS, ids=[n for n, _ in FORMS])
def test_forward_matches_dense(layout: torch.layout, block: tuple[int, int],
                               dtype: torch.dtype, name: str,
                               form: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    a, dense = make(layout, block, dtype)
    x = rand(dense.shape[1], 5, dtype=dtype)
    assert_dense_result(form(a, x), form(dense, x), dtype)
    assert ss.is_checked(a)  # the operand is untouched


@PARAMS
@BLOCK_PARAMS
@DTYPE_PARAMS
def test_transpose_view_multiplies(layout: torch.layout, block: tuple[int, int],
                                   dtype: torch.dtype) -> None:
    """``A.mT @ g``: the zero-copy transpose (BSC view of a BSR tensor, and back)."""
    a, dense = make(layout, block, dtype)
    g = rand(dense.shape[0], 3, dtype=dtype)
    at = a.mT
    assert at.layout == (BSC if layout == BSR else BSR) and ss.is_checked(at)
    assert_dense_result(at @ g, dense.mT @ g, dtype)
    assert_dense_result(torch.mm(a.t(), g), dense.t() @ g, dtype)


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (4, 4)], ids=["2x3", "4x4"])
def test_dense_times_block(layout: torch.layout, block: tuple[int, int]) -> None:
    a, dense = make(layout, block)
    x = rand(4, dense.shape[0])
    assert_dense_result(x @ a, x @ dense, torch.float64)
    assert_dense_result(torch.mm(x, a), x @ dense, torch.float64)
    assert_dense_result(a.__rmatmul__(x), x @ dense, torch.float64)
    v = rand(dense.shape[0])
    assert_dense_result(v @ a, v @ dense, torch.float64)
    bias = rand(dense.shape[1])
    assert_dense_result(torch.addmm(bias, x, a, beta=0.5, alpha=2.0),
                        torch.addmm(bias, x, dense, beta=0.5, alpha=2.0), torch.float64)


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_matmul_shapes(layout: torch.layout, block: tuple[int, int]) -> None:
    """matmul's broadcasting: vector, batched operand, batched tensor, both batched."""
    a, dense = make(layout, block)
    k = dense.shape[1]
    for x in (rand(k), rand(k, 1), rand(2, k, 3), rand(2, 3, k, 2)):
        assert_dense_result(a @ x, dense @ x, torch.float64)
    ab, denseb = make(layout, block, batch=(2,), seed=5)
    for x in (rand(k), rand(k, 3), rand(2, k, 3)):
        assert_dense_result(ab @ x, denseb @ x, torch.float64)
    g = rand(2, dense.shape[0], 3)
    assert_dense_result(ab.mT @ g, denseb.mT @ g, torch.float64)
    for x in (rand(2, 3, dense.shape[0]), rand(dense.shape[0])):
        assert_dense_result(x @ a, x @ dense, torch.float64)
    assert_dense_result(rand(2, 3, dense.shape[0]) @ ab, rand(2, 3, dense.shape[0]) @ denseb,
                        torch.float64)
    ab2, denseb2 = make(layout, block, batch=(2, 3), seed=6)
    x = rand(2, 3, k, 4)
    assert_dense_result(ab2 @ x, denseb2 @ x, torch.float64)


def test_addmm_scalars_and_broadcast() -> None:
    a, dense = make(BSC, (2, 3))
    x = rand(dense.shape[1], 4)
    for bias in (rand(4), rand(dense.shape[0], 1), rand(dense.shape[0], 4)):
        for beta, alpha in ((1, 1), (0.5, -2.0), (0, 3)):
            assert_dense_result(torch.addmm(bias, a, x, beta=beta, alpha=alpha),
                                torch.addmm(bias, dense, x, beta=beta, alpha=alpha),
                                torch.float64)
    nan = torch.full((dense.shape[0], 4), float("nan"), dtype=torch.float64)
    out = torch.addmm(nan, a, x, beta=0)  # torch ignores input when beta is 0
    assert_dense_result(out, dense @ x, torch.float64)


def test_noncontiguous_and_empty_operands() -> None:
    a, dense = make(BSR, (2, 3))
    x = rand(5, dense.shape[1]).mT  # column-major
    assert not x.is_contiguous()
    assert_dense_result(a @ x, dense @ x, torch.float64)
    assert_dense_result(a @ rand(dense.shape[1], 0), dense @ rand(dense.shape[1], 0),
                        torch.float64)
    empty = ss.validate(torch.zeros(4, 6, dtype=torch.float64).to_sparse_bsc((2, 3)))
    x = rand(6, 3).requires_grad_()
    y = empty @ x
    assert_dense_result(y, torch.zeros(4, 3, dtype=torch.float64), torch.float64)
    y.sum().backward()
    assert x.grad is not None and not x.grad.any()


# ---------------------------------------------------------------------------------------------
# Autograd


@PARAMS
@BLOCK_PARAMS
def test_gradcheck_values_and_operand(layout: torch.layout, block: tuple[int, int]) -> None:
    a, dense = make(layout, block)
    compressed, plain = members(a)
    build = factory(layout)
    values = a.values().detach().clone().requires_grad_()
    x = rand(dense.shape[1], 2).requires_grad_()
    g = rand(dense.shape[0], 2).requires_grad_()

    def forward(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return build(compressed, plain, v, dense.shape) @ x

    def through_transpose(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return build(compressed, plain, v, dense.shape).mT @ g

    def addmm(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(x[:1], x.mT, build(compressed, plain, v, dense.shape).mT,
                           alpha=0.5)

    assert torch.autograd.gradcheck(forward, (values, x))
    assert torch.autograd.gradcheck(through_transpose, (values, g))
    x_col = x.detach()[:, :1].mT.contiguous().mT.requires_grad_()  # column-major
    assert torch.autograd.gradcheck(addmm, (values, x_col), fast_mode=True)


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_gradcheck_batched(layout: torch.layout, block: tuple[int, int]) -> None:
    a, dense = make(layout, block, batch=(2,))
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    build = factory(layout)
    for x in (rand(2, dense.shape[-1], 2), rand(dense.shape[-1], 2)):
        x.requires_grad_()
        assert torch.autograd.gradcheck(
            lambda v, x: build(compressed, plain, v, dense.shape) @ x, (values, x),
            fast_mode=True)


@PARAMS
@BLOCK_PARAMS
@DTYPE_PARAMS
def test_gradients_match_dense(layout: torch.layout, block: tuple[int, int],
                               dtype: torch.dtype) -> None:
    """The table's backward rows: ``A @ x`` with ``x.requires_grad`` and the values'
    gradient, also through ``A.mT``; compared with the dense computation."""
    a, dense = make(layout, block, dtype)
    compressed, plain = members(a)
    mask = dense != 0
    for transposed in (False, True):
        values = a.values().detach().clone().requires_grad_()
        t = factory(layout)(compressed, plain, values, dense.shape)
        d = dense.clone().requires_grad_()
        op_t, op_d = (t.mT, d.mT) if transposed else (t, d)
        x = rand(op_d.shape[1], 4, dtype=dtype)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = rand(op_d.shape[0], 4, dtype=dtype, seed=9)
        ((op_t @ x1) * w).sum().backward()
        ((op_d @ x2) * w).sum().backward()
        assert x1.grad is not None and x2.grad is not None and d.grad is not None
        torch.testing.assert_close(x1.grad, x2.grad, **_tol(dtype))
        assert values.grad is not None
        got = factory(layout)(compressed, plain, values.grad, dense.shape).to_dense()
        torch.testing.assert_close(got, d.grad * mask, **_tol(dtype))
        assert values.grad.abs().sum() > 0


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_leaf_gets_a_strided_gradient(layout: torch.layout, block: tuple[int, int]) -> None:
    """A BSR / BSC leaf gets a strided gradient, as from torch's own (square) BSR product:
    torch 2.13 cannot accumulate a blocked gradient into a blocked leaf."""
    a, dense = make(layout, block)
    a.requires_grad_()
    assert a.is_leaf
    x = rand(dense.shape[1], 3)
    (a @ x).sum().backward()
    assert a.grad is not None and a.grad.layout == torch.strided
    expected = (torch.ones(dense.shape[0], 3, dtype=dense.dtype) @ x.mT) * (dense != 0)
    torch.testing.assert_close(a.grad, expected)
    a.grad = None
    g = rand(dense.shape[0], 2)
    (a.mT @ g).sum().backward()
    assert a.grad is not None
    expected = (g @ torch.ones(2, dense.shape[1], dtype=dense.dtype)) * (dense != 0)
    torch.testing.assert_close(a.grad, expected)


def test_sparse_leaf_below_is_found() -> None:
    """The walk that picks the gradient's route: a blocked leaf below (through a transpose and
    a scalar product) means a strided gradient; values below a factory mean a values one."""
    a, dense = make(BSR, (2, 3))
    leaf = a.detach().requires_grad_()
    assert not products._gradient_through_values(leaf)
    assert not products._gradient_through_values((leaf * 2).mT)
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    built = ss.sparse_bsr_tensor(compressed, plain, values * 3, dense.shape)
    assert products._gradient_through_values(built.mT)
    assert not products._gradient_through_values(a)  # no gradient at all


def test_no_grad_needed_gives_no_graph() -> None:
    a, dense = make(BSR, (2, 3))
    y = a @ rand(dense.shape[1], 2)
    assert not y.requires_grad and y.grad_fn is None
    values = a.values().detach().clone().requires_grad_()
    t = ss.sparse_bsr_tensor(*members(a), values, dense.shape)
    with torch.no_grad():
        y = t @ rand(dense.shape[1], 2)
    assert not y.requires_grad


def test_block_sparse_layer_trains_with_sgd() -> None:
    """A BSR linear layer with (2, 3) blocks (no CPU kernel in torch) learns a target."""
    torch.manual_seed(0)
    a, dense = make(BSR, (2, 3), torch.float32)
    compressed, plain = members(a)

    class BlockLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.values = torch.nn.Parameter(torch.randn_like(a.values()) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = ss.sparse_bsr_tensor(compressed, plain, self.values, dense.shape)
            return (w @ x.mT).mT

    layer = BlockLinear()
    opt = torch.optim.SGD(layer.parameters(), lr=0.2)
    inputs = torch.randn(64, dense.shape[1])
    targets = inputs @ dense.mT
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


# ---------------------------------------------------------------------------------------------
# Which calls take the route; everything else is torch's, as before


def test_route_decision() -> None:
    a, dense = make(BSR, (2, 3))
    x = rand(dense.shape[1], 2)
    call = products.block_call(torch.mm, (a, x), {})
    assert call is not None and call.a is a and call.x is x and call.sparse_left
    call = products.block_call(torch.addmm, (rand(2), x.mT, a.mT), {"beta": 2})
    assert call is not None and not call.sparse_left and call.beta == 2
    unchecked = ss.sparse_bsr_tensor(*members(a), a.values(), a.shape, check_invariants=False)
    assert not ss.is_checked(unchecked)
    assert products.block_call(torch.mm, (unchecked, x), {}) is None
    assert products.block_call(torch.mm, (a, x.float()), {}) is None  # dtypes differ
    assert products.block_call(torch.mm, (a, rand(5, 2)), {}) is None  # shapes differ
    out_call = products.block_call(torch.mm, (a, x), {"out": torch.empty(4, 2)})
    assert out_call is not None and out_call.a is a  # routed; ops writes the result into out
    assert products.block_call(torch.mm, (a, x), {"out_dtype": torch.float32}) is None
    assert products.block_call(torch.addmm, (a, x.mT, x), {}) is None  # sparse input
    csr = ss.validate(dense.to_sparse_csr())
    assert products.block_call(torch.mm, (csr, x), {}) is None
    hybrid = ss.validate(torch.randn(4, 6, 2, dtype=torch.float64).to_sparse_bsr((2, 3), 1))
    assert products.block_call(torch.matmul, (hybrid, x), {}) is None


def test_fallbacks_behave_as_torch() -> None:
    a, dense = make(BSR, (2, 3))
    x = rand(dense.shape[1], 2)
    with pytest.raises(RuntimeError):
        a @ x.float()  # torch's own dtype error
    csr = ss.validate(dense.to_sparse_csr())
    assert_dense_result(csr @ x, dense @ x, torch.float64)
    product = csr @ csr.mT.to_sparse_csr()  # sparse @ sparse: new indices, validated
    assert isinstance(product, ss.SafeSparseTensor) and ss.is_checked(product)
    torch.testing.assert_close(product.to_dense(), dense @ dense.mT)


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch-ops"])
def test_square_blocks_without_grad_use_torch_kernel(monkeypatch: pytest.MonkeyPatch,
                                                     native_kernels: bool) -> None:
    """Square BSR, CPU, no gradient: torch's MKL kernel where the native kernels do not run
    (see benchmarks/group_blocks.py); the block kernels where they do (faster than MKL)."""
    from safesparse.kernels import native

    if native_kernels and not native.available():
        pytest.skip(f"native kernels: {native.status().describe()}")
    if not native_kernels:
        monkeypatch.setattr(native, "_forced_off", True)  # (native.disabled(), for the test)
    a, dense = make(BSR, (2, 2))
    x = rand(dense.shape[1], 3)
    taken: list[bool] = []
    original = products._product

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        taken.append(True)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(products, "_product", spy)
    assert_dense_result(a @ x, dense @ x, torch.float64)
    assert bool(taken) is native_kernels
    assert_dense_result(a @ x.requires_grad_(), dense @ x, torch.float64)
    assert taken


def test_values_found_behind_the_factory() -> None:
    """The values a factory built the tensor from are found through wrapping and transposes
    (the gradient then reaches them without torch's densifying factory backward); any other
    op in between, or no gradient, gives None."""
    a, dense = make(BSR, (2, 3))
    values = a.values().detach().clone().requires_grad_()
    built = ss.sparse_bsr_tensor(*members(a), values, dense.shape)
    found = products._values_source(built)
    # the factory builds on its own view of the values (so that `.data =` on them cannot change
    # the built tensor): found is that view, connected to `values` in the graph
    assert found is not None and found._base is values and found.grad_fn is not None
    for view in (built.mT, built.t(), built.transpose(0, 1), built.mT.mT):
        found = products._values_source(view)
        assert found is not None and found.data_ptr() == values.data_ptr()
        assert found.shape == view.values().shape and found.stride() == view.values().stride()
    assert products._values_source(built * 2) is None
    assert products._values_source(a) is None


@PARAMS
def test_int32_indices(layout: torch.layout) -> None:
    a, dense = make(layout, (2, 3))
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    t = factory(layout)(compressed.int(), plain.int(), values, dense.shape)
    assert t.crow_indices().dtype == torch.int32 if layout == BSR else True
    x = rand(dense.shape[1], 2).requires_grad_()
    assert_dense_result(t @ x, dense @ x, torch.float64)
    assert torch.autograd.gradcheck(
        lambda v, x: factory(layout)(compressed.int(), plain.int(), v, dense.shape) @ x,
        (values, x), fast_mode=True)


def test_square_bsr_view_with_transposed_values() -> None:
    """The BSR view of a BSC tensor has block-transposed (non-contiguous) values; torch's
    kernel, taken for square blocks, must read them as such."""
    a, dense = make(BSC, (2, 2))
    view = a.mT
    assert view.layout == BSR and not view.values().is_contiguous()
    x = rand(dense.shape[0], 3)
    assert_dense_result(view @ x, dense.mT @ x, torch.float64)
    assert_dense_result(view @ x.requires_grad_(), dense.mT @ x, torch.float64)


# ---------------------------------------------------------------------------------------------
# Keyword, out= and in-place forms (issue 27, item 6): one binding by name, the same route


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_keyword_forms(layout: torch.layout, block: tuple[int, int]) -> None:
    a, dense = make(layout, block)
    x = rand(dense.shape[1], 3)
    y = rand(dense.shape[0], 3, seed=2)
    xl = rand(3, dense.shape[0], seed=3)
    ref = dense @ x
    for got in (torch.mm(a, mat2=x), torch.matmul(a, other=x), torch.matmul(input=a, other=x),
                a.mm(mat2=x), a.matmul(other=x), torch.mm(input=a, mat2=x)):
        assert_dense_result(got, ref, torch.float64)
    assert_dense_result(torch.matmul(xl, other=a), xl @ dense, torch.float64)
    assert_dense_result(torch.addmm(input=y, mat1=a, mat2=x, beta=0.5),
                        0.5 * y + ref, torch.float64)
    assert_dense_result(torch.addmm(y, mat1=a, mat2=x, alpha=2.0), y + 2 * ref, torch.float64)
    assert_dense_result(y.addmm(mat1=a, mat2=x), y + ref, torch.float64)


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_out_and_inplace_forms_with_a_dense_target(layout: torch.layout,
                                                   block: tuple[int, int]) -> None:
    a, dense = make(layout, block)
    x = rand(dense.shape[1], 3)
    y = rand(dense.shape[0], 3, seed=2)
    for call, ref in ((lambda o: torch.mm(a, x, out=o), dense @ x),
                      (lambda o: torch.matmul(a, x, out=o), dense @ x),
                      (lambda o: torch.addmm(y, a, x, beta=2.0, out=o), 2 * y + dense @ x)):
        out = torch.empty(dense.shape[0], 3, dtype=torch.float64)
        assert call(out) is out
        assert_dense_result(out, ref, torch.float64)
        resized = torch.empty(0, dtype=torch.float64)
        call(resized)
        assert_dense_result(resized, ref, torch.float64)
    target = y.clone()
    assert target.addmm_(a, x, alpha=3.0) is target
    assert_dense_result(target, y + 3 * (dense @ x), torch.float64)
    target = y.clone()
    target.addmm_(mat1=a, mat2=x)
    assert_dense_result(target, y + dense @ x, torch.float64)


def test_out_with_autograd_is_refused_as_torch_does() -> None:
    a, dense = make(BSC, (2, 3))
    x = rand(dense.shape[1], 3).requires_grad_()
    out = torch.empty(dense.shape[0], 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        torch.mm(a, x, out=out)
    with torch.no_grad():
        torch.mm(a, x, out=out)
    assert_dense_result(out, dense @ x.detach(), torch.float64)


# ---------------------------------------------------------------------------------------------
# Batched block tensors and unbatched operands (issue 27, item 7)


@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (2, 2)], ids=["2x3", "2x2"])
def test_unbatched_operand_times_batched_block(layout: torch.layout,
                                               block: tuple[int, int]) -> None:
    """``x @ A`` with a batched ``A`` and a 1-D / 2-D ``x``: matmul's broadcast (was an
    internal shape error), with gradients."""
    a, dense = make(layout, block, batch=(2,), seed=5)
    m = dense.shape[-2]
    for x in (rand(3, m), rand(m)):
        assert_dense_result(x @ a, x @ dense, torch.float64)
        assert_dense_result(torch.matmul(x, a), torch.matmul(x, dense), torch.float64)
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    x = rand(3, m).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v, x: x @ factory(layout)(compressed, plain, v, dense.shape), (values, x),
        fast_mode=True)


def test_batch_shapes_that_do_not_match_give_a_clear_error() -> None:
    a, dense = make(BSR, (2, 3), batch=(2,))
    with pytest.raises(RuntimeError, match="batch shapes"):
        a @ rand(3, dense.shape[-1], 4)
    with pytest.raises(RuntimeError, match="batch shapes"):
        rand(3, 4, dense.shape[-2]) @ a


# ---------------------------------------------------------------------------------------------
# The block structure is kept with the index data's proof (issue 25, item 4)


@PARAMS
def test_structure_is_cached_with_the_proof(layout: torch.layout) -> None:
    a, dense = make(layout, (2, 3))
    x = rand(dense.shape[1], 2)
    assert_dense_result(a @ x, dense @ x, torch.float64)
    first = products.structure(a, True, True)
    assert products.structure(a, True, True) is first  # kept: no sort, no rebuild
    twin = factory(layout)(*members(a), a.values().clone(), a.shape)
    assert products.structure(twin, True, True) is first  # same proven index data
    assert products.structure(a.mT, True, True) is not first  # another layout: its own entry


def _alias_writers(a: torch.Tensor) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Every route to a BSC tensor's row indices: its member, the BSR view's member, a twin
    built on the same index tensors, a view of the member."""
    return [
        ("row_indices()", lambda: a.row_indices()),
        ("mT.col_indices()", lambda: a.mT.col_indices()),
        ("twin.row_indices()", lambda: ss.sparse_bsc_tensor(
            a.ccol_indices(), a.row_indices(), a.values(), a.shape).row_indices()),
        ("row_indices()[:]", lambda: a.row_indices()[:]),
    ]


@pytest.mark.parametrize("writer", range(4), ids=[n for n, _ in _alias_writers(torch.empty(0))])
def test_write_through_an_alias_invalidates_the_cached_structure(writer: int) -> None:
    """A BSC tensor's regrouped structure is cached; a write through any alias of its indices
    drops it with the proof: after a valid write and revalidation the product is the new
    matrix's (not the stale structure's), an invalid write is refused."""
    a, dense = make(BSC, (2, 3))
    x = rand(dense.shape[1], 2)
    assert_dense_result(a @ x, dense @ x, torch.float64)
    stale = products.structure(a, True, True)
    stale.side(False)
    # MASK's block column 1 holds one block, at block row 2: move it to block row 1 (valid)
    ccol = a.ccol_indices()
    pos = int(ccol[1])
    assert int(ccol[2]) - pos == 1 and int(a.row_indices()[pos]) == 2
    _, alias = _alias_writers(a)[writer]
    alias()[pos] = 1
    assert not ss.is_checked(a)
    moved = dense.clone()
    moved[2:4, 3:6], moved[4:6, 3:6] = dense[4:6, 3:6], 0
    assert_dense_result(a @ x, moved @ x, torch.float64)  # revalidated by the guard
    assert ss.is_checked(a)
    assert products.structure(a, True, True) is not stale
    alias()[pos] = 7  # out of range: refused before any kernel reads it
    with pytest.raises(ss.InvariantError):
        a @ x


def test_pattern_positions_gather_the_stored_entries() -> None:
    for layout, block in ((BSR, (2, 3)), (BSC, (3, 2))):
        a, dense = make(layout, block, batch=(2,))
        pos = products.pattern_positions(a)
        assert pos.shape == a.values().shape
        assert torch.equal(dense.reshape(-1)[pos], a.values())
        view = a.mT
        assert torch.equal(dense.mT.reshape(-1)[products.pattern_positions(view)], view.values())
    csr = ss.validate(rand(4, 5).to_sparse_csr())
    assert torch.equal(csr.to_dense().reshape(-1)[products.pattern_positions(csr)], csr.values())


@PARAMS
@pytest.mark.parametrize("batch", [(), (2,)], ids=["2d", "batched"])
def test_gradcheck_large_blocks(layout: torch.layout, batch: tuple[int, ...]) -> None:
    """Blocks of at least ``products._BMM_MIN`` elements get the values' gradient from one
    batched matmul instead of ``sampled_addmm``: every orientation, shared and batched
    operands."""
    block = (12, 12)
    assert block[0] * block[1] >= products._BMM_MIN
    a, dense = make(layout, block, batch=batch)
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    build = factory(layout)
    m, k = dense.shape[-2:]
    for x in (rand(k, 3), rand(*batch, k, 3)):
        x.requires_grad_()
        assert torch.autograd.gradcheck(
            lambda v, x: build(compressed, plain, v, dense.shape) @ x, (values, x),
            fast_mode=True)
    g = rand(*batch, m, 3).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v, g: build(compressed, plain, v, dense.shape).mT @ g, (values, g),
        fast_mode=True)

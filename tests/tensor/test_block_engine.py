"""One block engine (issue 40, item 5; docs/ops.md, "Block products"): 2-D products of checked
BSR / BSC tensors on CPU run the kernels of the safesparse operators (safesparse.kernels.blocks),
batched tensors and other devices the element CSR route (safesparse/tensor/elements.py). Every
product, on both routes, against a dense float64 reference; gradcheck of every form; the
kernels' pattern kept with the proof and read by the backward as the forward read it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from support.block_matrices import (
    BSC,
    BSR,
    LAYOUTS,
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

# ---------------------------------------------------------------------------------------------
# One block engine (issue 40, item 5): 2-D products on CPU run the kernels of safesparse.nn's
# operators (safesparse.kernels.blocks); batched tensors and other devices the element route.
# Every product, on both routes, against a dense float64 reference.

ROUTES = pytest.mark.parametrize("route", ["kernels", "elements"])
ENGINE_BLOCKS = [(2, 3), (3, 2), (1, 4), (2, 2), (16, 16)]
HALF = (torch.float16, torch.bfloat16)


def _force(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if route == "elements":
        monkeypatch.setattr(products, "_kernels_cover", lambda a: False)


def _engine_tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype in HALF:
        return {"rtol": 3e-2, "atol": 3e-2}
    return _tol(dtype)


def _engine_tensor(layout: torch.layout, block: tuple[int, int], dtype: torch.dtype,
                   empty: bool = False, int32: bool = False
                   ) -> tuple[ss.SafeSparseTensor, torch.Tensor]:
    """A checked 2-D block tensor in ``dtype`` (stored blocks as MASK, or none) and its dense
    matrix in float64 (the values as stored, rounded to ``dtype``)."""
    a64, dense = make(layout, block)
    if empty:
        dense = torch.zeros_like(dense)
        plain = dense.to_sparse_bsr(block) if layout == BSR else dense.to_sparse_bsc(block)
        a64 = ss.validate(plain)
        assert a64.values().shape[0] == 0
    compressed, plain_idx = members(a64)
    if int32:
        compressed, plain_idx = compressed.int(), plain_idx.int()
    a = factory(layout)(compressed, plain_idx, a64.values().to(dtype), dense.shape)
    assert ss.is_checked(a)
    return a, a.to_dense().double()


def _operand(*shape: int, dtype: torch.dtype, contiguous: bool, seed: int = 3) -> torch.Tensor:
    """A dense operand, or the same values in a non-contiguous tensor (every other element of
    a wider one along a dimension of more than one element)."""
    x = rand(*shape, seed=seed).to(dtype)
    wide_dims = [i for i, s in enumerate(shape) if s > 1]
    if contiguous or not wide_dims or x.numel() == 0:
        return x
    dim = wide_dims[-1]
    wide_shape = list(shape)
    wide_shape[dim] *= 2
    wide = torch.zeros(wide_shape, dtype=dtype)
    wide.narrow(dim, 0, wide_shape[dim]).unfold(dim, 1, 2).squeeze(-1).copy_(x)
    out = wide.unfold(dim, 1, 2).squeeze(-1)
    assert not out.is_contiguous() and torch.equal(out, x)
    return out


#: (name, product of the sparse ``a`` and its operand(s), the same on the dense float64 ``d``,
#: operand shapes from (m, n, N)).
ENGINE_FORMS: list[tuple[str, Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                         Callable[[int, int, int], list[tuple[int, ...]]]]] = [
    ("A @ x", lambda a, x: a @ x, lambda d, x: d @ x, lambda m, n, k: [(n, k)]),
    ("torch.mm", torch.mm, lambda d, x: d @ x, lambda m, n, k: [(n, k)]),
    ("torch.sparse.mm", torch.sparse.mm, lambda d, x: d @ x, lambda m, n, k: [(n, k)]),
    ("A @ vector", lambda a, x: a @ x, lambda d, x: d @ x, lambda m, n, k: [(n,)]),
    ("A @ batches", lambda a, x: a @ x, lambda d, x: d @ x, lambda m, n, k: [(2, n, k)]),
    ("x @ A", lambda a, x: x @ a, lambda d, x: x @ d, lambda m, n, k: [(k, m)]),
    ("vector @ A", lambda a, x: x @ a, lambda d, x: x @ d, lambda m, n, k: [(m,)]),
    ("A.mT @ g", lambda a, g: a.mT @ g, lambda d, g: d.mT @ g, lambda m, n, k: [(m, k)]),
    ("F.linear", lambda a, x, b: F.linear(x, a, b), lambda d, x, b: x @ d.mT + b,
     lambda m, n, k: [(k, n), (m,)]),
    ("F.linear 3-D", lambda a, x: F.linear(x, a), lambda d, x: x @ d.mT,
     lambda m, n, k: [(2, k, n)]),
    ("addmm", lambda a, y, x: torch.addmm(y, a, x, beta=0.5, alpha=2.0),
     lambda d, y, x: 0.5 * y + 2.0 * (d @ x), lambda m, n, k: [(m, k), (n, k)]),
    ("torch.sparse.addmm", lambda a, y, x: torch.sparse.addmm(y, a, x),
     lambda d, y, x: y + d @ x, lambda m, n, k: [(m, k), (n, k)]),
]


@ROUTES
@PARAMS
@pytest.mark.parametrize("block", ENGINE_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_product_matches_the_float64_reference(
        route: str, layout: torch.layout, block: tuple[int, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every form, float32 / float64 (and float16 / bfloat16 on the kernel route), N = 0, 1,
    5, contiguous and not, no stored block, int32 indices: the dense float64 result."""
    _force(route, monkeypatch)
    dtypes = [torch.float32, torch.float64] + (list(HALF) if route == "kernels" else [])
    cases = [(dtype, False, False) for dtype in dtypes] + [(torch.float64, True, False),
                                                           (torch.float32, False, True)]
    for dtype, empty, int32 in cases:
        a, d = _engine_tensor(layout, block, dtype, empty=empty, int32=int32)
        m, n = a.shape
        for name, form, ref, shapes in ENGINE_FORMS:
            for k, contiguous in ((0, True), (1, True), (5, True), (5, False)):
                ops = [_operand(*s, dtype=dtype, contiguous=contiguous, seed=i + 3)
                       for i, s in enumerate(shapes(m, n, k))]
                out = form(a, *ops)
                expected = ref(d, *(o.double() for o in ops))
                where = f"{name}, {dtype}, N={k}, contiguous={contiguous}, empty={empty}"
                assert type(out) is torch.Tensor and out.layout == torch.strided, where
                assert out.dtype == dtype and out.shape == expected.shape, where
                torch.testing.assert_close(out.double(), expected, **_engine_tol(dtype),
                                           msg=lambda s, w=where: f"{w}: {s}")


GRAD_FORMS: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       Callable[[int, int], tuple[int, ...]]]] = [
    ("A @ x", lambda a, x: a @ x, lambda m, n: (n, 3)),
    ("A @ vector", lambda a, x: a @ x, lambda m, n: (n,)),
    ("x @ A", lambda a, x: x @ a, lambda m, n: (3, m)),
    ("A.mT @ g", lambda a, g: a.mT @ g, lambda m, n: (m, 3)),
    ("A.mT.mT @ x", lambda a, x: a.mT.mT @ x, lambda m, n: (n, 2)),
    ("x @ A.mT", lambda a, x: x @ a.mT, lambda m, n: (2, n)),
    ("F.linear", lambda a, x: F.linear(x, a), lambda m, n: (3, n)),
    ("F.linear 3-D", lambda a, x: F.linear(x, a), lambda m, n: (2, 2, n)),
    ("addmm", lambda a, x: torch.addmm(torch.ones(a.shape[0], x.shape[1],
                                                  dtype=x.dtype), a, x, alpha=0.5),
     lambda m, n: (n, 2)),
]


@ROUTES
@PARAMS
@pytest.mark.parametrize("block", [(2, 3), (3, 2), (16, 16)], ids=["2x3", "3x2", "16x16"])
def test_gradcheck_every_form(route: str, layout: torch.layout, block: tuple[int, int],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradcheck`` of values -> product and operand -> product for every form, through the
    zero-copy transposes; 16 x 16 blocks take the kernels' values gradient, smaller ones the
    element route's (``products._KERNEL_GRAD_FROM``)."""
    _force(route, monkeypatch)
    a, dense = make(layout, block)
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    build = factory(layout)
    m, n = dense.shape
    for name, form, shape in GRAD_FORMS:
        x = rand(*shape(m, n)).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda v, x, f=form: f(build(compressed, plain, v, dense.shape), x),
            (values, x), fast_mode=True), name


@PARAMS
def test_gradients_of_half_types_match_float64(layout: torch.layout) -> None:
    """float16 / bfloat16 forward and backward (the kernels compute them in float32)."""
    for dtype in HALF:
        a, dense = make(layout, (2, 3))
        compressed, plain = members(a)
        values = a.values().detach().to(dtype).requires_grad_()
        x = rand(dense.shape[1], 4).to(dtype).requires_grad_()
        y = factory(layout)(compressed, plain, values, dense.shape) @ x
        gy = rand(*y.shape, seed=7).to(dtype)
        y.backward(gy)
        d = factory(layout)(compressed, plain, values.detach().double(),
                            dense.shape).to_dense().requires_grad_()
        xd = x.detach().double().requires_grad_()
        (d @ xd).backward(gy.double())
        assert values.grad is not None and x.grad is not None
        assert values.grad.dtype == dtype and x.grad.dtype == dtype
        dv = d.grad.reshape(-1)[products.pattern_positions(ss.validate(
            factory(layout)(compressed, plain, values.detach().double(), dense.shape)))]
        torch.testing.assert_close(values.grad.double(), dv, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=3e-2, atol=3e-2)


def test_two_dimensional_cpu_products_run_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2-D products and both gradients call safesparse.kernels.blocks (the kernels of the
    safesparse operators, their gradients by the operators' formula); batched tensors do
    not."""
    calls: list[str] = []
    for name in ("matmul", "matmul_grad_input", "matmul_grad_values", "linear",
                 "linear_grad_input", "linear_grad_values"):
        original = getattr(products.kernels, name)

        def spy(*args: object, _f: Callable[..., torch.Tensor] = original,
                _n: str = name) -> torch.Tensor:
            calls.append(_n)
            return _f(*args)

        monkeypatch.setattr(products.kernels, name, spy)
    a, dense = make(BSC, (16, 16))
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    x = rand(dense.shape[1], 3).requires_grad_()
    (ss.sparse_bsc_tensor(compressed, plain, values, dense.shape) @ x).sum().backward()
    assert calls == ["matmul", "matmul_grad_values", "matmul_grad_input"]
    calls.clear()
    w = ss.sparse_bsc_tensor(compressed, plain, values, dense.shape)
    F.linear(rand(2, dense.shape[1]), w).sum().backward()
    assert calls == ["linear", "linear_grad_values"]
    calls.clear()
    assert_dense_result(a @ x.detach(), dense @ x.detach(), torch.float64)
    assert calls == ["matmul"]
    calls.clear()
    square, sdense = make(BSR, (16, 16))  # square blocks, no gradient: not torch's MKL kernel
    assert_dense_result(square @ x.detach(), sdense @ x.detach(), torch.float64)
    assert calls == ["matmul"]
    calls.clear()
    batched, bdense = make(BSR, (2, 3), batch=(2,))
    assert_dense_result(batched @ rand(bdense.shape[-1], 2), bdense @ rand(bdense.shape[-1], 2),
                        torch.float64)
    assert calls == []


@PARAMS
def test_kernel_pattern_is_kept_with_the_proof(layout: torch.layout) -> None:
    """The kernels' pattern (a private copy of the members, the other storage order) is built
    once per proven index state and dropped with the proof: a write through an alias of the
    indices, revalidated, gives the new matrix's product."""
    a, dense = make(layout, (2, 3))
    x = rand(dense.shape[1], 2)
    assert_dense_result(a @ x, dense @ x, torch.float64)
    assert_dense_result(a.mT @ rand(dense.shape[0], 2, seed=4),
                        dense.mT @ rand(dense.shape[0], 2, seed=4), torch.float64)
    first = products._pattern(a)
    assert products._pattern(a) is first
    assert first.compressed.data_ptr() != members(a)[0].data_ptr()  # a private copy
    # move MASK's only block of block row 2 / column 1 (valid) through the plain member
    plain = members(a)[1]
    moved = dense.clone()
    if layout == BSR:  # block row 0 holds block columns 0, 2, 3: move 2 -> 1
        plain[1] = 1
        moved[0:2, 6:9], moved[0:2, 3:6] = 0, dense[0:2, 6:9]
    else:  # block column 1 holds block row 2 only: move it to block row 1
        pos = int(a.ccol_indices()[1])
        plain[pos] = 1
        moved[4:6, 3:6], moved[2:4, 3:6] = 0, dense[4:6, 3:6]
    assert not ss.is_checked(a)
    assert_dense_result(a @ x, moved @ x, torch.float64)
    assert_dense_result(a.mT @ rand(dense.shape[0], 2, seed=4),
                        moved.mT @ rand(dense.shape[0], 2, seed=4), torch.float64)
    assert products._pattern(a) is not first


@ROUTES
def test_backward_reads_the_pattern_of_its_forward(route: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An index write between forward and backward (valid, revalidated) does not change the
    gradient of the product already computed: the backward reads the pattern the forward
    read (the kernels' private copy; the element structure's own index tensors, which were
    aliases of the members before), never the new data."""
    _force(route, monkeypatch)
    for layout in LAYOUTS:
        a, dense = make(layout, (2, 3))
        compressed, plain = members(a)
        values = a.values().detach().clone().requires_grad_()
        x = rand(dense.shape[1], 2).requires_grad_()
        y = factory(layout)(compressed, plain, values, dense.shape) @ x
        d = dense.clone().requires_grad_()
        yd = d @ x.detach()
        pos = int(compressed[1]) if layout == BSC else 1
        plain[pos] = 1  # a valid move (see test_kernel_pattern_is_kept_with_the_proof)
        ss.validate(a)
        gy = rand(*y.shape, seed=9)
        y.backward(gy)
        yd.backward(gy)
        assert values.grad is not None
        torch.testing.assert_close(x.grad, dense.mT @ gy)
        original = ss.validate(dense.to_sparse_bsr((2, 3)) if layout == BSR
                               else dense.to_sparse_bsc((2, 3)))
        torch.testing.assert_close(values.grad,
                                   d.grad.reshape(-1)[products.pattern_positions(original)])


def test_values_written_between_forward_and_backward_are_refused() -> None:
    a, dense = make(BSR, (16, 16))
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    x = rand(dense.shape[1], 2).requires_grad_()
    y = ss.sparse_bsr_tensor(compressed, plain, values, dense.shape) @ x
    with torch.no_grad():
        values.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@PARAMS
def test_debug_mode_builds_the_kernel_pattern_afresh(layout: torch.layout) -> None:
    """Debug mode trusts no remembered state: no pattern is kept, every call reads the
    members it was given (after the guard validates them), and gradients still flow."""
    a, dense = make(layout, (16, 16))
    compressed, plain = members(a)
    values = a.values().detach().clone().requires_grad_()
    x = rand(dense.shape[1], 2).requires_grad_()
    with ss.debug():
        t = factory(layout)(compressed, plain, values, dense.shape)
        assert products._pattern(t) is not products._pattern(t)
        y = t @ x
        assert_dense_result(y.detach(), dense @ x.detach(), torch.float64)
        y.sum().backward()
    assert values.grad is not None and x.grad is not None
    torch.testing.assert_close(x.grad, dense.mT @ torch.ones(dense.shape[0], 2,
                                                             dtype=torch.float64))


@ROUTES
@PARAMS
@pytest.mark.parametrize("shape", [(0, 6), (4, 0), (0, 0)], ids=str)
def test_zero_size_matrices(route: str, layout: torch.layout, shape: tuple[int, int],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Matrices with no rows or no columns, operands with no columns: every form gives the
    empty (or zero) result of the dense product, and the gradient of the operand."""
    _force(route, monkeypatch)
    d = torch.zeros(*shape, dtype=torch.float64)
    a = ss.validate(d.to_sparse_bsr((2, 3)) if layout == BSR else d.to_sparse_bsc((2, 3)))
    m, n = shape
    for k in (0, 3):
        x = rand(n, k).requires_grad_()
        y = a @ x
        assert_dense_result(y.detach(), d @ x.detach(), torch.float64)
        y.sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.zeros(n, k, dtype=torch.float64))
        assert_dense_result(F.linear(rand(k, n), a), rand(k, n) @ d.mT, torch.float64)
        assert_dense_result(F.linear(rand(2, k, n), a), rand(2, k, n) @ d.mT, torch.float64)
        assert_dense_result(rand(k, m) @ a, rand(k, m) @ d, torch.float64)
        assert_dense_result(rand(2, k, m) @ a, rand(2, k, m) @ d, torch.float64)

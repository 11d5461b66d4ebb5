"""The gradients of the sparse products: one formula, read by every door to the kernels.

The kernels compute four products of a 2-D compressed matrix ``A`` (its members, ``n_rows x
n_cols``) with a dense operand ``x``; each is a ``safesparse`` operator (:mod:`.library`) and
each one's gradients are two of the others (:data:`PRODUCTS`):

=====================  ========================  ===========================  ==================
product                ``y``                     gradient to ``x``            to the values
=====================  ========================  ===========================  ==================
``linear``             ``x @ A.T``, ``x`` (N, .)  ``linear_grad_input(g)``     ``(g, x)``
``linear_grad_input``  ``x @ A``                  ``linear(g)``                ``(x, g)``
``matmul``             ``A @ x``, ``x`` (., N)    ``matmul_grad_input(g)``     ``(g, x)``
``matmul_grad_input``  ``A.T @ x``                ``matmul(g)``                ``(x, g)``
=====================  ========================  ===========================  ==================

(the values' gradient is ``linear_grad_values`` for the batch-major products, whose operand's
rows are the batch, ``matmul_grad_values`` for the column-major ones). :func:`gradients` is
that formula, written once: the operators' registered autograd (compiled backward graphs hold
the gradient operators), the ``autograd.Function`` forms ``torch.func`` transforms
(:class:`LinearFunction`, :class:`MatmulFunction`) and the tensor layer's 2-D block products
(:mod:`safesparse.tensor.products`, which call the kernels on a kept pattern) all take their
gradients from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..kernels import blocks as blockkernels
from .library import (
    linear,
    linear_bias,
    linear_grad_input,
    linear_grad_values,
    matmul,
    matmul_grad_input,
    matmul_grad_values,
)

__all__ = ["LINEAR", "MATMUL", "PRODUCTS", "LinearFunction", "MatmulFunction", "SparseProduct",
           "again", "apply", "gradients"]

T = torch.Tensor


class SparseProduct(NamedTuple):
    """One of the four products (module docstring): ``name`` is its operator's (and its
    kernel's); ``batch_major``: ``x`` is ``(N, n_in)`` (its rows the batch; else ``(n_in,
    N)``); ``transpose``: the product is with ``A.T``."""

    name: str
    batch_major: bool
    transpose: bool

    @property
    def dual(self) -> SparseProduct:
        """The product that gives this one's gradient to ``x`` (the other ``transpose``)."""
        return PRODUCTS[(self.batch_major, not self.transpose)]

    @property
    def values_grad(self) -> str:
        """The operator (and kernel) of the gradient to the values."""
        return "linear_grad_values" if self.batch_major else "matmul_grad_values"


#: (batch_major, transpose) -> the product.
PRODUCTS: dict[tuple[bool, bool], SparseProduct] = {
    (True, False): SparseProduct("linear", True, False),
    (True, True): SparseProduct("linear_grad_input", True, True),
    (False, False): SparseProduct("matmul", False, False),
    (False, True): SparseProduct("matmul_grad_input", False, True),
}
LINEAR = PRODUCTS[(True, False)]
MATMUL = PRODUCTS[(False, False)]


def gradients(product: SparseProduct, g: T, x: T, need_x: bool, need_values: bool,
              run: Callable[[SparseProduct, T], T], values_grad: Callable[[T, T], T]
              ) -> tuple[T | None, T | None]:
    """``(gradient to x, gradient to the values)`` of ``y = product(A, x)`` for ``y``'s
    gradient ``g`` (None where not needed): ``run(product.dual, g)``, and ``values_grad(left,
    right)`` with ``(left, right)`` = ``(g, x)``, or ``(x, g)`` for a product with ``A.T``.
    ``run`` and ``values_grad`` compute over the same matrix: the operators, or the kernels."""
    gv = None
    if need_values:
        left, right = (x, g) if product.transpose else (g, x)
        gv = values_grad(left, right)
    return (run(product.dual, g) if need_x else None), gv


# ---------------------------------------------------------------------------------------------
# The operators' autograd (traced: compiled backward graphs hold the gradient operators)


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` (typed)."""
    return fn.apply(*args)  # type: ignore[no-untyped-call]


def again() -> RuntimeError:
    """The error of differentiating a safesparse product's gradient again (the gradients'
    own backward: the operators' here, the eager fast path's in ``safesparse.nn.eager``)."""
    return RuntimeError("safesparse: differentiating the gradient of a safesparse product "
                        "again is not supported")


class _Function(torch.autograd.Function):
    """An operator as an ``autograd.Function`` with ``setup_context`` (``torch.func``
    transforms only those; the one ``register_autograd`` makes has none) and a batching rule
    generated from the operators' own (:mod:`safesparse.operators.transforms`)."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise again()


class _LinearGradInput(_Function):
    @staticmethod
    def forward(*args: Any) -> Any:
        return linear_grad_input(*args)


class _LinearGradValues(_Function):
    @staticmethod
    def forward(*args: Any) -> Any:
        return linear_grad_values(*args)


class _MatmulGradInput(_Function):
    @staticmethod
    def forward(*args: Any) -> Any:
        return matmul_grad_input(*args)


class _MatmulGradValues(_Function):
    @staticmethod
    def forward(*args: Any) -> Any:
        return matmul_grad_values(*args)


#: The gradient operators of the two differentiable products, as autograd.Functions.
_GRADIENT_OPS: dict[str, type[torch.autograd.Function]] = {
    "linear_grad_input": _LinearGradInput, "linear_grad_values": _LinearGradValues,
    "matmul_grad_input": _MatmulGradInput, "matmul_grad_values": _MatmulGradValues,
}


def _operator_gradients(product: SparseProduct, g: T, x: T, values: T,
                        matrix: tuple[Any, ...], need_x: bool, need_values: bool
                        ) -> tuple[T | None, T | None]:
    """:func:`gradients` through the gradient operators over ``matrix`` (``compressed, plain,
    values, layout, n_rows, n_cols``), in ``g``'s dtype (computed under autocast: the backward
    in its dtype), returned in the dtypes of ``x`` and ``values``."""
    g = g.contiguous()
    dtype = x.dtype, values.dtype
    if g.dtype != values.dtype:
        x = x.to(g.dtype)
        matrix = (*matrix[:2], matrix[2].to(g.dtype), *matrix[3:])
    batch_major = product.batch_major

    def run(p: SparseProduct, operand: T) -> T:
        fn = _GRADIENT_OPS[p.name]
        out: T = apply(fn, operand, *matrix) if batch_major else apply(fn, *matrix, operand)
        return out

    def values_grad(left: T, right: T) -> T:
        fn = _GRADIENT_OPS[product.values_grad]
        out: T = apply(fn, left, right, *matrix) if batch_major else apply(fn, *matrix, left,
                                                                             right)
        return out

    gx, gv = gradients(product, g, x, need_x, need_values, run, values_grad)
    if gx is not None and gx.dtype != dtype[0]:
        gx = gx.to(dtype[0])
    if gv is not None and gv.dtype != dtype[1]:
        gv = gv.to(dtype[1])
    return gx, gv


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: T) -> None:
    x, compressed, plain, values, layout, out_features, in_features = inputs
    ctx.save_for_backward(x, compressed, plain, values)
    ctx.geometry = (layout, out_features, in_features)


def _linear_backward(ctx: Any, g: T) -> tuple[T | None, ...]:
    x, compressed, plain, values = ctx.saved_tensors
    need_x, _, _, need_values = ctx.needs_input_grad[:4]
    gx, gv = _operator_gradients(LINEAR, g, x, values,
                                 (compressed, plain, values, *ctx.geometry), need_x,
                                 need_values)
    return gx, None, None, gv, None, None, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _linear_bias_setup(ctx: Any, inputs: tuple[Any, ...], output: T) -> None:
    x, compressed, plain, values, _, layout, out_features, in_features = inputs
    _linear_setup(ctx, (x, compressed, plain, values, layout, out_features, in_features), output)


def _linear_bias_backward(ctx: Any, g: T) -> tuple[T | None, ...]:
    gx, _, _, gv, *_ = _linear_backward(ctx, g)
    gb = blockkernels.bias_grad(g) if ctx.needs_input_grad[4] else None
    return gx, None, None, gv, gb, None, None, None


linear_bias.register_autograd(_linear_bias_backward, setup_context=_linear_bias_setup)


class LinearFunction(_Function):
    """``safesparse::linear`` with its autograd formula: what ``SparseLinear`` calls under a
    ``torch.func`` transform."""

    @staticmethod
    def forward(*args: Any) -> Any:
        return linear(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _linear_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _linear_backward(ctx, *grads)


def _matmul_setup(ctx: Any, inputs: tuple[Any, ...], output: T) -> None:
    compressed, plain, values, layout, n_rows, n_cols, x = inputs
    ctx.save_for_backward(compressed, plain, values, x)
    ctx.geometry = (layout, n_rows, n_cols)


def _matmul_backward(ctx: Any, g: T) -> tuple[T | None, ...]:
    compressed, plain, values, x = ctx.saved_tensors
    need_values, need_x = ctx.needs_input_grad[2], ctx.needs_input_grad[6]
    gx, gv = _operator_gradients(MATMUL, g, x, values,
                                 (compressed, plain, values, *ctx.geometry), need_x,
                                 need_values)
    return None, None, gv, None, None, None, gx


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


class MatmulFunction(_Function):
    """``safesparse::matmul`` with its autograd formula (``SparseMatmul`` under a
    ``torch.func`` transform)."""

    @staticmethod
    def forward(*args: Any) -> Any:
        return matmul(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _matmul_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _matmul_backward(ctx, *grads)

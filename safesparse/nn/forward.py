"""The forward passes of the ``safesparse.nn`` modules: the one file of safesparse that
``torch.compile`` traces (see :mod:`safesparse._compile`).

They read strided tensors only (the index buffers, the values, the bias, the input) and call
the ``safesparse`` operators, which appear in the graph as one node each; the operators' real
implementations (the O(1) confirmation of the index members, the kernels) run eagerly.
Nothing here may build or inspect a sparse tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..kernels import blocks as blockkernels
from . import eager
from ..operators.library import (
    keyed,
    linear,
    linear_bias,
    linear_grad_input,
    linear_grad_values,
    matmul,
    matmul_grad_input,
    matmul_grad_values,
)

__all__ = ["LinearFunction", "MatmulFunction", "linear_forward", "linear_operators",
           "matmul_forward", "matmul_operators"]


# ---------------------------------------------------------------------------------------------
# The operators' autograd formulas (traced: compiled backward graphs hold the gradient operators)


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    return fn.apply(*args)  # type: ignore[no-untyped-call]


class _Function(torch.autograd.Function):
    """An operator as an ``autograd.Function`` with ``setup_context`` (``torch.func``
    transforms only those; the one ``register_autograd`` makes has none) and a batching rule
    generated from the operators' own (:mod:`safesparse.nn.transforms`)."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError("safesparse: differentiating the gradient of a safesparse product "
                           "again is not supported")


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


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, compressed, plain, values, layout, out_features, in_features = inputs
    ctx.save_for_backward(x, compressed, plain, values)
    ctx.geometry = (layout, out_features, in_features)


def _linear_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, compressed, plain, values = ctx.saved_tensors
    layout, out_features, in_features = ctx.geometry
    need_x, _, _, need_values = ctx.needs_input_grad[:4]
    g = g.contiguous()
    dtype = x.dtype, values.dtype
    if g.dtype != values.dtype:  # computed under autocast: the backward in its dtype
        x, values = x.to(g.dtype), values.to(g.dtype)
    gx = _apply(_LinearGradInput, g, compressed, plain, values, layout, out_features,
                                in_features) if need_x else None
    gv = _apply(_LinearGradValues, g, x, compressed, plain, values, layout, out_features,
                                 in_features) if need_values else None
    if gx is not None and gx.dtype != dtype[0]:
        gx = gx.to(dtype[0])
    if gv is not None and gv.dtype != dtype[1]:
        gv = gv.to(dtype[1])
    return gx, None, None, gv, None, None, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _linear_bias_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, compressed, plain, values, _, layout, out_features, in_features = inputs
    _linear_setup(ctx, (x, compressed, plain, values, layout, out_features, in_features), output)


def _linear_bias_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    gx, _, _, gv, *_ = _linear_backward(ctx, g)
    gb = blockkernels.bias_grad(g) if ctx.needs_input_grad[4] else None
    return gx, None, None, gv, gb, None, None, None


linear_bias.register_autograd(_linear_bias_backward, setup_context=_linear_bias_setup)


class LinearFunction(_Function):
    """``safesparse::linear`` with its autograd formula: what ``SparseLinear`` calls, so that
    ``torch.func`` transforms it."""

    @staticmethod
    def forward(*args: Any) -> Any:
        return linear(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _linear_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _linear_backward(ctx, *grads)




def _matmul_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    compressed, plain, values, layout, n_rows, n_cols, x = inputs
    ctx.save_for_backward(compressed, plain, values, x)
    ctx.geometry = (layout, n_rows, n_cols)


def _matmul_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    compressed, plain, values, x = ctx.saved_tensors
    layout, n_rows, n_cols = ctx.geometry
    need_values, need_x = ctx.needs_input_grad[2], ctx.needs_input_grad[6]
    g = g.contiguous()
    dtype = x.dtype, values.dtype
    if g.dtype != values.dtype:  # computed under autocast: the backward in its dtype
        x, values = x.to(g.dtype), values.to(g.dtype)
    gv = _apply(_MatmulGradValues, compressed, plain, values, layout, n_rows, n_cols, g,
                                 x) if need_values else None
    gx = _apply(_MatmulGradInput, compressed, plain, values, layout, n_rows, n_cols,
                                g) if need_x else None
    if gx is not None and gx.dtype != dtype[0]:
        gx = gx.to(dtype[0])
    if gv is not None and gv.dtype != dtype[1]:
        gv = gv.to(dtype[1])
    return None, None, gv, None, None, None, gx


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


class MatmulFunction(_Function):
    """``safesparse::matmul`` with its autograd formula (``SparseMatmul``)."""

    @staticmethod
    def forward(*args: Any) -> Any:
        return matmul(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _matmul_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _matmul_backward(ctx, *grads)


# ---------------------------------------------------------------------------------------------
# The forward passes


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev) is active in eager code: the
    products then go through the autograd.Functions above (traced code calls the operators:
    the same formulas, registered with ``register_autograd``)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseLinear.forward``: ``x @ W.T + b`` over any leading dims of ``x`` (in eager
    mode through the fast path of ``safesparse.nn.eager`` where it holds)."""
    if not torch.compiler.is_compiling():
        return eager.linear(self, x, linear_operators)
    return linear_operators(self, x)


def linear_operators(self: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`linear_forward` through the ``safesparse`` operators (the proving path)."""
    if x.dim() == 0 or x.shape[-1] != self.in_features:
        raise RuntimeError(
            f"SparseLinear: the input's last dim must be in_features={self.in_features}, got "
            f"{x.shape[-1] if x.dim() else 'a 0-dim tensor'} (input of shape "
            f"{tuple(x.shape)})")
    lead = x.shape[:-1]
    try:
        rows = x.unsqueeze(0) if x.dim() == 1 else x.flatten(0, -2)  # (in_features=0 too)
        args = (rows, self.compressed_indices, self.plain_indices,
                self.values, self._layout_name, self.out_features, self.in_features)
        y: torch.Tensor
        if _transformed():  # torch.func: the autograd.Function, the bias added after
            y = _apply(LinearFunction, *args)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif self.bias is None:
            y = linear(*args)
        else:  # the bias added in the product's pass (under autocast: its dtype, as nn.Linear)
            y = linear_bias(*args[:4], self.bias, *args[4:])
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    # (a 2-D input's output is returned as it is, not as a reshaped view: FSDP2 warns about a
    # module returning a view on every forward)
    return y if x.dim() == 2 else y.reshape(*lead, self.out_features)


def matmul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseMatmul.forward``: ``A @ x`` for ``x`` of shape ``(n_cols,)`` or
    ``(n_cols, N)`` (in eager mode through the fast path of ``safesparse.nn.eager`` where it
    holds)."""
    if not torch.compiler.is_compiling():
        return eager.matmul(self, x, matmul_operators)
    return matmul_operators(self, x)


def matmul_operators(self: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`matmul_forward` through the ``safesparse`` operators (the proving path)."""
    vector = x.dim() == 1
    try:
        args = (self.compressed_indices, self.plain_indices, self.values, self._layout_name,
                self.n_rows, self.n_cols, x.unsqueeze(1) if vector else x)
        y: torch.Tensor = (_apply(MatmulFunction, *args) if _transformed()
                             else matmul(*args))
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    return y.squeeze(1) if vector else y

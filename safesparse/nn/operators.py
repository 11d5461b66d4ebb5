"""The ``safesparse`` operators: sparse products over the dense members of a proven matrix.

Each product of :mod:`safesparse.nn` is one ``torch.library`` custom operator whose inputs are
strided tensors only (the compressed and plain index members, the values, the dense operand),
so ``torch.compile(fullgraph=True)`` traces it as one node (its fake implementation gives the
output's shape) and ``torch.export`` exports it. Their autograd formulas are operators too
(gradient to the dense operand: the transposed product; to the values: one small product per
stored block), so compiled backward graphs hold them the same way.

Validation stays where data enters (the modules' construction, ``load_state_dict``, setting a
new weight). At run time every real implementation confirms in O(1), with one question to
:func:`safesparse.state.checked.confirm`, that the index members it was given are the ones proven
for this geometry, unwritten since, and refuses anything else (:class:`UnprovenMembersError`),
before any kernel reads them. The metadata the kernels rely on beyond the proof (the values'
shape against the number of stored blocks, the block shape against the sizes, the dense
operand's shape, dtypes and devices) is checked next to it, also in O(1).

``layout`` is passed as a string (``"csr"``, ``"csc"``, ``"bsr"``, ``"bsc"``): custom operators
take no ``torch.layout`` argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import custom_op

from ..base.debug_flag import is_debug
from ..factories import sparse_compressed_tensor
from ..kernels import blocks as blockkernels
from ..state import checked

__all__ = ["LAYOUT_NAMES", "UnprovenMembersError", "linear", "linear_bias", "matmul"]

LAYOUT_NAMES: dict[torch.layout, str] = {
    torch.sparse_csr: "csr", torch.sparse_csc: "csc",
    torch.sparse_bsr: "bsr", torch.sparse_bsc: "bsc",
}
_LAYOUTS = {name: layout for layout, name in LAYOUT_NAMES.items()}
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class UnprovenMembersError(RuntimeError):
    """A ``safesparse`` operator was given index members that are not the proven ones."""


def _refuse(op: str, what: str) -> UnprovenMembersError:
    return UnprovenMembersError(
        f"safesparse::{op}: {what}\n"
        "  The operator reads only index members that were validated together and not written "
        "since (a module's own index buffers). Index buffers replaced or written in place "
        "(`layer.plain_indices.data = ...`, `buf[0] = ...`, a tensor assigned over a buffer, "
        "a program loaded from a file) are refused before any kernel reads them. Set a new "
        "pattern through the module (`layer.weight = W`, `load_state_dict`), which validates "
        "it.")


def _geometry(op: str, layout_name: str, compressed: torch.Tensor, plain: torch.Tensor,
              values: torch.Tensor, n_rows: int, n_cols: int
              ) -> tuple[torch.layout, dict[Any, Any] | None]:
    """Checks, in O(1), that the members are the proven ones for an ``n_rows x n_cols``
    matrix of ``layout_name`` and that ``values`` fits them; returns the layout and the
    proof's cache for the kernels' pattern data (:func:`checked.members_cache`; None in debug
    mode or where the state has none)."""
    layout = _LAYOUTS.get(layout_name)
    if layout is None:
        raise ValueError(f"safesparse::{op}: unknown layout {layout_name!r} "
                         f"(one of {', '.join(_LAYOUTS)})")
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    if values.layout != torch.strided or values.dim() != (3 if blocked else 1):
        raise _refuse(op, f"values of shape {tuple(values.shape)} do not fit a 2-D "
                          f"{layout_name.upper()} matrix")
    if values.dtype not in _FLOATS:
        raise TypeError(f"safesparse::{op}: values dtype {values.dtype} is not supported "
                        "(float32, float64, float16, bfloat16)")
    r, c = (int(values.shape[1]), int(values.shape[2])) if blocked else (1, 1)
    if r == 0 or c == 0 or n_rows % r or n_cols % c:
        raise _refuse(op, f"block shape ({r}, {c}) does not divide the size "
                          f"({n_rows}, {n_cols})")
    row = layout in (torch.sparse_csr, torch.sparse_bsr)
    n_compressed, n_plain = (n_rows // r, n_cols // c) if row else (n_cols // c, n_rows // r)
    if (compressed.dim() != 1 or plain.dim() != 1 or compressed.shape[0] != n_compressed + 1
            or plain.shape[0] != values.shape[0] or values.device != plain.device):
        raise _refuse(op, f"members of shapes {tuple(compressed.shape)}, "
                          f"{tuple(plain.shape)}, {tuple(values.shape)} do not fit a "
                          f"{n_rows} x {n_cols} {layout_name.upper()} matrix")
    if is_debug():  # debug mode trusts no remembered proof: the members are validated
        sparse_compressed_tensor(compressed, plain, values.detach(), (n_rows, n_cols),
                                 layout=layout)
        return layout, None
    geometry = checked.compressed_geometry(n_compressed, n_plain)
    if not checked.confirm(compressed, plain, geometry):
        raise _refuse(op, "the index members are not the proven ones (replaced, written or "
                          "never validated)")
    return layout, checked.members_cache(compressed, plain, geometry)


def _operand(op: str, x: torch.Tensor, values: torch.Tensor, shape: tuple[int, int],
             what: str) -> None:
    if x.dim() != 2 or tuple(x.shape) != shape:
        raise ValueError(f"safesparse::{op}: {what} must have shape {shape}, got "
                         f"{tuple(x.shape)}")
    if x.dtype != values.dtype or x.device != values.device:
        raise TypeError(f"safesparse::{op}: {what} is {x.dtype} on {x.device}, values are "
                        f"{values.dtype} on {values.device} (convert one of them)")


# ---------------------------------------------------------------------------------------------
# y = x @ W.T  (SparseLinear)


@custom_op("safesparse::linear", mutates_args=())
def linear(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
           layout: str, out_features: int, in_features: int) -> torch.Tensor:
    """``x @ W.T`` for the proven ``out_features x in_features`` matrix ``W`` with these
    members; ``x`` of shape ``(N, in_features)``."""
    lay, cache = _geometry("linear", layout, compressed, plain, values, out_features,
                           in_features)
    _operand("linear", x, values, (x.shape[0], in_features), "x")
    return blockkernels.linear(x, lay, compressed, plain, values, out_features, in_features,
                               cache=cache)


@linear.register_fake
def _(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      layout: str, out_features: int, in_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@custom_op("safesparse::linear_grad_input", mutates_args=())
def linear_grad_input(g: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                      values: torch.Tensor, layout: str, out_features: int,
                      in_features: int) -> torch.Tensor:
    """``g @ W``: the gradient of :func:`linear` to ``x``."""
    lay, cache = _geometry("linear_grad_input", layout, compressed, plain, values,
                           out_features, in_features)
    _operand("linear_grad_input", g, values, (g.shape[0], out_features), "g")
    return blockkernels.linear_grad_input(g, lay, compressed, plain, values, out_features,
                                          in_features, cache=cache)


@linear_grad_input.register_fake
def _(g: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      layout: str, out_features: int, in_features: int) -> torch.Tensor:
    return g.new_empty(g.shape[0], in_features)


@custom_op("safesparse::linear_grad_values", mutates_args=())
def linear_grad_values(g: torch.Tensor, x: torch.Tensor, compressed: torch.Tensor,
                       plain: torch.Tensor, values: torch.Tensor, layout: str,
                       out_features: int, in_features: int) -> torch.Tensor:
    """The gradient of :func:`linear` to ``values`` (``values``' shape)."""
    op = "linear_grad_values"
    lay, cache = _geometry(op, layout, compressed, plain, values, out_features, in_features)
    _operand(op, g, values, (g.shape[0], out_features), "g")
    _operand(op, x, values, (g.shape[0], in_features), "x")
    return blockkernels.linear_grad_values(g, x, lay, compressed, plain, values, out_features,
                                           in_features, cache=cache)


@linear_grad_values.register_fake
def _(g: torch.Tensor, x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
      values: torch.Tensor, layout: str, out_features: int, in_features: int) -> torch.Tensor:
    return torch.empty_like(values)


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, compressed, plain, values, layout, out_features, in_features = inputs
    ctx.save_for_backward(x, compressed, plain, values)
    ctx.geometry = (layout, out_features, in_features)


def _linear_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, compressed, plain, values = ctx.saved_tensors
    layout, out_features, in_features = ctx.geometry
    need_x, _, _, need_values = ctx.needs_input_grad[:4]
    g = g.contiguous()
    gx = linear_grad_input(g, compressed, plain, values, layout, out_features,
                           in_features) if need_x else None
    gv = linear_grad_values(g, x, compressed, plain, values, layout, out_features,
                            in_features) if need_values else None
    return gx, None, None, gv, None, None, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@custom_op("safesparse::linear_bias", mutates_args=())
def linear_bias(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                values: torch.Tensor, bias: torch.Tensor, layout: str, out_features: int,
                in_features: int) -> torch.Tensor:
    """``x @ W.T + bias``: :func:`linear` with the bias added in the same pass (the native
    kernels start each output from it)."""
    op = "linear_bias"
    lay, cache = _geometry(op, layout, compressed, plain, values, out_features, in_features)
    _operand(op, x, values, (x.shape[0], in_features), "x")
    _operand(op, bias.view(1, -1) if bias.dim() == 1 else bias, values, (1, out_features),
             "bias")
    return blockkernels.linear(x, lay, compressed, plain, values, out_features, in_features,
                               cache=cache, bias=bias)


@linear_bias.register_fake
def _(x: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
      bias: torch.Tensor, layout: str, out_features: int, in_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _linear_bias_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, compressed, plain, values, _, layout, out_features, in_features = inputs
    ctx.save_for_backward(x, compressed, plain, values)
    ctx.geometry = (layout, out_features, in_features)


def _linear_bias_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    gx, _, _, gv, *_ = _linear_backward(ctx, g)
    gb = g.sum(0) if ctx.needs_input_grad[4] else None
    return gx, None, None, gv, gb, None, None, None


linear_bias.register_autograd(_linear_bias_backward, setup_context=_linear_bias_setup)


# ---------------------------------------------------------------------------------------------
# y = A @ x  (SparseMatmul)


@custom_op("safesparse::matmul", mutates_args=())
def matmul(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
           n_rows: int, n_cols: int, x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` for the proven ``n_rows x n_cols`` matrix ``A`` with these members; ``x`` of
    shape ``(n_cols, N)``."""
    lay, cache = _geometry("matmul", layout, compressed, plain, values, n_rows, n_cols)
    _operand("matmul", x, values, (n_cols, x.shape[1]), "x")
    return blockkernels.matmul(lay, compressed, plain, values, n_rows, n_cols, x, cache=cache)


@matmul.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(n_rows, x.shape[1])


@custom_op("safesparse::matmul_grad_input", mutates_args=())
def matmul_grad_input(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                      layout: str, n_rows: int, n_cols: int, g: torch.Tensor) -> torch.Tensor:
    """``A.T @ g``: the gradient of :func:`matmul` to ``x``."""
    op = "matmul_grad_input"
    lay, cache = _geometry(op, layout, compressed, plain, values, n_rows, n_cols)
    _operand(op, g, values, (n_rows, g.shape[1]), "g")
    return blockkernels.matmul_grad_input(lay, compressed, plain, values, n_rows, n_cols, g,
                                          cache=cache)


@matmul_grad_input.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, g: torch.Tensor) -> torch.Tensor:
    return g.new_empty(n_cols, g.shape[1])


@custom_op("safesparse::matmul_grad_values", mutates_args=())
def matmul_grad_values(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                       layout: str, n_rows: int, n_cols: int, g: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`matmul` to ``values`` (``values``' shape)."""
    op = "matmul_grad_values"
    lay, cache = _geometry(op, layout, compressed, plain, values, n_rows, n_cols)
    _operand(op, g, values, (n_rows, g.shape[1]), "g")
    _operand(op, x, values, (n_cols, g.shape[1]), "x")
    return blockkernels.matmul_grad_values(g, x, lay, compressed, plain, values, n_rows, n_cols,
                                           cache=cache)


@matmul_grad_values.register_fake
def _(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, layout: str,
      n_rows: int, n_cols: int, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(values)


def _matmul_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    compressed, plain, values, layout, n_rows, n_cols, x = inputs
    ctx.save_for_backward(compressed, plain, values, x)
    ctx.geometry = (layout, n_rows, n_cols)


def _matmul_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    compressed, plain, values, x = ctx.saved_tensors
    layout, n_rows, n_cols = ctx.geometry
    need_values, need_x = ctx.needs_input_grad[2], ctx.needs_input_grad[6]
    g = g.contiguous()
    gv = matmul_grad_values(compressed, plain, values, layout, n_rows, n_cols, g,
                            x) if need_values else None
    gx = matmul_grad_input(compressed, plain, values, layout, n_rows, n_cols,
                           g) if need_x else None
    return None, None, gv, None, None, None, gx


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)

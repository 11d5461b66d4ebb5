"""torch's own tools around the ``safesparse`` operators: ``torch.func`` and autocast.

* **Autograd that ``torch.func`` can transform**: ``register_autograd`` of a custom operator
  makes an ``autograd.Function`` without a ``setup_context`` staticmethod, which
  ``torch.func.grad`` / ``jacrev`` refuse; under a ``torch.func`` transform the modules call
  the operators through autograd.Functions that have one (:mod:`.autograd`), whose
  ``generate_vmap_rule`` uses the rules below.
* **Batching rules** (``torch.library.register_vmap``): a batch of dense operands over one
  matrix is one call on the stacked rows (``linear``, ``linear_grad_input``) or columns
  (``matmul``, ``matmul_grad_input``); anything else (batched values or members, per-sample
  gradients to the values) one call per batch element, stacked.
* **Autocast** (``torch.library.register_autocast``): under ``torch.autocast("cpu",
  dtype=torch.bfloat16)`` (or float16) the forward operators compute in the autocast dtype,
  values included, and return it, as ``nn.Linear`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef

from . import library as ops

__all__: list[str] = []


# -- batching rules ----------------------------------------------------------------------------


def _vmap_rule(op: CustomOpDef, rows: int | None, cols: int | None) -> Callable[..., Any]:
    """A batching rule for ``op``: where only argument ``rows`` (a dense ``(N, k)`` operand
    whose rows the output's rows follow) or ``cols`` (a ``(k, N)`` operand whose columns the
    output's columns follow) is batched, one call on the batch folded into it; else one call
    per batch element."""

    def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, int]:
        batched = [i for i, d in enumerate(in_dims) if d is not None]
        size = info.batch_size
        if rows is not None and batched == [rows]:
            a = list(args)
            x = a[rows].movedim(in_dims[rows], 0)  # (B, N, k)
            a[rows] = x.reshape(size * x.shape[1], x.shape[2])
            y = op(*a)
            return y.reshape(size, x.shape[1], y.shape[1]), 0
        if cols is not None and batched == [cols]:
            a = list(args)
            x = a[cols].movedim(in_dims[cols], 1)  # (k, B, N)
            a[cols] = x.reshape(x.shape[0], size * x.shape[2])
            y = op(*a)
            return y.reshape(y.shape[0], size, x.shape[2]).movedim(1, 0), 0
        outs = [op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims,
                                                                             strict=True)))
                for i in range(size)]
        return torch.stack(outs), 0

    return rule


ops.linear.register_vmap(_vmap_rule(ops.linear, rows=0, cols=None))
ops.linear_grad_input.register_vmap(_vmap_rule(ops.linear_grad_input, rows=0, cols=None))
ops.linear_grad_values.register_vmap(_vmap_rule(ops.linear_grad_values, None, None))
ops.matmul.register_vmap(_vmap_rule(ops.matmul, rows=None, cols=6))
ops.matmul_grad_input.register_vmap(_vmap_rule(ops.matmul_grad_input, rows=None, cols=6))
ops.matmul_grad_values.register_vmap(_vmap_rule(ops.matmul_grad_values, None, None))


# -- autocast ------------------------------------------------------------------------------------



def _register_autocast(op: CustomOpDef) -> None:
    """Floating-point operands (not float64) cast to the autocast dtype of their device (CPU:
    ``torch.get_autocast_dtype("cpu")``), then ``op`` with autocast off: torch's own
    ``register_autocast`` takes one fixed dtype."""
    overload = op._opoverload
    key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(_: Any, *args: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        cast = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     and a.device.type == "cpu" and a.dtype is not torch.float64 else a
                     for a in args)
        with torch._C._ExcludeDispatchKeyGuard(key):
            return overload(*cast)

    op._lib.impl(op._name, kernel, "AutocastCPU",  # type: ignore[no-untyped-call]
                 with_keyset=True)


for _op in (ops.linear, ops.linear_bias, ops.matmul):
    _register_autocast(_op)

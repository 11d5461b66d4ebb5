"""Optimizer steps on sparse parameters: SGD on the pattern, every other optimizer refused.

Importing safesparse registers a global optimizer step pre-hook
(:func:`torch.optim.optimizer.register_optimizer_step_pre_hook`) that looks at the parameters
of the optimizer being stepped. A checked sparse parameter (an ``nn.Parameter`` holding a CSR,
CSC, BSR or BSC ``SafeSparseTensor``) with a dense gradient is updated on its pattern by
``torch.optim.SGD`` (single-tensor implementation: ``foreach`` and ``fused`` off, their default
for such a parameter; with or without momentum, Nesterov, dampening, maximize; weight decay for
CSR / CSC only, as torch 2.13 cannot add a BSR / BSC tensor to a dense one):
every ``param.add_(update)`` of the step adds the update's entries at the stored positions, as a
dense parameter with a fixed mask would. Every other optimizer (Adam, AdamW, RMSprop, Adagrad,
...) is refused before it touches anything, with :class:`SparseParameterError` naming what works,
instead of torch 2.13's ``INTERNAL ASSERT FAILED`` or ``unsupported tensor layout`` from inside
the step. Parameters that are not SafeSparseTensors are left to torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..base.layouts import BLOCK_LAYOUTS, COMPRESSED_LAYOUTS
from ..tensor import SafeSparseTensor, ops

__all__ = ["SparseParameterError"]


class SparseParameterError(TypeError):
    """An optimizer was asked to update a sparse-layout parameter it cannot update."""

    __module__ = "safesparse.nn"  # printed and pickled by its public name


def _sgd_on_pattern(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                    p: torch.Tensor) -> bool:
    """Whether this SGD group runs the single-tensor update (``param.add_``) on its
    parameters, the one this module applies on the pattern. Weight decay adds the parameter
    to the dense gradient (``grad.add(param)``), which torch 2.13 cannot do for a BSR / BSC
    parameter (an internal assertion): refused for those."""
    return (isinstance(optimizer, torch.optim.SGD) and not group.get("foreach")
            and not group.get("fused") and not group.get("differentiable")
            and not (isinstance(group.get("lr"), torch.Tensor) and group["lr"].requires_grad)
            and not (p.layout in BLOCK_LAYOUTS and group.get("weight_decay", 0) != 0))


def _refusal(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> SparseParameterError:
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    grad = p.grad.layout if p.grad is not None else None
    return SparseParameterError(
        f"{name} cannot update a sparse parameter ({p.layout}, shape {tuple(p.shape)}, "
        f"gradient {grad}): torch 2.13's optimizers have no kernels for it\n"
        "to repair: train the values instead: safesparse.nn.SparseLinear(weight) keeps the "
        "pattern as buffers and the values as one dense nn.Parameter (docs/models.md)\n"
        "or: torch.optim.SGD(foreach=False; no weight decay for BSR / BSC) updates a checked "
        "sparse parameter on its pattern")


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: SGD on the pattern, every other optimizer refused (module
    docstring)."""
    ops.on_pattern(())
    allowed: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, SafeSparseTensor) or p.grad is None:
                continue
            dense_grad = p.grad.layout == torch.strided
            if not _sgd_on_pattern(optimizer, group, p) or (
                    dense_grad and not _on_pattern_ok(p, p.grad)):
                raise _refusal(optimizer, p)
            if dense_grad:
                allowed.append(p)
    if allowed:
        ops.on_pattern(allowed)


def _on_pattern_ok(p: torch.Tensor, grad: torch.Tensor) -> bool:
    return (p.layout in COMPRESSED_LAYOUTS and p.dense_dim() == 0 and grad.shape == p.shape
            and grad.device == p.device)


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    ops.on_pattern(())


_HOOKS = (register_optimizer_step_pre_hook(_pre_step),
          register_optimizer_step_post_hook(_post_step))

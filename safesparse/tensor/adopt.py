"""Adoption of a plain sparse tensor on index members of its own (``ss.validate``, SPEC 4).

torch keeps the index tensors a plain sparse tensor was built from as its members (the caller's
``col``, a view of a PyG ``edge_index``), each with a version counter of its own that no public
API reaches from the sparse tensor, and a file mapping can be rewritten by another process:
safesparse cannot watch such memory. So adoption copies the index members (values stay shared)
and validates the copy, which nothing but the adopted tensor can write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base import originals as _originals
from ..base.layouts import compressed_members, index_members

__all__ = ["copyable", "own_indices"]


def copyable(t: torch.Tensor) -> bool:
    """Whether ``t``'s members can be built on as they are before validation: contiguous index
    members (a copy keeps every stride, so validating it says what validating them would) and
    contiguous values (values of other strides, 3.7, are validated as they are first: no torch
    constructor is handed what the checks may refuse)."""
    with DisableTorchFunctionSubclass():
        values = t._values() if t.layout is torch.sparse_coo else t.values()
        return values.is_contiguous() and all(m.is_contiguous() for m in index_members(t))


def _build(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor like ``t`` on copies of its index members and ``t``'s own values."""
    if t.layout is torch.sparse_coo:
        return _originals.sparse_coo_tensor(
            t._indices().clone(), t._values(), t.shape, check_invariants=False,
            is_coalesced=t.is_coalesced())
    c, p = compressed_members(t)
    return _originals.sparse_compressed_tensor(c.clone(), p.clone(), t.values(), t.shape,
                                               layout=t.layout, check_invariants=False)


class ToSafeSparseTensor(torch.autograd.Function):
    """Identity from a plain sparse tensor to one on copies of its index members, keeping the
    graph (the gradient flows back to the adopted tensor; named as core.ToSafeSparseTensor,
    what an adoption's grad_fn is called either way)."""

    @staticmethod
    def forward(ctx: Any, plain: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return _build(plain.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


def own_indices(t: torch.Tensor) -> torch.Tensor:
    """A new plain tensor sharing ``t``'s values (and its autograd graph) on copies of ``t``'s
    index members, which only the new tensor holds."""
    with DisableTorchFunctionSubclass():
        if t.requires_grad:
            out: torch.Tensor = ToSafeSparseTensor.apply(t)  # type: ignore[no-untyped-call]
            return out
        return _build(t)

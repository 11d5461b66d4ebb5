"""Sparse weights in model code: :class:`SparseLinear`, and optimizer steps on sparse parameters.

:class:`SparseLinear` is the module every user of a sparse layer would otherwise write by hand:
the pattern as checked index buffers, the nonzero values as one dense ``nn.Parameter`` (so every
``torch.optim`` optimizer trains it and the pattern never changes), the weight rebuilt from them
on every call without an O(nnz) check, and a ``state_dict`` of plain dense tensors whose
pattern is validated when it is loaded.

Importing safesparse also registers a global optimizer step pre-hook
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
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .catalog.invariants import COMPRESSED_LAYOUTS
from .factories.core import sparse_compressed_tensor
from .tensor import ops
from .tensor.core import SafeSparseTensor, validate

__all__ = ["SparseLinear", "SparseParameterError"]

_BLOCK = (torch.sparse_bsr, torch.sparse_bsc)
_ROW = (torch.sparse_csr, torch.sparse_bsr)


class SparseLinear(nn.Module):
    """``y = F.linear(x, weight, bias)`` for a sparse ``weight`` with a fixed pattern.

    Args:
        weight: the initial weight, a 2-D sparse tensor of layout CSR, CSC, BSR or BSC (any
            block shape; no dense dims), plain or ``SafeSparseTensor``. A plain tensor is
            validated first (``InvariantError`` when invalid). Its pattern is the layer's for
            good; its values are copied into :attr:`values`.
        bias: None (no bias), True (a zero bias), or a dense tensor of shape
            ``(out_features,)`` (copied).

    Attributes:
        values: the stored values, one dense ``nn.Parameter`` (shape ``(nnz,)`` for CSR / CSC,
            ``(nnz blocks, r, c)`` for BSR / BSC): what optimizers train.
        compressed_indices, plain_indices: the pattern, index buffers (``crow`` / ``col`` for
            the row layouts, ``ccol`` / ``row`` for the column layouts).
        bias: the bias parameter, or None.
        layout, in_features, out_features, blocksize: the weight's geometry (``blocksize`` is
            None for CSR / CSC).

    ``layer.weight`` is the current weight, a checked ``SafeSparseTensor`` rebuilt on the index
    buffers (no O(nnz) check: ``ss.stats().skipped`` counts it) whose gradient reaches
    :attr:`values`. ``state_dict()`` holds dense tensors only; ``load_state_dict`` validates the
    incoming pattern and raises ``InvariantError`` before anything is written when it is
    invalid.
    """

    values: nn.Parameter
    bias: nn.Parameter | None
    compressed_indices: torch.Tensor
    plain_indices: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | bool | None = None) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.layout not in COMPRESSED_LAYOUTS:
            got = weight.layout if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(
                f"SparseLinear: weight must be a CSR, CSC, BSR or BSC tensor, got {got} "
                "(convert a dense weight with .to_sparse_csr() or .to_sparse_bsr(blocksize))")
        if weight.dim() != 2 or weight.dense_dim() != 0:
            raise ValueError(
                f"SparseLinear: weight must be 2-D without dense dims, got shape "
                f"{tuple(weight.shape)} with {weight.dense_dim()} dense dims")
        # the layer's own copy (a clone of a checked tensor is checked without a validation):
        # writes to ``weight``'s tensors later do not reach the layer
        own = validate(weight.detach()).clone()
        self.layout: torch.layout = own.layout
        self.out_features, self.in_features = int(own.shape[0]), int(own.shape[1])
        # values of their own: ``own.values()`` shares ``own``'s version counter, so training
        # it in place would void the proof of the index buffers at every step
        values = own.values().detach().clone()
        self.blocksize: tuple[int, int] | None = (
            (int(values.shape[-2]), int(values.shape[-1])) if self.layout in _BLOCK else None)
        compressed, plain = _members(own)
        self.register_buffer("compressed_indices", compressed)
        self.register_buffer("plain_indices", plain)
        self.values = nn.Parameter(values)
        if bias is True:
            bias = torch.zeros(self.out_features, dtype=values.dtype, device=values.device)
        if isinstance(bias, torch.Tensor):
            if bias.shape != (self.out_features,):
                raise ValueError(f"SparseLinear: bias must have shape ({self.out_features},), "
                                 f"got {tuple(bias.shape)}")
            self.bias = nn.Parameter(bias.detach().clone())
        else:
            self.register_parameter("bias", None)
        # a checked tensor on the buffers keeps their proof alive between calls (a proof lives
        # as long as some tensor built on its index data); rebuilt when the buffers change.
        # Built on the buffers (proven through ``own``: no O(nnz) check), with the values
        # parameter, so that ``own`` and its copy of the values can go.
        self._pattern_of: tuple[int, int, torch.device] | None = None
        self._keep_proof()
        del own

    def _buffer_key(self) -> tuple[int, int, torch.device]:
        c = self.compressed_indices
        return (c.data_ptr(), self.plain_indices.data_ptr(), c.device)

    def _keep_proof(self) -> None:
        """(Re)build :attr:`_pattern` on the current buffers (validated once) when they are
        not the ones it was built on (``module.to(device)``, ``copy.deepcopy``,
        ``load_state_dict``)."""
        key = self._buffer_key()
        if key != self._pattern_of:
            self._pattern: SafeSparseTensor = sparse_compressed_tensor(
                self.compressed_indices, self.plain_indices, self.values.detach(), self.shape,
                layout=self.layout)
            self._pattern_of = key

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def weight(self) -> SafeSparseTensor:
        """The current weight: the checked pattern with the current :attr:`values`."""
        self._keep_proof()
        out: SafeSparseTensor = sparse_compressed_tensor(
            self.compressed_indices, self.plain_indices, self.values, self.shape,
            layout=self.layout)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        block = "" if self.blocksize is None else f", blocksize={self.blocksize}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={self.layout}{block}, nnz={self.values.numel()}, "
                f"bias={self.bias is not None}")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Validates the incoming pattern (with the incoming values, or the current ones)
        against this layer's layout and shape before torch copies anything: an invalid one
        raises ``InvariantError`` and the layer is unchanged."""
        names = ("compressed_indices", "plain_indices", "values")
        incoming = [state_dict.get(prefix + n) for n in names]
        if any(t is not None for t in incoming):
            compressed, plain, values = (
                t if t is not None else getattr(self, n).detach()
                for t, n in zip(incoming, names, strict=True))
            if not all(isinstance(t, torch.Tensor) for t in (compressed, plain, values)):
                raise TypeError(f"SparseLinear: {prefix}{{{', '.join(names)}}} must be tensors")
            sparse_compressed_tensor(compressed, plain, values.detach(), self.shape,
                                     layout=self.layout)  # InvariantError when invalid
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        self._pattern_of = None  # the buffers may have been written: proven again now
        self._keep_proof()


def _members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.layout in _ROW:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


# ---------------------------------------------------------------------------------------------
# Optimizer steps on sparse parameters


class SparseParameterError(TypeError):
    """An optimizer was asked to update a sparse-layout parameter it cannot update."""


def _sgd_on_pattern(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                    p: torch.Tensor) -> bool:
    """Whether this SGD group runs the single-tensor update (``param.add_``) on its
    parameters, the one this module applies on the pattern. Weight decay adds the parameter
    to the dense gradient (``grad.add(param)``), which torch 2.13 cannot do for a BSR / BSC
    parameter (an internal assertion): refused for those."""
    return (isinstance(optimizer, torch.optim.SGD) and not group.get("foreach")
            and not group.get("fused") and not group.get("differentiable")
            and not (isinstance(group.get("lr"), torch.Tensor) and group["lr"].requires_grad)
            and not (p.layout in _BLOCK and group.get("weight_decay", 0) != 0))


def _refusal(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> SparseParameterError:
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return SparseParameterError(
        f"{name} cannot update a sparse parameter ({p.layout}, shape {tuple(p.shape)}, "
        f"gradient {p.grad.layout if p.grad is not None else None}): torch 2.13's optimizers "
        "have no kernels for a sparse-layout parameter (their step would fail inside torch's "
        "kernels). Train the values "
        "instead: safesparse.nn.SparseLinear(weight) keeps the pattern as checked buffers and "
        "the nonzero values as one dense nn.Parameter, which every optimizer trains (or keep "
        "values = nn.Parameter(w.values()) and rebuild the weight with ss.sparse_*_tensor; "
        "docs/models.md). torch.optim.SGD (foreach=False, fused=False; no weight decay for "
        "BSR / BSC) updates a checked CSR / CSC / BSR / BSC parameter on its pattern.")


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

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
from .operators import keyed, linear, matmul

__all__ = ["linear_forward", "matmul_forward"]


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseLinear.forward``: ``x @ W.T + b`` over any leading dims of ``x``."""
    if x.dim() == 0 or x.shape[-1] != self.in_features:
        raise RuntimeError(
            f"SparseLinear: the input's last dim must be in_features={self.in_features}, got "
            f"{x.shape[-1] if x.dim() else 'a 0-dim tensor'} (input of shape "
            f"{tuple(x.shape)})")
    lead = x.shape[:-1]
    try:
        y: torch.Tensor = linear(x.reshape(-1, self.in_features), self.compressed_indices,
                                 self.plain_indices, self.values, self._layout_name,
                                 self.out_features, self.in_features)
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    y = y.reshape(*lead, self.out_features)
    if self.bias is not None:
        y = y + self.bias
    return y


def matmul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseMatmul.forward``: ``A @ x`` for ``x`` of shape ``(n_cols,)`` or
    ``(n_cols, N)``."""
    vector = x.dim() == 1
    try:
        y: torch.Tensor = matmul(self.compressed_indices, self.plain_indices, self.values,
                                 self._layout_name, self.n_rows, self.n_cols,
                                 x.unsqueeze(1) if vector else x)
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    return y.squeeze(1) if vector else y

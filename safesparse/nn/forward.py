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

from .operators import linear, linear_bias, matmul

__all__ = ["linear_forward", "matmul_forward"]


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseLinear.forward``: ``x @ W.T + b`` over any leading dims of ``x``."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, self.in_features)
    y: torch.Tensor
    if self.bias is None:
        y = linear(flat, self.compressed_indices, self.plain_indices, self.values,
                   self._layout_name, self.out_features, self.in_features)
    else:  # the bias added in the product's pass
        y = linear_bias(flat, self.compressed_indices, self.plain_indices, self.values,
                        self.bias, self._layout_name, self.out_features, self.in_features)
    return y.reshape(*lead, self.out_features)


def matmul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseMatmul.forward``: ``A @ x`` for ``x`` of shape ``(n_cols,)`` or
    ``(n_cols, N)``."""
    vector = x.dim() == 1
    y: torch.Tensor = matmul(self.compressed_indices, self.plain_indices, self.values,
                             self._layout_name, self.n_rows, self.n_cols,
                             x.unsqueeze(1) if vector else x)
    return y.squeeze(1) if vector else y

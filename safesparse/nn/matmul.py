"""``SparseMatmul``: ``y = A @ x`` for a fixed, proven sparse matrix (a graph's adjacency).

The product runs through the ``safesparse::matmul`` operator, so models holding the module
(graph convolutions) compile with ``fullgraph=True`` and export.
"""

from __future__ import annotations

import torch

from ..base.layouts import SHORT_NAMES
from ..tensor import SafeSparseTensor
from .forward import matmul_call, matmul_forward
from .pattern import CompressedModule

__all__ = ["SparseMatmul"]


class SparseMatmul(CompressedModule):
    """``forward(x) = A @ x`` for a fixed 2-D sparse ``A`` (CSR, CSC, BSR or BSC, any block
    shape), validated once when the module is built.

    Args:
        A: the matrix, plain or ``SafeSparseTensor`` (a plain one is validated first); its
            values are copied into :attr:`values`.
        trainable: whether :attr:`values` requires grad (the pattern never changes).

    ``x`` has shape ``(n_cols,)`` or ``(n_cols, N)``; the result ``(n_rows,)`` or
    ``(n_rows, N)``. Gradients reach ``x``, and :attr:`values` when trainable.
    """

    def __init__(self, A: torch.Tensor, trainable: bool = False) -> None:
        super().__init__()
        self._init_matrix(A, requires_grad=trainable)
        self.n_rows, self.n_cols = self._size
        self._layout_name = SHORT_NAMES[self.layout]

    @property
    def A(self) -> SafeSparseTensor:
        """The current matrix, a checked ``SafeSparseTensor`` (no O(nnz) check)."""
        return self.matrix

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._size)

    block_mask = CompressedModule.block_mask  # (documented here: SPEC 9)

    forward = matmul_forward  # (traced by torch.compile: nn/forward.py)
    __call__ = matmul_call  # (nn.Module.__call__ where anything but the forward runs)

    def extra_repr(self) -> str:
        return (f"shape=({self.n_rows}, {self.n_cols}), {self._describe()}, "
                f"trainable={self.values.requires_grad}")

"""``SparseLinear``: ``y = x @ W.T + b`` for a sparse weight with a fixed, proven pattern.

The product runs through the ``safesparse::linear`` operator (:mod:`safesparse.operators`),
so models holding the layer compile with ``fullgraph=True`` and export;
:meth:`SparseLinear.from_dense` prunes an ``nn.Linear`` to its blocks of largest norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base.layouts import SHORT_NAMES
from ..factories import sparse_compressed_tensor
from ..tensor import SafeSparseTensor
from .forward import linear_call, linear_forward
from .pattern import CompressedModule, block_shape

__all__ = ["SparseLinear"]


class SparseLinear(CompressedModule):
    """``y = F.linear(x, weight, bias)`` for a sparse ``weight`` with a fixed pattern.

    Args:
        weight: the initial weight, a 2-D sparse tensor of layout CSR, CSC, BSR or BSC (any
            block shape; no dense dims), plain or ``SafeSparseTensor``. A plain tensor is
            validated first (``InvariantError`` when invalid). Its values are copied into
            :attr:`values`.
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
    buffers (no O(nnz) check) whose gradient reaches :attr:`values`; ``layer.weight = W``
    validates ``W`` (same layout and shape) and replaces pattern and values whole. The forward
    pass is one ``safesparse::linear`` operator over the buffers and :attr:`values`.
    ``state_dict()`` holds dense tensors and the geometry (extra state); ``load_state_dict``
    validates the incoming pattern and raises ``InvariantError`` before anything is written
    when it is invalid; a valid one with another number of stored elements replaces pattern
    and values whole.
    """

    bias: nn.Parameter | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | bool | None = None) -> None:
        super().__init__()
        self._init_matrix(weight, requires_grad=True)
        self.out_features, self.in_features = self._size
        self._layout_name = SHORT_NAMES[self.layout]
        self._init_bias(bias)

    def _init_bias(self, bias: torch.Tensor | bool | None) -> None:
        if bias is True:
            bias = torch.zeros(self.out_features, dtype=self.values.dtype,
                               device=self.values.device)
        if isinstance(bias, torch.Tensor):
            if bias.shape != (self.out_features,):
                raise ValueError(f"SparseLinear: bias must have shape ({self.out_features},), "
                                 f"got {tuple(bias.shape)}")
            self.bias = nn.Parameter(bias.detach().clone())
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_dense(cls, linear: nn.Linear, blocksize: tuple[int, int] | int | None,
                   density: float) -> SparseLinear:
        """Prune ``linear`` to the blocks of largest Frobenius norm.

        Args:
            linear: the dense layer (its weight's dtype and device are kept).
            blocksize: ``(r, c)``, dividing ``(out_features, in_features)``: a BSR weight of
                r x c blocks (an int ``b``: square ``b x b`` blocks, as ``to_sparse_bsr``
                takes); None, 1 or ``(1, 1)``: a CSR weight (single entries, the entries of
                largest magnitude).
            density: the fraction of blocks kept, in ``[0, 1]``: ``round(density * blocks)``
                blocks, at least one when ``density > 0``. Ties keep the block that comes
                first in row-major order.

        Returns:
            A :class:`SparseLinear` whose stored blocks are the kept blocks' values (blocks
            of zeros included: the pattern is what was kept), with ``linear``'s bias copied.
            On the meta device: a skeleton of as many blocks, with no pattern yet (meta
            tensors hold no data), that ``load_state_dict(sd, assign=True)`` completes with
            the checkpoint's pattern and values (validated there; any number of blocks), or
            ``to_empty(device=...)`` followed by ``load_state_dict(sd)``.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SparseLinear.from_dense: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        bias = None if linear.bias is None else linear.bias.detach()
        return cls._pruned(linear.weight.detach(), bias, blocksize, density,
                           "SparseLinear.from_dense")

    @classmethod
    def _pruned(cls, w: torch.Tensor, bias: torch.Tensor | None,
                blocksize: tuple[int, int] | int | None, density: float,
                caller: str) -> SparseLinear:
        """:meth:`from_dense` of the dense weight ``w`` (``(out, in)``) and ``bias``."""
        if not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"{caller}: density must be in [0, 1], got {density}")
        out_f, in_f = int(w.shape[0]), int(w.shape[1])
        r, c = block_shape(blocksize)
        if r < 1 or c < 1 or out_f % r or in_f % c:
            raise ValueError(
                f"{caller}: blocksize {blocksize} does not divide the weight's "
                f"shape ({out_f}, {in_f})\n  Pick a block shape whose sides divide both.")
        nr, nc = out_f // r, in_f // c
        kept = round(float(density) * nr * nc)
        if density > 0:
            kept = max(kept, 1)
        layout = torch.sparse_csr if (r, c) == (1, 1) else torch.sparse_bsr
        if w.is_meta:
            return cls._skeleton(layout, (out_f, in_f), (r, c), kept, w.dtype,
                                 bias is not None)
        blocks = w.reshape(nr, r, nc, c).transpose(1, 2)  # (nr, nc, r, c)
        norms = blocks.float().pow(2).sum((2, 3)).flatten()
        order = torch.argsort(norms, descending=True, stable=True)[:kept]
        mask = torch.zeros(nr * nc, dtype=torch.bool, device=w.device)
        mask[order] = True
        rows, cols = mask.reshape(nr, nc).nonzero(as_tuple=True)  # row-major: sorted
        crow = torch.zeros(nr + 1, dtype=torch.int64, device=w.device)
        crow[1:] = torch.bincount(rows, minlength=nr).cumsum(0)
        if layout == torch.sparse_csr:
            weight: torch.Tensor = sparse_compressed_tensor(
                crow, cols, blocks[rows, cols, 0, 0].clone(), (out_f, in_f),
                layout=torch.sparse_csr)
        else:
            weight = sparse_compressed_tensor(crow, cols, blocks[rows, cols].clone(),
                                              (out_f, in_f), layout=torch.sparse_bsr)
        return cls(weight, bias)

    @classmethod
    def _skeleton(cls, layout: torch.layout, size: tuple[int, int], blocksize: tuple[int, int],
                  n_stored: int, dtype: torch.dtype, bias: bool) -> SparseLinear:
        """A layer on the meta device claiming ``n_stored`` blocks, with no pattern (see
        :meth:`from_dense`), with a (meta) bias or none."""
        self = cls.__new__(cls)
        CompressedModule.__init__(self)
        self._init_skeleton(layout, size, blocksize, n_stored, dtype, requires_grad=True)
        self.out_features, self.in_features = self._size
        self._layout_name = SHORT_NAMES[self.layout]
        self._init_bias(torch.empty(self.out_features, dtype=dtype, device="meta") if bias
                        else None)
        return self

    @property
    def weight(self) -> SafeSparseTensor:
        """The current weight: the checked pattern with the current :attr:`values`."""
        return self.matrix

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            self._set_matrix(value)
            return
        super().__setattr__(name, value)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._size)

    block_mask = CompressedModule.block_mask  # (documented here: SPEC 9)

    forward = linear_forward  # (traced by torch.compile: nn/forward.py)
    __call__ = linear_call  # (nn.Module.__call__ where anything but the forward runs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self._describe()}, bias={self.bias is not None}")

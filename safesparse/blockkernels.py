"""Products of a 2-D compressed sparse matrix with a dense operand, over its dense members.

Reference implementation (gather, one small product per stored block, ``index_add``): pure
functions over the members of an already validated CSR / CSC / BSR / BSC matrix ``W`` (or
``A``), any block shape; float16 and bfloat16 are computed in float32 and cast back. CSR / CSC
are the 1 x 1 block case (values of shape ``(nnz,)``). Nothing here checks its input: the
callers (:mod:`safesparse.nn.ops`) confirm the members are proven first.
"""

from __future__ import annotations

import torch

__all__ = [
    "linear",
    "linear_grad_input",
    "linear_grad_values",
    "matmul",
    "matmul_grad_input",
    "matmul_grad_values",
]

_ROW = (torch.sparse_csr, torch.sparse_bsr)
_BLOCKED = (torch.sparse_bsr, torch.sparse_bsc)
_NARROW = (torch.float16, torch.bfloat16)


def _work(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _NARROW else t


def _blocks(layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
            values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_rows, block_cols, blocks)``: each stored block's position and its (r, c) values
    in the working dtype."""
    counts = compressed[1:] - compressed[:-1]
    spread = torch.repeat_interleave(
        torch.arange(counts.numel(), device=plain.device, dtype=plain.dtype), counts,
        output_size=plain.numel())
    rows, cols = (spread, plain) if layout in _ROW else (plain, spread)
    blocks = values if layout in _BLOCKED else values.reshape(-1, 1, 1)
    return rows, cols, _work(blocks)


def linear(x: torch.Tensor, layout: torch.layout, compressed: torch.Tensor,
           plain: torch.Tensor, values: torch.Tensor, out_features: int,
           in_features: int) -> torch.Tensor:
    """``x @ W.T`` for ``x`` of shape ``(N, in_features)``."""
    rows, cols, blocks = _blocks(layout, compressed, plain, values)
    r, c = int(blocks.shape[1]), int(blocks.shape[2])
    n = x.shape[0]
    xb = _work(x).reshape(n, in_features // c, c)[:, cols]
    yb = torch.einsum("nkc,krc->nkr", xb, blocks)
    y = torch.zeros(n, out_features // r, r, dtype=yb.dtype, device=x.device)
    y.index_add_(1, rows, yb)
    return y.reshape(n, out_features).to(x.dtype)


def linear_grad_input(g: torch.Tensor, layout: torch.layout, compressed: torch.Tensor,
                      plain: torch.Tensor, values: torch.Tensor, out_features: int,
                      in_features: int) -> torch.Tensor:
    """``g @ W`` for ``g`` of shape ``(N, out_features)``."""
    rows, cols, blocks = _blocks(layout, compressed, plain, values)
    r, c = int(blocks.shape[1]), int(blocks.shape[2])
    n = g.shape[0]
    gb = _work(g).reshape(n, out_features // r, r)[:, rows]
    xb = torch.einsum("nkr,krc->nkc", gb, blocks)
    gx = torch.zeros(n, in_features // c, c, dtype=xb.dtype, device=g.device)
    gx.index_add_(1, cols, xb)
    return gx.reshape(n, in_features).to(g.dtype)


def linear_grad_values(g: torch.Tensor, x: torch.Tensor, layout: torch.layout,
                       compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                       out_features: int, in_features: int) -> torch.Tensor:
    """The gradient of ``(x @ W.T)`` with respect to ``values`` (``values``' shape) for the
    output gradient ``g``."""
    rows, cols, blocks = _blocks(layout, compressed, plain, values)
    r, c = int(blocks.shape[1]), int(blocks.shape[2])
    n = g.shape[0]
    gb = _work(g).reshape(n, out_features // r, r)[:, rows]
    xb = _work(x).reshape(n, in_features // c, c)[:, cols]
    gv = torch.einsum("nkr,nkc->krc", gb, xb)
    return gv.reshape(values.shape).to(values.dtype)


def matmul(layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
           values: torch.Tensor, n_rows: int, n_cols: int, x: torch.Tensor) -> torch.Tensor:
    """``A @ x`` for ``x`` of shape ``(n_cols, N)``."""
    return linear(x.mT, layout, compressed, plain, values, n_rows, n_cols).mT.contiguous()


def matmul_grad_input(layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
                      values: torch.Tensor, n_rows: int, n_cols: int,
                      g: torch.Tensor) -> torch.Tensor:
    """``A.T @ g`` for ``g`` of shape ``(n_rows, N)``."""
    return linear_grad_input(g.mT, layout, compressed, plain, values, n_rows,
                             n_cols).mT.contiguous()


def matmul_grad_values(layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor,
                       values: torch.Tensor, n_rows: int, n_cols: int, g: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``A @ x`` with respect to ``values`` for the output gradient ``g``."""
    return linear_grad_values(g.mT, x.mT, layout, compressed, plain, values, n_rows, n_cols)

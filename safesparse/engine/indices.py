"""Index checks before anything is built: validate index tensors on their own.

Code that converts indices itself (PyTorch Geometric's ``edge_index`` -> CSR conversion, a
hand-written COO -> CSR routine) runs torch kernels over the indices *before* any sparse
factory sees them; an out-of-range index can corrupt memory there. These functions run the
same checks as the safe factories on the index tensors alone, with the same invariant ids and
locations, so the conversion only ever sees valid indices:

* :func:`check_coo_indices` - a ``(sparse_dim, nnz)`` index tensor against a size (COO 1.x-5.x);
* :func:`check_compressed_indices` - a compressed/plain index pair without values (1.x-5.x of
  the compressed layouts).

Both reuse the validation engine (:mod:`safesparse.engine.validation`); no check is written here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..base import stats
from ..catalog.errors import InvariantError
from .convert import _as_size, _coo_index
from .metadata import LAYOUTS, check_compressed_metadata, check_coo_metadata, index_contiguous
from .validation import check_compressed_indices as _compressed_index_stage
from .validation import check_coo_indices as _coo_engine_stage

__all__ = ["check_compressed_indices", "check_coo_indices", "per_batch_contiguous"]


def _index_tensor(x: Any, device: torch.device | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if device is not None and t.device != device:
        t = t.to(device)
    return per_batch_contiguous(t)


def _size(size: Any, name: str) -> tuple[int, ...] | None:
    return _as_size(size, name)


def per_batch_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when its last dim is not unit-stride (3.5 / 3.6: torch
    requires index members to be contiguous per batch; any batch strides are kept)."""
    if t.layout == torch.strided and not index_contiguous(t):
        # not t.contiguous(): that returns t itself when only a size-1 dim has the odd stride
        t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return t


def check_coo_indices(
    indices: Any, size: Sequence[int] | None = None, *, is_coalesced: bool = False,
) -> torch.Size:
    """Validate COO-style indices (``(sparse_dim, nnz)``, e.g. a PyG ``edge_index``) against
    ``size`` before anything is built from them; return the size (estimated as max + 1 per
    sparse dim when ``size`` is None).

    ``size`` has ``sparse_dim`` extents, plus any dense extents the values would have. The
    checks, ids and locations are those of :func:`safesparse.sparse_coo_tensor` (``[COO 5.2]``:
    an index >= its extent); ``is_coalesced=True`` also checks 5.3 (sorted, no duplicates).
    Indices are converted as the factory converts them (any integer, bool or floating dtype to
    int64), so pass the tensor your own code will use.

    Args:
        indices: ``(sparse_dim, nnz)`` indices (a tensor, nested list or NumPy array).
        size: the extents (at least ``sparse_dim`` of them), or None to estimate them.
        is_coalesced: also check that the indices are sorted with no duplicates (5.3).

    Returns:
        The size, as a ``torch.Size``.

    Raises:
        InvariantError: an invariant is broken; ``str(err)`` names it and where.
        TypeError: ``size`` is not a sequence of integers.
    """
    idx = _coo_index(indices, None)
    shape = _size(size, "check_coo_indices")
    s = idx.shape[0] if idx.dim() == 2 else 0
    nnz = idx.shape[1] if idx.dim() == 2 else 0
    dense = () if shape is None else shape[s:]
    # the values are not the caller's concern here: a stand-in of the right shape, no memory
    values = torch.zeros((), device=idx.device).expand(nnz, *dense)
    meta = check_coo_metadata(idx, values, shape, device=idx.device)
    meta = _coo_engine_stage(meta, idx, is_coalesced=is_coalesced, estimate=shape is None)
    stats.count("validations")
    return torch.Size(meta.size)


def check_compressed_indices(
    compressed_indices: Any,
    plain_indices: Any,
    size: Sequence[int] | None = None,
    *,
    layout: torch.layout = torch.sparse_csr,
    blocksize: Sequence[int] | None = None,
) -> torch.Size:
    """Validate a compressed index pair (crow/col for CSR and BSR, ccol/row for CSC and BSC),
    without values, before anything is built from it; return the size (the plain extent
    estimated as in the factories when ``size`` is None).

    ``size`` is ``batch + (rows, cols)`` in elements (dense dims, if given, are ignored);
    ``blocksize`` (BSR/BSC, default ``(1, 1)``) is the block shape. The checks, ids and
    locations are those of :func:`safesparse.sparse_compressed_tensor` for that layout (e.g.
    ``[CSR 5.5]``: a column index >= ncols).

    Args:
        compressed_indices: ``batch + (n_compressed + 1,)`` (crow or ccol indices).
        plain_indices: ``batch + (nnz,)`` (col or row indices), of the same dtype.
        size: ``batch + (rows, cols)`` in elements, or None to estimate the plain extent.
        layout: ``torch.sparse_csr``, ``sparse_csc``, ``sparse_bsr`` or ``sparse_bsc``.
        blocksize: the block shape for BSR/BSC (default ``(1, 1)``).

    Returns:
        The size, as a ``torch.Size``.

    Raises:
        InvariantError: an invariant is broken; ``str(err)`` names it and where (a
            negative ``blocksize`` is ``[BSR 3.1]`` / ``[BSC 3.1]``, like a block shape the
            factories refuse).
        ValueError: ``layout`` is not compressed, or ``blocksize`` does not fit it.
        TypeError: ``size`` is not a sequence of integers.
    """
    compressed = _index_tensor(compressed_indices)
    plain = _index_tensor(plain_indices, compressed.device)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be a sparse compressed layout, got {layout}")
    info = LAYOUTS[layout]
    block = (1, 1) if blocksize is None else tuple(int(b) for b in blocksize)
    if len(block) != 2 or (not info.blocked and block != (1, 1)):
        raise ValueError(f"blocksize {tuple(block)} does not fit layout {layout}")
    if min(block) < 0:  # as the factories refuse a block shape that does not fit (3.1)
        raise InvariantError(layout, "3.1", f"blocksize {block} has a negative extent",
                             location={"blocksize": block})
    shape = _size(size, "check_compressed_indices")
    m = max(compressed.dim() - 1, 0)
    if shape is not None:
        shape = shape[: m + 2]  # batch + the two sparse dims; dense dims play no part
    nnz = plain.shape[-1] if plain.dim() else 0
    batch = tuple(compressed.shape[:-1])
    # A stand-in for the values: right shape and strides, one byte per entry, never written
    # or read (torch.empty maps pages lazily on the CPU).
    values = torch.empty((*batch, nnz, *(block if info.blocked else ())), dtype=torch.uint8,
                         device=compressed.device)
    meta = check_compressed_metadata(compressed, plain, values, shape, layout,
                                     device=compressed.device)
    meta = _compressed_index_stage(meta, compressed, plain, estimate=shape is None)
    stats.count("validations")
    return torch.Size(meta.size)

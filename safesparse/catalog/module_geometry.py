"""The geometry record of a ``safesparse.nn`` module in a checkpoint (its extra state).

One small int64 tensor ``[0x5353, 1, layout, rows, cols, block rows, block cols]`` (layout 0..3
for CSR, CSC, BSR, BSC; blocks 1 x 1 for CSR / CSC): a tensor, so every checkpoint format stores
it (``torch.save`` with ``weights_only`` loads, safetensors). ``safesparse.nn`` writes and reads
it; ``python -m safesparse check`` (``safesparse.files.modules``) finds the index triple next to
it and validates it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.layouts import BLOCK_LAYOUTS

__all__ = ["EXTRA_TAG", "geometry_tensor", "parse_geometry"]

EXTRA_TAG = 0x5353
_VERSION = 1
_CODES = {torch.sparse_csr: 0, torch.sparse_csc: 1, torch.sparse_bsr: 2, torch.sparse_bsc: 3}
_BY_CODE = {code: layout for layout, code in _CODES.items()}


def geometry_tensor(layout: torch.layout, shape: tuple[int, int],
                    blocksize: tuple[int, int] | None) -> torch.Tensor:
    """The extra-state tensor of a module holding a ``layout`` matrix of ``shape``."""
    r, c = blocksize or (1, 1)
    return torch.tensor([EXTRA_TAG, _VERSION, _CODES[layout], shape[0], shape[1], r, c],
                        dtype=torch.int64)


def parse_geometry(t: Any) -> tuple[torch.layout, tuple[int, int], tuple[int, int] | None]:
    """``(layout, shape, blocksize)`` from an extra-state tensor; ``ValueError`` when ``t`` is
    not one."""
    if (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != torch.int64
            or tuple(t.shape) != (7,)):
        raise ValueError("the extra state is not a safesparse.nn geometry (an int64 tensor "
                         "[0x5353, 1, layout, rows, cols, block rows, block cols])")
    tag, version, code, rows, cols, r, c = (int(v) for v in t.tolist())
    layout = _BY_CODE.get(code)
    if tag != EXTRA_TAG or version != _VERSION or layout is None or min(rows, cols) < 0 \
            or r < 1 or c < 1 or (layout not in BLOCK_LAYOUTS and (r, c) != (1, 1)):
        raise ValueError(f"the extra state {t.tolist()} is not a safesparse.nn geometry "
                         "(tag 0x5353, version 1, layout 0..3, sizes >= 0, blocks >= 1)")
    return layout, (rows, cols), ((r, c) if layout in BLOCK_LAYOUTS else None)

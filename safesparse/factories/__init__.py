"""The factories: validated drop-ins for torch's sparse factories, and SciPy conversion.

The public factories and their argument handling (:mod:`.core`), the build path that validates
once and attaches the checked state (:mod:`.build`), and :mod:`.interop` (``from_scipy`` /
``to_scipy``). Reads the tensor layer and below.
"""

from __future__ import annotations

from .core import (
    COMPRESSED_LAYOUTS,
    sparse_bsc_tensor,
    sparse_bsr_tensor,
    sparse_compressed_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)

__all__ = [
    "COMPRESSED_LAYOUTS",
    "sparse_bsc_tensor",
    "sparse_bsr_tensor",
    "sparse_compressed_tensor",
    "sparse_coo_tensor",
    "sparse_csc_tensor",
    "sparse_csr_tensor",
]

"""safesparse: validated sparse tensors for PyTorch.

Drop-in factories that check every sparse invariant once, before torch sees the data, and a
``torch.Tensor`` subclass that remembers it was checked. See ``docs/`` and SPEC.md.
"""

from __future__ import annotations

from . import ops as _ops  # noqa: F401  (fills the op table)
from . import transpose as _transpose  # noqa: F401  (zero-copy transposes)
from .checked import Stats, clear_cache, reset_stats, stats
from .debug import debug, is_debug, set_debug
from .enforce import enforce, is_enforced, set_enforce
from .errors import InvariantError
from .factories import (
    sparse_bsc_tensor,
    sparse_bsr_tensor,
    sparse_compressed_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)
from .indices import check_compressed_indices, check_coo_indices
from .invariants import CATALOG, Invariant
from .serialization import load
from .tensor import OpKind, SafeSparseTensor, is_checked, unwrap, validate

__version__ = "0.1.0"

__all__ = [
    "CATALOG",
    "Invariant",
    "InvariantError",
    "OpKind",
    "SafeSparseTensor",
    "Stats",
    "check_compressed_indices",
    "check_coo_indices",
    "clear_cache",
    "debug",
    "enforce",
    "is_checked",
    "is_debug",
    "is_enforced",
    "load",
    "reset_stats",
    "set_debug",
    "set_enforce",
    "sparse_bsc_tensor",
    "sparse_bsr_tensor",
    "sparse_compressed_tensor",
    "sparse_coo_tensor",
    "sparse_csc_tensor",
    "sparse_csr_tensor",
    "stats",
    "unwrap",
    "validate",
]

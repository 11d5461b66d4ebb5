"""How a ``SafeSparseTensor`` pickles: now :mod:`safesparse.files.pickling`; kept for imports."""

from __future__ import annotations

from .files.pickling import reduce_safe_sparse

__all__ = ["reduce_safe_sparse"]

"""Where the file functions lived before :mod:`safesparse.files`; kept so that imports and
pickled files that name ``safesparse.serialization`` (``_rebuild_safe_sparse``) keep working.
See :mod:`safesparse.files` for the design."""

from __future__ import annotations

from .files import (
    Found,
    LoadResult,
    OnSparse,
    SparseRecord,
    load,
    load_and_validate,
    save,
    unwrap_all,
)
from .files.pickling import _rebuild_safe_sparse as _rebuild_safe_sparse
from .files.session import _LEGACY_LOAD_CODE as _LEGACY_LOAD_CODE

__all__ = [
    "Found",
    "LoadResult",
    "OnSparse",
    "SparseRecord",
    "load",
    "load_and_validate",
    "save",
    "unwrap_all",
]

"""The tensor layer: :class:`SafeSparseTensor` and its operations.

The subclass and its ``__torch_function__`` (:mod:`.core`), the op table's vocabulary
(:mod:`.optable`) and its fast path (:mod:`.fastpath`), the registered ops (:mod:`.ops`), the
block products (:mod:`.products`, arguments bound by :mod:`.binding`), the zero-copy transposes
(:mod:`.transpose`), debug mode for plain tensors (:mod:`.debug_mode`) and printing
(:mod:`.printing`). Reads the checked state, the engine, the catalog and the base.

``from safesparse.tensor import wrap_results`` (docs/ops.md) and the other names of
:mod:`.core` are importable from here.
"""

from __future__ import annotations

from . import core
from .core import *  # noqa: F403  (the names core.__all__ lists: docs/ops.md: wrap_results)

__all__ = core.__all__

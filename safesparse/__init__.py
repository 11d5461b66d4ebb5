"""safesparse: validated sparse tensors for PyTorch.

Drop-in replacements for torch's sparse factories (``sparse_coo_tensor``, ``sparse_csr_tensor``,
``sparse_csc_tensor``, ``sparse_bsr_tensor``, ``sparse_bsc_tensor``, ``sparse_compressed_tensor``)
that check every sparse invariant once, before torch sees the data, and raise
:class:`InvariantError` (naming the invariant's id and the first violation's location) instead
of building a malformed tensor. Their results are :class:`SafeSparseTensor`, a ``torch.Tensor``
subclass that remembers it was checked, so rebuilding, transposing or moving it costs no second
validation.

Also: :func:`validate` / :func:`is_checked` / :func:`unwrap` for tensors built elsewhere,
:func:`load` (``torch.load`` that validates every sparse tensor in a file), debug mode
(:func:`debug`, :func:`set_debug`, :func:`is_debug`), :func:`stats` / :func:`reset_stats`,
the invariant catalog :data:`CATALOG`, and ``python -m safesparse check FILE``.

An uncaught :class:`InvariantError` is shown without safesparse's own frames (the user's frames
and the error stay); ``SAFESPARSE_TRACEBACK=full`` shows the whole traceback (see
:mod:`safesparse.catalog.tracebacks`).

Every public name documents itself: ``help(safesparse.NAME)``. The guides (invariants,
operations, checkpoints, debug mode, model code) and the API reference are the Markdown files
in the ``docs/`` directory of the source distribution and the repository.
"""

from __future__ import annotations

# first: torch imported without its NumPy warning (base/import_torch.py)
from .base import import_torch as _import_torch  # noqa: F401

# isort: split
from . import nn as nn  # sparse weights in model code (SparseLinear; optimizer steps)
from . import serialization as _serialization  # noqa: F401  (the name pickled files give)
from .base.debug_flag import debug, is_debug, set_debug
from .catalog.errors import InvariantError
from .catalog.invariants import CATALOG, Invariant
from .catalog.tracebacks import install as _install_tracebacks
from .compiled import SparseOperand, as_operand, compile, from_operand, portable
from .enforcement.mode import enforce, is_enforced, set_enforce
from .engine.indices import check_compressed_indices, check_coo_indices
from .factories.core import (
    sparse_bsc_tensor,
    sparse_bsr_tensor,
    sparse_compressed_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)
from .factories.interop import from_scipy, to_scipy
from .files import load, save, unwrap_all  # also registers SafeSparseTensor's pickling
from .state.checked import Stats, clear_cache, reset_stats, stats
from .tensor import debug_mode as _debug_mode  # noqa: F401  (debug mode sees plain tensors)
from .tensor.core import OpKind, SafeSparseTensor, is_checked, unwrap, validate
from .tensor.ops import register_builtin_ops as _register_builtin_ops

_register_builtin_ops(SafeSparseTensor)  # safesparse's own op table (tensor/ops.py's rows)
_install_tracebacks()  # uncaught InvariantErrors are shown without safesparse's own frames

__version__ = "0.2.0"

__all__ = [
    "CATALOG",
    "Invariant",
    "InvariantError",
    "OpKind",
    "SafeSparseTensor",
    "SparseOperand",
    "Stats",
    "as_operand",
    "check_compressed_indices",
    "check_coo_indices",
    "clear_cache",
    "compile",
    "debug",
    "enforce",
    "from_operand",
    "from_scipy",
    "is_checked",
    "is_debug",
    "is_enforced",
    "load",
    "portable",
    "reset_stats",
    "save",
    "set_debug",
    "set_enforce",
    "sparse_bsc_tensor",
    "sparse_bsr_tensor",
    "sparse_compressed_tensor",
    "sparse_coo_tensor",
    "sparse_csc_tensor",
    "sparse_csr_tensor",
    "stats",
    "to_scipy",
    "unwrap",
    "unwrap_all",
    "validate",
]

"""Sparse matrices in model code: :class:`SparseLinear`, :class:`SparseMatmul`, optimizer steps.

:class:`SparseLinear` (``y = x @ W.T + b``, a sparse weight with a fixed pattern) and
:class:`SparseMatmul` (``y = A @ x``, a fixed sparse matrix such as a graph's adjacency) keep
their pattern as checked index buffers and their stored values as one dense ``nn.Parameter``
(every ``torch.optim`` optimizer trains it), compute through the ``safesparse`` operators
(:mod:`safesparse.operators`: ``torch.compile(fullgraph=True)`` and ``torch.export`` trace
them), and save a state dict of dense tensors with their geometry as extra state
(:mod:`safesparse.nn.pattern`). :mod:`safesparse.nn.optim` registers the optimizer hook for
sparse-layout parameters. :func:`sparsify_` converts a whole model's linear layers.
"""

from __future__ import annotations

from .. import operators as _operators  # noqa: F401  (the safesparse operators, registered)
from ..operators.library import UnprovenMembersError
from .errors import UninitialisedMemoryError
from .linear import SparseLinear
from .matmul import SparseMatmul
from .optim import SparseParameterError
from .sparsify import SparsifyWarning, sparsify_

__all__ = ["SparseLinear", "SparseMatmul", "SparseParameterError", "SparsifyWarning",
           "UninitialisedMemoryError", "UnprovenMembersError", "sparsify_"]

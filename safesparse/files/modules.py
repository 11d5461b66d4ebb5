"""Sparse matrices saved by ``safesparse.nn`` modules: found in a loaded state dict, validated.

A ``SparseLinear`` / ``SparseMatmul`` state dict holds dense tensors only: under a prefix,
``compressed_indices``, ``plain_indices``, ``values`` and ``_extra_state``, the geometry
tensor ``[0x5353, 1, layout, rows, cols, block rows, block cols]``
(:mod:`safesparse.catalog.module_geometry`). :func:`module_matrices` finds every such group in
a mapping (a flat state dict, as ``torch.save(model.state_dict())`` and safetensors files hold
it) and validates each with the safe factory: the indices are checked before torch builds
anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..catalog.module_geometry import parse_geometry

__all__ = ["ModuleMatrix", "member_of", "module_matrices"]

_SUFFIX = "_extra_state"
_NAMES = ("compressed_indices", "plain_indices", "values")
_PLAIN_IDS = frozenset({"1.2", "2.2", "3.3", "3.6", "3.9", "4.3", "5.4", "5.5", "5.6"})
_COMPRESSED_IDS = frozenset({"1.1", "2.1", "3.2", "3.5", "3.8", "4.2", "5.1", "5.2", "5.3"})


@dataclass(frozen=True)
class ModuleMatrix:
    """One module's saved matrix: its key prefix, geometry, and the validation's verdict."""

    prefix: str
    layout: torch.layout
    shape: tuple[int, int]
    nnz: int
    error: InvariantError | None


def member_of(error: InvariantError) -> str:
    """The member an invariant is about (to name the key)."""
    if error.invariant in _PLAIN_IDS:
        return "plain_indices"
    if error.invariant in _COMPRESSED_IDS:
        return "compressed_indices"
    return "values"


def module_matrices(obj: Any) -> list[ModuleMatrix]:
    """Every ``safesparse.nn`` module matrix in the mapping ``obj``, validated."""
    from ..factories import sparse_compressed_tensor

    if not isinstance(obj, Mapping):
        return []
    found: list[ModuleMatrix] = []
    for key, extra in obj.items():
        if not isinstance(key, str) or not key.endswith(_SUFFIX):
            continue
        prefix = key[: -len(_SUFFIX)]
        try:
            layout, shape, _ = parse_geometry(extra)
        except ValueError:
            continue
        members = [obj.get(prefix + n) for n in _NAMES]
        if not all(isinstance(m, torch.Tensor) for m in members):
            continue
        c, p, v = (m for m in members if isinstance(m, torch.Tensor))
        nnz = int(p.shape[0]) if p.dim() == 1 else -1
        try:
            sparse_compressed_tensor(c, p, v, shape, layout=layout)
            error = None
        except InvariantError as err:
            error = err
        found.append(ModuleMatrix(prefix, layout, shape, nnz, error))
    return found

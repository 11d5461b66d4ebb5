"""Sparse matrices saved by ``safesparse.nn`` modules: found in a loaded object, validated.

A ``SparseLinear`` / ``SparseMatmul`` state dict holds dense tensors only: under a prefix,
``compressed_indices``, ``plain_indices``, ``values`` and ``_extra_state``, the geometry
tensor ``[0x5353, 1, layout, rows, cols, block rows, block cols]``
(:mod:`safesparse.catalog.module_geometry`). :func:`module_matrices` finds every such group in
the loaded object (a flat state dict, as ``torch.save(model.state_dict())`` and safetensors
files hold it, or one nested in a checkpoint dict, ``{"model": state_dict, ...}``) and
validates each: the geometry is parsed (a damaged one is a
:class:`~safesparse.catalog.module_geometry.GeometryError`, never "no geometry"), the values
must agree with it (block shape, dims), and the members go through the safe factory, which
checks the indices before torch builds anything. Each refusal names the member's key.

A group is recognised by its names: a key ``P_extra_state`` beside ``Pcompressed_indices``,
``Pplain_indices`` and ``Pvalues``. A state dict saved by safesparse 0.2.0 has no geometry:
its triple is vetted by ``load_state_dict`` against the layer's own geometry.

``ss.load``, ``safesparse.safetensors.load_file`` and ``torch.load`` under enforce mode raise
the first refusal (:attr:`LoadResult.first_error`); ``python -m safesparse check`` reports one
line per group.
"""

from __future__ import annotations

from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..catalog.module_geometry import (
    MEMBER_NAMES,
    GeometryError,
    member_of,
    parse_geometry,
    values_disagree,
)
from .limits import oversized_member
from .results import ModuleMatrix, Path, PathKey

__all__ = ["ModuleMatrix", "member_of", "module_matrices", "vet_module"]

SUFFIX = "_extra_state"
NAMES = MEMBER_NAMES
_MEMBER_IDS = {"compressed_indices": "2.1", "plain_indices": "2.2", "values": "2.3"}
#: how deep the search for state dicts goes into nested containers
_MAX_DEPTH = 64


def vet_module(extra: Any, members: tuple[Any, Any, Any]
               ) -> tuple[torch.layout | None, tuple[int, int] | None, str | None,
                          InvariantError | ValueError | None]:
    """Validate one module's saved matrix: its geometry ``extra`` and its ``(compressed,
    plain, values)`` members. Returns ``(layout, shape, member, error)``: ``member`` names
    what the error is about (``"_extra_state"`` for a damaged geometry, whose error is the
    parser's ``ValueError``). No kernel reads the members unless they are valid."""
    from ..factories import sparse_compressed_tensor

    try:
        layout, shape, blocksize = parse_geometry(extra)
    except ValueError as exc:
        return None, None, SUFFIX, exc
    for name, m in zip(NAMES, members, strict=True):
        if not isinstance(m, torch.Tensor):
            return layout, shape, name, InvariantError(
                layout, _MEMBER_IDS[name], f"{name} is a {type(m).__name__}, not a tensor")
    disagree = values_disagree(layout, blocksize, members[2])
    if disagree is not None:
        return layout, shape, "values", disagree
    claims = oversized_member(layout, members)  # before any copy
    if claims is not None:
        return layout, shape, member_of(claims), claims
    try:
        sparse_compressed_tensor(*members, shape, layout=layout)
    except InvariantError as err:
        return layout, shape, member_of(err), err
    return layout, shape, None, None


def _matrix(keys: Path, prefix: str, extra: Any, members: tuple[Any, Any, Any]
            ) -> ModuleMatrix:
    plain = members[1]
    nnz = int(plain.shape[0]) if isinstance(plain, torch.Tensor) and plain.dim() == 1 else None
    layout, shape, member, error = vet_module(extra, members)
    m = ModuleMatrix(keys, prefix, layout, shape, nnz, None, member)
    if member is None or error is None:
        return m
    where = m.path(member)
    if isinstance(error, InvariantError):
        error = error.with_context(path=where)
    else:
        error = GeometryError(where, str(error))
    return ModuleMatrix(keys, prefix, layout, shape, nnz, error, member)


def _in_mapping(obj: dict[Any, Any], keys: Path, found: list[ModuleMatrix]) -> None:
    for key in list(dict.keys(obj)):
        if not isinstance(key, str) or not key.endswith(SUFFIX):
            continue
        prefix = key[: -len(SUFFIX)]
        names = [prefix + n for n in NAMES]
        if not all(dict.__contains__(obj, n) for n in names):
            continue  # a geometry alone (or another module's extra state): nothing to vet
        c, p, v = (dict.__getitem__(obj, n) for n in names)
        found.append(_matrix(keys, prefix, dict.__getitem__(obj, key), (c, p, v)))


def module_matrices(obj: Any) -> list[ModuleMatrix]:
    """Every ``safesparse.nn`` module matrix in ``obj`` (in dicts, nested in dicts, lists and
    tuples), validated. Only the built-in container methods are called (a loaded object's own
    methods never run)."""
    found: list[ModuleMatrix] = []
    seen: set[int] = set()

    def visit(x: Any, keys: Path) -> None:
        if id(x) in seen or len(keys) > _MAX_DEPTH:
            return
        if isinstance(x, dict):  # (dicts only: another Mapping's methods may run code)
            seen.add(id(x))
            _in_mapping(x, keys, found)
            items: Any = dict.items(x)
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
            items = enumerate(x)
        else:
            return
        for k, v in items:
            if isinstance(v, (dict, list, tuple)):
                visit(v, (*keys, PathKey("item" if isinstance(x, dict) else "index", k)))

    visit(obj, ())
    return found

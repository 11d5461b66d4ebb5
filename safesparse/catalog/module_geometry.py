"""The geometry record of a ``safesparse.nn`` module in a checkpoint (its extra state).

One small int64 tensor ``[0x5353, 1, layout, rows, cols, block rows, block cols]`` (layout 0..3
for CSR, CSC, BSR, BSC; blocks 1 x 1 for CSR / CSC): a tensor, so every checkpoint format stores
it (``torch.save`` with ``weights_only`` loads, safetensors). ``safesparse.nn`` writes and reads
it; ``python -m safesparse check`` (``safesparse.files.modules``) finds the index triple next to
it and validates it (so do ``ss.load``, ``safesparse.safetensors.load_file`` and ``torch.load``
under enforce mode).

The geometry and the values must agree (:func:`values_disagree`: CSR / CSC values are 1-D,
BSR / BSC values 3-D with the geometry's block shape); a damaged geometry is a
:class:`GeometryError`, never read as "no geometry".
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.layouts import BLOCK_LAYOUTS
from .errors import InvariantError
from .invariants import hint_for

__all__ = ["EXTRA_TAG", "MEMBER_NAMES", "GeometryError", "geometry_tensor", "member_of",
           "parse_geometry", "values_disagree"]

EXTRA_TAG = 0x5353
_VERSION = 1
_CODES = {torch.sparse_csr: 0, torch.sparse_csc: 1, torch.sparse_bsr: 2, torch.sparse_bsc: 3}
_BY_CODE = {code: layout for layout, code in _CODES.items()}
#: A module's members in its state dict, beside ``_extra_state`` (the geometry).
MEMBER_NAMES = ("compressed_indices", "plain_indices", "values")
_PLAIN_IDS = frozenset({"1.2", "2.2", "3.3", "3.6", "3.9", "4.3", "5.4", "5.5", "5.6"})
_COMPRESSED_IDS = frozenset({"1.1", "2.1", "3.2", "3.5", "3.8", "4.2", "5.1", "5.2", "5.3"})


def geometry_tensor(layout: torch.layout, shape: tuple[int, int],
                    blocksize: tuple[int, int] | None) -> torch.Tensor:
    """The extra-state tensor of a module holding a ``layout`` matrix of ``shape``."""
    r, c = blocksize or (1, 1)
    return torch.tensor([EXTRA_TAG, _VERSION, _CODES[layout], shape[0], shape[1], r, c],
                        dtype=torch.int64)


def parse_geometry(t: Any) -> tuple[torch.layout, tuple[int, int], tuple[int, int] | None]:
    """``(layout, shape, blocksize)`` from an extra-state tensor; ``ValueError`` saying what
    is wrong when ``t`` is not one."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"a {type(t).__name__} where the int64 geometry tensor of 7 entries "
                         "belongs")
    if t.layout != torch.strided or t.dtype != torch.int64 or tuple(t.shape) != (7,) \
            or t.is_meta:
        raise ValueError(f"a {str(t.dtype).removeprefix('torch.')} tensor of shape "
                         f"{tuple(t.shape)} ({t.layout}, {t.device.type}) where the int64 "
                         "geometry tensor of 7 entries belongs")
    values = [int(v) for v in t.tolist()]
    tag, version, code, rows, cols, r, c = values
    layout = _BY_CODE.get(code)
    if tag != EXTRA_TAG or version != _VERSION or layout is None or min(rows, cols) < 0 \
            or r < 1 or c < 1 or (layout not in BLOCK_LAYOUTS and (r, c) != (1, 1)):
        raise ValueError(f"{values} is not [0x5353, 1, layout 0..3, rows >= 0, cols >= 0, "
                         "block rows >= 1, block cols >= 1] (blocks 1 x 1 for CSR / CSC)")
    return layout, (rows, cols), ((r, c) if layout in BLOCK_LAYOUTS else None)


def member_of(error: InvariantError) -> str:
    """The member of a module's state dict that a compressed invariant is about (to name its
    key): ``"plain_indices"``, ``"compressed_indices"`` or ``"values"``."""
    if error.invariant in _PLAIN_IDS:
        return "plain_indices"
    if error.invariant in _COMPRESSED_IDS:
        return "compressed_indices"
    return "values"


def values_disagree(layout: torch.layout, blocksize: tuple[int, int] | None,
                    values: Any) -> InvariantError | None:
    """The invariant ``values`` break against a geometry of ``layout`` and ``blocksize`` (the
    values of a 2-D matrix without dense dims: 1-D for CSR / CSC, ``(nnz, *blocksize)`` for
    BSR / BSC), or ``None`` when they agree (or are not a tensor: the factory says so).
    Metadata only, O(1)."""
    if not isinstance(values, torch.Tensor):
        return None
    shape = tuple(values.shape)
    if layout in BLOCK_LAYOUTS:
        if values.dim() != 3:
            return InvariantError(layout, "3.4", f"the geometry says {_name(layout)} with "
                                  f"blocks of {blocksize}; values of shape {shape} have "
                                  f"{values.dim()} dims, not 3")
        if blocksize is not None and shape[1:] != blocksize:
            return InvariantError(layout, "3.10", f"the geometry says blocks of "
                                  f"{blocksize[0]} x {blocksize[1]}; values of shape {shape} "
                                  f"hold blocks of {shape[1]} x {shape[2]}")
    elif values.dim() != 1:
        return InvariantError(layout, "3.4", f"the geometry says {_name(layout)}; values of "
                              f"shape {shape} have {values.dim()} dims, not 1")
    return None


def _name(layout: torch.layout) -> str:
    return str(layout).removeprefix("torch.sparse_").upper()


class GeometryError(ValueError, RuntimeError):
    """A ``safesparse.nn`` module's geometry (its extra state) in a checkpoint is damaged:
    not the int64 tensor ``[0x5353, 1, layout, rows, cols, block rows, block cols]`` beside
    the module's index members and values. The matrix cannot be vetted without it, so it is
    refused (``python -m safesparse check``: invalid), never read as a dense state. A
    ``ValueError`` and a ``RuntimeError``, as :class:`InvariantError` is.

    Attributes:
        key: the geometry's key (``"fc1._extra_state"``) or key path.
        reason: what is wrong with it.
        loaded_by: the loader and the file, where one read it, else ``None``.
    """

    def __init__(self, key: str, reason: str, *, loaded_by: str | None = None) -> None:
        self.key = key
        self.reason = reason
        self.loaded_by = loaded_by
        super().__init__(str(self))

    def __str__(self) -> str:
        reason = self.reason if len(self.reason) <= 100 else self.reason[:97] + "..."
        first = f"damaged safesparse.nn geometry at {self.key}: {reason}"
        if self.loaded_by is not None:
            first += f" (loaded by {self.loaded_by})"
        # the shape invariants' repair hint for loaded data ("corrupt or another model")
        hint = hint_for(torch.sparse_csr, "3.1", self.loaded_by or "load_state_dict")
        return f"{first}\nto repair: {hint}"

    def with_context(self, *, key: str | None = None,
                     loaded_by: str | None = None) -> GeometryError:
        """A copy naming ``key`` or the loader and file instead."""
        return GeometryError(key if key is not None else self.key, self.reason,
                             loaded_by=loaded_by if loaded_by is not None else self.loaded_by)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_geometry_error, (self.key, self.reason, self.loaded_by))


def _rebuild_geometry_error(key: str, reason: str, loaded_by: str | None) -> GeometryError:
    return GeometryError(key, reason, loaded_by=loaded_by)

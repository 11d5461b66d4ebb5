"""Safe factories: drop-in replacements for ``torch.sparse_*_tensor``.

Each factory converts its inputs the way torch does (tensors, nested lists, NumPy arrays;
``dtype=``/``device=`` conversion), validates every invariant of the catalog before torch sees
the data, and only then builds the tensor with torch's own factory and
``check_invariants=False`` (no second validation, no "implicitly disabled" warning).

Index data already validated together (same tensors, unmodified, same geometry) is not checked
again: only the O(1) metadata checks run (see :mod:`safesparse.checked`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from . import checked
from ._compile import not_traced
from .checked import IndexKey
from .debug import is_debug
from .invariants import COMPRESSED_LAYOUTS
from .tensor import SafeSparseTensor, compressed_geometry, validate_into, wrap
from .validation import (
    LAYOUTS,
    check_compressed_indices,
    check_compressed_metadata,
    check_coo_indices,
    check_coo_metadata,
    values_layout_ok,
)

DeviceLike = torch.device | str | int | None
SizeLike = Sequence[int] | torch.Size | None


def _device(device: DeviceLike) -> torch.device | None:
    return None if device is None else torch.device(device)


def _as_index(x: Any, device: torch.device | None) -> torch.Tensor:
    """Index input as a tensor: tensors keep their dtype, other integer data becomes int64."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        t = torch.as_tensor(x)
        if t.numel() == 0 and not t.dtype.is_complex and t.dtype.is_floating_point:
            t = t.to(torch.int64)  # an empty list of indices
    return t.to(device) if device is not None and t.device != device else t


def _as_values(x: Any, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)
    if (dtype is not None and t.dtype != dtype) or (device is not None and t.device != device):
        t = t.to(device=device, dtype=dtype)
    return t


def _as_size(size: SizeLike) -> tuple[int, ...] | None:
    return None if size is None else tuple(int(s) for s in size)


def _pin(pin_memory: bool) -> dict[str, Any]:
    """``pin_memory`` as a keyword torch's factories take (missing from torch's type stubs)."""
    return {"pin_memory": pin_memory}


def _proven(key: IndexKey, indices: tuple[torch.Tensor, ...], geometry: Hashable) -> bool:
    """Whether these index tensors are proven valid for ``geometry`` (outside debug mode).

    Index tensors whose version counter has moved are only trusted through a state that
    sees writes through them; ``_version == 0`` means no write ever went through them.
    """
    if is_debug():
        return False
    state = checked.lookup(key)
    return (state is not None and not any(x.is_inference() for x in indices)
            and state.is_proven(geometry)
            and all(x._version == 0 or state.knows(x) for x in indices))


class _Before:
    """What validation must be compared against: the counters of the index tensors (and of
    their state, if one is alive) taken before the O(nnz) checks read them."""

    __slots__ = ("snap", "versions")

    def __init__(self, key: IndexKey, indices: tuple[torch.Tensor, ...]) -> None:
        state = checked.lookup(key)
        self.snap = state.snapshot() if state is not None else {}
        self.versions = _versions(indices)

    def unchanged(self, indices: tuple[torch.Tensor, ...]) -> bool:
        return self.versions is not None and _versions(indices) == self.versions


def _versions(indices: tuple[torch.Tensor, ...]) -> list[int] | None:
    """The version counters of ``indices``; None if one has none (an inference tensor)."""
    if any(x.is_inference() for x in indices):
        return None
    return [x._version for x in indices]


def _wants_check(check_invariants: bool | None) -> bool:
    return check_invariants is None or bool(check_invariants) or is_debug()


@not_traced
def sparse_compressed_tensor(
    compressed_indices: Any,
    plain_indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_compressed_tensor``; see the module docstring."""
    dev = _device(device)
    compressed = _as_index(compressed_indices, dev)
    plain = _as_index(plain_indices, dev)
    vals = _as_values(values, dtype, dev)
    lay = layout if layout is not None else torch.strided  # torch requires a layout: 2.4
    info = LAYOUTS.get(lay)
    if info is not None and not values_layout_ok(vals, compressed.dim() - 1, info.blocked):
        vals = vals.contiguous()  # torch accepts any strides; its kernels assume 3.7
    shape = _as_size(size)
    if not _wants_check(check_invariants):
        sized = () if shape is None else (shape,)  # torch takes no explicit size=None
        plain_t = torch.sparse_compressed_tensor(
            compressed, plain, vals, *sized, dtype=vals.dtype, layout=lay, device=dev,
            check_invariants=False, **_pin(pin_memory),
        )
        out = wrap(plain_t, leaf_requires_grad=requires_grad)
        _watch_inputs(out, out._ss, (compressed, plain))
        return out
    meta = check_compressed_metadata(
        compressed, plain, vals, shape, lay, dtype=dtype, device=dev, requested_layout=lay,
    )
    key = checked.index_key((compressed, plain))
    geometry = compressed_geometry(meta.n_compressed, meta.n_plain)
    known = shape is not None and _proven(key, (compressed, plain), geometry)
    before = None
    if known:
        checked.count("skipped")
    else:
        before = _Before(key, (compressed, plain))
        meta = check_compressed_indices(meta, compressed, plain, estimate=shape is None,
                                        values=vals)
        checked.count("validations")
    plain_t = torch.sparse_compressed_tensor(
        compressed, plain, vals, meta.size, dtype=vals.dtype, layout=meta.info.layout,
        device=vals.device, check_invariants=False, **_pin(pin_memory),
    )
    if not known:  # estimation may have resolved the plain extent
        geometry = compressed_geometry(meta.n_compressed, meta.n_plain)
    return _finish(wrap(plain_t, leaf_requires_grad=requires_grad, key=key),
                   (compressed, plain), before, geometry)


def sparse_csr_tensor(
    crow_indices: Any,
    col_indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_csr_tensor``: every invariant is checked before torch sees the
    data; a violation raises :class:`safesparse.InvariantError`."""
    return sparse_compressed_tensor(
        crow_indices, col_indices, values, size, dtype=dtype, layout=torch.sparse_csr,
        device=device, pin_memory=pin_memory, requires_grad=requires_grad,
        check_invariants=check_invariants,
    )


def sparse_csc_tensor(
    ccol_indices: Any,
    row_indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_csc_tensor`` (see :func:`sparse_csr_tensor`)."""
    return sparse_compressed_tensor(
        ccol_indices, row_indices, values, size, dtype=dtype, layout=torch.sparse_csc,
        device=device, pin_memory=pin_memory, requires_grad=requires_grad,
        check_invariants=check_invariants,
    )


def sparse_bsr_tensor(
    crow_indices: Any,
    col_indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_bsr_tensor`` (see :func:`sparse_csr_tensor`)."""
    return sparse_compressed_tensor(
        crow_indices, col_indices, values, size, dtype=dtype, layout=torch.sparse_bsr,
        device=device, pin_memory=pin_memory, requires_grad=requires_grad,
        check_invariants=check_invariants,
    )


def sparse_bsc_tensor(
    ccol_indices: Any,
    row_indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_bsc_tensor`` (see :func:`sparse_csr_tensor`)."""
    return sparse_compressed_tensor(
        ccol_indices, row_indices, values, size, dtype=dtype, layout=torch.sparse_bsc,
        device=device, pin_memory=pin_memory, requires_grad=requires_grad,
        check_invariants=check_invariants,
    )


def _coo_index(x: Any, device: torch.device | None) -> torch.Tensor:
    t = _as_index(x, device)
    # torch converts integer (and bool) indices of other widths to int64; floating point and
    # complex indices are refused (1.1)
    if t.dtype != torch.int64 and not t.dtype.is_floating_point and not t.dtype.is_complex:
        t = t.to(torch.int64)
    return t


@not_traced
def sparse_coo_tensor(
    indices: Any,
    values: Any,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
    is_coalesced: bool | None = None,
) -> SafeSparseTensor:
    """Validated ``torch.sparse_coo_tensor``; ``is_coalesced=True`` is verified (5.3)."""
    dev = _device(device)
    idx = _coo_index(indices, dev)
    vals = _as_values(values, dtype, dev)
    shape = _as_size(size)
    if not _wants_check(check_invariants):
        args = (idx, vals) if shape is None else (idx, vals, shape)
        plain_t = torch.sparse_coo_tensor(
            *args, dtype=vals.dtype, device=dev, **_pin(pin_memory),
            check_invariants=False, is_coalesced=is_coalesced,
        )
        out = wrap(plain_t, leaf_requires_grad=requires_grad)
        _watch_inputs(out, out._ss, (idx,))
        return out
    meta = check_coo_metadata(idx, vals, shape, dtype=dtype, device=dev)
    coalesced = bool(is_coalesced)
    sparse_size = tuple(meta.size[: meta.sparse_dim])
    # an index set proven coalesced is also valid for an uncoalesced tensor
    key = checked.index_key((idx,))
    known = shape is not None and any(
        _proven(key, (idx,), ("coo", sparse_size, flag)) for flag in {coalesced, True})
    before = None
    if known:
        checked.count("skipped")
    else:
        before = _Before(key, (idx,))
        meta = check_coo_indices(meta, idx, is_coalesced=coalesced, estimate=shape is None,
                                 values=vals)
        checked.count("validations")
    plain_t = torch.sparse_coo_tensor(
        idx, vals, meta.size, dtype=vals.dtype, device=vals.device, **_pin(pin_memory),
        check_invariants=False, is_coalesced=is_coalesced,
    )
    # the built tensor's coalesced flag is torch's, so ask the tensor
    out = wrap(plain_t, leaf_requires_grad=requires_grad, key=key)
    return _finish(out, (idx,), before, checked.geometry_of(out))


def _finish(out: SafeSparseTensor, inputs: tuple[torch.Tensor, ...], before: _Before | None,
            geometry: Hashable) -> SafeSparseTensor:
    """Watch the caller's index tensors that ``out`` shares, and record ``out`` as checked: on a
    cache hit (``before`` None) through the proven state; after a validation only if no watched
    counter moved while it read the data (else the tensor is refused: another thread is
    writing the index data)."""
    rec = checked.record(out)
    assert rec is not None  # wrap() joined it
    _watch_inputs(out, rec, inputs)
    if before is None:
        if checked.mark_known(rec, geometry):
            return out
    elif before.unchanged(inputs) and checked.mark_validated(out, geometry, before.snap):
        return out
    # A counter moved while the checks read the data (another thread writes it), or the
    # index tensors cannot be watched: validate the built tensor itself (torch read nothing).
    validate_into(out)
    return out


def _watch_inputs(out: SafeSparseTensor, rec: checked.Record,
                  inputs: tuple[torch.Tensor, ...]) -> None:
    """The caller's index tensors that ``out`` shares storage with can write it: watch them."""
    for x in inputs:
        if checked.shares_index_data(rec, x) and not isinstance(x, SafeSparseTensor):
            checked.watch(out, x)  # (not again for a member handed out on this structure)


__all__ = [
    "COMPRESSED_LAYOUTS",
    "sparse_bsc_tensor",
    "sparse_bsr_tensor",
    "sparse_compressed_tensor",
    "sparse_coo_tensor",
    "sparse_csc_tensor",
    "sparse_csr_tensor",
]

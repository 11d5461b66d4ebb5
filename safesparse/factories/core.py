"""Safe factories: drop-in replacements for ``torch.sparse_*_tensor``.

Each factory converts its inputs the way torch does (tensors, nested lists, NumPy arrays;
``dtype=``/``device=`` conversion), validates every invariant of the catalog before torch sees
the data, and only then builds the tensor with torch's own factory and
``check_invariants=False`` (no second validation, no "implicitly disabled" warning).

``check_invariants``: ``None`` (default) or ``True``: validate every invariant first. ``False``
keeps torch's meaning: the tensor is built *without* validation and is unchecked
(``ss.is_checked(t) is False``); its first operation validates it (the guard: no torch kernel
reads unchecked sparse data), and ``ss.validate(t)`` validates it at once. Debug mode validates
regardless. Enforce mode ignores ``False`` when torch's own factory is called.

Index data already validated together (same tensors, unmodified, same geometry) is not checked
again: only the O(1) metadata checks run (see :mod:`safesparse.state.checked`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..base import originals as _originals
from ..base.compiling import not_traced
from ..base.debug_flag import is_debug
from ..base.layouts import INDEX_MEMBERS
from ..catalog import doctext
from ..engine.convert import _as_index, _as_size, _coo_index
from ..engine.indices import per_batch_contiguous
from ..engine.metadata import (
    LAYOUTS,
    check_compressed_metadata,
    check_coo_metadata,
    values_layout_ok,
)
from ..tensor.core import SafeSparseTensor
from . import build

_F = TypeVar("_F", bound=Callable[..., Any])
DeviceLike = torch.device | str | int | None
SizeLike = Sequence[int] | torch.Size | None


def _device(device: DeviceLike) -> torch.device | None:
    return None if device is None else torch.device(device)


def _as_values(x: Any, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)
    if (dtype is not None and t.dtype != dtype) or (device is not None and t.device != device):
        t = t.to(device=device, dtype=dtype)
    return t


def _pin(pin_memory: bool) -> dict[str, Any]:
    """``pin_memory`` as a keyword torch's factories take (missing from torch's type stubs)."""
    return {"pin_memory": pin_memory}


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
    out = build.fast_compressed(compressed_indices, plain_indices, values, size, layout, dtype,
                                device, pin_memory, requires_grad, check_invariants)
    return out if out is not None else _converted(
        compressed_indices, plain_indices, values, size, layout, dtype, device, pin_memory,
        requires_grad, check_invariants)


@not_traced
def _converted(c: Any, p: Any, v: Any, size: SizeLike, layout: torch.layout | None,
               dtype: torch.dtype | None, device: DeviceLike, pin_memory: bool,
               requires_grad: bool, check_invariants: bool | None) -> SafeSparseTensor:
    """Every compressed factory after the straight path (:func:`build.fast_compressed`, asked
    once, by the factory itself: the common case, members in their final form, a size, checks
    on) missed: the arguments converted as torch converts them, then validated and built."""
    shape = _as_size(size)
    dev = _device(device)
    compressed, plain, vals, lay = _compressed_args(c, p, v, dtype, layout, dev)
    if not _wants_check(check_invariants):
        sized = () if shape is None else (shape,)  # torch takes no explicit size=None
        plain_t = _originals.sparse_compressed_tensor(  # (on aliases of its own: build.own_alias)
            compressed.detach(), plain.detach(), build.own_alias(vals), *sized, dtype=vals.dtype,
            layout=lay, device=dev, check_invariants=False, requires_grad=requires_grad,
            **_pin(pin_memory),
        )
        return build.unchecked(plain_t, (compressed, plain))
    meta = check_compressed_metadata(
        compressed, plain, vals, shape, lay, dtype=dtype, device=dev, requested_layout=lay,
    )
    return build.compressed(compressed, plain, vals, meta, requires_grad=requires_grad,
                            pin_memory=pin_memory, estimate=shape is None)


sparse_compressed_tensor.__doc__ = doctext.factory(None)


def _compressed_factory(layout: torch.layout) -> Callable[[_F], _F]:
    """The four compressed factories are one template: each asks the straight path
    (:func:`build.fast_compressed`) once and, on a miss, :func:`_converted`, for its layout,
    with its parameter names (:data:`safesparse.base.layouts.INDEX_MEMBERS`) and the docstring
    :func:`safesparse.catalog.doctext.factory` writes for it."""

    def made(factory: _F) -> _F:
        assert factory.__code__.co_varnames[:2] == INDEX_MEMBERS[layout]
        factory.__doc__ = doctext.factory(layout)
        return factory

    return made


def _compressed(compressed_indices: Any, plain_indices: Any, values: Any, size: SizeLike,
                layout: torch.layout, dtype: torch.dtype | None, device: DeviceLike,
                pin_memory: bool, requires_grad: bool,
                check_invariants: bool | None) -> SafeSparseTensor:
    """The four compressed factories' body: the straight path where it takes the members,
    else the general one."""
    out = build.fast_compressed(compressed_indices, plain_indices, values, size, layout, dtype,
                                device, pin_memory, requires_grad, check_invariants)
    return out if out is not None else _converted(
        compressed_indices, plain_indices, values, size, layout, dtype, device, pin_memory,
        requires_grad, check_invariants)


@_compressed_factory(torch.sparse_csr)
def sparse_csr_tensor(crow_indices: Any, col_indices: Any, values: Any, size: SizeLike = None,
                      *, dtype: torch.dtype | None = None, device: DeviceLike = None,
                      pin_memory: bool = False, requires_grad: bool = False,
                      check_invariants: bool | None = None) -> SafeSparseTensor:
    return _compressed(crow_indices, col_indices, values, size, torch.sparse_csr, dtype, device,
                       pin_memory, requires_grad, check_invariants)


@_compressed_factory(torch.sparse_csc)
def sparse_csc_tensor(ccol_indices: Any, row_indices: Any, values: Any, size: SizeLike = None,
                      *, dtype: torch.dtype | None = None, device: DeviceLike = None,
                      pin_memory: bool = False, requires_grad: bool = False,
                      check_invariants: bool | None = None) -> SafeSparseTensor:
    return _compressed(ccol_indices, row_indices, values, size, torch.sparse_csc, dtype, device,
                       pin_memory, requires_grad, check_invariants)


@_compressed_factory(torch.sparse_bsr)
def sparse_bsr_tensor(crow_indices: Any, col_indices: Any, values: Any, size: SizeLike = None,
                      *, dtype: torch.dtype | None = None, device: DeviceLike = None,
                      pin_memory: bool = False, requires_grad: bool = False,
                      check_invariants: bool | None = None) -> SafeSparseTensor:
    return _compressed(crow_indices, col_indices, values, size, torch.sparse_bsr, dtype, device,
                       pin_memory, requires_grad, check_invariants)


@_compressed_factory(torch.sparse_bsc)
def sparse_bsc_tensor(ccol_indices: Any, row_indices: Any, values: Any, size: SizeLike = None,
                      *, dtype: torch.dtype | None = None, device: DeviceLike = None,
                      pin_memory: bool = False, requires_grad: bool = False,
                      check_invariants: bool | None = None) -> SafeSparseTensor:
    return _compressed(ccol_indices, row_indices, values, size, torch.sparse_bsc, dtype, device,
                       pin_memory, requires_grad, check_invariants)


def _compressed_args(
    compressed_indices: Any, plain_indices: Any, values: Any, dtype: torch.dtype | None,
    layout: torch.layout | None, dev: torch.device | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.layout]:
    """The members as tensors, converted as torch converts them. Copied: index members whose
    last dim is not unit-stride (3.5 / 3.6) and values that break 3.7; the others are kept."""
    # a member whose last dim is not unit-stride (which torch refuses) is copied; any batch
    # strides are kept, as torch keeps them (3.5 / 3.6: contiguous per batch). COO indices
    # may have any strides, as in torch.
    compressed = per_batch_contiguous(_as_index(compressed_indices, dev))
    plain = per_batch_contiguous(_as_index(plain_indices, dev))
    vals = _as_values(values, dtype, dev)
    lay = layout if layout is not None else torch.strided  # torch requires a layout: 2.4
    info = LAYOUTS.get(lay)
    if info is not None and not values_layout_ok(vals, compressed.dim() - 1, info.blocked):
        # torch accepts any strides (and its 2.13 CPU kernels read them correctly); a checked
        # tensor has contiguous values (3.7), so they are copied
        vals = vals.contiguous()
    return compressed, plain, vals, lay


_NO_VALUES: Any = object()


def _coo_args(
    indices: Any, values: Any, size: Any, dtype: torch.dtype | None, dev: torch.device | None,
    is_coalesced: bool | None, check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...] | None]:
    """torch's two overloads: ``(indices, values, size=None)`` and the size-only ``(size)``
    (an empty tensor of that size: ``sparse_dim == len(size)``, no dense dims). Scalar values
    are one specified element, as in torch."""
    if values is _NO_VALUES or values is None:
        if size is not None and (indices is _NO_VALUES or indices is None):
            indices = size  # sparse_coo_tensor(size=(2, 3))
        elif size is not None or indices is _NO_VALUES or indices is None:
            raise TypeError("sparse_coo_tensor() takes (indices, values, size=None) or (size)")
        if is_coalesced is not None:
            raise TypeError("sparse_coo_tensor(size) takes no is_coalesced argument")
        shape = _as_size(indices, "sparse_coo_tensor")
        assert shape is not None
        vals = torch.empty((0,), dtype=dtype, device=dev)
        return torch.empty((len(shape), 0), dtype=torch.int64, device=vals.device), vals, shape
    shape = _as_size(size, "sparse_coo_tensor")
    idx = _coo_index(indices, dev, check=check)
    vals = _as_values(values, dtype, dev)
    if vals.dim() == 0 and vals.layout == torch.strided:
        vals = vals.expand(1)  # one specified element, as torch expands it
    return idx, vals, shape


@not_traced
def sparse_coo_tensor(
    indices: Any = _NO_VALUES,
    values: Any = _NO_VALUES,
    size: SizeLike = None,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    pin_memory: bool = False,
    requires_grad: bool = False,
    check_invariants: bool | None = None,
    is_coalesced: bool | None = None,
) -> SafeSparseTensor:
    out = build.fast_coo(indices, values, size, dtype, device, pin_memory, requires_grad,
                         check_invariants, is_coalesced)
    if out is not None:  # the common case: int64 indices, values and a size, checks on
        return out
    dev = _device(device)
    idx, vals, shape = _coo_args(indices, values, size, dtype, dev, is_coalesced,
                                 _wants_check(check_invariants))
    # torch's meta device holds no data: an empty tensor there (the size-only overload) is
    # built as torch builds it, unchecked (4.1 admits only devices with data)
    meta_empty = vals.device.type == "meta" and idx.numel() == 0 and vals.numel() == 0
    if not _wants_check(check_invariants) or meta_empty:
        # (on aliases of its own: build.own_alias)
        args = (idx.detach(), build.own_alias(vals), *(() if shape is None else (shape,)))
        plain_t = _originals.sparse_coo_tensor(
            *args, dtype=vals.dtype, device=dev, **_pin(pin_memory),
            check_invariants=False, is_coalesced=is_coalesced, requires_grad=requires_grad,
        )
        return build.unchecked(plain_t, (idx,))
    meta = check_coo_metadata(idx, vals, shape, dtype=dtype, device=dev)
    return build.coo(idx, vals, meta, is_coalesced, requires_grad=requires_grad,
                     pin_memory=pin_memory, estimate=shape is None)


sparse_coo_tensor.__doc__ = doctext.factory(torch.sparse_coo)


__all__ = [
    "sparse_bsc_tensor",
    "sparse_bsr_tensor",
    "sparse_compressed_tensor",
    "sparse_coo_tensor",
    "sparse_csc_tensor",
    "sparse_csr_tensor",
]

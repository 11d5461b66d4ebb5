"""Zero-copy transposes: CSR <-> CSC and BSR <-> BSC, batched and hybrid.

Swapping the two sparse dims of a compressed tensor needs no data movement: the compressed and
plain index tensors are reinterpreted (crow_indices become ccol_indices), and for blocked
layouts the values are viewed with their two block dims swapped (converting to blocks and
transposing commute, with the blocksize swapped). Such block-transposed values are
column-contiguous, which invariant 3.7 admits.

torch 2.13 does this itself for non-hybrid tensors, as a view (``_is_view()``, ``_base``), but
refuses hybrid ones. Non-hybrid tensors get torch's own transpose, so the result is a view
exactly where torch's is (the result object is torch's view, typed ``SafeSparseTensor``);
hybrid ones are built with torch's factory (``check_invariants=False``: the indices are the
already-checked ones), sharing storage but not a view, since torch has no such view. Other dim
pairs keep torch's behaviour (and its views, and its errors: a batch dim with a sparse dim).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base import originals as _originals
from ..base.layouts import SWAPPED, compressed_members
from ..engine.metadata import LAYOUTS
from ..state import checked
from .core import OpKind, wrap_results

T = torch.Tensor



def sparse_dims(t: torch.Tensor) -> tuple[int, int]:
    """The two sparse dims of a compressed tensor (``-2-N, -1-N`` as non-negative dims)."""
    m = t.dim() - 2 - t.dense_dim()
    return m, m + 1


def swap_compressed(t: torch.Tensor, *, conj: bool = False) -> torch.Tensor:
    """The transpose of a plain compressed tensor's sparse dims, sharing all its storage.

    ``conj=True`` (the adjoint of a complex tensor) conjugates a copy of the values; the index
    tensors are still shared.
    """
    compressed, plain = compressed_members(t)
    values = t.values().conj_physical() if conj else t.values()
    m = compressed.dim() - 1
    if LAYOUTS[t.layout].blocked:
        values = values.transpose(m + 1, m + 2)
    size = list(t.shape)
    size[m], size[m + 1] = size[m + 1], size[m]
    return _originals.sparse_compressed_tensor(
        compressed, plain, values, size, layout=SWAPPED[t.layout], dtype=values.dtype,
        device=values.device, check_invariants=False,
    )


def _dims(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    dim0 = args[1] if len(args) > 1 else kwargs["dim0"]
    dim1 = args[2] if len(args) > 2 else kwargs["dim1"]
    return int(dim0), int(dim1)


def _finish(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            out: torch.Tensor) -> Any:
    # The swapped tensor has the input's index structure and extents: the same geometry (the
    # one its checked input was proven for, or computed).
    geometry = checked.proven_geometry(args[0])
    return wrap_results(func, OpKind.PRESERVING, args, kwargs, out, geometry, views=True)


def _swap(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          *, conj: bool = False) -> Any:
    """The sparse-dim transpose: torch's own (a view of the input) where torch has one, i.e.
    for non-hybrid tensors; :func:`swap_compressed` for hybrid ones, which torch refuses."""
    t = args[0]
    if t.dense_dim() == 0 and not conj:
        return _finish(func, args, kwargs, func(*args, **kwargs))
    return _finish(func, args, kwargs, swap_compressed(t, conj=conj))


def _torch_default(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   kind: OpKind = OpKind.PRESERVING) -> Any:
    with DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    return wrap_results(func, kind, args, kwargs, out, views=True)


def _transpose(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if t.layout not in SWAPPED:
        return _torch_default(func, args, kwargs)  # COO: torch permutes the index rows
    ndim = t.dim()
    dims = _dims(args, kwargs)
    if any(not -ndim <= d < ndim for d in dims):
        return _torch_default(func, args, kwargs)  # torch raises its own IndexError
    d0, d1 = (d % ndim for d in dims)
    with DisableTorchFunctionSubclass():
        s0, s1 = sparse_dims(t)
        if {d0, d1} == {s0, s1}:
            return _swap(func, args, kwargs)
    if d0 == d1:
        return _torch_default(func, args, kwargs)
    batch = set(range(s0))
    if (d0 in batch) != (d1 in batch) and {d0, d1} & {s0, s1}:
        # torch refuses this itself, with its own message (code matching on it keeps working)
        with DisableTorchFunctionSubclass():
            func(*args, **kwargs)
        raise RuntimeError(
            f"transpose(): can only transpose dimensions of the same type (Batch, Sparse, "
            f"Dense), got {d0} and {d1} of a {t.layout} tensor with {s0} batch dims"
        )
    return _torch_default(func, args, kwargs, OpKind.NEW_INDICES)


def _t(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if t.layout in SWAPPED and t.dim() == 2:
        with DisableTorchFunctionSubclass():
            return _swap(func, args, kwargs)
    return _torch_default(func, args, kwargs)


def _mT(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if t.layout in SWAPPED:
        with DisableTorchFunctionSubclass():
            _, s1 = sparse_dims(t)
            if s1 == t.dim() - 1:  # non-hybrid: the last two dims are the sparse dims
                return _swap(func, args, kwargs)
    return _torch_default(func, args, kwargs)


def _adjoint(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if t.layout in SWAPPED:
        with DisableTorchFunctionSubclass():
            _, s1 = sparse_dims(t)
            if s1 == t.dim() - 1:
                return _swap(func, args, kwargs, conj=t.is_complex())
    return _torch_default(func, args, kwargs)


__all__ = [
    "sparse_dims",
    "swap_compressed",
]

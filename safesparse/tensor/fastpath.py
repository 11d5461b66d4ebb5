"""The fast path of ``SafeSparseTensor.__torch_function__``: the common operations on one
checked tensor, in a straight line.

An entry of :data:`FAST` handles one torch function when its arguments have the expected form
(no keyword arguments, the first argument a checked ``SafeSparseTensor``, the others Python
scalars, non-tensors or one plain dense tensor, by the entry's rule) and debug mode is off.
Then that tensor is the only sparse argument, so the guard is one check of its record
(:func:`safesparse.state.checked.holds`), and the result needs no search:

* ``FRESH`` / ``MOVE`` (values-only ops, ``clone``, multiplication/division by a scalar, a
  positive power; dtype/device moves): torch copied the index data into memory it allocated in
  the op, so the result is born with a *sole* record (checked.py, shortcut 1), checked if the
  input still holds after the op. A move also re-checks the two O(1) invariants a move can
  break (1.5 values dtype, 4.1 device type).
* ``VIEW`` (``.mT``, ``.t()``, sparse-dim ``transpose`` of a non-hybrid compressed tensor) and
  ``DETACH``: torch's own view of the input (same counter, same index memory, same geometry):
  the result carries the input's record object (shortcut 3).
* ``PRODUCT`` (``A @ x``, ``mm``, ``matmul``, ``torch.sparse.mm`` with a plain dense ``x``,
  non-block layouts): the result is strided; nothing to wrap.

A handler returns :data:`MISS` before running anything when the call does not fit; the general
path then handles it as before. A result that turns out not to fit after the op ran (torch
returned memory shared with the input, or more references than its own) goes to the general
path's wrapping (``fallback``) with the input known checked before the op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import torch

from ..base.debug_flag import is_debug
from ..base.layouts import BLOCK_LAYOUTS, SWAPPED, index_members
from ..engine.metadata import _UNSUPPORTED_VALUE_DTYPES, SUPPORTED_DEVICE_TYPES
from ..state.admission import give
from ..state.checked import Record, born, held

__all__ = ["FAST", "MISS", "Fallback", "Handler"]

T = torch.Tensor
_run: Callable[..., Any] = torch._C._disabled_torch_function_impl
_getrefcount = sys.getrefcount
_SCALARS = (int, float)
_DENSE_TYPES = (torch.Tensor, torch.nn.Parameter)
_LAYOUT = T.layout.__get__  # type: ignore[attr-defined]


def _layout(a: Any) -> torch.layout:
    """``a.layout`` without a ``__torch_function__`` round trip (``a`` is a SafeSparseTensor)."""
    lay: torch.layout = _run(_LAYOUT, (), (a,), {})
    return lay

#: Returned by a handler that did not handle the call (nothing has run).
MISS: Final[Any] = object()

#: ``fallback(func, args, ret)``: wrap ``ret`` the general way (the first argument was checked
#: before the op ran).
Fallback = Callable[[Callable[..., Any], tuple[Any, ...], Any], Any]
Handler = Callable[[type, Callable[..., Any], Any, tuple[Any, ...], Fallback], Any]


def _checked(a: Any) -> Record | None:
    """``a``'s record if ``a`` is a checked SafeSparseTensor and debug mode is off."""
    r = held(a)
    return None if r is None or is_debug() else r


def _born(cls: type, a: Any, r: Record, ret: Any, move: bool, func: Callable[..., Any],
          args: tuple[Any, ...], fallback: Fallback) -> Any:
    """``ret``, the result of a copying op on checked ``a``: retyped and given a sole record if
    its index memory is fresh (see the module docstring), else the general wrapping."""
    if ret is a:
        return a  # (e.g. ``t.to(t.dtype)``): nothing was made, a's state stands
    # 2: our parameter and getrefcount's argument; more: someone else holds it too
    # (a's layout read as _layout does, inlined: this is the hot path of ``A * 2``)
    lay = ret.layout if type(ret) is T else None
    if (lay is None or _getrefcount(ret) != 2 or lay is not _run(_LAYOUT, (), (a,), {})
            or ret.is_inference()):  # (no counter to watch: joined as volatile there)
        return fallback(func, args, ret)
    if move and (ret.dtype in _UNSUPPORTED_VALUE_DTYPES
                 or ret.device.type not in SUPPORTED_DEVICE_TYPES):
        return fallback(func, args, ret)  # 1.5 / 4.1 are decided there
    members = index_members(ret)
    coalesced = ret.is_coalesced() if lay is torch.sparse_coo else None
    # checked.born: None when not fresh (or empty): joined by memory range; checked only if
    # the input still holds after the op (a write while torch copied it is never blessed)
    rec = born(r, members[0], members[1] if len(members) > 1 else None, coalesced)
    if rec is None:
        return fallback(func, args, ret)
    return give(ret, rec, cls)


def _fresh(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
           fallback: Fallback) -> Any:
    """``t.op()``: a values-only op, ``clone``, a unary dunder."""
    if len(args) != 1:
        return MISS
    a = args[0]
    r = _checked(a)
    if r is None:
        return MISS
    return _born(cls, a, r, _run(func, types, args, {}), False, func, args, fallback)


def _scalar(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
            fallback: Fallback) -> Any:
    """``t * 2``, ``2 * t``, ``t / 2``: one int/float scalar after the tensor."""
    if len(args) != 2 or type(args[1]) not in _SCALARS:
        return MISS
    a = args[0]
    r = _checked(a)
    if r is None:
        return MISS
    return _born(cls, a, r, _run(func, types, args, {}), False, func, args, fallback)


def _power(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
           fallback: Fallback) -> Any:
    """``t ** p`` for a scalar ``p > 0`` (zeros stay zero)."""
    if len(args) != 2 or type(args[1]) not in _SCALARS or not args[1] > 0:
        return MISS
    a = args[0]
    r = _checked(a)
    if r is None:
        return MISS
    return _born(cls, a, r, _run(func, types, args, {}), False, func, args, fallback)


def _move(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
          fallback: Fallback) -> Any:
    """``t.to(torch.float64)``, ``t.double()``, ``t.cpu()``: no tensor among the arguments."""
    for x in args[1:]:
        if isinstance(x, T):
            return MISS
    a = args[0]
    r = _checked(a)
    if r is None:
        return MISS
    return _born(cls, a, r, _run(func, types, args, {}), True, func, args, fallback)


def _view(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
          fallback: Fallback) -> Any:
    """``t.mT``, ``t.t()``, ``t.transpose(-2, -1)`` of a non-hybrid compressed tensor: torch's
    own view, carrying the input's record. Anything else (COO, hybrid, other dims, an error)
    returns MISS: the general path (transpose.py) runs it again."""
    n = len(args)
    if n != 1 and not (n == 3 and type(args[1]) is int and type(args[2]) is int):
        return MISS
    a = args[0]
    lay = _layout(a)
    if lay not in SWAPPED:
        return MISS
    r = _checked(a)
    if r is None:
        return MISS
    try:
        ret = _run(func, types, args, {})
    except (RuntimeError, IndexError):
        return MISS  # (torch refuses hybrid transposes; the general path handles them)
    # a layout swapped by torch's own view of a: the sparse dims of a non-hybrid tensor
    if type(ret) is not T or ret.layout is not SWAPPED[lay] or ret._base is not a:
        return MISS
    return give(ret, r, cls)


def _detach(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
            fallback: Fallback) -> Any:
    """``t.detach()``: the same counter and index memory, so the same record."""
    if len(args) != 1:
        return MISS
    a = args[0]
    r = _checked(a)
    if r is None:
        return MISS
    ret = _run(func, types, args, {})
    if type(ret) is not T:
        return fallback(func, args, ret)
    return give(ret, r, cls)


def _product(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
             fallback: Fallback) -> Any:
    """``A @ x``, ``torch.mm(A, x)``, ``torch.matmul(A, x)`` with a plain dense ``x`` and a
    CSR, CSC or COO ``A`` (block layouts take the block route of the general path): a strided
    result, returned as torch computes it."""
    if len(args) != 2:
        return MISS
    a = args[0]
    x = args[1]
    if type(x) not in _DENSE_TYPES or x.layout is not torch.strided or _layout(a) in BLOCK_LAYOUTS:
        return MISS
    if held(a) is None or is_debug():  # (_checked inlined: the hot path of ``A @ x``)
        return MISS
    return _run(func, types, args, {})


def _sparse_mm(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...],
               fallback: Fallback) -> Any:
    """``torch.sparse.mm(A, x[, reduce])`` of a checked CSR or COO ``A`` and a plain dense
    ``x`` (torch has no backward for a CSC ``A``: the general path computes that product with
    ``torch.mm``; block layouts take the block route)."""
    n = len(args)
    if n != 2 and not (n == 3 and type(args[2]) is str):
        return MISS
    a = args[0]
    x = args[1]
    lay = _layout(a)
    if (type(x) not in _DENSE_TYPES or x.layout is not torch.strided
            or (lay is not torch.sparse_csr and lay is not torch.sparse_coo)):
        return MISS
    if held(a) is None or is_debug():
        return MISS
    return _run(func, types, args, {})


#: torch function -> fast handler (see the module docstring), filled from the op rows by
#: :func:`safesparse.tensor.ops.register_builtin_ops` at import.
FAST: Final[dict[Callable[..., Any], Handler]] = {}

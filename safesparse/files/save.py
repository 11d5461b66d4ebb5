"""Saving for plain torch: :func:`save` (``ss.save``) and :func:`unwrap_all`."""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from ..tensor import SafeSparseTensor, unwrap
from .walk import _ATOMS, _rebuild_tuple

__all__ = ["save", "unwrap_all"]


_torch_save = torch.save


def _plain(t: SafeSparseTensor) -> torch.Tensor:
    plain = unwrap(t).detach()
    if t.requires_grad and t.is_leaf:
        return torch.nn.Parameter(plain, requires_grad=True)  # torch keeps it as a Parameter
    return plain


def unwrap_all(obj: Any) -> Any:
    """``obj`` with every :class:`SafeSparseTensor` replaced by the plain torch tensor (no copy
    of tensor data; a leaf that requires grad becomes an ``nn.Parameter``).

    Goes through dicts (``OrderedDict`` state dicts keep their ``_metadata``), lists, tuples,
    named tuples, sets and deques, copying each container that holds a replaced tensor and
    leaving ``obj`` itself unchanged. Other objects are returned as they are: for a model, pass
    its ``state_dict()``.

    Args:
        obj: any object, typically a state dict.

    Returns:
        ``obj`` (or a copy of each container on the way to a replaced tensor) holding no
        ``SafeSparseTensor``.
    """
    return _unwrap(obj, {})


def _unwrap(node: Any, memo: dict[int, Any]) -> Any:
    if isinstance(node, _ATOMS):
        return node
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = node
    out = node
    if isinstance(node, SafeSparseTensor):
        out = _plain(node)
    elif isinstance(node, dict):
        items = [(_unwrap(k, memo), _unwrap(v, memo)) for k, v in node.items()]
        if any(nk is not k or nv is not v
               for (k, v), (nk, nv) in zip(node.items(), items, strict=True)):
            out = copy.copy(node)  # keeps the type and attributes (_metadata)
            out.clear()
            for k, v in items:  # not update(): Counter.update adds
                out[k] = v
    elif isinstance(node, (list, collections.deque, set, frozenset, tuple)):
        old = list(node)
        new = [_unwrap(v, memo) for v in old]
        if any(n is not v for n, v in zip(new, old, strict=True)):
            if isinstance(node, tuple):
                out = _rebuild_tuple(node, new)
            elif isinstance(node, collections.deque):
                out = collections.deque(new, maxlen=node.maxlen)
            else:
                out = type(node)(new)
    memo[id(node)] = out
    return out


def save(obj: Any, f: Any, **kwargs: Any) -> None:
    """``torch.save(unwrap_all(obj), f, **kwargs)``: a checkpoint plain torch can load.

    The file holds no safesparse globals, so ``torch.load(f, weights_only=True)`` opens it
    where safesparse is not installed (a serving stack, a teammate); ``ss.load`` gives back
    checked tensors.

    Args:
        obj: the object to save, e.g. ``model.state_dict()``.
        f: a file name, path or file-like object, as for ``torch.save``.
        **kwargs: keyword arguments of ``torch.save``.

    Returns:
        None.
    """
    _torch_save(unwrap_all(obj), f, **kwargs)

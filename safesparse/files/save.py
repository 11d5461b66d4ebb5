"""Saving for plain torch: :func:`save` (``ss.save``) and :func:`unwrap_all`.

Saving is where the author can still fix bad data, so :func:`save` first validates every
sparse tensor in the object that is not checked (:func:`check_before_saving`, the walk that
loading uses) and raises :class:`InvariantError` naming its key path; only then is the file
written, through a temporary file renamed over the target (:mod:`safesparse.files.atomic`), so
no file and no partial file is left behind when anything fails.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from ..tensor.core import SafeSparseTensor, unwrap
from .atomic import is_path, replacing
from .results import Found
from .session import SparseRecord, _Session
from .walk import _ATOMS, _rebuild_tuple, _Walk

__all__ = ["check_before_saving", "save", "unwrap_all"]


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


def check_before_saving(obj: Any) -> None:
    """Validate every sparse tensor in ``obj`` that is not checked (dicts and their keys,
    lists, tuples, sets, object attributes, nested: what the load walk reaches); an unchecked
    ``SafeSparseTensor`` that passes is checked afterwards.

    Raises:
        InvariantError: the first invalid sparse tensor, with its key path.
    """
    walk = _Walk(_Session(), {})
    try:
        walk.find(obj, ())
    except RecursionError:
        raise RuntimeError(
            "the object is nested too deeply for safesparse to check every tensor in it"
        ) from None
    for s in walk.sparse.values():
        if isinstance(s.item, SparseRecord):
            err = Found(s.keys, s.item).error
            assert err is not None
            raise err


def save(obj: Any, f: Any, **kwargs: Any) -> None:
    """``torch.save(unwrap_all(obj), f, **kwargs)``, refusing invalid data: a checkpoint plain
    torch can load.

    Every sparse tensor in ``obj`` that is not checked (a plain torch sparse tensor, one built
    with ``check_invariants=False``) is validated first; an invalid one raises and nothing is
    written. A file name is written through a temporary file in the same directory, renamed
    over it once ``torch.save`` has finished, so no partial file is ever left behind.

    The file holds no safesparse globals, so ``torch.load(f, weights_only=True)`` opens it
    where safesparse is not installed (a serving stack, a teammate); ``ss.load`` gives back
    checked tensors.

    Args:
        obj: the object to save, e.g. ``model.state_dict()``.
        f: a file name, path or file-like object, as for ``torch.save``.
        **kwargs: keyword arguments of ``torch.save``.

    Returns:
        None.

    Raises:
        InvariantError: a sparse tensor breaks an invariant; ``err.path`` names its key path,
            e.g. ``['layer.weight']``. Nothing is written.
    """
    check_before_saving(obj)
    plain = unwrap_all(obj)
    if not is_path(f):
        _torch_save(plain, f, **kwargs)
        return
    with replacing(f) as tmp:
        _torch_save(plain, tmp, **kwargs)

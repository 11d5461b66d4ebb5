"""How a ``SafeSparseTensor`` pickles and unpickles.

``SafeSparseTensor.__reduce_ex__`` (:func:`reduce_safe_sparse`) reduces to
:func:`_rebuild_safe_sparse` with the layout, the member tensors, the size and
``requires_grad``, never a "checked" flag: unpickling validates again, always. Inside
``ss.load`` / ``check`` the rebuild reports to the load session, so that a violation is
recorded with its key path instead of raised.

The rebuild function is registered with ``torch.serialization.add_safe_globals``, so that
``torch.load(f, weights_only=True)`` accepts files holding ``SafeSparseTensor`` once safesparse
is imported. Files name it ``safesparse.serialization._rebuild_safe_sparse`` (earlier versions
defined it there, and :mod:`safesparse.serialization` still re-exports it): its ``__module__``
says so, so that files written before and after the move read alike.

The registration runs when this module is imported (by :mod:`safesparse.files`, which
``safesparse/__init__.py`` imports), which keeps :mod:`safesparse.tensor.core` free of any import of
the loader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import COMPRESSED_LAYOUTS, compressed_members
from ..factories.core import sparse_compressed_tensor, sparse_coo_tensor
from ..tensor.core import SafeSparseTensor
from .session import (
    LEGACY_SAFE_MESSAGE,
    SparseRecord,
    _data_not_read_yet,
    _Pending,
    _session,
    _trusted,
)

__all__ = ["reduce_safe_sparse"]


def reduce_safe_sparse(t: torch.Tensor) -> tuple[Any, ...]:
    """``__reduce_ex__`` of SafeSparseTensor: the members and size, never a checked flag."""
    with DisableTorchFunctionSubclass():
        plain = t.detach()
        data: tuple[Any, ...]
        if plain.layout == torch.sparse_coo:
            data = (plain._indices(), plain._values(), tuple(plain.shape), plain.is_coalesced())
        elif plain.layout in COMPRESSED_LAYOUTS:
            data = (*compressed_members(plain), plain.values(), tuple(plain.shape))
        else:
            raise TypeError(f"cannot pickle a SafeSparseTensor with layout {plain.layout}")
    return (_rebuild_safe_sparse, (plain.layout, data, bool(t.requires_grad)))


def _reduce_ex(self: SafeSparseTensor, protocol: Any) -> tuple[Any, ...]:
    return reduce_safe_sparse(self)


def _build(layout: torch.layout, data: tuple[Any, ...], requires_grad: bool) -> SafeSparseTensor:
    if layout == torch.sparse_coo:
        indices, values, size, *rest = data
        return sparse_coo_tensor(indices, values, size, is_coalesced=rest[0] if rest else None,
                                 requires_grad=requires_grad)
    if layout in COMPRESSED_LAYOUTS:
        compressed, plain, values, size = data
        return sparse_compressed_tensor(compressed, plain, values, size, layout=layout,
                                        requires_grad=requires_grad)
    raise NotImplementedError(f"rebuilding a sparse tensor with layout {layout}")


def _rebuild_safe_sparse(
    layout: torch.layout, data: tuple[Any, ...], requires_grad: bool = False
) -> SafeSparseTensor | SparseRecord | _Pending:
    """Unpickle a SafeSparseTensor: validate the members, then build (InvariantError if bad).

    Inside ``ss.load`` / ``check`` a violation is recorded instead of raised, so that it can be
    reported with its key path.
    """

    def build() -> SafeSparseTensor:
        with _trusted():
            return _build(layout, data, requires_grad)

    members = tuple(data[:2] if layout == torch.sparse_coo else data[:3])
    session = _session()
    if session is None:
        if _data_not_read_yet():
            raise RuntimeError(LEGACY_SAFE_MESSAGE)
        return build()
    size_at = 2 if layout == torch.sparse_coo else 3
    size = data[size_at] if len(data) > size_at else None
    coalesced = data[3] if layout == torch.sparse_coo and len(data) > 3 else None
    return session.attempt(layout, members, size, coalesced, build)


# the name files give it (see the module doc); safesparse.serialization re-exports it
_rebuild_safe_sparse.__module__ = "safesparse.serialization"
SafeSparseTensor.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign,assignment]
torch.serialization.add_safe_globals([_rebuild_safe_sparse])

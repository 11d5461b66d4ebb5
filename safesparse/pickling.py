"""How a ``SafeSparseTensor`` pickles: registered on the class when safesparse is imported.

``SafeSparseTensor.__reduce_ex__`` reduces to
:func:`safesparse.serialization._rebuild_safe_sparse` with the layout, the member tensors, the
size and ``requires_grad``, never a "checked" flag: unpickling validates again, always. The
rebuild function is registered with ``torch.serialization.add_safe_globals`` here, so that
``torch.load(f, weights_only=True)`` accepts files holding ``SafeSparseTensor`` once safesparse
is imported. (It lives in :mod:`safesparse.serialization`, next to the loader whose session it
reports to, and keeps its name there: files written by earlier versions name it so.)

Like :mod:`safesparse.ops` and :mod:`safesparse.transpose`, this module only registers; it is
imported by ``safesparse/__init__.py``, which keeps :mod:`safesparse.tensor` free of any import
of the loader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from .invariants import COMPRESSED_LAYOUTS
from .serialization import _rebuild_safe_sparse
from .tensor import SafeSparseTensor
from .validation import compressed_members

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


SafeSparseTensor.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign,assignment]
torch.serialization.add_safe_globals([_rebuild_safe_sparse])

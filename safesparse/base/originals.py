"""torch's own sparse factories and ``torch.load``, held once, when safesparse is imported.

safesparse calls these, never ``torch.sparse_*_tensor`` looked up at call time: a user who
monkeypatched ``torch.sparse_csr_tensor = ss.sparse_csr_tensor`` (or enforce mode, which wraps
these attributes) must not send safesparse's own calls back into safesparse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import torch.serialization

FACTORY_NAMES: Final = (
    "sparse_coo_tensor",
    "sparse_compressed_tensor",
    "sparse_csr_tensor",
    "sparse_csc_tensor",
    "sparse_bsr_tensor",
    "sparse_bsc_tensor",
)


def _original(obj: Any) -> Any:
    """``obj`` itself, or the torch function behind one of safesparse's wrappers."""
    return getattr(obj, "__ss_original__", obj)


def _held(name: str) -> Callable[..., Any]:
    fn = _original(getattr(torch, name))
    if getattr(fn, "__module__", None) is not None and str(fn.__module__).startswith("safesparse"):
        # torch.<name> was already replaced by a safesparse factory: torch's own is the
        # builtin of the same name in torch's C module.
        fn = getattr(torch._C._VariableFunctions, name)
    return fn  # type: ignore[no-any-return]


sparse_coo_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_coo_tensor")
sparse_compressed_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_compressed_tensor")
sparse_csr_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_csr_tensor")
sparse_csc_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_csc_tensor")
sparse_bsr_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_bsr_tensor")
sparse_bsc_tensor: Final[Callable[..., torch.Tensor]] = _held("sparse_bsc_tensor")
FACTORIES: Final[dict[str, Callable[..., torch.Tensor]]] = {
    name: _held(name) for name in FACTORY_NAMES
}
load: Final[Callable[..., Any]] = _original(torch.load)

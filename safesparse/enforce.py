"""Enforce mode: validate torch's own sparse factories, called from code you do not edit.

``with ss.enforce():`` (a block), ``ss.set_enforce(True)`` (until switched off) and
``SAFESPARSE_ENFORCE=1`` in the environment (read once, at import) switch it on. While it is on,
every call of ``torch.sparse_coo_tensor``, ``torch.sparse_csr_tensor``,
``torch.sparse_csc_tensor``, ``torch.sparse_bsr_tensor``, ``torch.sparse_bsc_tensor`` and
``torch.sparse_compressed_tensor`` runs the safe factory of the same name instead: the data is
validated before torch sees it, whatever ``check_invariants`` says, and the result is a checked
:class:`~safesparse.SafeSparseTensor` (or an :class:`~safesparse.InvariantError` is raised).
``torch.load`` validates every sparse tensor it loads, as :func:`safesparse.load` does (with
the caller's ``weights_only`` and torch's default for it).

Mechanism
---------
The switch is a :class:`contextvars.ContextVar`, like debug mode's: ``enforce()`` and
``set_enforce()`` act on the current thread (or asyncio task) only; the environment variable
sets the default every context starts from, so ``SAFESPARSE_ENFORCE=1`` holds in every thread,
including threads started before or after the import.

A :class:`~torch.overrides.TorchFunctionMode` would be per thread (a thread started elsewhere
would not see it), so the factories are intercepted by replacing the six ``torch.*``
attributes (and ``torch.load`` / ``torch.serialization.load``) with thin wrappers. They are
installed the first time enforce mode is switched on (at import with ``SAFESPARSE_ENFORCE=1``),
and removed again when the last ``with enforce():`` block ends unless ``set_enforce(True)`` or the
environment variable made enforcement lasting. Until then ``torch`` is untouched; while they are
installed, a call outside enforce mode goes straight to the function that was there before
(torch's own, or a user's monkeypatch), unchanged.

While a ``safesparse`` torch function mode is active (:func:`safesparse.load` reading a file),
the wrappers hand the call to torch's function, so that the mode validates the data and reports
its key path; ``torch.load`` inside :func:`safesparse.load` is torch's own, never a second
validating load.

Limits
------
* Code that took a reference before the wrappers were installed (``from torch import
  sparse_coo_tensor`` at import time, ``torch._C._VariableFunctions.sparse_coo_tensor``) calls
  torch's function directly; enforcement does not see those calls.
* torch's legacy typed constructors (``torch.sparse.FloatTensor(indices, values, size)``) and
  C++ code building sparse tensors (``Tensor.to_sparse()``, kernels) are not factories; their
  results are plain torch tensors (validate them with :func:`safesparse.validate`).
* ``torch.jit.script`` resolves the wrappers to torch's builtins (they are registered as such);
  ``torch.compile`` traces through them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.serialization

# files first: it records torch's functions before any wrapper is installed
from . import _originals, factories, files

__all__ = ["enforce", "is_enforced", "set_enforce"]

_ENV_VAR = "SAFESPARSE_ENFORCE"


def _env_default() -> bool:
    return os.environ.get(_ENV_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


_ENV_DEFAULT = _env_default()  # read once, at import
_ENFORCE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "safesparse_enforce", default=_ENV_DEFAULT
)

_SAFE: dict[str, Callable[..., Any]] = {
    "sparse_coo_tensor": factories.sparse_coo_tensor,
    "sparse_compressed_tensor": factories.sparse_compressed_tensor,
    "sparse_csr_tensor": factories.sparse_csr_tensor,
    "sparse_csc_tensor": factories.sparse_csc_tensor,
    "sparse_bsr_tensor": factories.sparse_bsr_tensor,
    "sparse_bsc_tensor": factories.sparse_bsc_tensor,
}

_local = threading.local()  # depth of validating loads run by the torch.load wrapper


def is_enforced() -> bool:
    """Whether enforce mode is on in the current thread/context.

    Returns:
        ``True`` inside ``with enforce():``, after ``set_enforce(True)`` in this
        thread/context, or with ``SAFESPARSE_ENFORCE=1`` (unless switched off here).
    """
    return _ENFORCE.get()


def _safesparse_mode_active() -> bool:
    """Whether one of safesparse's own torch function modes (a validating load) is active."""
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(type(mode).__module__.startswith("safesparse.") for mode in stack)


def _factory_wrapper(name: str, previous: Callable[..., Any]) -> Callable[..., Any]:
    safe = _SAFE[name]
    builtin = _originals.FACTORIES[name]

    @functools.wraps(previous)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _ENFORCE.get():
            return previous(*args, **kwargs)
        if _safesparse_mode_active():
            return builtin(*args, **kwargs)  # the mode validates and names the key path
        kwargs["check_invariants"] = True  # enforce mode ignores check_invariants=False
        return safe(*args, **kwargs)

    wrapper.__ss_original__ = builtin  # type: ignore[attr-defined]
    return wrapper


_LOAD_SIGNATURE = inspect.signature(_originals.load)


def _load_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def load(*args: Any, **kwargs: Any) -> Any:
        if not _ENFORCE.get() or _local.__dict__.get("loading", 0) or _safesparse_mode_active():
            return previous(*args, **kwargs)
        bound = _LOAD_SIGNATURE.bind(*args, **kwargs)
        bound.arguments.setdefault("weights_only", None)  # torch's own default, not ours
        f = bound.arguments.pop("f")
        extra = bound.arguments.pop("pickle_load_args", {})
        _local.loading = getattr(_local, "loading", 0) + 1
        try:
            return files.load(f, **bound.arguments, **extra)
        finally:
            _local.loading -= 1

    load.__ss_original__ = _originals.load  # type: ignore[attr-defined]
    return load


# ---------------------------------------------------------------------------------------------
# Installing and removing the wrappers

_install_lock = threading.Lock()
_installed: dict[tuple[Any, str], tuple[Any, Any]] = {}  # (module, attr) -> (previous, ours)
_blocks = 0  # live ``with enforce():`` blocks, all threads
_lasting = _ENV_DEFAULT  # set_enforce(True) or the environment: never removed


def _targets() -> list[tuple[Any, str]]:
    return [(torch, name) for name in _originals.FACTORY_NAMES] + [
        (torch, "load"), (torch.serialization, "load")]


def _install() -> None:
    with _install_lock:
        if _installed:
            return
        for module, attr in _targets():
            previous = getattr(module, attr)
            ours = (_load_wrapper(previous) if attr == "load"
                    else _factory_wrapper(attr, previous))
            _installed[(module, attr)] = (previous, ours)
            setattr(module, attr, ours)
            _register_jit_builtin(ours, attr)


def _uninstall() -> None:
    with _install_lock:
        if _blocks or _lasting:
            return
        for (module, attr), (previous, ours) in list(_installed.items()):
            if getattr(module, attr) is ours:  # leave a later monkeypatch alone
                setattr(module, attr, previous)
        _installed.clear()


def _register_jit_builtin(fn: Callable[..., Any], attr: str) -> None:
    """TorchScript compiles calls of ``torch.<factory>`` to the aten op; keep that working."""
    if attr == "load":
        return
    try:
        from torch.jit import _builtins

        _builtins._register_builtin(fn, f"aten::{attr}")
    except Exception:  # pragma: no cover - private API of torch.jit
        pass


def set_enforce(enabled: bool) -> None:
    """Switch enforce mode on or off for the current thread/context (until switched again).

    Args:
        enabled: ``True``: torch's six sparse factories validate whatever ``check_invariants``
            says and return checked ``SafeSparseTensor`` s, and ``torch.load`` validates like
            ``ss.load``; ``False``: torch behaves as without safesparse.
    """
    global _lasting
    if enabled:
        with _install_lock:
            _lasting = True
        _install()
    _ENFORCE.set(bool(enabled))


@contextlib.contextmanager
def enforce(enabled: bool = True) -> Iterator[None]:
    """``with enforce():`` validates torch's sparse factories and ``torch.load`` in this
    thread/context for the block (nestable; ``enforce(False)`` switches it off for a block).

    Args:
        enabled: switch enforce mode on (default) or off for the block.

    Yields:
        None; the previous setting is restored on exit, also on an exception.
    """
    global _blocks
    with _install_lock:
        _blocks += 1
    _install()
    token = _ENFORCE.set(bool(enabled))
    try:
        yield
    finally:
        _ENFORCE.reset(token)
        with _install_lock:
            _blocks -= 1
        _uninstall()


if _ENV_DEFAULT:
    _install()

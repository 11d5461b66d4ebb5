"""Debug mode: validate every sparse result of every operation, ignoring the cache.

Enabled by ``SAFESPARSE_DEBUG=1`` in the environment (read once, at import; ``1``/``0``,
``true``/``false``, ``yes``/``no``, ``on``/``off`` in any case, anything else is an error naming
the variable), by ``set_debug(True)`` or, for a block, by ``with debug():``. The switch is a
:class:`contextvars.ContextVar`, so ``with debug()`` in one thread (or asyncio task) does not
switch debug mode on in another; ``set_debug`` sets the value for the current context, and the
process default (the environment variable, or ``python -m safesparse run --debug``) is what
every context starts from.

Plain torch sparse tensors used in operations where no ``SafeSparseTensor`` takes part are
seen by a torch function mode (:mod:`safesparse.tensor.debug_mode`) that is pushed on the thread
that switches debug mode on; this module only keeps the switch and tells that mode when it moves.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from safesparse_hooks import env

_ENV_VAR = env.DEBUG
_ENV_DEFAULT = env.flag(_ENV_VAR)  # read once, at import; a bad value raises, naming it
_default = _ENV_DEFAULT
_DEBUG: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "safesparse_debug", default=None
)

#: Called with the new setting whenever debug mode is switched in the current thread (and
#: with the process default when that is set); :mod:`safesparse.tensor.debug_mode` registers here.
LISTENERS: list[Callable[[bool], None]] = []


def _tell(enabled: bool) -> None:
    for listener in LISTENERS:
        listener(enabled)


def is_debug() -> bool:
    """Whether debug mode is on in the current thread/context.

    Returns:
        ``True`` inside ``with debug():``, after ``set_debug(True)`` in this context, or when
        ``SAFESPARSE_DEBUG=1`` was set when safesparse was imported (and not switched off).
    """
    value = _DEBUG.get()
    return _default if value is None else value


def set_debug(enabled: bool) -> None:
    """Switch debug mode on or off for the current thread/context, until switched again.

    In debug mode every sparse result of every operation on a :class:`SafeSparseTensor` is
    fully validated (the cache is ignored), every sparse input is validated before the
    operation runs, plain torch sparse tensors included, also in operations where no
    ``SafeSparseTensor`` takes part, and an :class:`InvariantError` names the operation.
    Other threads and asyncio tasks keep their own setting.

    Args:
        enabled: ``True`` to switch debug mode on, ``False`` to switch it off.
    """
    _DEBUG.set(bool(enabled))
    _tell(bool(enabled))


def set_process_default(enabled: bool) -> None:
    """Make debug mode on (or off) the default of every thread/context of the process, as
    ``SAFESPARSE_DEBUG`` does at import (``python -m safesparse run --debug``, the pytest
    option); contexts that switched it themselves keep their setting."""
    global _default
    _default = bool(enabled)
    _tell(is_debug())


@contextlib.contextmanager
def debug(enabled: bool = True) -> Iterator[None]:
    """Context manager: debug mode on (or off) for the block, in this thread/context only.

    Blocks nest; leaving one restores the setting it found, also when it exits with an
    exception. See :func:`set_debug` for what debug mode does.

    Args:
        enabled: ``False`` switches debug mode *off* for the block (``with debug(False):``).

    Example::

        with ss.debug():
            out = (a @ b).coalesce()  # every sparse result validated, ops named in errors
    """
    token = _DEBUG.set(bool(enabled))
    _tell(bool(enabled))
    try:
        yield
    finally:
        _DEBUG.reset(token)
        _tell(is_debug())


__all__ = [
    "debug",
    "is_debug",
    "set_debug",
]

"""Debug mode: validate every sparse result of every operation, ignoring the cache.

Enabled by ``SAFESPARSE_DEBUG=1`` in the environment (read once, at import), by
``set_debug(True)`` or, for a block, by ``with debug():``. The switch is a
:class:`contextvars.ContextVar`, so ``with debug()`` in one thread (or asyncio task) does not
switch debug mode on in another; ``set_debug`` sets the value for the current context, and the
environment variable sets the default every context starts from.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

_ENV_VAR = "SAFESPARSE_DEBUG"


def _env_default() -> bool:
    return os.environ.get(_ENV_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


_ENV_DEFAULT = _env_default()  # read once, at import
_DEBUG: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "safesparse_debug", default=_ENV_DEFAULT
)


def is_debug() -> bool:
    """Whether debug mode is on in the current thread/context.

    Returns:
        ``True`` inside ``with debug():``, after ``set_debug(True)`` in this context, or when
        ``SAFESPARSE_DEBUG=1`` was set when safesparse was imported (and not switched off).
    """
    return _DEBUG.get()


def set_debug(enabled: bool) -> None:
    """Switch debug mode on or off for the current thread/context, until switched again.

    In debug mode every sparse result of every operation on a :class:`SafeSparseTensor` is
    fully validated (the cache is ignored), every sparse input is validated before the
    operation runs, and an :class:`InvariantError` names the operation. Other threads and
    asyncio tasks keep their own setting.

    Args:
        enabled: ``True`` to switch debug mode on, ``False`` to switch it off.
    """
    _DEBUG.set(bool(enabled))


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
    try:
        yield
    finally:
        _DEBUG.reset(token)


__all__ = [
    "debug",
    "is_debug",
    "set_debug",
]

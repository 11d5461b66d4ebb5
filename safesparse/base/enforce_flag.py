"""The enforce-mode switch on its own: whether enforce mode is on here, and nothing else.

Kept apart from :mod:`safesparse.enforcement.mode` (which installs the wrappers and imports the
factories, the loaders and the tensor class) so that low modules can ask the question without
an import cycle: :meth:`SafeSparseTensor.__repr__ <safesparse.SafeSparseTensor.__repr__>`
prints as torch prints while enforce mode is on.

The switch is a :class:`contextvars.ContextVar`, like debug mode's: a value set in a thread
(or asyncio task) holds there only; the process default (``SAFESPARSE_ENFORCE``, read once,
when this module is imported; or :func:`set_default`) is what every context that never
switched starts from.
"""

from __future__ import annotations

import contextvars

from safesparse_hooks import env

#: The environment variable, and its value when safesparse was imported (a bad value raises,
#: naming the variable).
ENV_VAR = env.ENFORCE
ENV_DEFAULT = env.flag(ENV_VAR)

_default = ENV_DEFAULT
_ENFORCE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "safesparse_enforce", default=None
)

__all__ = ["ENV_DEFAULT", "ENV_VAR", "is_enforced", "reset", "set_default", "set_here"]


def is_enforced() -> bool:
    """Whether enforce mode is on in the current thread/context."""
    value = _ENFORCE.get()
    return _default if value is None else value


def set_default(enabled: bool) -> None:
    """Make ``enabled`` what every context that never switched starts from."""
    global _default
    _default = bool(enabled)


def set_here(enabled: bool) -> contextvars.Token[bool | None]:
    """Switch enforce mode in the current context; the token undoes it (:func:`reset`)."""
    return _ENFORCE.set(bool(enabled))


def reset(token: contextvars.Token[bool | None]) -> None:
    """Undo the :func:`set_here` that returned ``token``."""
    _ENFORCE.reset(token)

"""Strict reading of safesparse's switches in the environment.

``SAFESPARSE_ENFORCE``, ``SAFESPARSE_DEBUG`` and ``SAFESPARSE_OMP_PASSIVE`` accept ``1``/``0``,
``true``/``false``, ``yes``/``no`` and ``on``/``off`` in any case (surrounding blanks ignored);
unset or empty means off. Any other value is an error naming the variable: a typo
(``SAFESPARSE_ENFORCE=ture``) must not silently leave protection off. Imports nothing but
:mod:`os` (at run time).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: the startup hook imports this module, keep it bare
    from collections.abc import Mapping

ENFORCE = "SAFESPARSE_ENFORCE"
DEBUG = "SAFESPARSE_DEBUG"
VARIABLES = (ENFORCE, DEBUG)
#: Opt-in for shared machines: the startup hook sets ``OMP_WAIT_POLICY=PASSIVE`` (threads
#: waiting at an OpenMP barrier sleep instead of spinning) before torch is imported, unless
#: ``OMP_WAIT_POLICY`` is set already (safesparse_hooks/startup.py).
OMP_PASSIVE = "SAFESPARSE_OMP_PASSIVE"
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})


class BadValueError(ValueError):
    """A safesparse environment variable holds a value that is neither on nor off."""

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value
        super().__init__(
            f"{name}={value!r} is not a valid value: use 1/0, true/false, yes/no or on/off "
            f"(any case), or leave {name} unset")


def parse(name: str, value: str | None) -> bool:
    """The switch ``value`` of variable ``name`` stands for (``None``: unset, off).

    Raises:
        BadValueError: ``value`` is none of the accepted spellings.
    """
    if value is None:
        return False
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise BadValueError(name, value)


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """``parse(name, environ[name])``, ``environ`` defaulting to :data:`os.environ`."""
    return parse(name, (os.environ if environ is None else environ).get(name))


def any_set(environ: Mapping[str, str] | None = None) -> bool:
    """Whether either variable is present with a non-blank value (cheap, never raises)."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip() for name in VARIABLES)

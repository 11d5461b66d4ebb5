"""The process-startup hook: ``SAFESPARSE_ENFORCE=1`` / ``SAFESPARSE_DEBUG=1`` in any process.

``safesparse-startup.pth`` (installed into site-packages next to the package) runs, in every
Python process of the environment, one line that reads two environment variables and stops
there when neither is set: ordinary processes pay a dictionary look-up. When one is set,
:func:`install` reads both strictly (a bad value ends the process with status 2 and a message
naming the variable, before the program runs) and, when one is on, arranges for safesparse to be
imported right after the program's first ``import torch``: a program that never imports torch
has nothing to protect and never pays for torch. safesparse reads the variables when it is
imported, so enforce (or debug) mode is then on in every thread, and the variables pass to
subprocesses and DataLoader workers, which run this hook again.

Only :mod:`os`, :mod:`sys` and :mod:`importlib` are imported here.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from . import env

__all__ = ["install"]


def _activate() -> None:
    import safesparse  # noqa: F401  (reads the variables: enforce / debug mode on)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first ``import torch`` it lets the other finders find
    torch and wraps the loader so that safesparse is imported once torch's module has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        _remove(self)
        spec = importlib.util.find_spec(fullname)
        loader: Any = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _activate()

        loader.exec_module = exec_module
        return spec


def _remove(finder: object) -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(finder)  # type: ignore[arg-type]


def install() -> None:
    """Read the variables; when one is on, import safesparse now (torch already imported) or
    right after the first ``import torch``. A bad value ends the process (status 2)."""
    try:
        on = [env.flag(name) for name in env.VARIABLES]
    except env.BadValueError as err:
        sys.stderr.write(f"safesparse: {err}\n")
        sys.stderr.flush()
        os._exit(2)  # SystemExit would only be reported by site.py, and the program would run
    if not any(on):
        return
    if "torch" in sys.modules:
        _activate()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())

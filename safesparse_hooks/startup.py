"""The process-startup hook: ``SAFESPARSE_ENFORCE=1`` / ``SAFESPARSE_DEBUG=1`` in any process,
and ``SAFESPARSE_OMP_PASSIVE=1`` (OpenMP's passive waiting, for shared machines).

``safesparse-startup.pth`` (installed into site-packages next to the package) runs, in every
Python process of the environment, one line that reads two environment variables and stops
there when neither is set: ordinary processes pay a dictionary look-up. When one is set,
:func:`install` reads both strictly (a bad value ends the process with status 2 and a message
naming the variable, before the program runs) and, when one is on, arranges for safesparse to be
imported right after the program's first ``import torch``: a program that never imports torch
has nothing to protect and never pays for torch. safesparse reads the variables when it is
imported, so enforce (or debug) mode is then on in every thread, and the variables pass to
subprocesses and DataLoader workers, which run this hook again.

``SAFESPARSE_OMP_PASSIVE=1`` is a request, never a default: the hook then sets
``OMP_WAIT_POLICY=PASSIVE`` in the environment, unless ``OMP_WAIT_POLICY`` is set already (the
user's own choice wins), and only while torch is not imported yet (GNU OpenMP reads it once,
when torch loads it: set later it would change nothing, so it is left alone and a line on
stderr says so). Waiting threads then sleep at torch's barriers instead of spinning, which on a
machine whose cores other processes use keeps a descheduled thread from costing the others
their turn (docs/models.md measures both sides).

What a process that has a variable set but never imports torch pays is this module and
:mod:`.env` (two small files) and one finder object on ``sys.meta_path``: nothing else is
imported here (:mod:`os` and :mod:`sys` are loaded at every start anyway; no :mod:`typing`,
no :mod:`importlib.util`, whose import pulls in a dozen modules), about a millisecond in all
(docs/protecting.md has the measurement).
"""

from __future__ import annotations

import os
import sys

from . import env

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: never imported at run time
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["install", "omp_passive"]


def _activate() -> None:
    import safesparse  # noqa: F401  (reads the variables: enforce / debug mode on)


class _AfterTorch:
    """A meta path finder that finds nothing itself: on the first ``import torch`` it asks the
    other finders for torch's spec and wraps its loader so that safesparse is imported once
    torch's module has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        _remove(self)
        spec = _find_spec(fullname, path, target)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _activate()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached here (``importlib.invalidate_caches`` calls every finder)."""


def _find_spec(fullname: str, path: Sequence[str] | None,
               target: ModuleType | None) -> ModuleSpec | None:
    """The spec the finders after this one give (what ``importlib.util.find_spec`` does for
    a top-level name, without importing :mod:`importlib.util`)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None:
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                return spec
    return None


def _remove(finder: object) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def omp_passive() -> bool:
    """``OMP_WAIT_POLICY=PASSIVE`` in the environment, on request (``SAFESPARSE_OMP_PASSIVE``):
    only where ``OMP_WAIT_POLICY`` is unset and torch is not imported yet. Returns whether it
    was set."""
    if os.environ.get(env.OMP_WAIT_POLICY, "").strip():
        return False  # the user's own setting
    if "torch" in sys.modules:
        sys.stderr.write(f"safesparse: {env.OMP_PASSIVE} is set but torch is imported already: "
                         f"{env.OMP_WAIT_POLICY} left unset (set it before the process starts)\n")
        return False
    os.environ[env.OMP_WAIT_POLICY] = "PASSIVE"
    return True


def install() -> None:
    """Read the variables; when one is on, import safesparse now (torch already imported) or
    right after the first ``import torch``. A bad value ends the process (status 2)."""
    try:
        on = [env.flag(name) for name in env.VARIABLES]
        passive = env.flag(env.OMP_PASSIVE)
    except env.BadValueError as err:
        sys.stderr.write(f"safesparse: {err}\n")
        sys.stderr.flush()
        os._exit(2)  # SystemExit would only be reported by site.py, and the program would run
    if passive:
        omp_passive()
    if not any(on):
        return
    if "torch" in sys.modules:
        _activate()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())

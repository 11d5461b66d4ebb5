"""``safesparse.tracebacks``: how an uncaught ``InvariantError`` is shown (docs/debug.md).

The import path the guides name; the module is :mod:`safesparse.catalog.tracebacks`.
"""

from __future__ import annotations

from .catalog.tracebacks import ENV, MODES, install, mode, shorten

__all__ = ["ENV", "MODES", "install", "mode", "shorten"]

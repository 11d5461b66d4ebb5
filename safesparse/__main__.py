"""``python -m safesparse check FILE...`` / ``python -m safesparse demo``: see :mod:`.cli`."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())

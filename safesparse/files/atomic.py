"""Writing a file whole or not at all: a temporary file next to the target, renamed over it.

A save that fails half-way (an error while pickling, a full disk, an interrupt) leaves neither
a partial file nor a damaged earlier version; the rename is atomic on POSIX and Windows
(:func:`os.replace`) because both names are in the same directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

__all__ = ["is_path", "replacing"]


def is_path(f: Any) -> bool:
    """Whether ``f`` names a file (``str``, ``bytes`` or ``os.PathLike``) rather than being one."""
    return isinstance(f, (str, bytes, os.PathLike))


@contextlib.contextmanager
def replacing(filename: str | bytes | os.PathLike[Any]) -> Iterator[str]:
    """Yield a temporary path in ``filename``'s directory; rename it over ``filename`` when the
    block succeeds, remove it when the block raises. A symbolic link is followed: its target
    is replaced and the link stays."""
    path = os.fsdecode(os.fspath(filename))
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

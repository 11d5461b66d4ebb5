"""Writing a file whole or not at all: a temporary file beside the target, renamed over it.

A save that fails half-way (an error while pickling, a full disk, an interrupt) leaves neither
a partial file nor a damaged earlier version; the rename is atomic on POSIX and Windows
(:func:`os.replace`) because both names are on the same file system (the temporary file lies
in a hidden directory created next to the target).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
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
    is replaced and the link stays.

    The temporary path has ``filename``'s own base name, inside a fresh hidden directory next
    to it (``.model.pt.<random>.tmp/model.pt``): ``torch.save`` names its archive's inner
    folder after the file (``model/``), so the file written is the one ``torch.save`` would
    have written to ``filename`` directly. The directory is removed in both cases.
    """
    path = os.fsdecode(os.fspath(filename))
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory, base = os.path.split(path)
    tmpdir = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=directory or os.curdir)
    tmp = os.path.join(tmpdir, base)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)

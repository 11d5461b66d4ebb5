"""What a file may make a reader allocate: a small multiple of the file, never what it claims.

A checkpoint is hostile until vetted, and the vetting itself must hold against it
(``python -m safesparse check`` is the one place that must). Two claims a file can make cost
memory before any invariant is checked:

* **A member's view.** A tensor in a file is a storage (the bytes the file holds) and a view
  (sizes, strides, offset). A view with stride 0 (or overlapping strides) can claim 3e8
  elements over a storage of one; checking it makes a contiguous copy of what it claims.
  :func:`oversized_member` finds a member whose view has more elements than its storage holds:
  the load refuses it as the shape invariant of that member (COO 3.3 / 3.4, compressed 3.8 /
  3.9 / 3.10) before any copy, so every copy made afterwards is at most the file's own bytes.
* **A zip entry's size.** A ``.pt`` (torch's zip format) or ``.pt2`` archive may hold entries
  compressed with deflate: 16 MB on disk can inflate to 16 GiB. :func:`vet_zip` refuses an
  archive whose entries declare, alone or together, more than :data:`INFLATE_RATIO` times the
  archive's size (plus :data:`SLACK`) before anything reads them (torch's reader allocates the
  declared size), and :func:`read_entry` reads one entry streaming, within a limit (Python's
  ``zipfile`` never returns more than the declared size; the limit bounds what it declares).
  JSON members are read within :func:`json_cap`, a tighter limit: parsed, JSON text costs
  several times its size.

torch writes its archives uncompressed: a file torch wrote always passes.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from typing import IO, Any, Final

import torch

from ..base.layouts import INDEX_MEMBERS
from ..catalog.errors import InvariantError

__all__ = ["INFLATE_RATIO", "SLACK", "ArchiveLimitError", "entry_cap", "json_cap",
           "oversized_member", "read_entry", "vet_zip", "vet_zip_file"]

#: The most an archive's entries may declare, together, as a multiple of the archive's size.
INFLATE_RATIO: Final = 16
#: Bytes every archive may declare beyond that (a tiny archive's metadata).
SLACK: Final = 1 << 20
#: The most a JSON member may hold, as a multiple of the archive's size (plus :data:`SLACK`).
JSON_RATIO: Final = 2

#: The shape invariant of each member, in torch's member order (indices, values for COO).
_SHAPE_IDS: Final = {"coo": ("3.3", "3.4"), "compressed": ("3.8", "3.9", "3.10")}


class ArchiveLimitError(ValueError):
    """An archive whose entries declare more than its size allows (a zip bomb, or a lie):
    refused before anything is read from it."""


def entry_cap(archive_bytes: int) -> int:
    """The most the entries of an archive of ``archive_bytes`` bytes may declare."""
    return INFLATE_RATIO * max(archive_bytes, 0) + SLACK


def json_cap(archive_bytes: int) -> int:
    """The most one JSON member of an archive of ``archive_bytes`` bytes may hold."""
    return JSON_RATIO * max(archive_bytes, 0) + SLACK


def _method(info: zipfile.ZipInfo) -> str:
    return {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated",
            zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}.get(
        info.compress_type, f"compression method {info.compress_type}")


def vet_zip(z: zipfile.ZipFile, archive_bytes: int) -> None:
    """Refuse (:class:`ArchiveLimitError`) an archive whose entries declare more than
    :func:`entry_cap` of its size, one entry or all together; reads the central directory
    only (what ``zipfile`` already read)."""
    cap = entry_cap(archive_bytes)
    total = 0
    for info in z.infolist():
        total += info.file_size
        if info.file_size > cap or total > cap:
            what = (f"entry {info.filename!r} declares {info.file_size} bytes "
                    f"({info.compress_size} {_method(info)})" if info.file_size > cap
                    else f"its entries declare {total} bytes or more")
            raise ArchiveLimitError(
                f"{what}, more than {INFLATE_RATIO} times the archive's {archive_bytes} "
                "bytes: refused unread (a zip bomb, or a damaged archive)")


def vet_zip_file(f: str | os.PathLike[str] | IO[bytes]) -> None:
    """:func:`vet_zip` on the file ``f`` (a path, or a seekable binary file, left where it
    was) when it is a zip archive; anything else is left to its reader."""
    if isinstance(f, (str, bytes, os.PathLike)):
        try:
            size = os.path.getsize(f)
        except OSError:
            return  # the reader says why it cannot open it
        if not zipfile.is_zipfile(f):
            return
        try:
            with zipfile.ZipFile(f) as z:
                vet_zip(z, size)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            if isinstance(exc, ArchiveLimitError):
                raise
        return
    seek, tell = getattr(f, "seek", None), getattr(f, "tell", None)
    seekable = getattr(f, "seekable", None)
    if seek is None or tell is None or (seekable is not None and not seekable()):
        return
    start = tell()
    try:
        end = seek(0, os.SEEK_END)
        seek(start)
        if not zipfile.is_zipfile(f):
            return
        seek(start)
        try:
            with zipfile.ZipFile(f) as z:
                vet_zip(z, end - start)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            if isinstance(exc, ArchiveLimitError):
                raise
    finally:
        seek(start)


def read_entry(z: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """Entry ``name`` of ``z``, read streaming: refused (:class:`ArchiveLimitError`) when it
    declares more than ``limit`` bytes, or holds more than it declares."""
    info = z.getinfo(name)
    if info.file_size > limit:
        raise ArchiveLimitError(f"entry {name!r} declares {info.file_size} bytes "
                                f"({info.compress_size} {_method(info)}), more than the "
                                f"{limit} it may hold: refused unread")
    with z.open(info) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # (zipfile stops at the declared size; a defence in depth)
        raise ArchiveLimitError(f"entry {name!r} holds more than the {limit} bytes it may")
    return data


def oversized_member(layout: torch.layout, members: Sequence[Any]) -> InvariantError | None:
    """The refusal of the first of ``members`` (torch's order: ``(indices, values)`` for COO,
    ``(compressed, plain, values)`` otherwise) whose view has more elements than its storage
    holds (stride 0, overlapping strides): the shape invariant of that member, with the
    elements claimed and held. ``None`` when every member's view fits its storage (what is
    not a strided tensor is left to the factory). Metadata only, O(1)."""
    family = "coo" if layout == torch.sparse_coo else "compressed"
    names = (*INDEX_MEMBERS.get(layout, ("compressed_indices", "plain_indices")), "values")
    for name, iid, m in zip(names, _SHAPE_IDS[family], members, strict=False):
        if not isinstance(m, torch.Tensor) or m.layout != torch.strided or m.is_meta:
            continue
        claimed = m.numel()
        if claimed <= 1:
            continue
        held = m.untyped_storage().nbytes() // max(m.element_size(), 1)
        if claimed > held:
            return InvariantError(
                layout, iid,
                f"{name} of shape {tuple(m.shape)} (strides {tuple(m.stride())}) claims "
                f"{claimed} elements; the file holds {held}",
                location={"member": name, "claimed": claimed, "held": held})
    return None

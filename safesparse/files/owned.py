"""Index members a loader hands out on memory of their own, never on a file mapping.

A tensor loaded from a mapped file (``safetensors``, ``torch.load(mmap=True)``) reads the page
cache of that file: another process that rewrites the file (a deploy copying a new model over
it, a trainer's ``torch.save`` to the same path) changes the indices under a checked tensor.
SPEC 4 never trusts such memory from a cache, so every loader validates and keeps its sparse
tensors on *copies* of their index members (the values stay mapped: no value can make a
product read out of bounds). :func:`own_copy` is that copy, the one place it is made.

Cost. The copy itself is a memcpy; what a plain ``clone()`` pays for a large member is the
first touch of freshly allocated memory, one page fault and one zeroed 4 KiB page at a time
(measured, 2-core CPU: 80 MB of int64 column indices, ``clone()`` 16-18 ms, the same copy into
memory already touched 2 ms). Above :data:`HUGE_FROM` bytes on Linux the copy goes to a private
anonymous mapping advised for transparent huge pages (2 MiB pages where the kernel's THP mode
is ``madvise`` or ``always``: 6.6 ms for the same 80 MB); elsewhere, and for anything small,
non-contiguous or not on the CPU, it is ``clone()``.

Why the mapping is as safe as ``clone()``: it is ``MAP_PRIVATE | MAP_ANONYMOUS`` (no file
behind it, and a forked child that writes it gets its own pages, copy on write); the tensor
returned by :func:`torch.frombuffer` holds the ``mmap`` object, so the memory lives exactly as
long as the tensor's storage, and ``mmap.close()`` refuses while the buffer is exported. The
memory is new: no other tensor, storage or state refers to it.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

#: Members of at least this many bytes are copied to a huge-page mapping (smaller: ``clone()``,
#: where one mapping's system calls cost more than the page faults they save).
HUGE_FROM = 2 << 20

_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_PRIVATE_ANON: int | None = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # type: ignore[attr-defined,unused-ignore]
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS") else None)


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the index member ``t`` (same dtype, shape and device) in memory nothing else
    refers to, and that no file backs. Reads ``t`` once."""
    nbytes = t.numel() * t.element_size()
    if (nbytes < HUGE_FROM or _MADV_HUGEPAGE is None or _PRIVATE_ANON is None
            or t.device.type != "cpu" or not t.is_contiguous()):
        return t.clone()
    buf = mmap.mmap(-1, nbytes, flags=_PRIVATE_ANON)
    with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages, still private
        buf.madvise(_MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)
    return out.copy_(t)

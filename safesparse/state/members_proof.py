"""Proofs of index members that model code's operators were given: the run-time question of
the ``safesparse`` operators, and how members that no checked tensor handed out get proven.

A ``safesparse`` operator reads dense index members (a module's buffers). They are proven when
they are members a checked tensor handed out, still proven (:func:`checked.confirm`: a module's
own buffers), or when this module remembers a checked tensor built on them (:func:`remember`)
whose proof still holds *for these very tensors* (:func:`checked.proves`: the same view of the
same memory, every counter that can write it unmoved, the same geometry). That second route is
how members nothing vouches for (written by DDP's buffer broadcast, in a program loaded with
``torch.export.load``, received through a process queue) are proven after the operator
validated them once: the next call answers in O(1), and any write through the members (or
anything else on their memory) voids it, so they are validated again before a kernel reads
them.

Memory that cannot be watched (inference tensors, shared memory, file mappings) is never
remembered: a checked tensor over it is volatile (:func:`checked.is_volatile`), its proof
never holds, and the operator validates it at each use (:func:`watchable` tells the caller).

The record remembered for a member is kept in a :class:`~safesparse.state.memory.Tags` entry
keyed by the member object (dropped with it, never in its ``__dict__``, which torch pickles).
Members in memory torch did not allocate (a program's constants loaded with
``torch.export.load``) are validated on a copy by the factories; they are remembered on their
own memory when they still hold the validated data (:func:`admission.proven_copy`), watched
through their counters (docs/ops.md, limits: their owner is torch's loader).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import checked
from .admission import proven_copy
from .memory import Tags, foreign

__all__ = ["confirm", "holding", "is_unwatched", "proof", "remember", "unwatched",
           "watchable"]

#: index member -> the record proving it (of a checked tensor the factories built on it, or
#: :func:`admission.proven_copy`'s where they built on a copy)
_proven = Tags()
#: index members something writes without moving a counter (see :func:`unwatched`)
_unwatched = Tags()


def confirm(compressed: torch.Tensor, plain: torch.Tensor, geometry: Hashable) -> bool:
    """Whether ``compressed`` / ``plain`` are proven for ``geometry`` now, in O(1): members a
    checked tensor handed out (:func:`checked.confirm`), or members :func:`remember` was told
    of whose proof still holds for them; never members marked :func:`unwatched`."""
    return proof(compressed, plain, geometry)[0]


def proof(compressed: torch.Tensor, plain: torch.Tensor, geometry: Hashable
          ) -> tuple[bool, dict[Hashable, Any] | None]:
    """``(proven, cache)``: :func:`confirm`'s answer and, where proven, the proof's cache for
    what the pattern alone decides (:func:`checked.proof_cache`; None where it has none), in
    one question."""
    if is_unwatched(compressed, plain):
        return False, None
    rec = _proving(compressed, plain, (geometry,))
    if rec is None:
        return False, None
    return True, checked.record_cache(rec)


def _proving(compressed: torch.Tensor, plain: torch.Tensor, geometries: tuple[Hashable, ...]
             ) -> checked.Record | None:
    """The record that proves these member objects now (a checked tensor's on their memory,
    or the one the operators remembered for them), or None: :func:`proof`'s and
    :func:`holding`'s one look-up."""
    rec = checked.vouch(compressed, plain, geometries)
    if rec is None:
        rec = _proven.get(compressed)
        if (rec is None or _proven.get(plain) is not rec
                or not checked.proves(rec, compressed, plain, geometries)):
            return None
    return rec


def holding(compressed: torch.Tensor, plain: torch.Tensor, geometry: Hashable
            ) -> Callable[[], bool] | None:
    """Where :func:`proof` holds for these member objects now: a check that answers, in O(1)
    and cheaper than :func:`proof` (no look-up of the record, no cache), whether the proof it
    found still holds for them: the same rule (:func:`checked.proves`: the same views of the
    same memory, every counter that can write it unmoved, the same geometry), and never once
    the members are marked :func:`unwatched`. None where the members are not proven now. For
    callers that ask the same question about the same members at every call (the eager fast
    path of ``safesparse.nn``)."""
    if is_unwatched(compressed, plain):
        return None
    geometries = (geometry,)
    rec = _proving(compressed, plain, geometries)
    if rec is None:
        return None
    proves = checked.proves
    marked = _unwatched._items  # (the Tags' dict: its truth value costs no call)

    def still() -> bool:
        if marked and is_unwatched(compressed, plain):
            return False
        return proves(rec, compressed, plain, geometries)

    return still


def remember(proven: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor) -> bool:
    """``proven`` is a checked tensor the factories just built (validated, or vouched for) on
    ``compressed`` / ``plain``: :func:`confirm` answers for these member objects from its proof
    from now on. Returns False (nothing remembered) where the memory cannot be watched or
    ``proven`` carries no proof that can hold: such members are validated at each use."""
    rec = checked.record(proven)
    if (rec is None or checked.is_volatile(rec) or not watchable(compressed, plain)
            or is_unwatched(compressed, plain)):
        return False
    # (built on a copy where their memory is not torch's allocation: proven on their own
    # memory if they still hold the validated data)
    rec = proven_copy(rec, compressed, plain)
    if rec is None:
        return False
    _proven.set(compressed, rec)
    _proven.set(plain, rec)
    return True


def unwatched(compressed: torch.Tensor, plain: torch.Tensor) -> None:
    """Something writes these member objects' memory without moving their counters (DDP's
    buffer broadcast with ``broadcast_buffers=True`` copies below autograd, every forward): no
    proof of them is trusted from now on, they are validated at each use."""
    _unwatched.set(compressed, True)
    _unwatched.set(plain, True)
    _proven.set(compressed, None)
    _proven.set(plain, None)


def is_unwatched(compressed: torch.Tensor, plain: torch.Tensor) -> bool:
    """Whether either member was marked :func:`unwatched`."""
    return _unwatched.get(compressed) is not None or _unwatched.get(plain) is not None


def watchable(compressed: torch.Tensor, plain: torch.Tensor) -> bool:
    """Whether writes to the members' memory are seen by this process (not an inference
    tensor, not shared memory, not a file mapping): a proof of them can be remembered."""
    return not foreign((compressed, plain))

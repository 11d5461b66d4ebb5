"""Checked-state tracking: which index data was validated, and whether it changed since.

One :class:`IndexState` exists per index *structure*: the index member tensors of a sparse
tensor, identified by data pointer, shape, strides, dtype and device. Every SafeSparseTensor
built on that structure joins the same state, checked or not: its views, its rebuilds with new
values, an unchecked tensor built on the same index tensors. The state records which
geometries (compressed/plain extents, or COO sparse sizes) validation has *proven*, and holds
*witnesses*: for each tensor object that can write the structure through torch (the members of
every joined tensor, the caller's input index tensors), a ``detach()`` alias sharing that
object's version counter, with the counter's value when last proven. An in-place write through
any of them bumps its counter; the state then stops holding and forgets its proofs, for every
tensor sharing it. Proving retakes every witness at its current version, since validation has
just read the current data.

Limits, the same as autograd's own in-place detection: writes through objects safesparse never
saw (``.data``, NumPy views, a plain torch tensor built elsewhere on the same storage) bypass
the witnessed counters and are not seen. Debug mode ignores the cache.

The cache maps index keys to states through weak references: a state lives only while a
tensor carries it, so the cache never keeps tensors alive and never grows past the live
tensors. A live state's witnesses alias its index storage, so that memory cannot be freed and
reused under a cached key.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

IndexKey = tuple[tuple[int, Hashable, Hashable, torch.dtype, torch.device], ...]


class _Witness:
    __slots__ = ("alias", "owner", "version")

    def __init__(self, owner: torch.Tensor, member: torch.Tensor) -> None:
        self.owner = weakref.ref(owner)
        self.alias = member.detach()  # shares the version counter of ``member``
        self.version = member._version

    def alive(self) -> bool:
        return self.owner() is not None

    def unchanged(self) -> bool:
        return self.alias._version == self.version


class IndexState:
    """What is known about one index structure; shared by every tensor built on it."""

    __slots__ = ("__weakref__", "_lock", "key", "proven", "witnesses")

    def __init__(self, key: IndexKey) -> None:
        self.key = key
        self.proven: set[Hashable] = set()
        self.witnesses: list[_Witness] = []
        self._lock = threading.Lock()

    def witness(self, owner: torch.Tensor, members: Iterable[torch.Tensor]) -> None:
        """Watch ``owner``'s members. A tensor joining a state that holds is taken at its
        current version; one joining a state that no longer holds cannot revive it."""
        with self._lock:
            if any(w.owner() is owner for w in self.witnesses):
                return
            self.witnesses += [_Witness(owner, m) for m in members]

    def witnesses_owner(self, owner: torch.Tensor) -> bool:
        with self._lock:
            return any(w.owner() is owner for w in self.witnesses)

    def _holds(self) -> bool:
        live = [w for w in self.witnesses if w.alive()]
        if len(live) != len(self.witnesses):
            self.witnesses = live
        if all(w.unchanged() for w in live):
            return True
        self.proven.clear()
        return False

    def holds(self) -> bool:
        """True while no witnessed index tensor was written in place (prunes dead owners)."""
        with self._lock:
            return self._holds()

    def is_proven(self, geometry: Hashable) -> bool:
        with self._lock:
            return geometry in self.proven and self._holds()

    def prove(self, geometry: Hashable) -> None:
        """Validation just passed for ``geometry`` on the current data."""
        with self._lock:
            if not self._holds():
                for w in self.witnesses:
                    w.version = w.alias._version
            self.proven.add(geometry)

    def retake(self, owner: torch.Tensor) -> None:
        """``owner`` wrote only values (a known-safe in-place op): re-arm its witnesses."""
        with self._lock:
            intact = all(w.unchanged() for w in self.witnesses if w.owner() is not owner)
            if intact:
                for w in self.witnesses:
                    if w.owner() is owner:
                        w.version = w.alias._version


def tensor_key(t: torch.Tensor) -> tuple[int, Hashable, Hashable, torch.dtype, torch.device]:
    """Identity of one index tensor: data pointer first (``witness_inputs`` relies on it)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def index_key(indices: Iterable[torch.Tensor]) -> IndexKey:
    return tuple(tensor_key(t) for t in indices)


# ---------------------------------------------------------------------------------------------
# The cache of index structures

_cache: weakref.WeakValueDictionary[IndexKey, IndexState] = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


def state_for(key: IndexKey) -> IndexState:
    """The live state of this index structure, created if none is alive."""
    with _cache_lock:
        state = _cache.get(key)
        if state is None:
            state = _cache[key] = IndexState(key)
        return state


def lookup(key: IndexKey) -> IndexState | None:
    """The live state of this index structure, if any (not created)."""
    with _cache_lock:
        return _cache.get(key)


def cache_size() -> int:
    """Number of live cached index structures (for tests and diagnostics)."""
    with _cache_lock:
        return len(_cache)


def clear_cache() -> None:
    """Forget every proof: the next build or validate checks its indices again."""
    with _cache_lock:
        states = list(_cache.values())
    for state in states:
        with state._lock:
            state.proven.clear()


# ---------------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True)
class Stats:
    """Counters since the last :func:`reset_stats`."""

    validations: int = 0  # full index validations run
    skipped: int = 0  # index validations avoided because the state was known


_stats_lock = threading.Lock()
_counts = {"validations": 0, "skipped": 0}


def count(field: str) -> None:
    with _stats_lock:
        _counts[field] += 1


def stats() -> Stats:
    with _stats_lock:
        return Stats(**_counts)


def reset_stats() -> None:
    with _stats_lock:
        for k in _counts:
            _counts[k] = 0

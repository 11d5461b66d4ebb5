"""Checked-state tracking: which index data was validated, and whether it changed since.

One :class:`IndexState` exists per index *structure*: the index member tensors of a sparse
tensor, identified by data pointer, shape, strides, dtype and device. Every SafeSparseTensor
built on that structure joins the same state, checked or not: its views, its rebuilds with new
values, an unchecked tensor built on the same index tensors. The state records which
geometries (compressed/plain extents, or COO sparse sizes) validation has *proven*, and holds
*witnesses*: for each tensor object that can write the structure through torch (the members of
every joined tensor, the caller's input index tensors), an alias sharing that object's version
counter, with the counter's value when last proven. An in-place write through any of them
bumps its counter; the state then stops holding and forgets its proofs, for every tensor
sharing it. Proving (after a validation) retakes every witness at its current version, since
validation has just read the current data; deriving (a known op on checked tensors) only adds
a geometry while the state still holds.

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


class _Watch:
    """The witnessed members of one owner: aliases sharing its version counter(s), and the
    version each had when the state last held."""

    __slots__ = ("aliases", "owner", "versions")

    def __init__(self, owner: torch.Tensor, members: Iterable[torch.Tensor]) -> None:
        self.owner = weakref.ref(owner)
        # The members of a sparse tensor come from its accessors, which return a fresh alias
        # on every call: keep those. A caller's own tensor gets a detach() alias, so that the
        # state never keeps the caller's object alive.
        self.aliases = [m if m is not owner else m.detach() for m in members]
        self.versions = [m._version for m in self.aliases]

    def unchanged(self) -> bool:
        for alias, version in zip(self.aliases, self.versions, strict=True):
            if alias._version != version:
                return False
        return True

    def rearm(self) -> None:
        self.versions = [a._version for a in self.aliases]


class IndexState:
    """What is known about one index structure; shared by every tensor built on it."""

    __slots__ = ("__weakref__", "_lock", "_watches", "key", "proven")

    def __init__(self, key: IndexKey) -> None:
        self.key = key
        self.proven: set[Hashable] = set()
        self._watches: dict[int, _Watch] = {}  # by id(owner); stale ids are pruned
        self._lock = threading.Lock()

    def _watch_of(self, owner: torch.Tensor) -> _Watch | None:
        watch = self._watches.get(id(owner))
        return watch if watch is not None and watch.owner() is owner else None

    def witness(self, owner: torch.Tensor, members: Iterable[torch.Tensor]) -> None:
        """Watch ``owner``'s members. A tensor joining a state that holds is taken at its
        current version; one joining a state that no longer holds cannot revive it."""
        with self._lock:
            if self._watch_of(owner) is not None:
                return
            if len(self._watches) >= 8:
                self._prune()
            self._watches[id(owner)] = _Watch(owner, members)

    def witnesses_owner(self, owner: torch.Tensor) -> bool:
        with self._lock:
            return self._watch_of(owner) is not None

    def witness_count(self) -> int:
        with self._lock:
            self._prune()
            return sum(len(w.aliases) for w in self._watches.values())

    def _prune(self) -> None:
        dead = [i for i, w in self._watches.items() if w.owner() is None]
        for i in dead:
            del self._watches[i]

    def _holds(self) -> bool:
        # Watches of dead owners are checked too (pruned only as the dict grows): their
        # aliases share the structure's storage, so checking them can only catch more.
        for watch in self._watches.values():
            if not watch.unchanged():
                self.proven.clear()
                return False
        return True

    def holds(self) -> bool:
        """True while no witnessed index tensor was written in place."""
        with self._lock:
            return self._holds()

    def is_proven(self, geometry: Hashable) -> bool:
        with self._lock:
            return geometry in self.proven and self._holds()

    def derive(self, geometry: Hashable) -> bool:
        """A tensor derived from checked tensors by a known op has ``geometry``: record it while
        the state holds (no re-arming: no data was read). Returns whether it holds."""
        with self._lock:
            if not self._holds():
                return False
            self.proven.add(geometry)
            return True

    def prove(self, geometry: Hashable) -> None:
        """Validation just passed for ``geometry`` on the current data."""
        with self._lock:
            if not self._holds():
                for w in self._watches.values():
                    w.rearm()
            self.proven.add(geometry)

    def retake(self, owner: torch.Tensor) -> None:
        """``owner`` wrote only values (a known-safe in-place op): re-arm its witnesses."""
        with self._lock:
            mine = self._watch_of(owner)
            others = (w for i, w in self._watches.items() if i != id(owner))
            if mine is not None and all(w.unchanged() for w in others if w.owner() is not None):
                mine.rearm()


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

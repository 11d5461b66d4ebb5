"""Checked-state tracking: which index tensors were validated together, and whether they changed.

A :class:`CheckedState` is the proof that a set of index tensors satisfies every index invariant
for one geometry (compressed/plain extents, or COO sparse sizes). It holds *witnesses*: for each
tensor object that can write the validated index storage through torch (the caller's input
tensors, the members of every tensor built on those indices), a ``detach()`` alias sharing that
tensor's version counter, and the counter's value at validation. An in-place write through any
of them bumps the counter, and the state stops holding.

Limits, the same as autograd's own in-place detection: writes that bypass torch's version
counters (``.data``, NumPy views, raw pointers) are not seen. Debug mode ignores the cache.

The cache maps an index key (data pointers, shapes, strides, dtypes, geometry) to the newest
state for it, through weak references: a state lives only as long as a tensor carries it, so the
cache never keeps tensors alive and never grows past the live tensors. Because a live state holds
aliases of its index storage, that storage cannot be freed and reused while the key is cached.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

IndexKey = tuple[Hashable, ...]


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


class CheckedState:
    """Proof that one index structure was validated; shared by every tensor built on it.

    Each tensor that can write the structure's storage adds witnesses for its members, so a
    write through any of them is seen by all tensors sharing the structure.
    """

    __slots__ = ("__weakref__", "_lock", "key", "witnesses")

    def __init__(self, key: IndexKey) -> None:
        self.key = key
        self.witnesses: list[_Witness] = []
        self._lock = threading.Lock()

    def witness(self, owner: torch.Tensor, members: Iterable[torch.Tensor]) -> None:
        """(Re-)take witnesses of ``owner``'s members at their current versions."""
        fresh = [_Witness(owner, m) for m in members]
        with self._lock:
            self.witnesses = [w for w in self.witnesses if w.owner() is not owner] + fresh

    def holds(self) -> bool:
        """True while no witnessed index tensor was written in place (prunes dead owners)."""
        with self._lock:
            live = [w for w in self.witnesses if w.alive()]
            if len(live) != len(self.witnesses):
                self.witnesses = live
            return all(w.unchanged() for w in live)


def tensor_key(t: torch.Tensor) -> Hashable:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def index_key(indices: Iterable[torch.Tensor], geometry: Hashable) -> IndexKey:
    return (*(tensor_key(t) for t in indices), geometry)


# ---------------------------------------------------------------------------------------------
# The cache of validated index structures

_cache: weakref.WeakValueDictionary[IndexKey, CheckedState] = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


def lookup(key: IndexKey) -> CheckedState | None:
    """The state proving ``key`` valid, if one is alive and still holds."""
    with _cache_lock:
        state = _cache.get(key)
    return state if state is not None and state.holds() else None


def register(state: CheckedState) -> CheckedState:
    with _cache_lock:
        _cache[state.key] = state
    return state


def cache_size() -> int:
    """Number of live cached index structures (for tests and diagnostics)."""
    with _cache_lock:
        return len(_cache)


def clear_cache() -> None:
    """Forget every cached validation: the next build validates its indices again."""
    with _cache_lock:
        _cache.clear()


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

"""Index memory and its states: what is known about one piece of index memory, found by range.

An :class:`IndexState` holds the proofs made on a piece of index memory (``(view key, geometry)``
pairs: the index tensors at that view were validated for that geometry) and one :class:`Watch`
per version counter that can write that memory. The registry finds the state of some memory by
the ranges of the storages over it (device, start, end): every storage over overlapping memory
shares one state, whatever object it is (two ``torch.from_numpy`` views of one array, a slice at
another start, ``frombuffer``, ``from_dlpack``, ``set_`` on a storage), and states that come to
overlap are merged. A storage that died or moved (``share_memory_()``) takes the proofs naming
addresses inside it with it, before another storage can be given that address.

Lookups happen when a state is made or joined (a factory call, an adoption, the first hand-out of
a member), never per operation; :mod:`safesparse.state.checked` decides what a tensor's record
needs.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "IndexKey",
    "IndexState",
    "Snapshot",
    "Span",
    "Spans",
    "Tags",
    "Watch",
    "all_states",
    "claims",
    "file_mapped",
    "foreign",
    "index_key",
    "memory_state_count",
    "must_copy",
    "overlaps_registered",
    "register",
    "resolve",
    "spans_of",
    "torch_loader",
    "unowned",
    "watchable_spans",
]

IndexKey = tuple[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]

#: Epochs of states (unique across states: a record that follows a merge never mistakes one).
_epochs = itertools.count()


def index_key(indices: Iterable[torch.Tensor]) -> IndexKey:
    """Identity of an index structure: per member, data pointer, shape, strides, dtype, device."""
    return tuple((m.data_ptr(), tuple(m.shape), m.stride(), m.dtype, m.device) for m in indices)


# ---------------------------------------------------------------------------------------------
# Watches and index states


class Watch:
    """One version counter that can write a state's index memory: an alias sharing it, the
    owner (a :class:`Record` or a plain tensor; weakly held), and the counter's value when the
    state's proofs were made."""

    __slots__ = ("alias", "owner", "version")

    def __init__(self, owner: object, alias: torch.Tensor) -> None:
        self.owner = weakref.ref(owner)
        self.alias = alias
        self.version = alias._version

    def changed(self) -> bool:
        return self.alias._version != self.version


#: A snapshot of an index state's counters, taken before validation reads the data.
Snapshot = dict[int, int]


class IndexState:
    """What is known about one piece of index memory; shared by every record whose index
    members overlap it (SPEC 4).

    ``proven`` holds ``(view key, geometry)`` pairs: the index tensors at that view (data
    pointer, shape, strides, dtype) were validated for that geometry. ``ranges`` holds the
    storages the state covers (by storage address; see :class:`_Range`); a storage that died
    or moved takes the proofs naming addresses inside it with it. ``epoch`` counts removals of
    proofs (records remember the epoch they saw their proof in). States that come to overlap
    are merged (``merged`` points to the survivor)."""

    __slots__ = ("__weakref__", "_limit", "caches", "epoch", "lock", "merged", "proven",
                 "range_limit", "ranges", "retired", "watches")

    def __init__(self) -> None:
        self.proven: set[Hashable] = set()
        #: per proof, what was derived from the index data it proves (see proof_cache)
        self.caches: dict[Hashable, dict[Hashable, Any]] = {}
        self.watches: dict[int, Watch] = {}  # by id(owner), checked against the weak owner
        self.retired: list[Watch] = []  # watches whose owner died; dropped once checked
        self.ranges: dict[int, _Range] = {}
        self.range_limit = 4
        self.merged: IndexState | None = None
        self.lock = threading.Lock()
        self.epoch = next(_epochs)
        self._limit = 8

    # -- methods with a leading underscore expect ``self.lock`` to be held --------------------

    def _all(self) -> Iterable[Watch]:
        yield from self.watches.values()
        yield from self.retired

    def _void(self) -> None:
        """Every proof (and what was derived from it) is gone."""
        if self.proven or self.caches:
            self.proven = set()
            self.caches = {}
        self.epoch = next(_epochs)

    def _holds(self) -> bool:
        for w in self._all():
            if w.alias._version != w.version:
                self._void()
                return False
        return True

    def _watch_of(self, owner: object) -> Watch | None:
        w = self.watches.get(id(owner))
        return w if w is not None and w.owner() is owner else None

    def _witness(self, owner: object, alias: torch.Tensor) -> Watch:
        i = id(owner)
        old = self.watches.get(i)
        if old is not None:
            if old.owner() is owner:
                return old
            self.retired.append(old)  # the id was reused: its owner died; keep checking it
        if len(self.watches) + len(self.retired) >= self._limit:
            self._prune()
        w = self.watches[i] = Watch(owner, alias)
        return w

    def _prune(self) -> None:
        """Retire the watches of dead owners and drop them after checking them: once its owner
        (a record, kept alive by its tensors and the members they handed out, or a caller's
        index tensor) is gone, nothing safesparse knows of writes through that counter."""
        for i in [i for i, w in self.watches.items() if w.owner() is None]:
            self.retired.append(self.watches.pop(i))
        for w in self.retired:
            if w.changed():
                self._void()  # written before it died: no proof survives it
                break
        self.retired = []
        self._limit = max(8, 2 * len(self.watches))

    def _absorb(self, other: IndexState) -> None:
        """Take over ``other``'s watches, ranges and (if they still hold) proofs; both locks
        are held."""
        if other._holds():
            self.proven |= other.proven
        else:
            self._void()  # the merged memory was written under other's watch
        for i, w in other.watches.items():
            if i in self.watches:
                self.retired.append(w)
            else:
                self.watches[i] = w
        self.retired += other.retired
        for k, rg in other.ranges.items():
            rg.state = weakref.ref(self)
            self.ranges.setdefault(k, rg)
        other.merged = self
        other.proven = set()  # a late proof on the absorbed state proves nothing here
        other.caches = {}
        other.epoch = next(_epochs)
        self._limit = max(8, 2 * (len(self.watches) + len(self.retired)))

    def _forget(self, rg: _Range) -> None:
        """The storage of ``rg`` died or moved: drop it and every proof naming an address
        inside it (another storage may be given that address)."""
        if self.ranges.get(rg.cdata) is rg:
            del self.ranges[rg.cdata]
        kept = {p for p in self.proven
                if not any(rg.start <= m[0] < rg.end for m in p[0])}  # type: ignore[index]
        if len(kept) != len(self.proven):
            self.proven = kept
            self.caches = {p: c for p, c in self.caches.items() if p in kept}
            self.epoch = next(_epochs)

    # -- public, locking ---------------------------------------------------------------------

    def witness(self, owner: object, alias: torch.Tensor) -> Watch:
        """Watch ``owner``'s counter (through ``alias``, which shares it). A counter joining is
        taken at its current value: it cannot revive proofs that stopped holding."""
        with self.lock:
            return self._witness(owner, alias)

    def holds_now(self) -> bool:
        with self.lock:
            return self._holds()

    def watching(self, owner: object) -> bool:
        """Whether ``owner``'s counter is watched here."""
        with self.lock:
            return self._watch_of(owner) is not None

    def proves_now(self, proof: Hashable) -> bool:
        """:meth:`is_proven` for a caller already holding ``self.lock``."""
        return proof in self.proven and self._holds()

    def join_proof(self, watched: Sequence[tuple[object, torch.Tensor, int]],
                   proof: Hashable | None) -> None:
        """Watch each ``(owner, alias, version)`` (a record and its member alias, a caller's
        tensor and a detached alias) and, if ``proof`` is given and every counter is at the
        version its proof was made at (a private record's proof joining this state), add
        ``proof``. ``self.lock`` is taken here."""
        with self.lock:
            ok = proof is not None
            for owner, alias, version in watched:
                w = self._witness(owner, alias)
                ok = ok and w.version == version
            if ok and self._holds():
                self.proven.add(proof)

    def counters_with(self, owner: object, snap: Snapshot) -> Snapshot:
        """``snap`` with ``owner``'s counter taken as it is now (its own write is known)."""
        with self.lock:
            mine = self._watch_of(owner)
            return snap if mine is None else {**snap, id(mine): mine.alias._version}

    def void(self) -> None:
        """Forget every proof of this state (and what was derived from them)."""
        with self.lock:
            self._void()

    def is_proven(self, proof: Hashable) -> bool:
        with self.lock:
            return proof in self.proven and self._holds()

    def snapshot(self) -> Snapshot:
        """The counters now: pass to :meth:`prove` once validation has read the data."""
        with self.lock:
            return {id(w): w.alias._version for w in self._all()}

    def moved(self, snap: Snapshot) -> bool:
        """Whether a counter of ``snap`` moved since it was taken."""
        with self.lock:
            return any(snap.get(id(w), w.version) != w.alias._version for w in self._all())

    def prove(self, proof: Hashable, snap: Snapshot) -> bool:
        """Validation passed for ``proof`` on the data as it was at ``snap``. Proven only if no
        counter moved since (a write during validation); returns whether it was."""
        with self.lock:
            for w in self._all():
                if snap.get(id(w), w.version) != w.alias._version:
                    return False
            if not self._holds():  # the proofs were void: re-arm at the validated versions
                for w in self._all():
                    w.version = w.alias._version
            self.proven.add(proof)
            return True

    def derive(self, proof: Hashable) -> bool:
        """A tensor made by a known op from checked tensors has ``proof``: record it while the
        state holds (nothing is re-armed: no data was read). Returns whether it holds."""
        with self.lock:
            if not self._holds():
                return False
            self.proven.add(proof)
            return True

    def rearm(self, owner: object, proof: Hashable) -> bool:
        """``owner`` ran an in-place op known to keep its index data valid for ``proof``: take
        its counter as it is now, if every other watch still holds."""
        with self.lock:
            mine = self._watch_of(owner)
            if mine is None or proof not in self.proven:
                return False
            for w in self._all():
                if w is not mine and w.changed():
                    self._void()
                    return False
            mine.version = mine.alias._version
            return True

    def watch_count(self) -> int:
        with self.lock:
            self._prune()
            return len(self.watches) + len(self.retired)


def resolve(state: IndexState | None) -> IndexState | None:
    """The live state a (possibly merged) state forwards to."""
    while state is not None and state.merged is not None:
        state = state.merged
    return state


# ---------------------------------------------------------------------------------------------
# The registry: states by memory range


class _Range:
    """One storage's memory in the registry: ``[start, end)`` on ``device``, a weak reference
    to the storage (alive and still at ``start``, or the entry is stale) and to its state."""

    __slots__ = ("cdata", "device", "end", "ref", "start", "state")

    def __init__(self, storage: torch.UntypedStorage, device: int | None, start: int,
                 end: int, state: IndexState) -> None:
        self.ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        self.cdata: int = self.ref.cdata
        self.device = device
        self.start = start
        self.end = end
        self.state = weakref.ref(state)

    def alive(self, live: torch.UntypedStorage | None = None) -> bool:
        """Whether the storage is alive and still at ``start`` (``live``: the storage at that
        address, if the caller has it; our weak reference keeps its control block, so its
        address is not another's while we hold it)."""
        if self.ref.expired():  # type: ignore[no-untyped-call]
            return False
        if live is not None and live._cdata == self.cdata:
            return bool(live.data_ptr() == self.start)
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        return storage is not None and storage.data_ptr() == self.start


class _Registry:
    """Ranges per device, sorted by start (``_lock`` held for every access)."""

    def __init__(self) -> None:
        self.starts: dict[int | None, list[int]] = {}
        self.items: dict[int | None, list[_Range]] = {}
        self.longest: dict[int | None, int] = {}
        self.count = 0
        self.sweep_at = 256

    def overlapping(self, device: int | None, start: int, end: int) -> list[_Range]:
        starts = self.starts.get(device)
        if not starts:
            return []
        items = self.items[device]
        lo = start - self.longest[device]
        out = []
        j = bisect.bisect_left(starts, end) - 1
        while j >= 0 and starts[j] > lo:
            if items[j].end > start:
                out.append(items[j])
            j -= 1
        return out

    def add(self, rg: _Range) -> None:
        starts = self.starts.setdefault(rg.device, [])
        items = self.items.setdefault(rg.device, [])
        i = bisect.bisect_right(starts, rg.start)
        starts.insert(i, rg.start)
        items.insert(i, rg)
        if rg.end - rg.start > self.longest.get(rg.device, 0):
            self.longest[rg.device] = rg.end - rg.start
        self.count += 1
        if self.count >= self.sweep_at:
            self.sweep()

    def remove(self, rg: _Range) -> None:
        starts, items = self.starts[rg.device], self.items[rg.device]
        i = bisect.bisect_left(starts, rg.start)
        while i < len(items) and items[i] is not rg:
            i += 1
        if i < len(items):
            del starts[i], items[i]
            self.count -= 1

    def sweep(self) -> None:
        """Drop the entries of dead states and dead or moved storages (amortised)."""
        for device in list(self.items):
            kept = []
            for rg in self.items[device]:
                state = rg.state()
                if state is not None and rg.alive():
                    kept.append(rg)
                elif state is not None:
                    with state.lock:
                        state._forget(rg)
            self.items[device] = kept
            self.starts[device] = [rg.start for rg in kept]
            self.longest[device] = max((rg.end - rg.start for rg in kept), default=0)
        self.count = sum(len(v) for v in self.items.values())
        self.sweep_at = max(256, 2 * self.count)

    def states(self) -> list[IndexState]:
        out: dict[int, IndexState] = {}
        for items in self.items.values():
            for rg in items:
                state = resolve(rg.state())
                if state is not None:
                    out[id(state)] = state
        return list(out.values())


_registry = _Registry()
_lock = threading.RLock()
#: States of index data without memory (no element anywhere): by view key.
_empty: weakref.WeakValueDictionary[IndexKey, IndexState] = weakref.WeakValueDictionary()


#: ``(device, start, end)``: the device as the storage's ``get_device()`` gives it (None: the
#: CPU; an index for an accelerator; two accelerators with one index only ever share a state,
#: never a proof: proofs name the device)
Span = tuple[int | None, int, int]
Spans = tuple[Span, ...]


def spans_of(members: Sequence[torch.Tensor]) -> tuple[Span, ...]:
    """``(device, start, end)`` of the storages with memory of ``members``."""
    out = []
    for m in members:
        span = _span(m, m.untyped_storage())
        if span is not None:
            out.append(span)
    return tuple(out)


def overlaps_registered(spans: Sequence[Span]) -> bool:
    """Whether the registry holds a live range overlapping ``spans``. Stale ones (their state
    or storage dead, or the storage moved) are dropped on the way, as the registering path
    drops them (:func:`_stale`): the memory of a storage that died is soon another's, and a
    process that keeps checked tensors while others die would otherwise send most fresh index
    memory down the registering path (the factories' straight path declined in 30-75 % of
    calls after 3,000 tensors built, a fifth kept)."""
    if not _registry.count:
        # (read without the lock: a registration racing with this call could as well come
        # right after it, and checked.py's protocol for racing first validations covers both)
        return False
    with _lock:
        for dev, start, end in spans:
            for rg in _registry.overlapping(dev, start, end):
                if not _stale(rg):
                    return True
        return False


def _stale(rg: _Range, live: torch.UntypedStorage | None = None) -> bool:
    """Whether ``rg``'s state or storage died or its storage moved (``live``: the storage at
    its address, if the caller has it; ``_lock`` held); then it is dropped from the registry
    and from its state, with every proof naming an address inside it."""
    owner = rg.state()
    if owner is not None and rg.alive(live):
        return False
    _drop(rg, owner)
    return True


def _drop(rg: _Range, owner: IndexState | None) -> None:
    """``rg`` out of the registry and of its state ``owner`` (if alive), with every proof
    naming an address inside it (``_lock`` held)."""
    _registry.remove(rg)
    if owner is not None:
        with owner.lock:
            owner._forget(rg)


def _storages(members: Sequence[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages with memory of ``members``, by storage address."""
    out: dict[int, torch.UntypedStorage] = {}
    for m in members:
        st = m.untyped_storage()
        if st.data_ptr():
            out[st._cdata] = st
    return out


def _merge(found: list[IndexState]) -> IndexState:
    """One state for ``found`` (``_lock`` held): the first absorbs the others."""
    state = found[0]
    if len(found) > 1:
        locks = sorted(found, key=id)
        for held in locks:
            held.lock.acquire()
        try:
            for other in found[1:]:
                state._absorb(other)
        finally:
            for held in locks:
                held.lock.release()
    return state


def register(members: Sequence[torch.Tensor], key: IndexKey | None = None) -> IndexState:
    """The one state of the memory of ``members``: found by memory range, created, or merged
    from the states that held overlapping memory. Index data without memory (no element) has
    a state per view ``key``."""
    storages = _storages(members)
    with _lock:
        if not storages:
            k = index_key(members) if key is None else key
            state = _empty.get(k)
            if state is None:
                state = _empty[k] = IndexState()
            return state
        found: list[IndexState] = []
        spans = []
        for cdata, st in storages.items():
            device = st.get_device()
            start = st.data_ptr()
            end = start + max(st.nbytes(), 1)
            spans.append((cdata, st, device, start, end))
            for rg in _registry.overlapping(device, start, end):
                owner = rg.state()
                if owner is not None and rg.cdata == cdata and rg.end != end:
                    # the storage was resized at the same address (``resize_(0)`` then
                    # ``resize_(n)``): new memory; no proof naming the old survives
                    _drop(rg, owner)
                elif _stale(rg, st):
                    continue
                owner = resolve(owner)
                assert owner is not None
                if all(owner is not f for f in found):
                    found.append(owner)
        state = _merge(found) if found else IndexState()
        for cdata, st, device, start, end in spans:
            old = state.ranges.get(cdata)
            if old is not None:
                if old.start == start and old.end == end and old.alive(st):
                    continue
                _drop(old, state)  # that storage moved, or died and its address was reused
            if len(state.ranges) >= state.range_limit:
                _prune_ranges(state)
            new = _Range(st, device, start, end, state)
            state.ranges[cdata] = new
            _registry.add(new)
        return state


def _prune_ranges(state: IndexState) -> None:
    """Drop ``state``'s ranges whose storage died or moved (``_lock`` held); bounded by the
    storages alive (a persistent member with a fresh other member per call does not grow it).
    The watches of dead owners go first: their aliases may be what keeps a storage alive."""
    with state.lock:
        state._prune()
    for rg in [rg for rg in state.ranges.values() if not rg.alive()]:
        _drop(rg, state)
    state.range_limit = max(4, 2 * len(state.ranges))


class Tags:
    """Values attached to tensors without touching their ``__dict__`` (which torch pickles
    with the tensor: a tag there would end up in checkpoints). Keyed by ``id``, each entry
    dropped when its tensor dies (a weak reference's callback, before the id can be reused)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def set(self, x: torch.Tensor, value: Any) -> None:
        i = id(x)
        items = self._items

        def drop(_: object, i: int = i) -> None:
            entry = items.get(i)
            if entry is not None and entry[0]() is None:
                del items[i]

        items[i] = (weakref.ref(x, drop), value)

    def get(self, x: torch.Tensor) -> Any:
        entry = self._items.get(id(x))
        if entry is None or entry[0]() is not x:
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._items)


#: Members handed out (and plain tensors from ``unwrap``) -> the record whose counter they share.
claims = Tags()


def all_states() -> list[IndexState]:
    """Every live state (with memory or without)."""
    with _lock:
        out = {id(s): s for s in _registry.states()}
        for st in _empty.values():
            live = resolve(st)
            if live is not None:
                out[id(live)] = live
    return list(out.values())


def memory_state_count() -> int:
    """Number of live states with memory (for tests and diagnostics)."""
    with _lock:
        return len(_registry.states())


def watchable_spans(members: Sequence[torch.Tensor],
                    allocated: bool = False) -> tuple[Span, ...] | None:
    """:func:`spans_of` ``members``, or None when their memory cannot be watched (an inference
    tensor, shared memory, a file mapping: see :func:`foreign`) or, with ``allocated``, is
    not torch's allocation (:func:`unowned`: the factories' fast path leaves it to the
    admission)."""
    out = []
    for m in members:
        if m.is_inference():
            return None
        st = m.untyped_storage()
        if st.resizable():
            if st.is_shared():
                return None
        elif allocated or _foreign_storage(st):
            return None
        span = _span(m, st)
        if span is not None:
            out.append(span)
    return tuple(out)


def unclaimed_spans(members: Sequence[torch.Tensor]) -> Spans | None:
    """The factories' straight path's one question about memory (:func:`safesparse.state.
    records.opening`): :func:`watchable_spans` of ``members`` (torch's own allocation), or
    None when a record claims the first (a member a checked tensor handed out: the caller asks
    :mod:`safesparse.state.checked` for its proof) or the memory cannot be watched or has
    none."""
    if claims.get(members[0]) is not None:
        return None
    return watchable_spans(members, True) or None


def _span(m: torch.Tensor, st: torch.UntypedStorage) -> Span | None:
    """The span of ``m``'s storage ``st``; None without memory."""
    start = st.data_ptr()
    if not start:
        return None
    # the tensor's get_device() (a C call) is its storage's index, -1 for the CPU (where the
    # storage's, a Python property building a device object, says None)
    d = m.get_device()
    return (None if d < 0 else d, start, start + (st.nbytes() or 1))


def _foreign_storage(st: torch.UntypedStorage) -> bool:
    """Memory another process or a file can change: shared memory, a file mapping (the
    mapping's own storage, or any storage over part of it: see :func:`file_mapped`). A
    storage torch's allocator made (resizable: one C call, the factories' hot path) is neither
    a file's nor a slice of one; only ``share_memory_()`` makes it shared."""
    if st.resizable():
        return bool(st.is_shared())
    return bool(st.is_shared() or st._get_filename() is not None or _mapped_storage(st))


def _mapped_storage(st: torch.UntypedStorage) -> bool:
    """Whether ``st``'s memory lies in a file mapping. A storage torch's allocator made is
    resizable and never mapped (one C call decides: the factories' hot path); any other one
    (a slice of ``torch.load(mmap=True)``'s mapping, safetensors' ``load_file``,
    ``from_numpy`` of a ``np.memmap``, ``frombuffer``, ``from_dlpack``) is looked up in the
    process's file mappings, once per storage allocation."""
    if st.resizable():
        return False
    start = st.data_ptr()
    if not start:
        return False
    nbytes = st.nbytes()
    cdata = st._cdata
    hit = _mapped_seen.get(cdata)
    if hit is not None and hit[1] == start and hit[2] == nbytes and not hit[0].expired():
        return hit[3]
    out = _in_file_mapping(start, start + max(nbytes, 1))
    if len(_mapped_seen) >= _MAPPED_MAX:
        for k in [k for k, v in _mapped_seen.items() if v[0].expired()]:
            del _mapped_seen[k]
        if len(_mapped_seen) >= _MAPPED_MAX:
            _mapped_seen.clear()
    _mapped_seen[cdata] = (StorageWeakRef(st), start, nbytes, out)  # type: ignore[no-untyped-call]
    return out


#: storage address -> (weak reference, data pointer, nbytes, in a file mapping): a storage
#: allocation's answer (an entry counts only while its storage lives at that pointer and size)
_mapped_seen: dict[int, tuple[Any, int, int, bool]] = {}
_MAPPED_MAX = 1024


def _in_file_mapping(start: int, end: int) -> bool:
    """Whether ``[start, end)`` overlaps a mapping backed by a file (``/proc/self/map_files``
    lists exactly those, shared anonymous memory included; ``/proc/self/maps`` where that
    cannot be listed). Without either (not Linux) every memory torch did not allocate counts
    as mapped: validated whenever asked, never trusted from a cache."""
    try:
        names = os.listdir("/proc/self/map_files")
    except OSError:
        names = None
    if names is not None:
        for name in names:
            lo, _, hi = name.partition("-")
            if int(lo, 16) < end and start < int(hi, 16):
                return True
        return False
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return True
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) >= 5 and parts[4] != b"0":  # an inode: a file (or shared memory)
            low, _, high = parts[0].partition(b"-")
            if int(low, 16) < end and start < int(high, 16):
                return True
    return False


def file_mapped(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether the memory of one of ``tensors`` lies in a file mapping (not shared memory a
    process set up: :func:`foreign` says that): where safesparse takes such index members it
    works on its own copy of them (SPEC 4)."""
    for x in tensors:
        st = x.untyped_storage()
        if not st.is_shared() and _mapped_storage(st):
            return True
    return False


def unowned(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether the memory of one of ``tensors`` is not torch's own allocation and not shared
    memory a process set up (:func:`foreign` says that): a file mapping, or memory another
    owner can write without moving any counter (``torch.frombuffer`` over a ``bytearray`` or
    an ``mmap``, ``torch.from_numpy``, DLPack imports, a program's constants loaded with
    ``torch.export.load``). One C call per member on the hot path (torch's allocations are
    resizable). Where safesparse admits such index members it works on its own copy of them
    (SPEC 4, docs/ops.md)."""
    for x in tensors:
        st = x.untyped_storage()
        if not st.resizable() and not st.is_shared() and st.data_ptr():
            return True
    return False


_loader = threading.local()


@contextlib.contextmanager
def torch_loader() -> Iterator[None]:
    """While this block runs (in this thread), storages that are not torch's allocation are
    taken to be torch's own loader's (``torch.load``'s zip reader: only the loaded objects
    reach them): index members on them are admitted in place (:func:`must_copy`). For
    :func:`safesparse.load`, which copies members that alias other loaded tensors itself;
    file mappings are copied all the same."""
    depth = getattr(_loader, "depth", 0)
    _loader.depth = depth + 1
    try:
        yield
    finally:
        _loader.depth = depth


def must_copy(members: Sequence[torch.Tensor]) -> bool:
    """Whether index ``members`` are admitted on a copy: memory torch did not allocate
    (:func:`unowned`; inside :func:`torch_loader`, file mappings only)."""
    if not unowned(members):
        return False
    return not getattr(_loader, "depth", 0) or file_mapped(members)


def _foreign(m: torch.Tensor) -> bool:
    return _foreign_storage(m.untyped_storage())


def foreign(tensors: Iterable[torch.Tensor]) -> bool:
    return any(x.is_inference() or _foreign(x) for x in tensors)

"""Checked state: the one module that decides whether a tensor counts as checked.

When is a tensor checked
------------------------
A SafeSparseTensor is checked when validation has passed on its current index data, or when an
operation known to keep index data (a view or a copy of it) made it from tensors that were
checked before and after the operation ran. It stops being checked as soon as any tensor that
can write that index data (every tensor built on it, the index tensors it was built from, the
members it handed out) writes it in place, unless the write is one known to keep it valid.
Index data this process cannot watch (inference tensors, storage shared with other processes)
is never remembered: it is validated again whenever its state is asked for.

How it is remembered
--------------------
Each SafeSparseTensor carries one :class:`Record` (attribute ``_ss``). Records of tensors whose
index members live on the same *storage* (any view, shape or direction: a batch and one of its
samples, an edge list and its prefix) share one :class:`IndexState`, found through a weak cache
keyed by storage; states that come to share a storage are merged. The state holds

* the proofs: for a *view* of its index data (data pointer, shape, strides, dtype and device of
  each member), the *geometries* (compressed/plain extents, or COO sparse sizes and coalesced
  flag) that validation has proven for the current data, and
* one :class:`Watch` per tensor object that can write the structure: an alias sharing that
  object's version counter, and the counter's value when the proofs were made. torch bumps the
  counter on every in-place write, through the object or anything sharing its counter (the
  members a sparse tensor hands out share its counter; so do views of them).

A moved counter voids every proof of the state, for every tensor on its storages. A watch is only
dropped once its owner and every member it handed out are gone, and only after it was checked:
a write through a tensor that has died since is still seen. Proofs are made from a snapshot of
the counters taken *before* validation read the data, so a write landing during validation is
never blessed.

Limits: writes through objects safesparse never saw or handed out bypass the counters (``.data``
of a member, NumPy views, ``detach()`` of a handed-out member once the member itself is gone,
a plain tensor built elsewhere on the same storage). Debug mode ignores all of this and
validates every input and result.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.multiprocessing.reductions import StorageWeakRef

from .metadata import compressed_members, members

__all__ = [
    "IndexKey",
    "IndexState",
    "Record",
    "Snapshot",
    "Stats",
    "cache_size",
    "clear_cache",
    "count",
    "geometry_of",
    "index_key",
    "index_members",
    "proof_cache",
    "reset_stats",
    "stats",
]

IndexKey = tuple[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]


# ---------------------------------------------------------------------------------------------
# Members, keys and geometries of sparse tensors


def index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index tensors of a sparse tensor (compressed + plain, or the COO indices)."""
    with DisableTorchFunctionSubclass():
        return members(t)[:-1]


def index_key(indices: Iterable[torch.Tensor]) -> IndexKey:
    """Identity of an index structure: per member, data pointer, shape, strides, dtype, device."""
    return tuple((m.data_ptr(), tuple(m.shape), m.stride(), m.dtype, m.device) for m in indices)


def compressed_geometry(n_compressed: int, n_plain: int) -> Hashable:
    return ("compressed", n_compressed, n_plain)


def coo_geometry(sparse_size: Sequence[int], coalesced: bool) -> Hashable:
    return ("coo", tuple(sparse_size), bool(coalesced))


def geometry_of(t: torch.Tensor) -> Hashable:
    """What, beyond the index tensors themselves, their validity depends on."""
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            return coo_geometry(t.shape[: t.sparse_dim()], t.is_coalesced())
        compressed, _ = compressed_members(t)
        m = compressed.dim() - 1
        blocked = t.layout in (torch.sparse_bsr, torch.sparse_bsc)
        vshape = t.values().shape
        b0, b1 = (vshape[m + 1], vshape[m + 2]) if blocked else (1, 1)
        rows, cols = t.shape[m], t.shape[m + 1]
        row_compressed = t.layout in (torch.sparse_csr, torch.sparse_bsr)
        extent, block = (cols, b1) if row_compressed else (rows, b0)
        return compressed_geometry(compressed.shape[-1] - 1, extent // block if block else 0)


# ---------------------------------------------------------------------------------------------
# Watches and index states


class Watch:
    """One tensor object that can write an index structure: an alias sharing its version
    counter, the counter's value when the state's proofs were made, and weak references to
    the members it handed out (which share its counter and may outlive it)."""

    __slots__ = ("alias", "handed", "owner", "version")

    def __init__(self, owner: torch.Tensor, alias: torch.Tensor) -> None:
        self.owner = weakref.ref(owner)
        self.alias = alias
        self.version = alias._version
        self.handed: list[weakref.ref[torch.Tensor]] = []

    def changed(self) -> bool:
        return self.alias._version != self.version

    def gone(self) -> bool:
        """Nothing but our own alias can write through this counter any more."""
        return self.owner() is None and all(h() is None for h in self.handed)

    def hand_out(self, member: torch.Tensor) -> None:
        if len(self.handed) >= 16:
            self.handed = [h for h in self.handed if h() is not None]
        self.handed.append(weakref.ref(member))


#: A snapshot of an index state's counters, taken before validation reads the data.
Snapshot = dict[int, int]


class IndexState:
    """What is known about the index data on one set of storages; shared by every tensor
    whose index members live on any of them (any view, any shape: SPEC 4).

    ``proven`` holds ``(view key, geometry)`` pairs: the index tensors at that view (data
    pointer, shape, strides, dtype) were validated for that geometry. ``storages`` holds a
    weak reference and the size of each storage: a storage that died or moved
    (``share_memory_()``) takes the proofs naming its addresses with it, before another
    storage can be taken for it at that address. States that come to share a storage are
    merged (``merged`` points to the survivor)."""

    __slots__ = ("__weakref__", "_limit", "caches", "lock", "merged", "proven", "retired",
                 "storages", "watches")

    def __init__(self) -> None:
        self.proven: set[Hashable] = set()
        #: per proof, what was derived from the index data it proves (see proof_cache);
        #: dropped with the proof
        self.caches: dict[Hashable, dict[Hashable, Any]] = {}
        self.watches: dict[int, Watch] = {}  # by id(owner), checked against the weak owner
        self.retired: list[Watch] = []  # watches whose owner died; dropped once gone
        self.storages: dict[StorageKey, tuple[StorageWeakRef, int]] = {}
        self.merged: IndexState | None = None
        self.lock = threading.Lock()
        self._limit = 8

    # -- all methods below with a leading underscore expect ``self.lock`` to be held --------

    def _all(self) -> Iterable[Watch]:
        yield from self.watches.values()
        yield from self.retired

    def _void(self) -> None:
        """Every proof (and what was derived from it) is gone."""
        self.proven.clear()
        self.caches.clear()

    def _holds(self) -> bool:
        for w in self.watches.values():
            if w.alias._version != w.version:
                self._void()
                return False
        for w in self.retired:
            if w.alias._version != w.version:
                self._void()
                return False
        return True

    def _watch_of(self, owner: torch.Tensor) -> Watch | None:
        w = self.watches.get(id(owner))
        return w if w is not None and w.owner() is owner else None

    def _witness(self, owner: torch.Tensor, alias: torch.Tensor) -> Watch:
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
        """Retire the watches of dead owners and drop the gone ones, after checking them."""
        for i in [i for i, w in self.watches.items() if w.owner() is None]:
            self.retired.append(self.watches.pop(i))
        keep = []
        for w in self.retired:
            if w.changed():
                self._void()  # written before it died: no proof survives it
            if not w.gone():
                keep.append(w)  # a member it handed out can still write through its counter
        self.retired = keep
        self._limit = max(8, 2 * (len(self.watches) + len(self.retired)))

    def _absorb(self, other: IndexState) -> None:
        """Take over ``other``'s watches, storages and (if they still hold) proofs; both
        locks are held."""
        if other._holds():
            self.proven |= other.proven
        for i, w in other.watches.items():
            if i in self.watches:
                self.retired.append(w)
            else:
                self.watches[i] = w
        self.retired += other.retired
        self.storages.update(other.storages)
        other.merged = self
        other.proven = set()  # a late proof on the absorbed state proves nothing here
        other.caches = {}
        self._limit = max(8, 2 * (len(self.watches) + len(self.retired)))

    # -- public, locking ---------------------------------------------------------------------

    def witness(self, owner: torch.Tensor, alias: torch.Tensor) -> Watch:
        """Watch ``owner`` (through ``alias``, which shares its version counter). A tensor
        joining is taken at its current version: it cannot revive a state that stopped
        holding, since that state has no proofs left."""
        with self.lock:
            return self._witness(owner, alias)

    def holds(self) -> bool:
        """True while no watched tensor was written in place since the proofs were made."""
        with self.lock:
            return self._holds()

    def is_proven(self, proof: Hashable) -> bool:
        with self.lock:
            return proof in self.proven and self._holds()

    def snapshot(self) -> Snapshot:
        """The counters now: pass to :meth:`prove` once validation has read the data."""
        with self.lock:
            return {id(w): w.alias._version for w in self._all()}

    def prove(self, proof: Hashable, snap: Snapshot) -> bool:
        """Validation passed for ``proof`` (view key, geometry) on the data as it was at
        ``snap``. Proven only if no counter moved since (a write during validation); returns
        whether it was."""
        with self.lock:
            for w in self._all():
                now = w.alias._version
                if snap.get(id(w), w.version) != now:
                    return False
            if not self._holds():  # the proofs were void: re-arm at the validated versions
                for w in self._all():
                    w.version = w.alias._version
            self.proven.add(proof)
            return True

    def derive(self, proof: Hashable) -> bool:
        """A tensor made by a known op from checked tensors has ``proof``: record it while
        the state holds (nothing is re-armed: no data was read). Returns whether it holds."""
        with self.lock:
            if not self._holds():
                return False
            self.proven.add(proof)
            return True

    def rearm(self, owner: torch.Tensor, proof: Hashable) -> bool:
        """``owner`` ran an in-place op known to keep its index data valid for ``proof``:
        take its counter as it is now, if every other watch still holds."""
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

    def hand_out(self, owner: torch.Tensor, member: torch.Tensor) -> None:
        """``owner`` handed ``member`` (sharing its counter) to the user: keep watching
        ``owner``'s counter while ``member`` lives, even after ``owner`` dies."""
        with self.lock:
            w = self._watch_of(owner)
            if w is None:
                return
            w.hand_out(member)
        member._ss_state = self  # type: ignore[attr-defined]  # see knows()

    def _fresh(self, k: StorageKey, live: torch.UntypedStorage | None = None) -> bool:
        """Whether the storage keyed ``k`` is alive and still at that address. ``live``: the
        storage now at that address, if the caller has it (then: whether it is that one; our
        weak reference keeps its control block, so its address is not another's)."""
        entry = self.storages.get(k)
        if entry is None or entry[0].expired():  # type: ignore[no-untyped-call]
            return False
        if live is not None:
            return bool(entry[0].cdata == live._cdata)
        storage = torch.UntypedStorage._new_with_weak_ptr(entry[0].cdata)
        return storage is not None and storage.data_ptr() == k[1]

    def _forget(self, k: StorageKey) -> None:
        """The storage keyed ``k`` died or moved: drop it and every proof naming an address
        inside it (another storage may be given that address)."""
        entry = self.storages.pop(k, None)
        start = k[1]
        end = start + (entry[1] if entry is not None else 1)
        self.proven = {p for p in self.proven
                       if not any(start <= m[0] < end for m in p[0])}  # type: ignore[index]
        self.caches = {p: c for p, c in self.caches.items() if p in self.proven}

    def _prune_storages(self) -> list[StorageKey]:
        """Forget the storages that died or moved; returns their keys."""
        gone = [k for k in self.storages if not self._fresh(k)]
        for k in gone:
            self._forget(k)
        return gone

    def knows(self, x: torch.Tensor) -> bool:
        """Whether writes through the plain tensor ``x`` are seen here: it is a watched owner,
        or a member handed out by one (sharing that owner's counter)."""
        if resolve(x.__dict__.get("_ss_state")) is self:
            return True
        with self.lock:
            return self._watch_of(x) is not None

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
# Records: the checked state of one tensor


class Record:
    """The checked state of one SafeSparseTensor.

    ``state`` is the shared state of its index storages (None for volatile tensors; read it
    through :func:`state_of`, which follows merges); ``members`` its index members when it
    joined, ``ptrs`` their data pointers then (storage moved since, e.g. by
    ``share_memory_()``, makes it unchecked) and ``key`` their view key; ``geometry`` what it
    was proven for when ``trusted`` (validated, or derived by a known op). ``volatile``
    tensors (inference tensors, shared memory) are validated whenever their state is asked for.
    """

    __slots__ = ("geometry", "key", "members", "ptrs", "state", "trusted", "volatile")

    def __init__(self, state: IndexState | None, members: Sequence[torch.Tensor],
                 ptrs: tuple[int, ...], volatile: bool, key: IndexKey = ()) -> None:
        self.state = state
        self.members = tuple(members)
        self.ptrs = ptrs
        self.key = key
        self.volatile = volatile
        self.trusted = False
        self.geometry: Hashable = None

    def unmoved(self) -> bool:
        """Whether the member storage is still where it was when this record joined."""
        return tuple(m.data_ptr() for m in self.members) == self.ptrs

    def proof(self) -> Hashable:
        return (self.key, self.geometry)


def state_of(rec: Record) -> IndexState | None:
    """``rec``'s state, following merges (and remembering the survivor)."""
    state = rec.state
    if state is not None and state.merged is not None:
        state = rec.state = resolve(state)
    return state


#: Storage identity: device and the storage's data pointer.
StorageKey = tuple[torch.device, int]

_cache: weakref.WeakValueDictionary[StorageKey, IndexState] = weakref.WeakValueDictionary()
_cache_lock = threading.Lock()


def storage_keys(members: Iterable[torch.Tensor]) -> dict[StorageKey, torch.UntypedStorage]:
    """The storages of ``members`` by key (storages without data are left out)."""
    out: dict[StorageKey, torch.UntypedStorage] = {}
    for m in members:
        st = m.untyped_storage()
        ptr = st.data_ptr()
        if ptr:
            out[(m.device, ptr)] = st
    return out


def _find(keys: dict[StorageKey, torch.UntypedStorage]) -> list[IndexState]:
    """The distinct live states on these storages (``_cache_lock`` held). A state whose
    storage at a key died or moved away (the address may now be another storage's) forgets
    it, and the proofs naming it, and is not the state for that key any more."""
    found: list[IndexState] = []
    for k, live in keys.items():
        state = resolve(_cache.get(k))
        if state is None:
            continue
        with state.lock:
            fresh = state._fresh(k, live)
            if not fresh:
                state._forget(k)
        if not fresh:
            del _cache[k]
            continue
        if all(state is not f for f in found):
            found.append(state)
    return found


#: States of index data without storage (no element anywhere): by view key.
_empty: weakref.WeakValueDictionary[IndexKey, IndexState] = weakref.WeakValueDictionary()


def lookup(members: Sequence[torch.Tensor]) -> IndexState | None:
    """The live state holding every one of these index tensors' storages, if any (nothing is
    created or merged)."""
    keys = storage_keys(members)
    if not keys:
        return _empty.get(index_key(members))
    with _cache_lock:
        found = _find(keys)
        if len(found) != 1 or any(k not in found[0].storages for k in keys):
            return None
        return found[0]


def _state_for(storages: dict[StorageKey, torch.UntypedStorage], key: IndexKey) -> IndexState:
    """The one state for these storages: found, created, or merged from the states that
    held some of them (SPEC 4: one state per storage). Index data without storage (no
    element) has a state per view ``key``."""
    with _cache_lock:
        if not storages:
            state = _empty.get(key)
            if state is None:
                state = _empty[key] = IndexState()
            return state
        found = _find(storages)
        if not found:
            state = IndexState()
        else:
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
                for k in state.storages:
                    _cache[k] = state
        new = [k for k in storages if k not in state.storages]
        if new:
            with state.lock:
                for k in state._prune_storages():  # bounded by the storages alive
                    if resolve(_cache.get(k)) is state:
                        del _cache[k]
                for k in new:
                    storage = storages[k]
                    state.storages[k] = (StorageWeakRef(storage),  # type: ignore[no-untyped-call]
                                         storage.nbytes())
            for k in new:
                _cache[k] = state
        return state


def _shared(members: Sequence[torch.Tensor]) -> bool:
    """Whether any member's storage is shared with other processes."""
    return any(m.untyped_storage().is_shared() for m in members)


def join(t: torch.Tensor, members: Sequence[torch.Tensor] | None = None,
         key: IndexKey | None = None, *, unshared: bool = False) -> Record:
    """Give ``t`` (a fresh wrapper) a record, joined to the state of its index storages and
    watched there. ``key``: the view key, if the caller has it (reused while the pointers
    match).

    Storage shared with other processes, and inference tensors, get a volatile record (no
    state). ``unshared``: the caller knows the storage is not shared (an op's result from
    inputs checked just now)."""
    with DisableTorchFunctionSubclass():
        if members is None:
            members = index_members(t)
        ptrs = tuple(m.data_ptr() for m in members)
        if t.is_inference() or (not unshared and _shared(members)):
            rec = Record(None, members, ptrs, True)
        else:
            if key is None or ptrs != tuple(k[0] for k in key):
                key = index_key(members)
            state = _state_for(storage_keys(members), key)
            state.witness(t, members[0] if members else t)
            rec = Record(state, members, ptrs, False, key)
    t._ss = rec  # type: ignore[attr-defined]
    return rec


def record(t: torch.Tensor) -> Record | None:
    rec: Record | None = t.__dict__.get("_ss")
    return rec


def current_record(t: torch.Tensor) -> Record:
    """``t``'s record, re-joined if its members were replaced or moved since it joined."""
    rec = record(t)
    with DisableTorchFunctionSubclass():
        members = index_members(t)
        if rec is None or rec.ptrs != tuple(m.data_ptr() for m in members):
            rec = join(t, members)
    return rec


# -- the rule -----------------------------------------------------------------------------


def is_checked(t: torch.Tensor,
               revalidate: Callable[[torch.Tensor], bool] | None = None) -> bool:
    """The rule of the module docstring. ``revalidate(t)`` answers for volatile tensors (a
    full validation); without it they count as unchecked."""
    rec = record(t)
    if rec is None or not rec.trusted:
        return False
    if rec.volatile:
        return revalidate is not None and revalidate(t)
    state = state_of(rec)
    assert state is not None
    return rec.unmoved() and state.is_proven((rec.key, rec.geometry))


def proof_cache(t: torch.Tensor) -> dict[Hashable, Any] | None:
    """A dict for what is derived from ``t``'s index data alone (e.g. a regrouped block
    structure), tied to the proof that makes ``t`` checked: every tensor on the same proven
    index data (same view, same geometry) gets the same dict, and it is dropped with the
    proof (any write through anything that can write that data, a storage that died or
    moved, :func:`clear_cache`), so a later call gets a new, empty one. None when ``t`` is
    not checked now, or its index data cannot be watched (volatile): compute afresh then.

    Only what depends on the index data and the geometry may be cached (never values)."""
    rec = record(t)
    if rec is None or not rec.trusted or rec.volatile or not rec.unmoved():
        return None
    state = state_of(rec)
    if state is None:
        return None
    proof = (rec.key, rec.geometry)
    with state.lock:
        if proof not in state.proven or not state._holds():
            return None
        cache = state.caches.get(proof)
        if cache is None:
            cache = state.caches[proof] = {}
        return cache


def is_proven(rec: Record, geometry: Hashable) -> bool:
    """Whether ``rec``'s index data (its view) is proven for ``geometry`` now."""
    state = state_of(rec)
    return state is not None and state.is_proven((rec.key, geometry))


def same_index_data(a: Record, b: Record) -> bool:
    """Both records are on one view of one state's storage, with the same geometry."""
    sa = state_of(a)
    return (sa is not None and sa is state_of(b) and a.key == b.key
            and a.geometry == b.geometry)


def snapshot(t: torch.Tensor) -> Snapshot:
    """Counters of ``t``'s state before validation reads its data (see :meth:`IndexState.prove`)."""
    state = state_of(current_record(t))
    return state.snapshot() if state is not None else {}


def mark_validated(t: torch.Tensor, geometry: Hashable, snap: Snapshot) -> bool:
    """Validation passed on ``t``'s data as it was at ``snap``: record ``t`` as checked.
    Returns False (``t`` stays unchecked) if a watched counter moved meanwhile."""
    rec = current_record(t)
    state = state_of(rec)
    ok = True if state is None else state.prove((rec.key, geometry), snap)
    rec.trusted = ok
    rec.geometry = geometry
    return ok


def mark_derived(t: torch.Tensor, geometry: Hashable, rec: Record | None = None) -> bool:
    """``t`` was made by a known op from tensors checked before and after it ran, and has
    ``geometry``: checked without validation, while its state holds. ``rec``: ``t``'s record,
    if it was just joined."""
    if rec is None:
        rec = current_record(t)
    state = state_of(rec)
    ok = True if state is None else state.derive((rec.key, geometry))
    rec.trusted = ok
    rec.geometry = geometry
    return ok


def mark_copied(t: torch.Tensor, geometry: Hashable, snap: Snapshot) -> bool:
    """``t`` was just overwritten in place (``copy_``) with index data known valid for
    ``geometry``; ``snap`` was taken before the write. Proven if no *other* counter moved."""
    rec = current_record(t)
    state = state_of(rec)
    if state is None:
        rec.trusted, rec.geometry = True, geometry
        return True
    with state.lock:
        mine = state._watch_of(t)
        if mine is not None:
            snap = {**snap, id(mine): mine.alias._version}
    ok = state.prove((rec.key, geometry), snap)
    rec.trusted = ok
    rec.geometry = geometry
    return ok


def mark_known(rec: Record, geometry: Hashable) -> bool:
    """The tensor of ``rec`` (just built and joined) is on index tensors whose state proved
    ``geometry`` (a cache hit). Returns False if the state stopped proving it meanwhile."""
    ok = is_proven(rec, geometry)
    rec.trusted = ok
    rec.geometry = geometry
    return ok


def mark_unchecked(t: torch.Tensor) -> None:
    rec = record(t)
    if rec is not None:
        rec.trusted = False


def after_inplace(t: torch.Tensor, keeps_indices: bool) -> None:
    """``t`` ran an in-place op. One known to keep index data valid re-arms ``t``'s own watch
    (if everything else still holds); any other makes ``t`` unchecked (its shared state stops
    holding by itself if the op wrote index data)."""
    rec = record(t)
    if rec is None:
        return
    if not keeps_indices or not rec.trusted:
        rec.trusted = False
        return
    if rec.volatile:
        return
    fresh = current_record(t)
    state = state_of(fresh)
    if fresh is not rec or state is None or not state.rearm(t, rec.proof()):
        fresh.trusted = False


def hand_out(t: torch.Tensor, member: torch.Tensor) -> None:
    """``t`` handed out ``member`` (an index member alias sharing its counter)."""
    rec = record(t)
    state = state_of(rec) if rec is not None else None
    if state is not None:
        state.hand_out(t, member)


def watch(t: torch.Tensor, owner: torch.Tensor) -> None:
    """``owner`` (a plain tensor: an index tensor ``t`` was built from, or the plain sparse
    tensor ``t`` wraps) can write ``t``'s index data: watch it too."""
    rec = record(t)
    if rec is None or owner is t:
        return
    state = state_of(rec)
    if state is None:
        return
    if owner.is_inference():  # no counter to watch: t can only be validated when asked
        rec.state, rec.volatile = None, True
        return
    if resolve(owner.__dict__.get("_ss_state")) is state:
        return  # a member this state handed out: its owner's watch covers its counter
    if owner.layout == torch.strided:
        alias = owner.detach()
    else:
        members = index_members(owner)
        alias = members[0] if members else owner
    state.witness(owner, alias)


def shares_index_data(rec: Record, x: torch.Tensor) -> bool:
    """Whether the plain tensor ``x`` is one of the index members' storage of ``rec``."""
    return x.numel() > 0 and x.data_ptr() in rec.ptrs


def cache_size() -> int:
    """Number of live index states (for tests and diagnostics)."""
    with _cache_lock:
        return len({id(resolve(st)) for st in _cache.values()})


def clear_cache() -> None:
    """Forget every validation proof: the next build or ``validate`` checks its indices again.

    Tensors that were checked become unchecked until validated again (``ss.is_checked`` is
    ``False`` for them). Useful in tests and benchmarks; normal code never needs it, since
    in-place writes to index data already drop the checked state.
    """
    with _cache_lock:
        states = {id(s): s for s in (resolve(st) for st in _cache.values()) if s is not None}
    for state in states.values():
        with state.lock:
            state._void()


# ---------------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True)
class Stats:
    """Counters since the last :func:`reset_stats`, as returned by :func:`stats` (frozen).

    Attributes:
        validations: full O(nnz) index validations run.
        skipped: index validations avoided because the index data was known valid (a rebuild
            on checked indices, ``validate`` of a checked tensor).
    """

    validations: int = 0
    skipped: int = 0


_stats_lock = threading.Lock()
_counts = {"validations": 0, "skipped": 0}


def count(field: str) -> None:
    with _stats_lock:
        _counts[field] += 1


def stats() -> Stats:
    """Counters of index validations since the last :func:`reset_stats` (all threads).

    Shows whether the checked-state cache works for your code, e.g. that rebuilding a tensor
    with new values in a training loop skips the O(nnz) index check::

        ss.reset_stats()
        for _ in range(10):
            w = ss.sparse_csr_tensor(p.crow_indices(), p.col_indices(), values, p.shape)
        assert ss.stats().skipped == 10 and ss.stats().validations == 0

    Returns:
        A frozen :class:`Stats` snapshot: ``validations`` (full index validations run) and
        ``skipped`` (validations avoided because the index data was known valid).
    """
    with _stats_lock:
        return Stats(**_counts)


def reset_stats() -> None:
    """Set the :func:`stats` counters (``validations``, ``skipped``) back to zero.

    Process-wide, for every thread. The counters are diagnostics only: resetting them changes
    no checked state and clears no cache (that is :func:`clear_cache`).
    """
    with _stats_lock:
        for k in _counts:
            _counts[k] = 0

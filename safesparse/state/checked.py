"""Checked state: the one module that decides whether a tensor counts as checked.

(The records and the rule itself, :func:`proves` / :func:`holds`, are in :mod:`.records`, whose
names this module re-exports; the factories' admission protocol is in :mod:`.admission`.)

When is a tensor checked
------------------------
A SafeSparseTensor is checked when validation has passed on its current index data, or when an
operation known to keep index data (a view or a copy of it) made it from tensors that were
checked before and after the operation ran. It stops being checked as soon as anything that can
write that index memory writes it in place (every tensor built or adopted on overlapping memory,
the index tensors it was built from, the members it handed out), unless the write is one known
to keep it valid. Index memory this process cannot watch (inference tensors, storage shared
with other processes, file mappings and every slice of one: :func:`memory.file_mapped`) is never
remembered: it is validated whenever asked, and the factories and ``ss.validate`` given members
in a file mapping work on their own copy of them.

How it is remembered
--------------------
torch bumps a tensor's *version counter* on every in-place write through it or anything sharing
that counter (its views, ``detach()``, and, for a sparse tensor, the members its accessors hand
out). Each SafeSparseTensor carries a :class:`Record` (``t._ss``): aliases of its index members
(``m0``, ``m1``, sharing its counter), their data pointers, the counter value its proof holds for
(``ver``), and the proven geometry. There are three kinds:

* **sole** (``state is None``): only this record's counter can write the index memory. Checked
  means ``m0._version == ver`` and the member pointers unmoved: two attribute reads, no lock,
  nothing registered.
* **private** (``state is None``, ``extra`` set): also the caller's index tensors can write it
  (a factory's result on fresh index memory); their counters are checked too, still without a
  state (shortcut 5).
* **shared** (``state`` an :class:`IndexState`): other counters can write the memory too.
  Checked additionally means the state still holds the proof ``(view key, geometry)`` and no
  counter it watches moved.

An :class:`IndexState` belongs to index *memory*: it is found by the memory range of the
storages of the index members (device, start, end), so every storage over overlapping memory
shares one state, whatever object it is (a batch and one sample, an edge list and its prefix,
two ``torch.from_numpy`` views of one array, ``frombuffer``, ``from_dlpack``, ``set_`` on a
storage). States that come to overlap are merged. A state watches one counter per
:class:`Watch`: an alias sharing the counter, and its value when the proofs were made. A moved
counter voids every proof of the state. The range lookup happens when a state is created or
joined (a factory call, an adoption, the first hand-out of a member), never per operation.

The shortcuts, and why each is sound
------------------------------------
1. *Fresh results are born sole* (``A * 2``, ``.to(dtype)``, ``clone``, values-only ops: see
   :mod:`safesparse.tensor.fastpath`). These ops either reuse the input's index tensors whole
   or copy them; the result's member pointers are compared with the input's, and only a result whose
   index memory torch allocated inside the op gets a sole record. Nothing else can reach that
   memory: the only routes to it are the result's accessors, which share its counter. The
   result counts as checked only if the input was checked before the op (the guard) and after
   it (a write landing while torch copied the data is never blessed).
2. *A sole record becomes shared (:func:`share`) before anything that could give its memory a
   second counter leaves safesparse*: a member handed out (``crow_indices()``, ``_indices()``,
   their ``torch.ops.aten`` overloads), :func:`safesparse.unwrap`, any operation of the general
   path (whose implementation may build a tensor with its own counter on the input's memory),
   a factory call on its members. The watch on a record's counter is owned by the record, which
   every tensor carrying it and every member it handed out keeps alive, so the counter is
   watched while anything can write through it.
3. *Views share their input's record object* (``.mT``, ``.t()``, sparse-dim ``transpose`` of a
   non-hybrid compressed tensor, ``detach()``): torch gives them the input's counter and index
   memory, and a transpose of the sparse dims keeps ``(n_compressed, n_plain)``, so the proof
   is literally the same statement. A tensor whose members are replaced in place (``set_``,
   ``t.data = ...``, in-place ops torch implements by swapping members) gets a *new* record
   (:func:`renew`); a record object is never repointed at other memory.
4. *Rebuilds on handed-out members* (``ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(),
   v, t.shape)``): a member carries ``(record, id(member))``; a factory call whose two members
   carry the same record, at that record's data pointers, shapes and strides, with the same
   geometry, while the record is checked, is proven through it (no storage lookup, no O(nnz)
   check). A copy of a member (``copy.copy``: its own counter) carries the dict but not the id:
   its claim is refused.
5. *First validations are private until their memory is looked up* (a factory call on index
   memory no state or pending record covers; :mod:`.admission`): the result's record watches its own
   counter and the caller's index tensors (``extra``) without a state, and is listed as
   *pending* with the memory ranges of its members. Every registry lookup first shares the
   pending records overlapping the memory it looks up (see the section on private records), so
   a later build or adoption on that memory finds their counters exactly as if they had been
   registered at birth; and every route by which a private record's own counter can write its
   memory (a hand-out, unwrap, the general path) shares it first. A pending record holds its
   members, so its memory cannot be freed and reused while it is listed. It is listed *before*
   the call looks for states and other pending records, and a registration looks at the list
   after inserting its ranges, so calls racing on one memory in two threads always meet (see
   the section on private records: :func:`announce`, :func:`settle`).
6. *Lock-free reads of a shared state.* Each read is atomic under the GIL, and a proof is only
   added under the lock with every watch at its recorded version, so seeing the proof with
   every version unmoved means it holds. A state whose watch dicts change during the read is
   read again under the lock.

When in doubt the sound path runs: anything the fast path does not recognise goes through the
general path (the guard over every sparse argument, results joined by memory range).

The questions other modules ask (none reads a record's fields)
------------------------------------------------------------------
*Does a proof hold?* :func:`proves` (the rule, for given members and geometries), :func:`holds`
(for a record's own tensors), :func:`vouch` (members a checked tensor handed out: a rebuild),
:func:`confirm` (model code's operators), :func:`known` (a state already proves a view),
:func:`proven_members` (what a proven rebuild builds on).
*What is proven?* :func:`proven_geometry`, :func:`is_volatile`, :func:`proof_cache`,
:func:`members_cache`, :func:`record_cache`.
*Admit index members (factories):* :mod:`safesparse.state.admission` (``admit``), which writes
the protocols of shortcuts 4 and 5 and the registering path once, on the functions below.
*Record a proof or a tensor:* :func:`announce` / :func:`settle` (a first validation, private),
:func:`register` + :func:`shared_record` (on a state), :func:`rebuilt` (a proven rebuild),
:func:`born` (a fresh result), :func:`implied_coo`, the ``mark_*`` functions, :func:`join`,
:func:`renew`, :func:`share`, :func:`hand_out`, :func:`watch`, :func:`before_copy` /
:func:`copied`, :func:`replaced`. The layers above reach the writers through
:mod:`safesparse.state.writers` (one list) and give a tensor its record through
:func:`safesparse.state.admission.give` (``attach`` is called in ``state/`` only).

Limits: writes that bypass version counters are not seen (NumPy views of the memory, raw
pointers, a storage object's own ``fill_`` / ``copy_`` and a ``resize_`` back to the same size
at the same address, ``.data`` of a member, a ``detach()`` of a handed-out member once that
member and its tensor are gone, private APIs that skip ``__torch_function__`` such as
``torch._C.DisableTorchFunctionSubclass``). Debug mode ignores all of this and validates every
input and result.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.debug_flag import is_debug
from ..base.stats import Stats, count, reset_stats, stats
from .members import compressed_geometry, coo_geometry, geometry_of, plain_members
from .memory import (
    IndexKey,
    IndexState,
    Snapshot,
    Spans,
    all_states,
    claims,
    foreign,
    index_key,
    memory_state_count,
    must_copy,
    overlaps_registered,
    resolve,
    spans_of,
)
from .memory import register as _register
from .records import (
    RECORD_ATTR,
    UNCHECKED,
    VOLATILE,
    Record,
    attach,
    born,
    bump_generation,
    confirm,
    held,
    holds,
    is_volatile,
    opening,
    proven_geometry,
    proven_members,
    proves,
    record,
    standing,
    state_of,
    vouch,
)

#: Every name used outside this module (the questions, and the writers state/writers.py lists
#: for the layers above).
__all__ = [
    "RECORD_ATTR",
    "VOLATILE",
    "IndexState",
    "Record",
    "Stats",
    "announce",
    "before_copy",
    "born",
    "cache_size",
    "claim",
    "clear_cache",
    "compressed_geometry",
    "confirm",
    "coo_geometry",
    "copied",
    "count",
    "current",
    "geometry_of",
    "hand_out",
    "held",
    "holds",
    "implied_coo",
    "index_members",
    "is_volatile",
    "join",
    "known",
    "mark_derived",
    "mark_known",
    "mark_validated",
    "members_cache",
    "moved",
    "proof_cache",
    "proven_geometry",
    "proven_members",
    "proves",
    "rearm",
    "rebuilt",
    "record",
    "record_cache",
    "register",
    "renew",
    "replaced",
    "reset_stats",
    "same_index_data",
    "settle",
    "share",
    "shared_record",
    "snapshot",
    "standing",
    "state_of",
    "stats",
    "vouch",
    "watch",
]

_share_lock = threading.RLock()  # (sharing one record may share the pending ones it meets)


# ---------------------------------------------------------------------------------------------
# Members, keys and geometries of sparse tensors


def index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index tensors of a sparse tensor (compressed + plain, or the COO indices). A
    SafeSparseTensor's record is shared first: whoever takes its members may build a tensor
    with a counter of its own on them (checked.py, shortcut 2)."""
    rec = record(t)
    if rec is not None and rec.state is None:
        share(rec)
    with DisableTorchFunctionSubclass():
        m0, m1 = plain_members(t)
    return (m0,) if m1 is None else (m0, m1)


def rebuilt(r: Record, m0: torch.Tensor, m1: torch.Tensor | None, ver: int,
            geom: Hashable = None, nnz: int = 0) -> Record:
    """A record for a tensor built on the index data ``r`` proves (a rebuild that
    :func:`vouch` accepted), on ``r``'s state and view; ``geom``: the new tensor's geometry
    (None: ``r``'s). A COO geometry other than ``r``'s is proven only where ``r``'s implies it
    (:func:`implied_coo`); else the record is unchecked (validated at its first use)."""
    state = share(r)
    assert state is not None  # (a record that handed out members is shared)
    sizes = (r.n0, r.n1)  # (the new members are on r's proven storages)
    if geom is None or geom == r.geom:
        return shared_record((m0, m1), state, r.key, ver, r.geom, sizes)
    implied_coo(state, r.key, geom, nnz)
    rec = shared_record((m0, m1), state, r.key, UNCHECKED, geom, sizes)
    if state.is_proven((r.key, geom)):
        rec.set_checked(ver, geom)
    return rec


def implied_coo(state: IndexState, key: IndexKey, geom: Hashable, nnz: int) -> None:
    """Add to ``state`` the COO proof ``(key, geom)`` where another proof of the same view
    implies it: indices proven coalesced are valid uncoalesced, and at most one entry is
    trivially coalesced (torch marks such a tensor coalesced)."""
    sparse: tuple[int, ...] = geom[1]  # type: ignore[index]
    flag: bool = geom[2]  # type: ignore[index]
    with state.lock:
        proven = state.proven
        if (key, geom) not in proven:
            other = (key, coo_geometry(sparse, not flag))
            if other in proven and (not flag or nnz <= 1):
                proven.add((key, geom))


def share(rec: Record) -> IndexState | None:
    """Make ``rec`` shared (shortcut 2): join the state of its index memory, watched there by
    its own counter; a sole record that held keeps its proof. Returns the state (None for a
    volatile record)."""
    state = state_of(rec)
    if state is not None or rec.ver == VOLATILE:
        return state
    with _share_lock:
        if rec.state is not None:  # another thread shared it meanwhile
            return state_of(rec)
        ok = holds(rec)
        members = rec.members()
        key = index_key(members)
        _unpend(rec)
        state = register(members, key)
        # its own counter and a private record's other counters, at their proof
        state.join_proof([(rec, rec.m0, rec.ver), *((x, x.detach(), v) for x, v in rec.extra)],
                         (key, rec.geom) if ok else None)
        rec.key = key
        rec.state = state
        rec.extra = ()
    return state


# -- private records: first validations that nothing else has seen -----------------------------
#
# A factory's first validation of index memory no state covers gives its result a *private*
# record: its own counter plus the caller's index tensors' counters (``extra``), checked in
# :func:`holds` without a state. The record is *pending*: listed with the memory ranges of its
# members, not registered. Every registry lookup (:func:`register`) shares the pending records
# whose ranges overlap the memory looked up, so a tensor built or adopted later on that memory
# finds their counters as if they had been registered at birth; records that died before any
# lookup touched their memory never cost a registration. The list is short and scanned (a
# lookup compares its memory with each entry): past :data:`_PENDING_MAX` entries, the live ones
# are all shared (registered), so many live first validations cost what eager registration
# costs, amortised, and a scan never meets more than that many. A pending record holds its
# members and the caller's tensors, so its memory cannot be freed (and its address reused)
# while it is listed.
#
# Racing first validations (another thread builds or adopts on the same memory while this one
# validates, with the GIL released by torch's checker): the record is listed *before* the
# lookup (:func:`announce`: list, then look) and a registration looks at the list *after* it
# inserted its ranges (:func:`register`: insert, then share the pending records on its
# memory). Under the GIL's sequential order, of two such calls the second to look sees the
# other: two announcements see each other's record (one at least), or a registration shares the
# announced record, or the announcement finds the registered range. A record shared before it
# was settled holds no proof (its counter was UNCHECKED when shared): :func:`settle` refuses it
# and the factory takes the registering path, which validates under the state.

_PENDING_MAX = 16
#: (a deque: appends and pops are atomic, so a birth takes no lock; _flush takes the lock
#: against other flushes and pops only the entries that were there when it started)
_pending: collections.deque[tuple[Spans, weakref.ref[Record]]] = collections.deque()
_pending_lock = threading.Lock()


def announce(m0: torch.Tensor, m1: torch.Tensor | None, spans: Spans | None = None
             ) -> Record | None:
    """Open a first validation of the caller's index tensors ``m0``/``m1`` (their memory
    ``spans``; None: the straight path's, :func:`safesparse.state.records.opening`, which
    also declines members a record claims): a pending record, unchecked, is listed, *then* the
    states and the other pending records are looked at (see above). Returns the record, to
    :func:`settle` once the tensor is built on proven data; None when memory overlapping the
    spans may be covered (the caller takes the registering path; the listed record dies with
    the call) or, on the straight path, is claimed or cannot be watched."""
    if spans is None:
        made = opening(m0, m1)
        if made is None:
            return None
        rec, spans = made
    else:
        rec = Record(m0, m1, UNCHECKED, None, (0, 0))  # (sizes: unchecked until settled)
    entry = (spans, weakref.ref(rec))
    with _pending_lock:  # (a scan rotates the list: only under the lock is every entry in it)
        _pending.append(entry)
        if len(_pending) > 1 and _others_overlap(spans, rec):
            return None
    if overlaps_registered(spans):
        return None
    return rec


def settle(rec: Record, m0: torch.Tensor, m1: torch.Tensor | None, ver: int, geom: Hashable,
           extra: tuple[tuple[torch.Tensor, int], ...]) -> bool:
    """Close an announced first validation: ``rec`` becomes the private record of the tensor just
    built on proven index data (members ``m0``/``m1``, sharing its counter, at ``ver``; the
    caller's index tensors ``extra`` at the versions validation read). False when a registration
    shared ``rec`` meanwhile (a racing build or adoption on the same memory): the caller takes
    the registering path."""
    with _share_lock:  # (share() sets rec.state under it: settled or shared, never both)
        if rec.state is not None:
            return False
        rec.m0 = m0
        rec.p0 = m0.data_ptr()
        rec.n0 = m0.untyped_storage().nbytes()
        if m1 is not rec.m1:
            rec.m1 = m1
            rec.p1 = 0 if m1 is None else m1.data_ptr()
        rec.n1 = 0 if m1 is None else m1.untyped_storage().nbytes()
        rec.extra = extra
        rec.set_checked(ver, geom)
    if len(_pending) > _PENDING_MAX:
        _flush(None)
    return True


def _unpend(rec: Record) -> None:
    with _pending_lock:
        for _ in range(len(_pending)):
            entry = _pending.popleft()
            if entry[1]() is not rec:
                _pending.append(entry)


def _overlap(a: Spans,
             b: Spans) -> bool:
    for dev, s0, e0 in a:
        for dev1, s1, e1 in b:
            if s0 < e1 and s1 < e0 and dev == dev1:
                return True
    return False


def _flush(spans: Spans | None) -> None:
    """Share the pending records overlapping ``spans`` (None: all of them); drop dead ones."""
    with _pending_lock:
        due: list[Record] = []
        for _ in range(len(_pending)):  # (entries appended meanwhile wait for the next one)
            entry = _pending.popleft()
            rec = entry[1]()
            if rec is None:
                continue
            if spans is None or _overlap(entry[0], spans):
                due.append(rec)
            else:
                _pending.append(entry)
    for rec in due:
        share(rec)


def _others_overlap(spans: Spans, own: Record) -> bool:
    """Whether a live pending record other than ``own`` overlaps ``spans`` (dead entries are
    dropped). ``_pending_lock`` held."""
    hit = False
    for _ in range(len(_pending)):
        entry = _pending.popleft()
        rec = entry[1]()
        if rec is None:
            continue
        _pending.append(entry)
        hit = hit or (rec is not own and _overlap(entry[0], spans))
    return hit


def register(members: Sequence[torch.Tensor], key: IndexKey | None = None) -> IndexState:
    """The one state of the memory of ``members`` (:func:`safesparse.state.memory.register`), after
    sharing the pending records that overlap it."""
    if _pending:
        _flush(spans_of(members))
    state = _register(members, key)
    # first validations announced while this registered (see above): their records are shared
    # now, on this memory's state (under the lock, never skipped on a glance at the list: a
    # scan in another thread can hold its one entry out of it for a moment)
    _flush(spans_of(members))
    return resolve(state)  # type: ignore[return-value]


def shared_record(members: tuple[torch.Tensor, torch.Tensor | None], state: IndexState,
                  key: IndexKey, ver: int, geom: Hashable,
                  sizes: tuple[int, int] | None = None) -> Record:
    """A record on ``state`` for a tensor whose members (aliases sharing its counter) are
    ``members``, watched there by its own counter (``sizes``: the storages' byte sizes, when
    known)."""
    rec = Record(members[0], members[1], ver, geom, sizes)
    rec.key = key
    rec.state = state
    state.witness(rec, rec.m0)
    return rec


def volatile(plain: torch.Tensor) -> bool:
    """Whether the index memory of ``plain`` can be written where no counter of this process
    sees it: inference tensors (no counter), storage shared with other processes, file
    mappings, memory torch did not allocate (SPEC 4; :func:`memory.must_copy`)."""
    with DisableTorchFunctionSubclass():
        m0, m1 = plain_members(plain)
    ms = (m0,) if m1 is None else (m0, m1)
    return foreign(ms) or must_copy(ms)


def join(t: torch.Tensor, ver: int = UNCHECKED, geom: Hashable = None) -> Record:
    """Give ``t`` a record on the state of its index memory (found by range), watched there by
    its own counter; volatile if that memory cannot be watched."""
    with DisableTorchFunctionSubclass():
        members = plain_members(t)
        if volatile(t):
            rec = Record(members[0], members[1], VOLATILE, geom)
        else:
            ms = (members[0],) if members[1] is None else (members[0], members[1])
            key = index_key(ms)
            rec = shared_record(members, register(ms, key), key, ver, geom)
    return attach(t, rec)


def current(t: torch.Tensor) -> Record:
    """``t``'s record, renewed (unchecked, joined by range) if ``t``'s members are not the
    record's any more (replaced in place) or it has none."""
    rec = record(t)
    if rec is not None:
        with DisableTorchFunctionSubclass():
            m0, m1 = plain_members(t)
        r1 = rec.m1
        if (m0.data_ptr() == rec.p0 and m0.shape == rec.m0.shape
                and m0.stride() == rec.m0.stride()
                and m0.untyped_storage().nbytes() == rec.n0
                and (m1 is None) == (r1 is None)
                and (m1 is None or r1 is None or (m1.data_ptr() == rec.p1
                                                  and m1.shape == r1.shape
                                                  and m1.stride() == r1.stride()
                                                  and m1.untyped_storage().nbytes() == rec.n1))):
            return rec
    return join(t)


def renew(t: torch.Tensor) -> Record:
    """``t`` ran an in-place op that may have replaced or rewritten its members: a new,
    unchecked record on its current members (the old record object, which views may share,
    is left to its counters)."""
    return join(t)


# -- marking -----------------------------------------------------------------------------------


def mark_validated(rec: Record, geometry: Hashable, snap: Snapshot, ver: int) -> bool:
    """Validation passed on ``rec``'s data as it was at ``snap`` (``ver``: its own counter
    then). Returns False (it stays unchecked) if a counter moved meanwhile."""
    if rec.ver == VOLATILE:
        rec.geom = geometry
        return True
    state = state_of(rec)
    ok = rec.m0._version == ver if state is None else state.prove((rec.key, geometry), snap)
    if ok:
        rec.set_checked(ver, geometry)
    return ok


def snapshot(rec: Record) -> tuple[Snapshot, int]:
    """Counters before validation reads the data: the state's, and the record's own."""
    if rec.ver == VOLATILE:
        return {}, VOLATILE
    if rec.state is None and rec.extra:
        share(rec)  # a private record's other counters are re-armed by the state's proof
    state = state_of(rec)
    ver = rec.m0._version
    return (state.snapshot() if state is not None else {}), ver


def moved(rec: Record, snap: Snapshot, ver: int) -> bool:
    """Whether a counter of :func:`snapshot`'s ``(snap, ver)`` moved since it was taken."""
    if ver == VOLATILE:
        return False
    state = state_of(rec)
    return rec.m0._version != ver or (state is not None and state.moved(snap))


def mark_derived(rec: Record, geometry: Hashable) -> bool:
    """``rec``'s tensor was made by a known op from tensors checked before and after it ran,
    and has ``geometry``: checked without validation, while its state holds."""
    if rec.ver == VOLATILE:
        return False
    state = state_of(rec)
    ver = rec.m0._version
    ok = state is None or state.derive((rec.key, geometry))
    if ok:
        rec.set_checked(ver, geometry)
    return ok


def known(rec: Record, geometry: Hashable, watched: bool) -> bool:
    """Whether ``rec``'s index data is already proven for ``geometry`` on its state (a cache
    hit: no O(nnz) check needed) and no write through ``rec``'s own counter can have been
    missed (``watched``: the record saw every write through its counter; else nothing wrote
    through its members yet)."""
    state = state_of(rec)
    return (state is not None and state.is_proven((rec.key, geometry))
            and (watched or all(m._version == 0 for m in rec.members())))


def mark_known(rec: Record, geometry: Hashable) -> bool:
    """``rec`` (just made, shared) is on index data whose state proves ``geometry`` (a cache
    hit). Returns False if the state stopped proving it meanwhile."""
    state = state_of(rec)
    if state is None or not state.is_proven((rec.key, geometry)):
        return False
    rec.set_checked(rec.m0._version, geometry)
    return True


def mark_copied(rec: Record, geometry: Hashable, snap: Snapshot) -> bool:
    """``rec``'s tensor was just overwritten in place (``copy_``) with index data known valid for
    ``geometry``; ``snap`` was taken before the write. Proven if no *other* counter moved (the
    copy moved the tensor's own); every other proof on that memory is void (the copy wrote it)."""
    state = state_of(rec)
    if state is None:
        return False  # (volatile) validated when asked
    ok = state.prove((rec.key, geometry), state.counters_with(rec, snap))
    if ok:
        rec.set_checked(rec.m0._version, geometry)
    return ok


def before_copy(dst: torch.Tensor) -> Snapshot:
    """The counters of ``dst``'s index memory before ``dst.copy_(src)`` writes it (pass to
    :func:`copied`)."""
    return snapshot(current(dst))[0]


def copied(dst: torch.Tensor, before: Snapshot) -> bool:
    """``dst.copy_(src)`` just wrote ``dst``'s index data from a checked ``src`` of the same
    layout and shape (``before``: :func:`before_copy`): checked if no other counter moved
    (:func:`mark_copied`)."""
    return mark_copied(current(dst), geometry_of(dst), before)


def replaced(t: torch.Tensor, derived: bool) -> None:
    """``t``'s members were replaced in place (``t.data = new``): a new record on them, checked
    without validation when ``derived`` (``new`` was checked before and after, and ``t``'s
    metadata passed)."""
    rec = renew(t)
    if derived:
        mark_derived(rec, geometry_of(t))


def same_index_data(a: Record, b: Record) -> bool:
    """Both records are on one view of one piece of index memory, with the same geometry."""
    if a is b:
        return True
    sa = state_of(a)
    return (sa is not None and sa is state_of(b) and a.key == b.key and a.geom == b.geom)


def rearm(rec: Record) -> bool:
    """A known values-only in-place op ran on ``rec``'s checked tensor: take its counter as it
    is now (shared: if every other watch still holds)."""
    if rec.ver < 0:
        return False
    state = state_of(rec)
    if state is not None and not state.rearm(rec, rec.proof()):
        return False
    rec.set_checked(rec.m0._version, rec.geom)
    return True


def hand_out(t: torch.Tensor, member: torch.Tensor) -> None:
    """``t`` handed out ``member`` (an index member alias sharing its counter): its record is
    shared from now on, and the member carries it (keeping its watch alive, and claiming it for
    a rebuild)."""
    rec = record(t)
    if rec is None or rec.ver == VOLATILE:
        return
    share(rec)
    claims.set(member, rec)


def claim(x: torch.Tensor) -> Record | None:
    """The record whose counter ``x`` shares (a member it handed out), if any."""
    rec: Record | None = claims.get(x)
    return rec


def watch(rec: Record, owner: torch.Tensor) -> None:
    """``owner`` (a plain tensor: an index tensor ``rec``'s tensor was built from) can write its
    index memory: watch its counter too."""
    state = state_of(rec)
    if state is None:
        return
    c = claim(owner)
    if c is not None and state_of(c) is state:
        return  # a member handed out on this state: its record's watch covers its counter
    state.witness(owner, owner.detach())


def proof_cache(t: torch.Tensor) -> dict[Hashable, Any] | None:
    """A dict for what is derived from ``t``'s index data alone (e.g. a regrouped block
    structure), tied to the proof that makes ``t`` checked: every tensor on the same proven
    index data (same view, same geometry) gets the same dict, and it is dropped with the proof
    (any write through anything that can write that data, a storage that died or moved,
    :func:`clear_cache`), so a later call gets a new, empty one. None when ``t`` is not checked
    now, or its index data cannot be watched (volatile): compute afresh then.

    Only what depends on the index data and the geometry may be cached (never values). In
    debug mode, which trusts no remembered state, there is no cache (None)."""
    rec = record(t)
    if rec is None or rec.ver < 0 or not holds(rec):
        return None
    return _cache_of(rec)


def _cache_of(rec: Record) -> dict[Hashable, Any] | None:
    """The cache dict of ``rec``'s proof (made on first use), or None when the proof does not
    hold now or in debug mode."""
    if is_debug():
        return None
    state = share(rec)
    if state is None:
        return None
    proof = (rec.key, rec.geom)
    with state.lock:
        if not state.proves_now(proof):
            return None
        cache = state.caches.get(proof)
        if cache is None:
            cache = state.caches[proof] = {}
        return cache


def members_cache(compressed: torch.Tensor, plain: torch.Tensor,
                  geometry: Hashable) -> dict[Hashable, Any] | None:
    """:func:`proof_cache` for index members a checked tensor handed out (the operators of
    model code hold members, not the tensor): the dict of the proof that :func:`confirm`
    finds for ``compressed`` / ``plain`` and ``geometry`` now, dropped with that proof. None
    when they are not proven (or in debug mode): compute afresh then."""
    rec = vouch(compressed, plain, (geometry,))
    return None if rec is None else record_cache(rec)


def record_cache(rec: Record) -> dict[Hashable, Any] | None:
    """:func:`proof_cache` of the proof ``rec`` stands for (a record a proof question such as
    :func:`vouch` or :func:`proves` just accepted), or None where it has none."""
    return None if rec.ver < 0 else _cache_of(rec)


def cache_size() -> int:
    """Number of live index states with memory (for tests and diagnostics); pending private
    records are shared first, so each is counted."""
    _flush(None)
    return memory_state_count()


def clear_cache() -> None:
    """Forget every validation proof: the next build or ``validate`` checks its indices again.

    Tensors that were checked become unchecked until validated again (``ss.is_checked`` is
    ``False`` for them). Useful in tests and benchmarks; normal code never needs it, since
    in-place writes to index data already drop the checked state.
    """
    bump_generation()  # sole records (in no state) proven before now are not trusted
    for state in all_states():
        state.void()


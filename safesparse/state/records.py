"""Records and the one rule deciding whether a proof holds (:func:`proves`, :func:`holds`).

A :class:`Record` is what a checked tensor carries; this module reads records and the state of
their memory, never changes a state. Sharing, registration, first validations and the marking
functions are in :mod:`safesparse.state.checked` (which re-exports every name here); the
soundness argument is in its module docstring.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

import torch
from torch._C import DisableTorchFunctionSubclass

from .members import geometry_of, plain_members
from .memory import IndexKey, IndexState, Spans, claims, resolve, unclaimed_spans

__all__ = [
    "UNCHECKED",
    "VOLATILE",
    "Record",
    "attach",
    "born",
    "bump_generation",
    "confirm",
    "fresh",
    "held",
    "holds",
    "is_volatile",
    "proven_geometry",
    "proven_members",
    "proves",
    "record",
    "sole_record",
    "state_of",
    "vouch",
]

#: ``Record.ver`` of a tensor that is not checked; of one whose memory cannot be watched.
UNCHECKED: Final = -1
VOLATILE: Final = -2

#: Bumped by :func:`safesparse.state.checked.clear_cache` (:func:`bump_generation`): records
#: proven before it are not trusted after it.
_generation = 0


def bump_generation() -> None:
    global _generation
    _generation += 1


# ---------------------------------------------------------------------------------------------
# Records

#: A record's members and their storage objects (see :func:`_storages`).
_Storages = tuple[torch.Tensor, torch.Tensor | None, torch.UntypedStorage,
                  torch.UntypedStorage | None]


class Record:
    """The checked state of the tensors that carry it (one tensor, its views, ``detach()``).

    ``m0``, ``m1``: aliases of the index members sharing the owner's version counter (COO:
    ``m1`` None); ``p0``, ``p1``: their data pointers when the record was made (storage moved
    since, e.g. by ``share_memory_()``, makes it unchecked); ``ver``: the counter value its
    proof holds for (:data:`UNCHECKED`, :data:`VOLATILE`: validated whenever asked); ``geom``:
    the proven geometry; ``state``: None (sole) or the shared :class:`IndexState`, with ``key``
    the view key and ``seen`` the state's epoch when the proof was last seen there.
    """

    __slots__ = ("__weakref__", "extra", "gen", "geom", "key", "m0", "m1", "n0", "n1", "p0",
                 "p1", "seen", "state", "stores", "ver")

    def __init__(self, m0: torch.Tensor, m1: torch.Tensor | None, ver: int,
                 geom: Hashable, sizes: tuple[int, int] | None = None) -> None:
        self.m0 = m0
        self.m1 = m1
        self.p0 = m0.data_ptr()
        self.p1 = 0 if m1 is None else m1.data_ptr()
        if sizes is None:  # (a rebuild passes its proven record's: the same storages)
            sizes = (m0.untyped_storage().nbytes(),
                     0 if m1 is None else m1.untyped_storage().nbytes())
        self.n0, self.n1 = sizes
        self.ver = ver
        self.gen = _generation
        self.geom = geom
        self.state: IndexState | None = None
        self.key: IndexKey = ()
        self.seen = -1
        #: a *private* record's other counters: ``(tensor, version at the proof)`` for the
        #: caller's index tensors (see :func:`announce`, :func:`settle`); () once shared
        self.extra: tuple[tuple[torch.Tensor, int], ...] = ()
        #: the members and their storage objects, made at the first :func:`holds`
        self.stores: _Storages | None = None

    def set_checked(self, ver: int, geom: Hashable) -> None:
        """The proof holds at counter value ``ver`` for ``geom`` (callers made sure)."""
        self.geom = geom
        self.gen = _generation
        self.ver = ver

    def members(self) -> tuple[torch.Tensor, ...]:
        return (self.m0,) if self.m1 is None else (self.m0, self.m1)

    def proof(self) -> Hashable:
        return (self.key, self.geom)


def opening(m0: torch.Tensor, m1: torch.Tensor | None) -> tuple[Record, Spans] | None:
    """A new unchecked record of the members ``m0`` / ``m1`` for a first validation on the
    factories' straight path, and their memory (:func:`safesparse.state.memory.
    unclaimed_spans`); None when a record claims them or their memory cannot be watched."""
    spans = unclaimed_spans((m0,) if m1 is None else (m0, m1))
    if spans is None:
        return None
    return Record(m0, m1, UNCHECKED, None, (0, 0)), spans  # (sizes: unchecked until settled)


def holds(r: Record) -> bool:
    """:func:`proves` for ``r``'s own tensors: ``r``'s proof holds now (see the module
    docstring). Never for volatile records (those are validated by the caller)."""
    ver = r.ver
    if ver < 0:  # (inference tensors, which volatile records hold, have no counter to read)
        return False
    m0 = r.m0
    m1 = r.m1
    if (m0._version != ver or m0.data_ptr() != r.p0
            or (m1 is not None and m1.data_ptr() != r.p1)):
        return False
    kept = r.stores
    if kept is None or kept[0] is not m0 or kept[1] is not m1:
        kept = r.stores = _storages(m0, m1)
    if kept[2].nbytes() != r.n0 or (kept[3] is not None and kept[3].nbytes() != r.n1):
        return False
    extra = r.extra  # read before the state: share() sets the state, then clears extra
    st = r.state
    if st is None:
        for x, v in extra:
            if x._version != v:
                return False
        return r.gen == _generation  # (clear_cache voids states; sole records by generation)
    return _shared_holds(r, st)


def _storages(m0: torch.Tensor, m1: torch.Tensor | None) -> _Storages:
    """``(m0, m1, storage of m0, storage of m1)``: a record's members and their storage objects,
    kept so :func:`holds` reads the storages' sizes without making a storage object per call.
    A member's storage is one object for its life: only ``set_`` / ``.data =`` on the member
    itself, which only the record holds, could give it another (and its data pointer, compared
    first, would differ while the kept storage holds the old allocation); a ``resize_`` of the
    storage changes that object, whose size is read at each call."""
    return (m0, m1, m0.untyped_storage(), None if m1 is None else m1.untyped_storage())


def proves(r: Record, m0: torch.Tensor, m1: torch.Tensor | None,
           geometries: tuple[Hashable, ...]) -> bool:
    """The one question every module asks before it trusts index data: does ``r``'s proof hold
    now for the index tensors ``m0`` / ``m1`` (compressed and plain; COO: indices and None),
    presented in the roles of ``r``'s members, as a tensor of one of ``geometries``?

    Why a True answer is sound. A proof names everything the validity of the data depends on:

    * *the members' objects*: ``r.m0`` / ``r.m1`` are aliases that only ``r`` (and the tensors
      carrying it) hold, and the tensor they describe was built on detached aliases of the
      caller's index tensors (build.py), so no outside object can swap, shrink or move its
      members (``col.data = col[:1]``, ``nn.Module._apply``): ``.data =`` on the caller's
      tensor changes that tensor only;
    * *the memory*: ``r.m0`` / ``r.m1`` hold their storages, so the storage cannot die and
      another take its address; the proof names each storage's data pointer and byte size, so
      a ``resize_`` that moves the memory or changes its size is seen. What is not: a storage
      resized to zero and back to the same size that the allocator places at the same address,
      and ``fill_`` / ``copy_`` through the storage object (public torch names an allocation
      by nothing else, and storage methods bump no counter): docs/ops.md lists them beside raw
      pointers and NumPy;
    * *the view*: ``m0`` / ``m1`` must have ``r``'s members' data pointer, shape, strides,
      dtype and device: a tensor presented as a member whose shape or memory changed without a
      counter moving (``.data =`` on a handed-out member) is not the proven one;
    * *the counters*: :func:`holds`: the record's own counter unmoved and, for a shared record,
      every counter that can write the memory (the state's watches) unmoved, or for a private
      one the caller's index tensors' counters (``extra``) unmoved, and no
      :func:`clear_cache` since;
    * *the geometry*: ``(n_compressed, n_plain)`` (COO: sparse size and coalesced flag) is the
      proven one; the metadata stage checked everything else about the new tensor in O(1).

    Every other module asks this function (or :func:`holds`, its form for a record's own
    tensors, :func:`vouch` for members a record handed out) and never compares a record's
    fields itself."""
    # (cheapest first, no helper calls: the eager layers ask this at every call). A member is
    # at the proven one's view of the same memory (which ``r``'s member holds alive): the same
    # storage, offset, sizes and strides (``is_set_to``, one call) and the same dtype (a
    # ``view(dtype)`` of the same item size has the same sizes).
    if r.geom not in geometries:
        return False
    r0 = r.m0
    if m0 is not r0 and not (m0.is_set_to(r0) and m0.dtype is r0.dtype):
        return False
    r1 = r.m1
    if r1 is None or m1 is None:
        if r1 is not m1:
            return False
    elif m1 is not r1 and not (m1.is_set_to(r1) and m1.dtype is r1.dtype):
        return False
    return holds(r)


def vouch(m0: torch.Tensor, m1: torch.Tensor | None,
          geometries: tuple[Hashable, ...]) -> Record | None:
    """The record that proves ``m0`` / ``m1`` (index tensors a checked tensor handed out, each
    carrying its record: see :func:`hand_out`) for one of ``geometries`` now, or None. A
    rebuild on such members needs no O(nnz) check (shortcut 4)."""
    r = claims.get(m0)
    if r is None or (m1 is not None and claims.get(m1) is not r):
        return None
    return r if proves(r, m0, m1, geometries) else None


def proven_members(r: Record) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``r``'s own aliases of its members, at the proven views: what a rebuild that
    :func:`vouch` accepted builds on (only ``r`` and its tensors hold them, so no ``.data =``
    from outside can change the new tensor's members; the caller's handed-out tensors, which
    :func:`proves` found at these views, are not used)."""
    return r.m0, r.m1


def confirm(compressed: torch.Tensor, plain: torch.Tensor, geometry: Hashable) -> bool:
    """Whether ``compressed`` / ``plain`` are index members a checked tensor handed out, still
    proven for ``geometry`` (:func:`vouch`): the O(1) run-time check of model code's
    operators."""
    return vouch(compressed, plain, (geometry,)) is not None


def _shared_holds(r: Record, st: IndexState) -> bool:
    """Lock-free read of a shared record's state (shortcut 6 of the module docstring)."""
    if st.merged is not None:
        st = r.state = resolve(st)  # type: ignore[assignment]
        r.seen = -1
    try:
        epoch = st.epoch  # read first: a removal after this read changes it
        if r.seen != epoch:
            if (r.key, r.geom) not in st.proven:
                return False
            r.seen = epoch
        for w in st.watches.values():
            if w.alias._version != w.version:
                return False
        for w in st.retired:  # noqa: SIM110  (a loop: no generator on the hot path)
            if w.alias._version != w.version:
                return False
        return True
    except RuntimeError:  # a watch dict changed size while we read it
        with st.lock:
            return st.proves_now((r.key, r.geom))


def is_volatile(r: Record) -> bool:
    """Whether ``r``'s index memory cannot be watched: its tensor is validated whenever asked."""
    return r.ver == VOLATILE


def proven_geometry(t: torch.Tensor) -> Hashable:
    """The geometry ``t``'s proof is for when ``t`` carries a proof (its index data and
    extents are unchanged since, or the proof does not hold and nothing is trusted on it),
    else the geometry read from ``t`` (:func:`geometry_of`)."""
    rec = record(t)
    if rec is not None and rec.ver >= 0:
        return rec.geom
    return geometry_of(t)


def born(r: Record, m0: torch.Tensor, m1: torch.Tensor | None,
         coalesced: bool | None) -> Record | None:
    """A sole record for the result of a copying op on ``r``'s checked tensor (shortcut 1),
    whose index members are ``m0`` / ``m1`` (aliases sharing the result's counter) and, for
    COO, whose coalesced flag is ``coalesced``; checked if ``r`` still holds after the op.
    None when the result's index memory is not fresh (the input's, or empty) or its flag is
    not the proven one: the caller wraps it the general way (joined by memory range)."""
    if coalesced is not None and coalesced != r.geom[2]:  # type: ignore[index]
        return None
    p0 = m0.data_ptr()
    if p0 == r.p0 or p0 == 0 or (m1 is not None and (m1.data_ptr() == r.p1
                                                    or m1.data_ptr() == 0)):
        return None
    return Record(m0, m1, m0._version if holds(r) else UNCHECKED, r.geom)


#: The attribute of a tensor's ``__dict__`` that holds its record (set by :func:`attach` only).
RECORD_ATTR: Final = "_ss"


def record(t: torch.Tensor) -> Record | None:
    rec: Record | None = t.__dict__.get(RECORD_ATTR)
    return rec


def held(t: torch.Tensor) -> Record | None:
    """``t``'s record when its proof :func:`holds` now, else None: the per-op question of the
    fast path (tensor/fastpath.py), asked in one call."""
    rec: Record | None = t.__dict__.get(RECORD_ATTR)
    return rec if rec is not None and holds(rec) else None


def standing(t: torch.Tensor) -> bool | None:
    """Whether ``t``'s proof holds now (True), or cannot be known without validating it now
    (None: a volatile record, index memory that cannot be watched), else False (no record, or
    its proof no longer holds): the question of ``is_checked``."""
    rec: Record | None = t.__dict__.get(RECORD_ATTR)
    if rec is None:
        return False
    if holds(rec):
        return True
    return None if rec.ver == VOLATILE else False


def sole_record(plain: torch.Tensor, ver: int, geom: Hashable) -> Record:
    """A sole record for a tensor whose index memory only its own counter can write (shortcut
    1); ``ver``: its counter now if checked, else :data:`UNCHECKED`."""
    m0, m1 = plain_members(plain)
    return Record(m0, m1, ver, geom)


def fresh(t: torch.Tensor) -> Record:
    """Give ``t``, whose index members were just copied into memory only ``t`` holds (an
    adoption on a copy), a sole record, unchecked (shortcut 1: only ``t``'s counter can write
    that memory); volatile without a counter (made in inference mode)."""
    with DisableTorchFunctionSubclass():
        m0, m1 = plain_members(t)
        inference = t.is_inference()
    return attach(t, Record(m0, m1, VOLATILE if inference else UNCHECKED, None))


def attach(t: torch.Tensor, rec: Record) -> Record:
    """``t`` carries ``rec`` (``state/`` only; the layers above call
    :func:`safesparse.state.admission.give`)."""
    t.__dict__[RECORD_ATTR] = rec
    return rec


def state_of(rec: Record) -> IndexState | None:
    """``rec``'s state, following merges (and remembering the survivor)."""
    state = rec.state
    if state is not None and state.merged is not None:
        state = rec.state = resolve(state)
        rec.seen = -1
    return state

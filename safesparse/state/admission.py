"""Admission: the one way index members come to be trusted (factories, adoption).

A factory asks once, :func:`admit` on the caller's index members in their final form, and the
returned :class:`Admission` finishes the job in one of its ways; the protocol each way follows
(the shortcuts of :mod:`safesparse.state.checked`) is written here, once:

* :meth:`Admission.proven`: members a checked tensor handed out, still proven (shortcut 4):
  the record's own aliases to build on; :meth:`Admission.rebuilt` gives the built tensor its
  record on that state.
* :meth:`Admission.validate`: a first validation. Memory no state or pending record covers
  takes the private path (announce, read the counters, validate, compare, build, settle:
  shortcut 5); anything else the registering path (register, watch the caller's tensors, a
  proof already there or validate under a snapshot, prove). Memory that cannot be watched
  (inference tensors, shared memory) is validated and volatile; members in a file mapping are
  copied first (:func:`safesparse.state.memory.file_mapped`) and admitted on the copy.
* :func:`opened` / :meth:`First.close`: a first validation's protocol around the caller's
  validate-and-build (announce and read the counters; compare, settle and attach), used by
  :meth:`Admission.validate` and by the factories' straight-line fast paths (build.py);
  tensor/fastpath.py gives fresh results and views their record with
  :func:`safesparse.state.checked.attach`.

Records are attached here and nowhere else: the callers get the plain tensor back with its
record and only retype it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import torch

from ..base.stats import count
from .checked import (
    VOLATILE,
    IndexState,
    Record,
    announce,
    attach,
    claim,
    implied_coo,
    proven_members,
    rebuilt,
    register,
    settle,
    shared_record,
    state_of,
    vouch,
)
from .members import plain_members
from .memory import IndexKey, Spans, file_mapped, index_key, watchable_spans

__all__ = ["Admission", "First", "Validation", "admit", "opened", "proven", "settled",
           "volatile_onto"]

#: Attempts to validate index data that another thread keeps writing, before giving up.
ATTEMPTS = 3
CHANGING = ("safesparse: the index data kept changing while it was validated (another thread "
            "writes it); nothing was built")

M = TypeVar("M")


def _own_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of index member ``x`` in memory torch allocates (nothing else can write it)."""
    return x.detach().clone(memory_format=torch.contiguous_format)


class Validation(Generic[M]):
    """What a first validation needs from its factory: ``check(members, meta, estimate)``
    validates the members (raises ``InvariantError``) and returns the resolved metadata;
    ``build(members, meta)`` builds the plain tensor on them; ``geometry(meta)`` is the
    geometry validation proves; ``final(plain, meta)`` the geometry of the built tensor (None:
    torch gave it a flag validation did not prove, it stays unchecked); ``known(meta)`` the
    proofs that already make a view valid (a cache hit)."""

    __slots__ = ("build", "check", "final", "geometry", "known")

    def __init__(self, check: Callable[[tuple[torch.Tensor, ...], M, bool], M],
                 build: Callable[[tuple[torch.Tensor, ...], M], torch.Tensor],
                 geometry: Callable[[M], Hashable],
                 final: Callable[[torch.Tensor, M], Hashable | None],
                 known: Callable[[M], Sequence[Hashable]]) -> None:
        self.check = check
        self.build = build
        self.geometry = geometry
        self.final = final
        self.known = known


class Admission:
    """One factory call's question about its index members (see the module docstring)."""

    __slots__ = ("members",)

    def __init__(self, members: tuple[torch.Tensor, ...]) -> None:
        self.members = members

    # -- rebuilds ---------------------------------------------------------------------------

    def proven(self, geometries: tuple[Hashable, ...]) -> Record | None:
        """:func:`proven` for these members."""
        ms = self.members
        return proven(ms[0], ms[1] if len(ms) > 1 else None, geometries)

    @staticmethod
    def proven_members(r: Record) -> tuple[torch.Tensor, torch.Tensor | None]:
        return proven_members(r)

    @staticmethod
    def rebuilt(plain: torch.Tensor, r: Record, geom: Hashable = None, nnz: int = 0,
                members: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> torch.Tensor:
        """``plain``, built on the index data ``r`` proves, with a record on ``r``'s state
        (``geom``: its geometry when it may differ from ``r``'s, COO's flag; ``members``: its
        member aliases when the caller has them)."""
        if plain.is_inference():
            return volatile_onto(plain, r.geom if geom is None else geom)
        m0, m1 = plain_members(plain) if members is None else members
        attach(plain, rebuilt(r, m0, m1, m0._version, geom, nnz))
        return plain

    # -- first validations ------------------------------------------------------------------

    def validate(self, how: Validation[M], meta: M, *, estimate: bool = False,
                 debug: bool = False) -> tuple[torch.Tensor, bool]:
        """Validate the members and build on them (the protocol of the module docstring).
        Returns the plain tensor and whether it got a record (False: torch gave it a flag
        validation did not prove; the caller makes it an unchecked tensor)."""
        members = self.members
        spans = watchable_spans(members)
        if spans is None and file_mapped(members):
            # index memory in a file mapping (SPEC 4): admitted on a copy of its own
            members = self.members = tuple(_own_copy(m) for m in members)
            spans = watchable_spans(members)
        if spans is None:  # memory that cannot be watched: validated, volatile
            meta = how.check(members, meta, estimate)
            count("validations")
            plain = how.build(members, meta)
            geom = how.final(plain, meta)
            if geom is None:
                return plain, False
            volatile_onto(plain, geom)
            return plain, True
        first = opened(spans, members) if spans else None
        if first is not None:  # memory no state covers: a private record, no registration
            for _ in range(ATTEMPTS):
                first.read()
                meta = how.check(members, meta, estimate)
                count("validations")
                if first.unchanged():
                    break
            else:
                raise RuntimeError(CHANGING)
            plain = how.build(members, meta)
            geom = how.final(plain, meta)
            if geom is None:
                return plain, False
            if first.close(plain, geom):
                return plain, True
            estimate = False  # (resolved; a racing write or registration met it: register)
        key = index_key(members)
        state = register(members, key)
        known = _watch_callers(state, members) and not estimate and not debug
        if known and any(state.is_proven((key, g)) for g in how.known(meta)):
            count("skipped")
        else:
            for _ in range(ATTEMPTS):
                snap = state.snapshot()
                meta = how.check(members, meta, estimate)
                count("validations")
                if state.prove((key, how.geometry(meta)), snap):
                    break
            else:
                raise RuntimeError(CHANGING)
        plain = how.build(members, meta)
        geom = how.final(plain, meta)
        if geom is None:
            return plain, False
        if geom[0] == "coo":  # type: ignore[index]
            implied_coo(state, key, geom, int(plain._nnz()))
        _finish(plain, state, key, geom)
        return plain, True


class First:
    """An open first validation of memory no state covered (shortcut 5): the announced pending
    record and the caller's counters as validation read them. The caller validates and builds
    between :func:`opened` and :meth:`close`; nothing else of the protocol is its business."""

    __slots__ = ("members", "rec", "versions")

    def __init__(self, rec: Record, members: tuple[torch.Tensor, ...]) -> None:
        self.rec = rec
        self.members = members
        self.versions = _versions(members)

    def read(self) -> None:
        """Read the caller's counters (before validation reads the data)."""
        self.versions = _versions(self.members)

    def unchanged(self) -> bool:
        return self.versions == _versions(self.members)

    def close(self, plain: torch.Tensor, geom: Hashable,
              aliases: tuple[torch.Tensor, ...] | None = None,
              members: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> bool:
        """``plain`` was built on the validated data: settle the record onto it (its own
        counter and the caller's at the versions read, watched through ``aliases``, detached
        aliases of the caller's tensors; ``members``: ``plain``'s member aliases, when the
        caller has them). False when a counter moved since :meth:`read` or a racing
        registration shared the record: the caller takes the registering path."""
        vers = self.versions
        if vers != _versions(self.members):
            return False
        if aliases is None:
            ms = self.members
            aliases = (ms[0].detach(),) if len(ms) == 1 else (ms[0].detach(), ms[1].detach())
        if len(vers) == 1:
            extra: tuple[tuple[torch.Tensor, int], ...] = ((aliases[0], vers[0]),)
        else:
            extra = ((aliases[0], vers[0]), (aliases[1], vers[1]))
        return settled(plain, self.rec, geom, extra, members)


def _versions(members: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    if len(members) == 1:
        return (members[0]._version,)
    return (members[0]._version, members[1]._version)


def opened(spans: Spans, members: tuple[torch.Tensor, ...]) -> First | None:
    """Open a first validation of ``members`` (their memory ``spans``, watchable): None when
    memory overlapping it may be covered (a state or another open first validation): the
    caller takes the registering path."""
    rec = announce(spans, members[0], members[1] if len(members) > 1 else None)
    return None if rec is None else First(rec, members)


def proven(m0: torch.Tensor, m1: torch.Tensor | None,
           geometries: tuple[Hashable, ...]) -> Record | None:
    """The record proving ``m0`` / ``m1`` (handed out by a checked tensor) for one of
    ``geometries`` now, or None: shortcut 4 (counted as skipped). The caller builds on
    :meth:`Admission.proven_members` and finishes with :meth:`Admission.rebuilt`."""
    if claim(m0) is None:
        return None
    r = vouch(m0, m1, geometries)
    if r is not None:
        count("skipped")
    return r


def admit(members: tuple[torch.Tensor, ...]) -> Admission:
    """Ask once about the caller's index ``members`` (final form: compressed and plain, or the
    COO indices); the :class:`Admission` finishes the job."""
    return Admission(members)


def _watch_callers(state: IndexState, xs: Sequence[torch.Tensor]) -> bool:
    """Watch the caller's index tensors on ``state`` (each can write the data). Returns whether a
    proof already on the state can be taken for them: each was watched there already, is a
    member a record of this state handed out, or never wrote (``_version == 0``)."""
    known = True
    for x in xs:
        c = claim(x)
        if c is not None and state_of(c) is state:
            continue  # its record's watch covers its counter
        with state.lock:
            seen = state._watch_of(x) is not None
        if not seen:
            known = known and x._version == 0
            state.witness(x, x.detach())
    return known


def _finish(plain: torch.Tensor, state: IndexState, key: IndexKey, geom: Hashable) -> None:
    """``plain`` (built on proven index data) with a record on ``state`` watched by its own
    counter (new: nothing wrote through it yet). A write through any other counter since the
    proof shows in the state. Built in inference mode, it has no counter: volatile."""
    if plain.is_inference():
        volatile_onto(plain, geom)
        return
    m0, m1 = plain_members(plain)
    attach(plain, shared_record((m0, m1), state, key, m0._version, geom))


# ---------------------------------------------------------------------------------------------
# The fast paths' endings


def settled(plain: torch.Tensor, rec: Record, geom: Hashable,
            extra: tuple[tuple[torch.Tensor, int], ...],
            members: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> bool:
    """``plain``, built on index memory no state covered when ``rec`` was announced and just
    validated, gets ``rec`` settled as its private record: its own counter and the caller's
    tensors' (``extra``, at the versions validation read); ``members``: its member aliases
    when the caller has them (the fast path). False when a racing registration shared ``rec``
    meanwhile (:func:`checked.settle`): the caller registers. Built in inference mode:
    volatile."""
    if plain.is_inference():
        volatile_onto(plain, geom)
        return True
    m0, m1 = plain_members(plain) if members is None else members
    if not settle(rec, m0, m1, m0._version, geom, extra):
        return False
    attach(plain, rec)
    return True


def volatile_onto(plain: torch.Tensor, geom: Hashable) -> torch.Tensor:
    """``plain`` with a volatile record (validated whenever asked)."""
    m0, m1 = plain_members(plain)
    attach(plain, Record(m0, m1, VOLATILE, geom))
    return plain

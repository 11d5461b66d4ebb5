"""Admission: the one way index data comes to be trusted, and the one helper that gives a tensor
its record.

Each way in is one straight-line function or method here; the tensor layer and the factories
validate and build, and leave every question of trust to this module:

* **factories** ask once, :func:`admit` on the caller's index members in their final form; the
  returned :class:`Admission` finishes the job:

  - :meth:`Admission.proven` / :meth:`Admission.rebuilt`: members a checked tensor handed out,
    still proven (shortcut 4 of :mod:`safesparse.state.checked`): built on the record's own
    aliases, with a record on that state;
  - :meth:`Admission.validate`: a first validation. Memory no state or pending record covers
    takes the private path (announce, read the counters, validate, compare, build, settle:
    shortcut 5); anything else the registering path (register, watch the caller's tensors, a
    proof already there or validate under a snapshot, prove). Memory that cannot be watched
    (inference tensors, shared memory) is validated and volatile;
  - :func:`straight`: the compressed factories' straight path in one call (a rebuild on
    proven members, or a private first validation; None: the general path);
  - :func:`opened` / :meth:`First.close`: the private path's two halves around the caller's own
    validate-and-build, for the COO factory's straight-line fast path (build.py).

* **adoption and the guard** revalidate a tensor that has a record: :func:`revalidate`
  (``ss.validate``, the guard, results torch built).
* **fast-path results** (tensor/fastpath.py): :func:`give` (a view or ``detach()`` carries its
  input's record; :func:`safesparse.state.checked.born` makes a fresh result's).

Two rules hold for every way in:

* *Memory torch did not allocate* (:func:`safesparse.state.memory.unowned`: file mappings,
  ``torch.frombuffer`` over a ``bytearray`` or an ``mmap``, ``torch.from_numpy``, DLPack
  imports) can be written by its owner without moving any counter: the members are copied
  first and admitted on the copy (SPEC 4; docs/ops.md lists what remains).
* *One retry rule* (:func:`steady`): validation reads the counters, validates, and compares; a
  validation that saw the data change (a counter moved, or the check failed while one moved:
  the engine's fast and diagnostic passes may then disagree) is tried again, up to
  :data:`ATTEMPTS` times. A first validation that keeps seeing changes validates a private copy
  of the members instead; a revalidation (which cannot swap a tensor's members) refuses with
  the one message, :data:`CHANGING`. No internal assertion reaches a caller.

Records are attached here (:func:`give`) and nowhere else outside ``state/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import torch

from ..base.stats import count
from .checked import (
    VOLATILE,
    IndexState,
    Record,
    announce,
    claim,
    current,
    holds,
    implied_coo,
    known,
    mark_known,
    mark_validated,
    moved,
    proven_members,
    proves,
    rebuilt,
    register,
    settle,
    shared_record,
    snapshot,
    state_of,
    vouch,
)
from .members import geometry_of, plain_members
from .memory import IndexKey, Spans, index_key, must_copy, watchable_spans
from .records import attach, record

__all__ = ["ATTEMPTS", "CHANGING", "Admission", "First", "Validation", "admit", "give",
           "opened", "proven", "proven_copy", "revalidate", "settled", "steady", "straight",
           "volatile_onto"]

#: Attempts to validate index data that another thread keeps writing (see :func:`steady`).
ATTEMPTS = 3
CHANGING = ("safesparse: the index data kept changing while it was validated (another thread "
            "writes it)")

M = TypeVar("M")
R = TypeVar("R")
S = TypeVar("S")


def _own_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of index member ``x`` in memory torch allocates (nothing else can write it)."""
    return x.detach().clone(memory_format=torch.contiguous_format)


def give(t: torch.Tensor, rec: Record, cls: type | None = None) -> torch.Tensor:
    """``t`` carrying ``rec`` (and typed ``cls``, when given: a tensor torch just made, which
    nobody else holds). The one way a record is attached outside ``state/``'s own modules."""
    if cls is not None:
        t.__class__ = cls
    attach(t, rec)
    return t


def steady(check: Callable[[], R], read: Callable[[], S], settled: Callable[[S, R], bool],
           changed: Callable[[S], bool], attempts: int = ATTEMPTS) -> tuple[R] | None:
    """The one retry rule. ``read()`` takes the counters before ``check()`` reads the data;
    ``settled(before, result)`` records the result if no counter moved since (False: one did);
    ``changed(before)`` says whether one moved. A check that raises while a counter moved saw
    a racing write (its two passes may disagree: no internal assertion is passed on) and is
    tried again; one that raises with the counters unmoved is the answer, except an internal
    assertion (memory written where no counter sees it), which becomes a RuntimeError. Each
    check that passed is counted (``ss.stats().validations``). Returns
    ``(result,)``, or None after ``attempts`` attempts that each saw the data change."""
    for i in range(attempts):
        if i:
            time.sleep(0)  # (let the writer run: the next attempt may find it done)
        before = read()
        try:
            out = check()
        except AssertionError as err:
            if changed(before):
                continue
            raise RuntimeError(CHANGING) from err
        except Exception:
            if changed(before):
                continue
            raise
        count("validations")
        if settled(before, out):
            return (out,)
    return None


def _never(_: object = None) -> bool:
    return False


def _ok(_: object, __: object) -> bool:
    return True


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
    """One factory call's question about its index members (see the module docstring);
    ``cls``: the type the built tensor is given with its record."""

    __slots__ = ("cls", "copied", "members")

    def __init__(self, members: tuple[torch.Tensor, ...], cls: type | None = None) -> None:
        self.members = members
        self.cls = cls
        self.copied = False  # (the members are a copy of the caller's, made here)

    def _copy(self) -> None:
        self.members = tuple(_own_copy(m) for m in self.members)
        self.copied = True

    # -- rebuilds ---------------------------------------------------------------------------

    def proven(self, geometries: tuple[Hashable, ...]) -> Record | None:
        """:func:`proven` for these members."""
        ms = self.members
        return proven(ms[0], ms[1] if len(ms) > 1 else None, geometries)

    @staticmethod
    def proven_members(r: Record) -> tuple[torch.Tensor, torch.Tensor | None]:
        return proven_members(r)

    def rebuilt(self, plain: torch.Tensor, r: Record, geom: Hashable = None, nnz: int = 0,
                members: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> torch.Tensor:
        """``plain``, built on the index data ``r`` proves, with a record on ``r``'s state
        (``geom``: its geometry when it may differ from ``r``'s, COO's flag; ``members``: its
        member aliases when the caller has them), typed :attr:`cls`."""
        return _rebuilt_onto(plain, r, geom, nnz, members, self.cls)

    # -- first validations ------------------------------------------------------------------

    def validate(self, how: Validation[M], meta: M, *, estimate: bool = False,
                 debug: bool = False) -> tuple[torch.Tensor, bool]:
        """Validate the members and build on them (the protocol of the module docstring).
        Returns the tensor and whether it got a record (typed :attr:`cls`; False: torch gave
        it a flag validation did not prove, the plain tensor is returned for the caller to
        make an unchecked tensor of)."""
        if not self.copied and must_copy(self.members):
            self._copy()  # memory another owner can write unseen: a copy of its own
        members = self.members
        spans = watchable_spans(members)
        if spans is None:  # memory that cannot be watched: validated, volatile
            return self._built(how, validated_now(lambda: how.check(members, meta, estimate)),
                               None)
        first = opened(members, spans) if spans else None
        if first is not None:  # memory no state covers: a private record, no registration
            out = steady(lambda: how.check(members, meta, estimate), first.read,
                         lambda _, __: first.unchanged(), lambda _: not first.unchanged())
            if out is None:
                return self._contended(how, meta, estimate, debug)
            meta = out[0]
            plain = how.build(members, meta)
            geom = how.final(plain, meta)
            if geom is None:
                return plain, False
            if first.close(plain, geom, cls=self.cls):
                return plain, True
            estimate = False  # (resolved; a racing write or registration met it: register)
        key = index_key(members)
        state = register(members, key)
        if (_watch_callers(state, members) and not estimate and not debug
                and any(state.is_proven((key, g)) for g in how.known(meta))):
            count("skipped")
        else:
            out = steady(lambda: how.check(members, meta, estimate), state.snapshot,
                         lambda snap, m: state.prove((key, how.geometry(m)), snap),
                         state.moved)
            if out is None:
                return self._contended(how, meta, estimate, debug)
            meta = out[0]
        return self._built(how, meta, (state, key))

    def _contended(self, how: Validation[M], meta: M, estimate: bool,
                   debug: bool) -> tuple[torch.Tensor, bool]:
        """Every attempt saw the caller's data change (another thread writes it): validate
        and build on a private copy, which nothing else can write."""
        if self.copied:  # (nothing else holds the copy: not reached)
            raise RuntimeError(CHANGING)
        self._copy()
        return self.validate(how, meta, estimate=estimate, debug=debug)

    def _built(self, how: Validation[M], meta: M,
               on: tuple[IndexState, IndexKey] | None) -> tuple[torch.Tensor, bool]:
        """Build on the validated members; a record on ``on`` (state, view key), or volatile
        (None)."""
        plain = how.build(self.members, meta)
        geom = how.final(plain, meta)
        if geom is None:
            return plain, False
        if on is None:
            volatile_onto(plain, geom, self.cls)
            return plain, True
        state, key = on
        if geom[0] == "coo":  # type: ignore[index]
            implied_coo(state, key, geom, int(plain._nnz()))
        if plain.is_inference():  # built in inference mode: no counter to watch
            volatile_onto(plain, geom, self.cls)
            return plain, True
        # watched by its own counter (new: nothing wrote through it yet); a write through any
        # other counter since the proof shows in the state
        m0, m1 = plain_members(plain)
        give(plain, shared_record((m0, m1), state, key, m0._version, geom), self.cls)
        return plain, True


def _rebuilt_onto(plain: torch.Tensor, r: Record, geom: Hashable, nnz: int,
                  members: tuple[torch.Tensor, torch.Tensor | None] | None,
                  cls: type | None) -> torch.Tensor:
    """:meth:`Admission.rebuilt` (and :func:`straight`'s rebuild)."""
    if plain.is_inference():
        return volatile_onto(plain, r.geom if geom is None else geom, cls)
    m0, m1 = plain_members(plain) if members is None else members
    return give(plain, rebuilt(r, m0, m1, m0._version, geom, nnz), cls)


def straight(c: torch.Tensor, p: torch.Tensor, values: torch.Tensor, size: tuple[int, ...],
             geom: Hashable, build: Callable[..., torch.Tensor],
             compressed_of: Callable[[torch.Tensor], torch.Tensor],
             check: Callable[[], object], cls: type) -> torch.Tensor | None:
    """The compressed factories' straight path (:func:`safesparse.factories.build.
    fast_compressed`), in one call: the caller's members ``c`` / ``p`` in their final form,
    past the metadata stage (``geom``), ``values`` the member torch is given (an alias of the
    caller's), ``build`` torch's unchecked constructor of the layout, ``compressed_of`` the
    layout's compressed-member accessor, ``check()`` the index stage (raises, located). Returns
    the tensor, typed ``cls`` with its record, or None (nothing built that counts): the caller
    takes the general path (:func:`admit`), which asks again.

    * members a checked tensor handed out, still proven (shortcut 4): built on the record's
      own aliases of them (see ``build.own_alias``), a record on its state;
    * memory no state or pending record covers (shortcut 5): announced, validated by
      ``check()`` with the caller's counters read before, built by torch's unchecked
      constructor on detached aliases, settled private. (Not torch's factory with
      ``check_invariants=True``: it sets torch's process-wide invariant-check flag for the
      call and restores what it saw, so two threads in it at once can leave it on for good.)
    Anything else (memory torch did not allocate, memory a state may cover, a failed check
    while a counter moved, a racing registration) is None."""
    first = opened((c, p))  # (one question: memory no record claims, no state covers)
    if first is None:
        r = proven(c, p, (geom,))  # (members a checked tensor handed out)
        if r is None:
            return None
        own0, own1 = proven_members(r)
        built = build(own0, own1, values, size, check_invariants=False)
        return _rebuilt_onto(built, r, None, 0, (compressed_of(built), own1), cls)
    if not first.passes(check):
        return None
    cd = c.detach()
    pd = p.detach()
    plain = build(cd, pd, values, size, check_invariants=False)
    # m0: an alias sharing the new tensor's counter; m1: the new tensor's own plain member (a
    # detached alias of the caller's, sharing its counter), whose data pointer tells a move;
    # the caller's counters are watched through the detached aliases
    if not first.close(plain, geom, (cd, pd), (compressed_of(plain), pd), cls):
        return None  # written meanwhile, or a racing registration
    return plain


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

    def passes(self, check: Callable[[], object]) -> bool:
        """The caller's own validation of the members (the factories' fast path), one attempt
        under :func:`steady`'s rule: True when it passed (counted); False when it failed while
        a counter moved since :func:`opened` (a racing write: the caller takes the general
        path, which tries again); else its error (an internal assertion as RuntimeError)."""
        return steady(check, _never, _ok, lambda _: not self.unchanged(), 1) is not None

    def close(self, plain: torch.Tensor, geom: Hashable,
              aliases: tuple[torch.Tensor, ...] | None = None,
              members: tuple[torch.Tensor, torch.Tensor | None] | None = None,
              cls: type | None = None) -> bool:
        """``plain`` was built on the validated data: settle the record onto it (its own
        counter and the caller's at the versions read, watched through ``aliases``, detached
        aliases of the caller's tensors; ``members``: ``plain``'s member aliases, when the
        caller has them) and type it ``cls``. False when a counter moved since :meth:`read`
        or a racing registration shared the record: the caller takes the registering path."""
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
        return settled(plain, self.rec, geom, extra, members, cls)


def _versions(members: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    if len(members) == 1:
        return (members[0]._version,)
    return (members[0]._version, members[1]._version)


def opened(members: tuple[torch.Tensor, ...], spans: Spans | None = None) -> First | None:
    """Open a first validation of ``members`` (their memory ``spans``, watchable; None: the
    factories' straight path, which asks for torch's own memory that no record claims): None
    when memory overlapping it may be covered (a state, a claim, another open first
    validation) or cannot be watched: the caller takes the registering path."""
    rec = announce(members[0], members[1] if len(members) > 1 else None, spans)
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


def admit(members: tuple[torch.Tensor, ...], cls: type | None = None) -> Admission:
    """Ask once about the caller's index ``members`` (final form: compressed and plain, or the
    COO indices); the :class:`Admission` finishes the job, typing what it builds ``cls``."""
    return Admission(members, cls)


def _watch_callers(state: IndexState, xs: Sequence[torch.Tensor]) -> bool:
    """Watch the caller's index tensors on ``state`` (each can write the data). Returns whether a
    proof already on the state can be taken for them: each was watched there already, is a
    member a record of this state handed out, or never wrote (``_version == 0``)."""
    ok = True
    for x in xs:
        c = claim(x)
        if c is not None and state_of(c) is state:
            continue  # its record's watch covers its counter
        if not state.watching(x):
            ok = ok and x._version == 0
            state.witness(x, x.detach())
    return ok


# ---------------------------------------------------------------------------------------------
# Revalidation of a tensor that has a record (ss.validate, the guard, results torch built)


def revalidate(t: torch.Tensor, check: Callable[[bool], object], *, debug: bool = False,
               watched: bool = True) -> None:
    """Validate ``t`` (a SafeSparseTensor, read as a plain tensor) and record it as checked.
    ``check(indices)`` validates it (``indices=False``: the O(1) metadata only) and raises
    ``InvariantError``. ``watched=False``: ``t`` was only just wrapped, so writes through its
    counter before that went unseen. A proof already on its index data is taken (the
    metadata checked); else the data is validated under :func:`steady`, and refused with
    :data:`CHANGING` when every attempt saw it change."""
    old = record(t)
    rec = current(t)
    watched = watched and rec is old  # a record made just now saw no earlier write
    geometry = geometry_of(t)
    if not debug and known(rec, geometry, watched):
        # proven index data, and no write through t's own counter that the proof missed
        check(False)
        count("skipped")
        if mark_known(rec, geometry):
            return
    out = steady(lambda: check(True), lambda: snapshot(rec),
                 lambda snap, _: mark_validated(rec, geometry, *snap),
                 lambda snap: moved(rec, *snap))
    if out is None:
        raise RuntimeError(CHANGING + "; the tensor is left unchecked")


def validated_now(check: Callable[[], R]) -> R:
    """One validation of data no counter here watches (a plain tensor's members, memory that
    cannot be watched), under :func:`steady`'s rule for failures: an internal assertion (the
    data changed while it was read) becomes a RuntimeError. Counted."""
    out = steady(check, _never, _ok, _never, 1)
    assert out is not None  # (one attempt, which cannot see a change)
    return out[0]


def proven_copy(rec: Record, m0: torch.Tensor, m1: torch.Tensor) -> Record | None:
    """The record proving index members ``m0`` / ``m1`` that a factory just built ``rec``'s
    tensor on: ``rec`` itself, or, where the factory validated a copy of them (their memory is
    not torch's allocation: a program's constants loaded with ``torch.export.load``), a record
    proving ``m0`` / ``m1`` themselves on their memory's state, watched by their
    counters, if they hold the very data ``rec`` proves now (compared under a snapshot of the
    counters: O(nnz), once); else None. Only for index buffers of model code
    (:mod:`.members_proof`), whose owner is torch's loader: docs/ops.md, limits."""
    if rec.ver < 0 or rec.m1 is None or not holds(rec):
        return None
    if proves(rec, m0, m1, (rec.geom,)):
        return rec  # built on these very members
    members = (m0, m1)
    key = index_key(members)
    state = register(members, key)
    _watch_callers(state, members)
    snap = state.snapshot()
    if not (torch.equal(m0, rec.m0) and torch.equal(m1, rec.m1)):
        return None
    if not state.prove((key, rec.geom), snap):
        return None
    return shared_record((m0.detach(), m1.detach()), state, key, m0._version, rec.geom)


# ---------------------------------------------------------------------------------------------
# The fast paths' endings


def settled(plain: torch.Tensor, rec: Record, geom: Hashable,
            extra: tuple[tuple[torch.Tensor, int], ...],
            members: tuple[torch.Tensor, torch.Tensor | None] | None = None,
            cls: type | None = None) -> bool:
    """``plain``, built on index memory no state covered when ``rec`` was announced and just
    validated, gets ``rec`` settled as its private record (and is typed ``cls``): its own
    counter and the caller's tensors' (``extra``, at the versions validation read);
    ``members``: its member aliases when the caller has them (the fast path). False when a
    racing registration shared ``rec`` meanwhile (:func:`checked.settle`): the caller
    registers. Built in inference mode: volatile."""
    if plain.is_inference():
        volatile_onto(plain, geom, cls)
        return True
    m0, m1 = plain_members(plain) if members is None else members
    if not settle(rec, m0, m1, m0._version, geom, extra):
        return False
    give(plain, rec, cls)
    return True


def volatile_onto(plain: torch.Tensor, geom: Hashable, cls: type | None = None) -> torch.Tensor:
    """``plain`` with a volatile record (validated whenever asked), typed ``cls``."""
    m0, m1 = plain_members(plain)
    return give(plain, Record(m0, m1, VOLATILE, geom), cls)


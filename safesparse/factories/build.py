"""Building a checked tensor from members in their final form: the second half of every factory.

:mod:`safesparse.factories` converts the arguments and runs the O(1) metadata stage; what is
left is here, one straight path per case:

* **rebuild** on members a checked tensor handed out (``ss.sparse_csr_tensor(t.crow_indices(),
  t.col_indices(), v, t.shape)``): proven through the record the members carry (checked.py,
  shortcut 4): no storage lookup, no O(nnz) check; the new tensor's counter joins that state.
* **first validation**: the state of the index memory is found (or made) once by memory range,
  the caller's index tensors are watched there (they can write the data), the index stage runs
  unless that state already proves this view and geometry, and the proof is taken from a
  snapshot of the counters made before validation read the data.
* **volatile** index memory (inference tensors, shared memory, file mappings): validated, never
  remembered (validated again whenever asked).
* **unchecked** (``check_invariants=False``): built and joined, not validated.

The result is the tensor torch built, retyped (no wrapper object).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

import torch

from ..base import originals as _originals
from ..base.compiling import bind
from ..base.debug_flag import is_debug
from ..engine import validation
from ..engine.metadata import (
    CompressedMeta,
    CooMeta,
    _accept_compressed_metadata,
    check_coo_metadata,
)
from ..engine.validation import (
    _native_coo_accepts,
    check_compressed_indices,
    check_coo_indices,
    native_accepts_contiguous,
    native_coo_ok,
)
from ..state import checked
from ..state.checked import VOLATILE, Record, attach, claim, plain_members
from ..state.memory import file_mapped, watchable_spans
from ..tensor.core import SafeSparseTensor, retype

__all__ = ["compressed", "coo", "fast_compressed", "fast_coo", "final_size", "own_alias",
           "unchecked"]

_BUILD: Final[dict[torch.layout, Callable[..., torch.Tensor]]] = {
    torch.sparse_csr: _originals.sparse_csr_tensor,
    torch.sparse_csc: _originals.sparse_csc_tensor,
    torch.sparse_bsr: _originals.sparse_bsr_tensor,
    torch.sparse_bsc: _originals.sparse_bsc_tensor,
}
#: Attempts to validate index data that another thread keeps writing, before giving up.
_ATTEMPTS = 3


def _extra(requires_grad: bool, pin_memory: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if requires_grad:
        out["requires_grad"] = True
    if pin_memory:
        out["pin_memory"] = True
    return out


def own_alias(x: torch.Tensor) -> torch.Tensor:
    """A member for torch's constructor (every path of the factories, unchecked builds
    included) that only the built tensor holds: a detached alias of the caller's tensor (same
    memory and counter), so that ``.data =`` on the caller's tensor
    (``col.data = col[:1]``, ``nn.Module._apply``) changes that tensor, never the built one
    (torch keeps the tensors it is given as the members themselves). Values that require grad
    get a view instead, which keeps them in the autograd graph."""
    return x.view_as(x) if x.requires_grad else x.detach()


def _own_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of index member ``x`` in memory torch allocates (nothing else can write it)."""
    return x.detach().clone(memory_format=torch.contiguous_format)


def _key(members: Sequence[torch.Tensor]) -> checked.IndexKey:
    return tuple((m.data_ptr(), tuple(m.shape), m.stride(), m.dtype, m.device) for m in members)


def _finish(plain: torch.Tensor, state: checked.IndexState, key: checked.IndexKey,
            geom: Hashable) -> SafeSparseTensor:
    """``plain`` (built on proven index data) retyped, with a record on ``state`` watched by its
    own counter (new: nothing wrote through it yet). A write through any other counter since
    the proof shows in the state (the record is unchecked at its next check). Built in
    inference mode, it has no counter: volatile (validated whenever asked)."""
    if plain.is_inference():
        return _volatile(plain, geom)
    m0, m1 = plain_members(plain)
    rec = checked.shared_record((m0, m1), state, key, m0._version, geom)
    plain.__class__ = SafeSparseTensor  # (torch just made it: nobody else holds it)
    plain.__dict__["_ss"] = rec
    return plain  # type: ignore[return-value]


def _rebuilt(plain: torch.Tensor, r: Record, nnz: int = 0) -> SafeSparseTensor:
    """``plain``, built on the index data ``r`` proves (:func:`checked.vouch` accepted the
    members), retyped with a record on ``r``'s state; COO with the coalesced flag torch gave
    it (``nnz``: its stored entries)."""
    geom = checked.geometry_of(plain)
    if plain.is_inference():
        return _volatile(plain, geom)
    m0, m1 = plain_members(plain)
    rec = checked.rebuilt(r, m0, m1, m0._version, geom, nnz)
    plain.__class__ = SafeSparseTensor  # (torch just made it: nobody else holds it)
    plain.__dict__["_ss"] = rec
    return plain  # type: ignore[return-value]


def _watch_callers(state: checked.IndexState, xs: Sequence[torch.Tensor]) -> bool:
    """Watch the caller's index tensors on ``state`` (each can write the data). Returns whether a
    proof already on the state can be taken for them: each was watched there already, is a
    member a record of this state handed out, or never wrote (``_version == 0``)."""
    known = True
    for x in xs:
        c = claim(x)
        if c is not None and checked.state_of(c) is state:
            continue  # its record's watch covers its counter
        with state.lock:
            seen = state._watch_of(x) is not None
        if not seen:
            known = known and x._version == 0
            state.witness(x, x.detach())
    return known


_CHANGING = ("safesparse: the index data kept changing while it was validated (another thread "
             "writes it); nothing was built")


def _private(plain: torch.Tensor, geom: Hashable, extra: tuple[tuple[torch.Tensor, int], ...],
             rec: Record) -> SafeSparseTensor | None:
    """``plain``, built on index memory no state covered when ``rec`` was announced and just
    validated, retyped with ``rec`` settled as its private record: its own counter and the
    caller's tensors' (``extra``, at the versions validation read). None when a racing
    registration shared ``rec`` meanwhile (:func:`checked.settle`): the caller registers."""
    if plain.is_inference():
        return _volatile(plain, geom)
    m0, m1 = plain_members(plain)
    if not checked.settle(rec, m0, m1, m0._version, geom, extra):
        return None
    plain.__class__ = SafeSparseTensor  # (torch just made it: nobody else holds it)
    plain.__dict__["_ss"] = rec
    return plain  # type: ignore[return-value]


def _volatile(plain: torch.Tensor, geom: Hashable) -> SafeSparseTensor:
    m0, m1 = plain_members(plain)
    out = retype(plain)
    attach(out, Record(m0, m1, VOLATILE, geom))
    return out


# ---------------------------------------------------------------------------------------------
# Compressed layouts


#: Values the fast path takes as they are (a Parameter: a layer's weights).
_VALUE_TYPES = (torch.Tensor, torch.nn.Parameter)
_T = torch.Tensor


def final_size(size: Any) -> tuple[int, ...] | None:
    """``size`` when it is already a tuple of Python ints or a ``torch.Size`` (the fast path's
    form), else None (the factories convert or refuse it)."""
    if type(size) is torch.Size:
        return tuple(size)
    if type(size) is tuple:
        for x in size:
            if type(x) is not int:
                return None
        return size
    return None


def fast_compressed(c: Any, p: Any, v: Any, size: Any, layout: torch.layout | None,
                    dtype: torch.dtype | None, device: Any, pin_memory: bool,
                    requires_grad: bool, check_invariants: bool | None
                    ) -> SafeSparseTensor | None:
    """The factories' common case, in a straight line: members already in their final form
    (tensors of an index dtype, contiguous, on the values' device), an explicit size, nothing
    to convert, checks on. None (nothing done) for anything else: the caller converts the
    arguments and takes :func:`compressed`.

    A rebuild on a checked record's members is proven through it; index memory no state covers
    is validated (torch's native checker on the CPU, behind the engine's metadata stage and
    offsets pre-check) and gets a private record; anything else goes to :func:`compressed`."""
    if (dtype is not None or device is not None or pin_memory or requires_grad
            or check_invariants is False or type(c) is not _T or type(p) is not _T
            or type(v) not in _VALUE_TYPES or layout not in _BUILD):
        return None
    shape = final_size(size)
    if shape is None:
        return None
    meta = _accept_compressed_metadata(c, p, v, shape, layout, None, None)
    if meta is None or is_debug() or validation._forked:  # (a forked child: validation.py)
        return None
    geom = ("compressed", meta.n_compressed, meta.n_plain)
    build = _BUILD[layout]
    if claim(c) is not None:
        # members a checked tensor handed out: proven through its record (checked.proves:
        # the same objects at the proven views, unwritten since, the same geometry)
        r = checked.vouch(c, p, (geom,))
        if r is None:
            return compressed(c, p, v, meta)
        checked.count("skipped")
        # built on the record's own aliases of the proven members (see own_alias), not on the
        # caller's handed-out tensors; m1: the new tensor's own plain member
        own0, own1 = checked.proven_members(r)
        built = build(own0, own1, v.view_as(v) if v.requires_grad else v.detach(), shape,
                      check_invariants=False)
        if built.is_inference():
            return _volatile(built, geom)
        m0 = built.crow_indices() if meta.info.row_compressed else built.ccol_indices()
        rec = checked.rebuilt(r, m0, own1, m0._version)
        built.__class__ = SafeSparseTensor
        built.__dict__["_ss"] = rec
        return built  # type: ignore[return-value]
    spans = watchable_spans((c, p))
    if not spans:  # (no memory at all: a state per view key; or memory never cached)
        return compressed(c, p, v, meta)
    pending = checked.announce(spans, c, p)
    if pending is None:  # memory a state or another first validation may cover
        return compressed(c, p, v, meta)
    vc = c._version
    vp = p._version
    # torch's index kernel (validation.py's native path, behind its preconditions and the
    # offsets pre-check), then torch's unchecked constructor. Not torch's factory with
    # check_invariants=True: it sets torch's process-wide invariant-check flag for the call and
    # restores what it saw, so two threads in it at once can leave the flag on for good
    # (every later torch factory validating, torch.load's post-load check enabled)
    if not native_accepts_contiguous(meta, c, p, v):
        check_compressed_indices(meta, c, p)  # raises, located; or accepts what torch refused
    checked.count("validations")
    cd = c.detach()
    pd = p.detach()
    # (own_alias inlined: the factories' hot path)
    plain = build(cd, pd, v.view_as(v) if v.requires_grad else v.detach(), shape,
                  check_invariants=False)
    if c._version != vc or p._version != vp:
        return compressed(c, p, v, meta)  # written meanwhile: the general way decides
    if plain.is_inference():
        return _volatile(plain, geom)
    # m0: an alias sharing the new tensor's counter; m1: the new tensor's own plain member (a
    # detached alias of the caller's, sharing its counter), whose data pointer tells a move;
    # the caller's counters are watched through the detached aliases
    m0 = plain.crow_indices() if meta.info.row_compressed else plain.ccol_indices()
    if not checked.settle(pending, m0, pd, m0._version, geom, ((cd, vc), (pd, vp))):
        return compressed(c, p, v, meta)  # a racing registration met it: register
    plain.__class__ = SafeSparseTensor  # (torch just made it: nobody else holds it)
    plain.__dict__["_ss"] = pending
    return plain  # type: ignore[return-value]


def fast_coo(idx: Any, v: Any, size: Any, dtype: torch.dtype | None, device: Any,
             pin_memory: bool, requires_grad: bool, check_invariants: bool | None,
             is_coalesced: bool | None) -> SafeSparseTensor | None:
    """:func:`fast_compressed` for COO: int64 indices and values as they are, an explicit size;
    None (nothing done) for anything else."""
    if (dtype is not None or device is not None or pin_memory or requires_grad
            or check_invariants is False or type(idx) is not _T or type(v) not in _VALUE_TYPES
            or idx.dtype is not torch.int64 or not v.dim()):
        return None
    shape = final_size(size)
    if shape is None or is_debug() or validation._forked:  # (a forked child: validation.py)
        return None
    meta = check_coo_metadata(idx, v, shape)
    if claim(idx) is not None:
        return coo(idx, v, meta, is_coalesced)
    spans = watchable_spans((idx,))
    if not spans:
        return coo(idx, v, meta, is_coalesced)
    pending = checked.announce(spans, idx, None)
    if pending is None:
        return coo(idx, v, meta, is_coalesced)
    coalesced = bool(is_coalesced)
    vi = idx._version
    if not (native_coo_ok(meta, idx, v, is_coalesced=coalesced)
            and _native_coo_accepts(meta, idx, v, is_coalesced=coalesced)):
        check_coo_indices(meta, idx, is_coalesced=coalesced)  # the vectorised path: located
    checked.count("validations")
    plain = _originals.sparse_coo_tensor(idx.detach(), own_alias(v), shape, check_invariants=False,
                                         is_coalesced=is_coalesced)
    if idx._version != vi:
        return coo(idx, v, meta, is_coalesced)  # written meanwhile: the general way decides
    # the coalesced flag torch gave it: the validated one, or (nnz <= 1) trivially true
    flag = plain.is_coalesced()
    if flag and not coalesced and meta.nnz > 1:
        return unchecked(plain, (idx,))
    out = _private(plain, ("coo", shape[: meta.sparse_dim], flag), ((idx, vi),), pending)
    return coo(idx, v, meta, is_coalesced) if out is None else out


# the factories call build.fast_* by attribute: bound here, never traced by torch.compile
bind(sys.modules[__name__], "fast_compressed", fast_compressed)
bind(sys.modules[__name__], "fast_coo", fast_coo)


def compressed(c: torch.Tensor, p: torch.Tensor, v: torch.Tensor, meta: CompressedMeta, *,
               requires_grad: bool = False, pin_memory: bool = False,
               estimate: bool = False) -> SafeSparseTensor:
    """A checked tensor of ``meta``'s layout on members in their final form, which passed the
    metadata stage (``estimate``: the size was omitted; the index stage resolves it)."""
    geom = checked.compressed_geometry(meta.n_compressed, meta.n_plain)
    extra = _extra(requires_grad, pin_memory)
    build = _BUILD[meta.info.layout]
    debug = is_debug()
    if not estimate and not debug:
        r = checked.vouch(c, p, (geom,)) if claim(c) is not None else None
        if r is not None:
            checked.count("skipped")
            own0, own1 = checked.proven_members(r)
            return _rebuilt(build(own0, own1, own_alias(v), meta.size, check_invariants=False,
                                  **extra), r)
    spans = watchable_spans((c, p))
    if spans is None and file_mapped((c, p)):
        # index memory in a file mapping (SPEC 4): built and validated on a copy of its own
        c, p = _own_copy(c), _own_copy(p)
        spans = watchable_spans((c, p))
    # torch builds on detached aliases (see own_alias), validation reads the caller's tensors (the
    # same memory and view) and watches their counters
    cd, pd, vd = c.detach(), p.detach(), own_alias(v)
    if spans is None:
        meta = check_compressed_indices(meta, c, p, estimate=estimate, values=v)
        checked.count("validations")
        return _volatile(build(cd, pd, vd, meta.size, check_invariants=False, **extra),
                         checked.compressed_geometry(meta.n_compressed, meta.n_plain))
    pending = checked.announce(spans, c, p) if spans else None
    if pending is not None:
        # memory no state covers: a private record (checked.py), no registration
        for _ in range(_ATTEMPTS):
            vc, vp = c._version, p._version
            meta = check_compressed_indices(meta, c, p, estimate=estimate, values=v)
            checked.count("validations")
            if c._version == vc and p._version == vp:
                break
        else:
            raise RuntimeError(_CHANGING)
        geom = checked.compressed_geometry(meta.n_compressed, meta.n_plain)
        plain = build(cd, pd, vd, meta.size, check_invariants=False, **extra)
        if c._version == vc and p._version == vp:  # (else written meanwhile: register)
            out = _private(plain, geom, ((cd, vc), (pd, vp)), pending)
            if out is not None:
                return out
        estimate = False  # (resolved; a racing write or registration met it: register)
    key = _key((c, p))
    state = checked.register((c, p), key)
    known = _watch_callers(state, (c, p)) and not estimate and not debug
    if known and state.is_proven((key, geom)):
        checked.count("skipped")
    else:
        for _ in range(_ATTEMPTS):
            snap = state.snapshot()
            meta = check_compressed_indices(meta, c, p, estimate=estimate, values=v)
            checked.count("validations")
            geom = checked.compressed_geometry(meta.n_compressed, meta.n_plain)
            if state.prove((key, geom), snap):
                break
        else:
            raise RuntimeError(_CHANGING)
    return _finish(build(cd, pd, vd, meta.size, check_invariants=False, **extra), state, key, geom)


# ---------------------------------------------------------------------------------------------
# COO


def coo(idx: torch.Tensor, v: torch.Tensor, meta: CooMeta, is_coalesced: bool | None, *,
        requires_grad: bool = False, pin_memory: bool = False,
        estimate: bool = False) -> SafeSparseTensor:
    """A checked COO tensor on members in their final form, which passed the metadata stage.
    A proof for the indices as coalesced also proves them for an uncoalesced tensor."""
    coalesced = bool(is_coalesced)
    extra = _extra(requires_grad, pin_memory)
    debug = is_debug()

    own_v = own_alias(v)  # (see own_alias)

    def build(size: Sequence[int], own_idx: torch.Tensor | None = None) -> torch.Tensor:
        return _originals.sparse_coo_tensor(idx.detach() if own_idx is None else own_idx,
                                            own_v, size, check_invariants=False,
                                            is_coalesced=is_coalesced, **extra)

    sparse = tuple(meta.size[: meta.sparse_dim])
    if not estimate and not debug and claim(idx) is not None:
        r = checked.vouch(idx, None, (checked.coo_geometry(sparse, coalesced),
                                      checked.coo_geometry(sparse, True)))
        if r is not None:
            checked.count("skipped")
            return _rebuilt(build(meta.size, checked.proven_members(r)[0]), r, meta.nnz)
    spans = watchable_spans((idx,))
    if spans is None and file_mapped((idx,)):
        idx = _own_copy(idx)  # a file mapping (SPEC 4): built and validated on a copy
        spans = watchable_spans((idx,))
    if spans is None:
        meta = check_coo_indices(meta, idx, is_coalesced=coalesced, estimate=estimate, values=v)
        checked.count("validations")
        plain = build(meta.size)
        return _volatile(plain, checked.coo_geometry(meta.size[: meta.sparse_dim],
                                                     plain.is_coalesced()))
    pending = checked.announce(spans, idx, None) if spans else None
    if pending is not None:
        for _ in range(_ATTEMPTS):
            vi = idx._version
            meta = check_coo_indices(meta, idx, is_coalesced=coalesced, estimate=estimate,
                                     values=v)
            checked.count("validations")
            if idx._version == vi:
                break
        else:
            raise RuntimeError(_CHANGING)
        plain = build(meta.size)
        # the coalesced flag torch gave it: the validated one, or (nnz <= 1) trivially true
        flag = plain.is_coalesced()
        if flag and not coalesced and meta.nnz > 1:
            return unchecked(plain, (idx,))
        if idx._version == vi:  # (else written meanwhile: register)
            out = _private(plain, checked.coo_geometry(meta.size[: meta.sparse_dim], flag),
                           ((idx, vi),), pending)
            if out is not None:
                return out
        estimate = False  # (resolved; a racing write or registration met it: register)
        sparse = tuple(meta.size[: meta.sparse_dim])
    key = _key((idx,))
    state = checked.register((idx,), key)
    known = _watch_callers(state, (idx,)) and not estimate and not debug
    if known and any(state.is_proven((key, checked.coo_geometry(sparse, flag)))
                     for flag in {coalesced, True}):
        checked.count("skipped")
    else:
        for _ in range(_ATTEMPTS):
            snap = state.snapshot()
            meta = check_coo_indices(meta, idx, is_coalesced=coalesced, estimate=estimate,
                                     values=v)
            checked.count("validations")
            sparse = tuple(meta.size[: meta.sparse_dim])
            if state.prove((key, checked.coo_geometry(sparse, coalesced)), snap):
                break
        else:
            raise RuntimeError(_CHANGING)
    return _finish_coo(build(meta.size), state, key, sparse, meta.nnz)


def _finish_coo(plain: torch.Tensor, state: checked.IndexState, key: checked.IndexKey,
                sparse: tuple[int, ...], nnz: int) -> SafeSparseTensor:
    """As :func:`_finish`, with the geometry of the coalesced flag torch gave ``plain``
    (:func:`checked.implied_coo`)."""
    geom = checked.coo_geometry(sparse, plain.is_coalesced())
    checked.implied_coo(state, key, geom, nnz)
    return _finish(plain, state, key, geom)


# ---------------------------------------------------------------------------------------------
# check_invariants=False


def unchecked(plain: torch.Tensor, members: Sequence[torch.Tensor]) -> SafeSparseTensor:
    """``plain`` (built without validation on the caller's ``members``) retyped and joined to
    the state of its index memory, unchecked; the caller's members that it shares are watched
    there (they can write it)."""
    out = retype(plain)
    rec = checked.join(out)
    ptrs = {m.data_ptr() for m in rec.members()}
    for x in members:
        if isinstance(x, torch.Tensor) and not isinstance(x, SafeSparseTensor) \
                and x.numel() and x.data_ptr() in ptrs and not x.is_inference():
            checked.watch(rec, x)
    return out

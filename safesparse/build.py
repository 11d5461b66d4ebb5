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

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

import torch

from . import _originals, checked
from .checked import UNCHECKED, VOLATILE, Record, attach, claim, holds, plain_members
from .debug import is_debug
from .metadata import CompressedMeta, CooMeta
from .tensor import SafeSparseTensor, retype
from .validation import check_compressed_indices, check_coo_indices

__all__ = ["compressed", "coo", "unchecked"]

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


def _at(m: torch.Tensor | None, x: torch.Tensor) -> bool:
    """``x`` is at ``m``'s view: data pointer, shape, strides."""
    return (m is not None and x.data_ptr() == m.data_ptr() and x.shape == m.shape
            and x.stride() == m.stride())


def _key(members: Sequence[torch.Tensor]) -> checked.IndexKey:
    return tuple((m.data_ptr(), tuple(m.shape), m.stride(), m.dtype, m.device) for m in members)


def _finish(plain: torch.Tensor, state: checked.IndexState, key: checked.IndexKey,
            geom: Hashable) -> SafeSparseTensor:
    """``plain`` (built on proven index data) retyped, with a record on ``state`` watched by its
    own counter; unchecked if a write landed since the proof (the guard validates it then).
    Built in inference mode, it has no counter: volatile (validated whenever asked)."""
    if plain.is_inference():
        return _volatile(plain, geom)
    m0, m1 = plain_members(plain)
    rec = checked.shared_record((m0, m1), state, key, m0._version, geom)
    if not holds(rec):
        rec.ver = UNCHECKED
    out = retype(plain)
    attach(out, rec)
    return out


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


def _volatile(plain: torch.Tensor, geom: Hashable) -> SafeSparseTensor:
    m0, m1 = plain_members(plain)
    out = retype(plain)
    attach(out, Record(m0, m1, VOLATILE, geom))
    return out


# ---------------------------------------------------------------------------------------------
# Compressed layouts


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
        r = claim(c)
        if (r is not None and claim(p) is r and r.geom == geom and _at(r.m0, c)
                and _at(r.m1, p) and holds(r)):
            state = checked.share(r)
            assert state is not None  # (a record that handed out members is shared)
            checked.count("skipped")
            return _finish(build(c, p, v, meta.size, check_invariants=False, **extra), state,
                           r.key, geom)
    if checked.foreign((c, p)):
        meta = check_compressed_indices(meta, c, p, estimate=estimate, values=v)
        checked.count("validations")
        return _volatile(build(c, p, v, meta.size, check_invariants=False, **extra),
                         checked.compressed_geometry(meta.n_compressed, meta.n_plain))
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
            raise RuntimeError("safesparse: the index data kept changing while it was "
                               "validated (another thread writes it); nothing was built")
    return _finish(build(c, p, v, meta.size, check_invariants=False, **extra), state, key, geom)


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

    def build(size: Sequence[int]) -> torch.Tensor:
        return _originals.sparse_coo_tensor(idx, v, size, check_invariants=False,
                                            is_coalesced=is_coalesced, **extra)

    sparse = tuple(meta.size[: meta.sparse_dim])
    if not estimate and not debug:
        r = claim(idx)
        if (r is not None and r.m1 is None and _at(r.m0, idx) and holds(r)
                and r.geom in (checked.coo_geometry(sparse, coalesced),
                               checked.coo_geometry(sparse, True))):
            state = checked.share(r)
            assert state is not None
            checked.count("skipped")
            return _finish_coo(build(meta.size), state, r.key, sparse, meta.nnz)
    if checked.foreign((idx,)):
        meta = check_coo_indices(meta, idx, is_coalesced=coalesced, estimate=estimate, values=v)
        checked.count("validations")
        plain = build(meta.size)
        return _volatile(plain, checked.coo_geometry(meta.size[: meta.sparse_dim],
                                                     plain.is_coalesced()))
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
            raise RuntimeError("safesparse: the index data kept changing while it was "
                               "validated (another thread writes it); nothing was built")
    return _finish_coo(build(meta.size), state, key, sparse, meta.nnz)


def _finish_coo(plain: torch.Tensor, state: checked.IndexState, key: checked.IndexKey,
                sparse: tuple[int, ...], nnz: int) -> SafeSparseTensor:
    """As :func:`_finish`, with the geometry of the coalesced flag torch gave ``plain``: an
    index set proven coalesced is proven uncoalesced too, and one of at most one entry is
    trivially coalesced (torch marks such a tensor coalesced)."""
    flag = plain.is_coalesced()
    geom = checked.coo_geometry(sparse, flag)
    with state.lock:
        proven = state.proven
        if (key, geom) not in proven:
            other = (key, checked.coo_geometry(sparse, not flag))
            if other in proven and (not flag or nnz <= 1):
                proven.add((key, geom))
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

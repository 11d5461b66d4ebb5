"""Building a checked tensor from members in their final form: the second half of every factory.

:mod:`safesparse.factories` converts the arguments and runs the O(1) metadata stage; what is
left is here. Trust is asked for once, :func:`safesparse.state.admission.admit` on the caller's
index members, and the admission finishes the job (the protocol is written there, in
``state/``; this module builds tensors, and the admission gives them their record and type):

* **rebuild** on members a checked tensor handed out (``ss.sparse_csr_tensor(t.crow_indices(),
  t.col_indices(), v, t.shape)``): proven through the record the members carry (checked.py,
  shortcut 4): no storage lookup, no O(nnz) check; the new tensor's counter joins that state.
* **first validation** (:meth:`Admission.validate`): private when no state covers the memory,
  else registered (watched, proven from a snapshot of the counters made before validation read
  the data, or already proven there). Index members in a file mapping are copied first.
* **volatile** index memory (inference tensors, shared memory): validated, never remembered
  (validated again whenever asked).
* **unchecked** (``check_invariants=False``): built and joined, not validated.

:func:`fast_compressed` / :func:`fast_coo` keep the common case in a straight line (the per-op
costs of SPEC 4). :func:`fast_compressed` runs the metadata stage and hands the members to the
admission once (:func:`safesparse.state.admission.straight`: a rebuild on proven members, or a
private first validation; ``tools/walk.py`` follows ``crow_indices`` through it);
:func:`fast_coo` opens the private path itself and ends it with
:func:`safesparse.state.admission.First.close`. Anything else goes to :func:`compressed` /
:func:`coo`. The result is the tensor torch built, retyped (no wrapper object).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Final

import torch

from ..base import originals as _originals
from ..base.compiling import bind
from ..base.debug_flag import is_debug
from ..base.forking import in_forked_child
from ..base.layouts import COMPRESSED_LAYOUTS, INDEX_MEMBERS
from ..engine.metadata import (
    CompressedMeta,
    CooMeta,
    _accept_compressed_metadata,
    check_coo_metadata,
)
from ..engine.validation import (
    _native_coo_accepts,
    check_compressed_indices,
    check_contiguous_compressed,
    check_coo_indices,
    native_coo_ok,
)
from ..state import checked, writers
from ..state.writers import Validation, admit, opened, straight
from ..tensor.core import SafeSparseTensor, retype

__all__ = ["compressed", "coo", "fast_compressed", "fast_coo", "final_size", "own_alias",
           "unchecked"]

_BUILD: Final[dict[torch.layout, Callable[..., torch.Tensor]]] = {
    torch.sparse_csr: _originals.sparse_csr_tensor,
    torch.sparse_csc: _originals.sparse_csc_tensor,
    torch.sparse_bsr: _originals.sparse_bsr_tensor,
    torch.sparse_bsc: _originals.sparse_bsc_tensor,
}


#: Each compressed layout's compressed-member accessor (``Tensor.crow_indices`` ...).
_COMPRESSED_OF: Final[dict[torch.layout, Callable[[torch.Tensor], torch.Tensor]]] = {
    layout: getattr(torch.Tensor, INDEX_MEMBERS[layout][0]) for layout in COMPRESSED_LAYOUTS
}


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
    if meta is None or is_debug() or in_forked_child():  # (base/forking.py)
        return None
    # the trust of the straight path is the admission's (state/admission.py): one hand-off
    out = straight(c, p, v.view_as(v) if v.requires_grad else v.detach(),  # (own_alias)
                   shape, ("compressed", meta.n_compressed, meta.n_plain), _BUILD[layout],
                   _COMPRESSED_OF[layout],
                   partial(check_contiguous_compressed, meta, c, p, v), SafeSparseTensor)
    return compressed(c, p, v, meta) if out is None else out  # type: ignore[return-value]


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
    if shape is None or is_debug() or in_forked_child():  # (base/forking.py)
        return None
    meta = check_coo_metadata(idx, v, shape)
    first = opened((idx,))  # (memory no record claims, no state covers: else the general path)
    if first is None:
        return coo(idx, v, meta, is_coalesced)
    coalesced = bool(is_coalesced)
    def check() -> None:
        if not (native_coo_ok(meta, idx, v, is_coalesced=coalesced)
                and _native_coo_accepts(meta, idx, v, is_coalesced=coalesced)):
            check_coo_indices(meta, idx, is_coalesced=coalesced)  # the vectorised path: located

    if not first.passes(check):  # (failed while another thread wrote: the general path)
        return coo(idx, v, meta, is_coalesced)
    plain = _originals.sparse_coo_tensor(idx.detach(), own_alias(v), shape, check_invariants=False,
                                         is_coalesced=is_coalesced)
    # the coalesced flag torch gave it: the validated one, or (nnz <= 1) trivially true
    flag = plain.is_coalesced()
    if flag and not coalesced and meta.nnz > 1:
        return unchecked(plain, (idx,))
    if not first.close(plain, ("coo", shape[: meta.sparse_dim], flag), (idx.detach(),),
                       (plain._indices(), None), SafeSparseTensor):
        return coo(idx, v, meta, is_coalesced)  # written meanwhile, or a racing registration
    return plain  # type: ignore[return-value]  # (typed by close)


# the factories call build.fast_* by attribute: bound here, never traced by torch.compile
bind(sys.modules[__name__], "fast_compressed", fast_compressed)
bind(sys.modules[__name__], "fast_coo", fast_coo)


def compressed(c: torch.Tensor, p: torch.Tensor, v: torch.Tensor, meta: CompressedMeta, *,
               requires_grad: bool = False, pin_memory: bool = False,
               estimate: bool = False) -> SafeSparseTensor:
    """A checked tensor of ``meta``'s layout on members in their final form, which passed the
    metadata stage (``estimate``: the size was omitted; the index stage resolves it)."""
    extra = _extra(requires_grad, pin_memory)
    build = _BUILD[meta.info.layout]
    debug = is_debug()
    adm = admit((c, p), SafeSparseTensor)
    if not estimate and not debug:
        geom = checked.compressed_geometry(meta.n_compressed, meta.n_plain)
        r = adm.proven((geom,))
        if r is not None:
            own0, own1 = adm.proven_members(r)
            return adm.rebuilt(build(own0, own1, own_alias(v), meta.size,  # type: ignore[return-value]
                                     check_invariants=False, **extra), r)
    vd = own_alias(v)

    def check(ms: tuple[torch.Tensor, ...], m: CompressedMeta, est: bool) -> CompressedMeta:
        return check_compressed_indices(m, ms[0], ms[1], estimate=est, values=v)

    def make(ms: tuple[torch.Tensor, ...], m: CompressedMeta) -> torch.Tensor:
        # torch builds on detached aliases (see own_alias); validation read the caller's
        # tensors (the same memory and view) and watches their counters
        return build(ms[0].detach(), ms[1].detach(), vd, m.size, check_invariants=False,
                     **extra)

    def geometry(m: CompressedMeta) -> Hashable:
        return checked.compressed_geometry(m.n_compressed, m.n_plain)

    how = Validation(check, make, geometry, lambda _, m: geometry(m),
                     lambda m: (geometry(m),))
    out, _ = adm.validate(how, meta, estimate=estimate, debug=debug)
    return out  # type: ignore[return-value]  # (typed by the admission)


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

    def build(size: Sequence[int], own_idx: torch.Tensor) -> torch.Tensor:
        return _originals.sparse_coo_tensor(own_idx, own_v, size, check_invariants=False,
                                            is_coalesced=is_coalesced, **extra)

    adm = admit((idx,), SafeSparseTensor)
    if not estimate and not debug:
        sparse = tuple(meta.size[: meta.sparse_dim])
        r = adm.proven((checked.coo_geometry(sparse, coalesced),
                        checked.coo_geometry(sparse, True)))
        if r is not None:
            plain = build(meta.size, adm.proven_members(r)[0])
            return adm.rebuilt(plain, r, checked.geometry_of(plain),  # type: ignore[return-value]
                               meta.nnz)

    def check(ms: tuple[torch.Tensor, ...], m: CooMeta, est: bool) -> CooMeta:
        return check_coo_indices(m, ms[0], is_coalesced=coalesced, estimate=est, values=v)

    def final(plain: torch.Tensor, m: CooMeta) -> Hashable | None:
        # the coalesced flag torch gave it: the validated one, or (nnz <= 1) trivially true
        flag = plain.is_coalesced()
        if flag and not coalesced and m.nnz > 1:
            return None
        return checked.coo_geometry(m.size[: m.sparse_dim], flag)

    def known(m: CooMeta) -> tuple[Hashable, ...]:
        sparse = m.size[: m.sparse_dim]
        return tuple(checked.coo_geometry(sparse, f) for f in {coalesced, True})

    how = Validation(check, lambda ms, m: build(m.size, ms[0].detach()),
                     lambda m: checked.coo_geometry(m.size[: m.sparse_dim], coalesced),
                     final, known)
    out, ok = adm.validate(how, meta, estimate=estimate, debug=debug)
    return out if ok else unchecked(out, adm.members)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# check_invariants=False


def unchecked(plain: torch.Tensor, members: Sequence[torch.Tensor]) -> SafeSparseTensor:
    """``plain`` (built without validation on the caller's ``members``) retyped and joined to
    the state of its index memory, unchecked; the caller's members that it shares are watched
    there (they can write it)."""
    out = retype(plain)
    rec = writers.join(out)
    ptrs = {m.data_ptr() for m in rec.members()}
    for x in members:
        if isinstance(x, torch.Tensor) and not isinstance(x, SafeSparseTensor) \
                and x.numel() and x.data_ptr() in ptrs and not x.is_inference():
            writers.watch(rec, x)
    return out

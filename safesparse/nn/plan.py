"""The plan of the eager fast path (:mod:`safesparse.nn.eager`): what a module keeps after a
proving call succeeded, the native product's arguments packed once, and the key they were
packed for, which :meth:`_Plan.holds` re-checks in O(1) at every call (the members' objects,
addresses, views and dtypes, the thread count, the autocast dtype, the state layer's re-check
of the proof: :func:`safesparse.state.members_proof.holding`).

Where the plan reads a copy of the values instead of the values (a bfloat16 copy under
autocast, a half layer's float32 copies, the pre-packed copy of :meth:`_Plan.prepacked`), the
copy is keyed on the values' (and bias's) version counter and, for a write that moves none
(through ``.data``, NumPy, another process), on their fingerprint taken before the copy was
made (:func:`safesparse.kernels.native.fingerprint`, one pass over the values at each call
that reads a copy): a stale copy is never read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from ctypes import addressof
from typing import Any, Literal

import torch

from ..base.layouts import BLOCK_LAYOUTS, extents
from ..kernels import native
from ..kernels.pattern import matrix
from ..state import checked, members_proof

__all__ = ["PlanSlot", "plan_of"]

T = torch.Tensor
_Tensor = torch.Tensor
_F32, _BF16 = torch.float32, torch.bfloat16
_FAST_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
#: the parameters' types the plan reads (no ``__torch_function__`` of their own)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_threads = torch.get_num_threads
_ident = threading.get_ident
_empty = torch.empty
_default_dtype = torch.get_default_dtype
_SLOT_X, _SLOT_N, _SLOT_Y = native.SLOT_X, native.SLOT_N, native.SLOT_Y
_SLOT_XK, _SLOT_YI = native.SLOT_XK, native.SLOT_YI

#: The plan's kinds: the kernels read the values and the input in place (float32 / float64,
#: and bfloat16 in the bfloat16 kernels); a float32 layer under bfloat16 autocast, in the
#: bfloat16 kernels from a cached bfloat16 copy of the values; half types through float32
#: (float16; bfloat16 where the bfloat16 kernels do not run), from converted copies.
_DIRECT, _AUTOCAST, _CONVERTED = 0, 1, 2
#: The plan's answers to "does it hold?": no; yes; yes but its cached copy of the values (or
#: bias) is stale (a write moved their counter: a new plan is built at once, O(values)).
_NO, _YES, _STALE = 0, 1, 2
#: Under bfloat16 autocast, a float32 input of at most this many elements is rounded to
#: bfloat16 by the library inside the product's call (one pass, no tensor); larger ones by
#: torch (``x.to(torch.bfloat16)``: threaded), then read in place.
_ROUND_IN_CALL = 64 * 1024
#: Under bfloat16 autocast, a forward of at most this many rows that records no gradient reads
#: the float32 values and bias in place, rounded by the library's call (the bits of
#: the product over the plan's copy but for a band of subnormals:
#: :func:`safesparse.kernels.native.rounding_values`), so the copy's fingerprint is not taken:
#: at batch 1 it cost as much as the product.
_SMALL_ROWS = native.ROUNDING_VALUES_MAX_N
#: Batches from which a float32 / float64 plan reads pre-packed values (:meth:`_Plan.prepacked`)
_PREPACKED_FROM = native.PREPACKED_FROM


class PlanSlot:
    """Where a module keeps its plan (an attribute of the module, dropped by pickling, deep
    and shallow copies: a copy builds its own after its first proving call)."""

    __slots__ = ("plan",)

    def __init__(self) -> None:
        self.plan: _Plan | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlanSlot, ())

    def __copy__(self) -> PlanSlot:
        return PlanSlot()

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanSlot:
        return PlanSlot()


def _slot(module: torch.nn.Module) -> PlanSlot:
    slot = module.__dict__.get("_ss_fast")
    if slot is None:
        slot = PlanSlot()
        module.__dict__["_ss_fast"] = slot
    return slot


def plan_of(module: torch.nn.Module) -> Any:
    """The module's current plan, or None (for tests and diagnostics)."""
    slot = module.__dict__.get("_ss_fast")
    return None if slot is None else slot.plan

class _Plan:
    """One module's packed product and the key it holds for (module docstring)."""

    __slots__ = ("addr", "args", "autocast", "b", "b_alias", "b_ptr", "batch_major", "bwd",
                 "c", "cache", "dtype", "entry", "geometry", "grad", "keep", "kind", "layout",
                 "layout_name", "n_out", "p", "pre", "pre_held", "pre_seen", "prints", "rounded",
                 "small", "still", "thread", "threads", "v",
                 "v_alias", "v_ptr", "vals", "ver", "width", "x_alt", "x_dtype", "y_dtype")

    def __init__(self, packed: tuple[native.PackedArgs, tuple[T, ...]], entry: Any,
                 still: Callable[[], bool], c: T, p: T, v: T, b: T | None, vals: T,
                 geometry: Hashable, autocast: torch.dtype, kind: int, y_dtype: torch.dtype,
                 width: int, n_out: int, batch_major: bool,
                 layout: torch.layout, layout_name: str, cache: dict[Hashable, Any] | None,
                 prints: tuple[int, int] | None = None,
                 small: tuple[native.PackedArgs, tuple[T, ...]] | None = None) -> None:
        self.args, self.keep = packed
        self.addr = addressof(self.args)
        self.entry = entry
        self.still = still  # the state layer's O(1) re-check of the proof
        self.thread = _ident()
        self.c, self.p, self.v, self.b = c, p, v, b
        self.vals = vals  # what the kernel reads: the values (detached), or the plan's copy
        self.dtype = v.dtype
        # the values and bias as the plan read them: the same storage, offset, sizes and
        # strides (``is_set_to`` against an alias), address and dtype
        self.v_alias, self.v_ptr = v.detach(), v.data_ptr()
        self.b_alias: T = self.v_alias if b is None else b.detach()  # (read only with a bias)
        self.b_ptr = 0 if b is None else b.data_ptr()
        # where the plan holds converted copies: their sources' counters and fingerprints
        # (taken before the copies were made: :func:`_prints`)
        self.ver = None if kind == _DIRECT else (v._version,
                                                 None if b is None else b._version)
        self.prints = None if kind == _DIRECT else prints
        self.geometry = geometry
        self.threads = _threads()
        self.autocast = autocast
        self.kind = kind
        # gradients through the plan except for the float32 route under autocast (whose cast
        # of the values torch's autograd records on the operators' path)
        self.grad = kind != _CONVERTED or autocast is _F32
        # the input's dtype (the proving path refuses any other) and, under autocast, the
        # autocast dtype's (the output of an earlier layer under autocast)
        self.x_dtype = v.dtype if autocast is _F32 else _F32
        self.x_alt = self.x_dtype if autocast is _F32 else autocast
        self.y_dtype = y_dtype
        # (under autocast: the entry that rounds a small float32 input in the call)
        self.rounded = native.packed_entry_rounded() if kind == _AUTOCAST else None
        # (under autocast: the array that reads the float32 values and bias in place, rounded
        # by the library's call, for forwards of at most _SMALL_ROWS rows that record no
        # gradient; its address; what it points to)
        self.small = None if small is None else (small[0], addressof(small[0]), small[1])
        self.width, self.n_out = width, n_out
        self.batch_major = batch_major
        self.layout, self.layout_name = layout, layout_name
        self.cache = cache  # (the proof's cache of pattern data, as the operators pass it)
        # the pre-packed values (:meth:`prepacked`): whether the plan may make them; what it
        # holds (the values' counter they were copied at, the array that reads them, its
        # address, the copy: one tuple, read and replaced whole, so that a call in another
        # thread never pairs an array with another's copy); the counter the last call saw
        # (never over inference tensors: they have no counter to key a copy on)
        self.pre = (kind == _DIRECT and batch_major and layout in BLOCK_LAYOUTS
                    and v.dtype in (_F32, torch.float64) and not v.is_inference())
        self.pre_held: tuple[int, native.PackedArgs, int, T, int] | None = None
        self.pre_seen = v._version if self.pre else -1
        # the backward's packed array (:meth:`backward_args`): None until the first backward
        # through the kernels asks, then the array, its address, the entry and what the array
        # points to, or False (none: the gradient kernels run)
        self.bwd: tuple[native.PackedArgs, int, Any, tuple[T, ...]] | Literal[False] | None = None

    def holds(self, buffers: dict[str, Any], params: dict[str, Any], autocast: torch.dtype,
              small: bool = False) -> int:
        """Whether nothing this plan skips could have changed (module docstring): ``_YES``,
        ``_NO``, or ``_STALE`` (it holds but its converted copy of the values or bias is
        older than a write to them). ``small``: the call reads the float32 values in place
        where the plan can (:meth:`run` with ``small``), so its copies are not asked about."""
        v = params.get("values")
        b = params.get("bias")
        if (buffers.get("compressed_indices") is not self.c
                or buffers.get("plain_indices") is not self.p or v is not self.v
                or b is not self.b or autocast is not self.autocast
                or _threads() != self.threads):
            return _NO
        if (v.dtype is not self.dtype or v.data_ptr() != self.v_ptr
                or not v.is_set_to(self.v_alias)):
            return _NO
        if b is not None and (b.dtype is not self.dtype or b.data_ptr() != self.b_ptr
                              or not b.is_set_to(self.b_alias)):
            return _NO
        if not self.still():  # (the members' views, every counter on their memory)
            return _NO
        ver = self.ver
        if small and self.small is not None:  # (no copy read: the values in place)
            return _YES
        if ver is not None and (ver[0] != v._version
                                or (b is not None and ver[1] != b._version)
                                or _prints(v, b) != self.prints):
            return _STALE  # (a write through ``.data`` moves no counter: the fingerprints)
        return _YES

    def run(self, x: T, n: int, y_shape: tuple[int, ...], small: bool = False) -> T | None:
        """The product for the contiguous ``x`` of ``n`` rows (batch-major) or columns, into
        a fresh output of ``y_shape``; None when the library refused (the caller falls
        back). ``small``: as the :meth:`holds` that answered for this call was told (the
        float32 values read in place where the plan can: ``n`` is at most
        :data:`_SMALL_ROWS`). (``torch.empty(*sizes)``: parsing a tuple of sizes costs about
        0.6 us more.)"""
        args = self.args
        addr = self.addr
        if small and self.small is not None:
            args, addr = self.small[0], self.small[1]
        pre = self.prepacked() if self.pre and n >= _PREPACKED_FROM else None
        if pre is not None:  # (held here, the array and its copy, until the call returned)
            args, addr = pre[1], pre[2]
        if self.thread != _ident():  # (another thread: its own copy of the array)
            args = type(args).from_buffer_copy(args)
            addr = addressof(args)
        kind = self.kind
        entry = self.entry
        if kind == _DIRECT:  # (a dtype argument costs about 0.2 us to parse)
            y = (_empty(*y_shape) if self.y_dtype is _default_dtype()
                 else _empty(*y_shape, dtype=self.y_dtype))
        elif kind == _AUTOCAST:  # bfloat16 kernels; a float32 x rounded to bfloat16 once
            y = _empty(*y_shape, dtype=_BF16)
            if x.dtype is not _BF16:
                if n * self.width <= _ROUND_IN_CALL and self.rounded is not None:
                    entry = self.rounded  # (by the library, in this call)
                else:
                    x = x.to(_BF16)
        else:  # x as the operators hand it to the kernel: under autocast rounded to its
            if self.autocast is not _F32:  # dtype; read in float32
                x = x.to(self.autocast)
            x = x.to(_F32)
            y = _empty(*y_shape, dtype=self.y_dtype)
        try:
            ptr = x.data_ptr()
        except RuntimeError:  # (no storage: a functorch wrapper that outlived its transform)
            return None
        if not ptr:  # (no memory: a zero tensor, ``torch._efficientzerotensor``)
            return None
        args[_SLOT_X] = ptr
        args[_SLOT_N] = n
        args[_SLOT_Y] = y.data_ptr()
        if not self.batch_major:
            args[_SLOT_XK] = n
            args[_SLOT_YI] = n
        if entry(addr) != 0:
            return None
        return y


    def prepacked(self) -> tuple[int, native.PackedArgs, int, T, int] | None:
        """What this call reads where it reads the pre-packed values (the values' counter,
        the array, its address, the copy, the values' fingerprint), or None: a copy of the
        values with each block's columns contiguous (:func:`safesparse.kernels.native.
        prepacked`), which the batch-major kernels otherwise pack at every call. The copy is
        keyed on the values' counter and their fingerprint (:meth:`holds` answered for their
        object, address, view and dtype): made where two calls in a row saw the same counter
        (inference; a training loop, whose optimizer writes the values between calls, never
        copies), read only while the counter is the one it was made at and the values'
        fingerprint the one taken before the copy (:func:`safesparse.kernels.native.
        fingerprint`: a write through ``.data``, NumPy or another process moves no counter),
        dropped at the first call that sees either moved; after a fingerprint moved under an
        unmoved counter the plan makes no copy again (such writes may come between any two
        calls: a copy would be dropped as soon as made)."""
        ver = self.v._version
        held = self.pre_held
        if held is not None and held[0] == ver:
            if native.fingerprint(self.v) == held[4]:
                return held
            self.pre = False  # (written unseen by the counter: no copies from now on)
        if ver != self.pre_seen or held is not None:  # (written: the values in place)
            self.pre_seen = ver
            self.pre_held = None
            return None
        if not self.v.is_contiguous():  # (the fingerprint reads its memory as one run)
            self.pre = False
            return None
        mark = native.fingerprint(self.v)  # (before the copy: a write meanwhile is seen)
        got = native.prepacked(self.args, self.vals)
        if got is None:
            self.pre = False
            return None
        held = (ver, got[0], addressof(got[0]), got[1], mark)
        self.pre_held = held
        return held


    def backward_args(self) -> tuple[native.PackedArgs, int, Any, tuple[T, ...]] | None:
        """The backward's arguments packed once (:func:`safesparse.kernels.native.
        pack_linear_backward`: one call for the three gradients), over what the plan's product
        reads (its pattern data, the values or its copy of them), or None (not native, a kind
        or layout the packed backward does not take: the gradient kernels run). Built at the
        first backward and kept with the plan: read only where :meth:`still` and the saved
        values' checks (``_FastLinear.backward``) hold, as the forward's array."""
        bwd = self.bwd
        if bwd is None:
            bwd = False
            if self.kind != _CONVERTED and self.batch_major and self.layout in BLOCK_LAYOUTS:
                w = matrix(self.layout, self.c, self.p, self.vals, self.n_out, self.width)
                packed = native.pack_linear_backward(w, self.vals.dtype, self.kind == _AUTOCAST,
                                                     cache=self.cache)
                entry = native.backward_entry()
                if packed is not None and entry is not None:
                    bwd = (packed[0], addressof(packed[0]), entry, packed[1])
            self.bwd = bwd
        return bwd or None

    def backward_failed(self) -> None:
        """The library refused the packed backward (no kernel for these operands): the
        gradient kernels run from now on."""
        self.bwd = False


def _prints(v: T, b: T | None) -> tuple[int, int] | None:
    """The fingerprints of the values and the bias (0 for none) that a plan's converted
    copies are keyed on besides their counters (:func:`safesparse.kernels.native.fingerprint`:
    a write through ``.data`` moves no counter), or None where either is not contiguous."""
    if not v.is_contiguous() or (b is not None and not b.is_contiguous()):
        return None
    return native.fingerprint(v), 0 if b is None else native.fingerprint(b)


def _geometry(layout: torch.layout, values: T, n_rows: int, n_cols: int) -> Hashable:
    r, c = (int(values.shape[1]), int(values.shape[2])) if layout in BLOCK_LAYOUTS else (1, 1)
    return checked.compressed_geometry(*extents(layout, n_rows, n_cols, r, c))


def _build(module: Any, x: T, autocast: torch.dtype, batch_major: bool) -> _Plan | None:
    """A plan for ``module`` after a proving call with ``x`` succeeded (or where its plan's
    copy of the values went stale), or None (members not proven, not watchable, no native
    path, an operand the plan does not take)."""
    buffers, params = module._buffers, module._parameters
    c, p = buffers.get("compressed_indices"), buffers.get("plain_indices")
    v, b = params.get("values"), params.get("bias") if batch_major else None
    # (members of a tensor subclass decide what the operators read, in their
    # ``__torch_function__``: the plan, which reads their memory, never runs over them; a
    # strided bias would be read from a contiguous copy, which no counter keys)
    if (type(c) is not _Tensor or type(p) is not _Tensor or type(v) not in _PLAIN
            or v.device.type != "cpu" or p.numel() == 0 or v.dtype not in _FAST_DTYPES
            or (b is not None and (type(b) not in _PLAIN or b.dtype is not v.dtype
                                   or not b.is_contiguous()))):
        return None
    if autocast is _F32:
        if v.dtype is not x.dtype:
            return None
    elif v.dtype is not _F32 or autocast not in _HALF or x.dtype not in (_F32, autocast):
        return None  # (autocast casts float32 layers only)
    layout = module.layout
    n_rows, n_cols = module._size
    if n_rows == 0 or n_cols == 0:
        return None
    if members_proof.is_unwatched(c, p) or not members_proof.watchable(c, p):
        return None
    geometry = _geometry(layout, v, n_rows, n_cols)
    proven, cache = members_proof.proof(c, p, geometry)
    still = members_proof.holding(c, p, geometry) if proven else None
    if still is None:
        return None
    kind = _DIRECT
    want = v.dtype if autocast is _F32 else autocast  # the dtype the product computes in
    vals = v.detach()
    bias = None if b is None else b.detach()
    packed = None
    # where the plan makes converted copies: the fingerprints of what they copy, taken first
    # (a write while they are made is seen at the next call); None: a strided values or bias,
    # which no fingerprint reads, so no copy
    prints: tuple[int, int] | None = None
    small = None
    if want is _BF16:  # the bfloat16 kernels, values read in place or the plan's copy
        if autocast is not _F32:
            kind = _AUTOCAST
            prints = _prints(v, b)
            if prints is None:
                return None
            vals = vals.to(_BF16)
            bias = None if bias is None else bias.to(_BF16)
        packed = native.pack_product(matrix(layout, c, p, vals, n_rows, n_cols), batch_major,
                                     _BF16, _BF16, bias=bias, cache=cache)
        if packed is not None and kind == _AUTOCAST and batch_major:
            small = native.rounding_values(packed[0], v.detach(),
                                           None if b is None else b.detach())
    if packed is None:
        if want in _HALF:  # through float32 from converted copies
            kind = _CONVERTED
            prints = prints or _prints(v, b)
            if prints is None:
                return None
            vals = v.detach().to(want)
            bias = None if b is None else b.detach().to(want)
        x_dtype = torch.float64 if v.dtype is torch.float64 else _F32
        packed = native.pack_product(matrix(layout, c, p, vals, n_rows, n_cols), batch_major,
                                     x_dtype, want, bias=bias, cache=cache)
    entry = native.packed_entry()
    if packed is None or entry is None:
        return None
    return _Plan(packed, entry, still, c, p, v, b, vals, geometry, autocast, kind, want, n_cols,
                 n_rows, batch_major, layout, module._layout_name, cache, prints, small)

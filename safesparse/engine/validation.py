"""The validation engine: every invariant of :mod:`safesparse.catalog.invariants`, checked once.

Two stages, for every layout:

1. **Metadata** (O(1), no device access; :mod:`safesparse.engine.metadata`): dtypes, layouts, dims,
   shapes, devices, strides. The first violated id, in catalog order, is raised at once.
2. **Index data** (O(nnz), vectorised torch ops, no Python loop over nnz or rows; this module).
   The *fast path* reduces all index invariants to one boolean tensor (the masks of
   :mod:`safesparse.engine.masks`) and reads it with a single device-to-host sync, or runs torch's
   own
   C++ checker where that is safe and faster (CPU, see the native section). Only when the data is
   refused does the *diagnostic path* (:mod:`safesparse.engine.diagnose`) run: it evaluates the same
   masks one invariant at a time, in id order, and reports the first violating batch / row /
   position / value.

Nothing here calls a torch sparse kernel: all work is on the strided member tensors.
"""

from __future__ import annotations

import math

import torch

from ..base.forking import in_forked_child, serial_in_forked_child
from ..base.layouts import COMPRESSED_LAYOUTS, compressed_members
from .diagnose import diagnose_compressed, diagnose_coo
from .masks import (
    any_set,
    bad_negative,
    bad_too_large,
    compressed_flags,
    coo_bad_order,
    none_set,
    row_counts,
)
from .metadata import (
    INT32_MAX,
    INT64_MAX,
    CompressedMeta,
    CooMeta,
    Size,
    check_compressed_metadata,
    check_coo_metadata,
    check_coo_size,
    check_index_capacity,
    fail,
    numel_overflows,
)

# --------------------------------------------------------------------------------------------
# Forked children: the index stage runs with one intra-op thread there (base/forking.py), and
# the factories leave their native fast path to the general one, which does so.

fork_safe = serial_in_forked_child


# --------------------------------------------------------------------------------------------
# Native path: torch's own C++ checker, on CPU, where it is the faster one
#
# torch's checker costs a few µs where the vectorised path pays ~100 µs of fixed cost (dozens
# of small aten ops), so on CPU it runs the index stage up to a measured size (above it the
# vectorised path, multi-threaded and single-pass, is faster). It is only ever given inputs
# that passed the complete metadata stage *and* the conditions below, which exclude every input
# shape known or suspected to make it crash (zero-size blocks and other empty dims: division by
# zero) or answer wrongly (int32 offsets that could wrap; sparse sizes whose flattened index
# overflows int64; sparse_dim 0, where torch accepts repeated empty index tuples as coalesced).
# It accepts or raises; when it raises, the vectorised path decides and reports (it accepts
# what torch rejected for reasons outside the catalog), so an error always has our id and
# location. On CUDA the vectorised path always runs: torch's checker uses device asserts there.

#: Largest nnz for which the native checker runs on COO, per ``is_coalesced``; above it the
#: vectorised path runs. Compressed layouts use it at every size. Measured
#: (torch 2.13, 2 threads, benchmarks/ validate group): for compressed layouts torch's checker
#: is never much slower than the vectorised path (CSR int64 2**17: 0.23 vs 0.29 ms; 2**20: both
#: ~1 ms; 1e7: 32 vs 34-133 ms) and far more robust on a busy machine (one pass, no chain of
#: parallel regions), so it runs at every size. For COO the vectorised path wins from ~2**15
#: when the indices are marked coalesced (fresh clones, 2 sparse dims: 1e5 native 247 µs,
#: vectorised 224 µs; 1e6 2.66 vs 1.64 ms; 1e7 0.5x torch's). Unmarked, torch checks bounds
#: only, in one pass without temporaries, and through the public factory on fresh clones it
#: stays ahead up to ~2**19 (6e4 nnz: 56 vs 150 µs; 2e5: 155 vs 376 µs; 5e5: 352 vs 392 µs;
#: 1e6: 829 vs 774 µs), where the vectorised path's large temporaries make it vary with the
#: allocator's state (alone on reused memory it is faster from ~2**16).
NATIVE_MAX_NNZ_COO: dict[bool, int] = {True: 1 << 15, False: 1 << 19}
_native_enabled = True


def set_native(enabled: bool) -> bool:
    """Allow (default) or forbid the native checker; returns the previous setting (tests)."""
    global _native_enabled
    previous, _native_enabled = _native_enabled, bool(enabled)
    return previous


def native_enabled() -> bool:
    """Whether the native checker may run at all (:func:`set_native`)."""
    return _native_enabled


def native_compressed_ok(meta: CompressedMeta, compressed: torch.Tensor, plain: torch.Tensor,
                         values: torch.Tensor) -> bool:
    """Whether torch's native checker may run the index stage of this (metadata-checked) input.

    Besides size and device: every dim and block dim non-zero (no empty batch, no zero-size
    block, no empty dense dim), members fully contiguous, and ``n_plain + nnz`` below the index
    dtype's maximum, so no difference of two compressed offsets can wrap around in its arithmetic.
    """
    return (compressed.is_contiguous() and plain.is_contiguous()
            and _native_ok_contiguous(meta, compressed, values))


def _native_ok_contiguous(meta: CompressedMeta, compressed: torch.Tensor,
                          values: torch.Tensor) -> bool:
    """:func:`native_compressed_ok` for members known to be fully contiguous."""
    # min(size) > 0 also excludes zero-size blocks: 3.1 allows a zero block dim only with a
    # zero sparse extent
    _, size, _, _, _, _, n_plain, nnz = meta
    return (_native_enabled and values.is_cpu and min(size) > 0
            and n_plain + nnz < (INT32_MAX if compressed.dtype is _INT32 else INT64_MAX))


def _native_accepts(meta: CompressedMeta, compressed: torch.Tensor, plain: torch.Tensor,
                    values: torch.Tensor) -> bool:
    """torch's native checker accepted the index data, run only where it may run
    (:func:`native_compressed_ok`, :func:`_offsets_in_bounds`); False: the vectorised path
    decides (and reports)."""
    return (compressed.is_contiguous() and plain.is_contiguous()
            and native_accepts_contiguous(meta, compressed, plain, values))


def check_contiguous_compressed(meta: CompressedMeta, compressed: torch.Tensor,
                                plain: torch.Tensor, values: torch.Tensor) -> None:
    """The index stage of the factories' straight path (members fully contiguous, past
    :func:`safesparse.engine.metadata._accept_compressed_metadata`): torch's native checker
    behind its preconditions and the offsets pre-check (:func:`native_accepts_contiguous`);
    where it declines, the vectorised path, which raises, located (or accepts what torch
    refused)."""
    if not native_accepts_contiguous(meta, compressed, plain, values):
        check_compressed_indices(meta, compressed, plain)


def native_accepts_contiguous(meta: CompressedMeta, compressed: torch.Tensor,
                              plain: torch.Tensor, values: torch.Tensor) -> bool:
    """:func:`_native_accepts` for members known to be fully contiguous (the factories' fast
    path: :func:`safesparse.engine.metadata._accept_compressed_metadata` accepts no other)."""
    if not (_native_ok_contiguous(meta, compressed, values)
            and _offsets_in_bounds(meta, compressed)):
        return False
    info, _, _, _, _, nc, n_plain, nnz = meta
    try:
        _VALIDATE(info.row_compressed, compressed, plain, nc, n_plain, nnz)
    except Exception:  # rejected: the vectorised path decides and reports
        return False
    return True


#: torch's index kernel alone (what its checker runs after its metadata checks, which the
#: complete metadata stage has already done): 5.1-5.6 of the compressed and plain indices
#: against the compressed and plain extents (blocks for BSR/BSC) and nnz
_VALIDATE = torch._validate_compressed_sparse_indices
_INT32 = torch.int32


def _offsets_in_bounds(meta: CompressedMeta, compressed: torch.Tensor) -> bool:
    """Whether every compressed offset lies in ``[0, nnz]`` (one host sync). torch's native
    checker reads the plain indices of each line *before* it has checked the offsets of the
    later lines, so offsets outside that range make it read outside the plain indices (a
    segfault, e.g. BSR crow ``[0, 3, -1, 2, 0]`` with no plain index at all)."""
    _, _, batch, _, _, nc, _, nnz = meta
    # (the native path is CPU-only) up to ~40 offsets a list is cheaper than aminmax and two
    # items (1.4 µs); every dim is non-empty here (native_compressed_ok): no list is empty.
    # One batch dim at most: a nested list is flattened in Python (a view(-1) costs 0.7 µs)
    if len(batch) <= 1 and (batch[0] if batch else 1) * (nc + 1) <= 32:
        lines = compressed.tolist()
        offsets = sum(lines, []) if batch else lines  # noqa: RUF017  (at most 32 offsets)
        return bool(min(offsets) >= 0 and max(offsets) <= nnz)
    lo, hi = torch.aminmax(compressed)
    return bool(lo.item() >= 0 and hi.item() <= nnz)  # (CPU: an item is no sync)


def native_coo_ok(meta: CooMeta, indices: torch.Tensor, values: torch.Tensor, *,
                  is_coalesced: bool) -> bool:
    """Whether torch's native checker may run the COO index stage (see the section comment):
    at least one sparse dim, every dim non-zero, and a sparse numel that fits int64."""
    return (
        _native_enabled
        and meta.nnz <= NATIVE_MAX_NNZ_COO[is_coalesced]
        and meta.sparse_dim > 0
        and values.is_cpu
        and min(meta.size) > 0
        and not numel_overflows(meta.size[:meta.sparse_dim])
        and indices.is_contiguous()
    )


def _native_coo_accepts(meta: CooMeta, indices: torch.Tensor, values: torch.Tensor, *,
                        is_coalesced: bool) -> bool:
    try:
        torch._validate_sparse_coo_tensor_args(indices, values, meta.size, is_coalesced)
    except Exception:  # rejected: the vectorised path decides and reports
        return False
    return True


def _flatten_batch(meta: CompressedMeta, compressed: torch.Tensor, plain: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    b = math.prod(meta.batch)
    return compressed.reshape(b, meta.n_compressed + 1), plain.reshape(b, meta.nnz)


def _estimate_plain_extent(c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Seed 000's rule: max(plain.max() + 1, max line count), as a 0-dim int64 tensor."""
    est = torch.zeros((), dtype=torch.int64, device=c.device)
    if p.numel():
        est = torch.maximum(est, p.max().to(torch.int64).clamp(max=INT64_MAX - 1) + 1)
    if c.shape[1] > 1 and c.numel():
        est = torch.maximum(est, row_counts(c).max())
    return est


@fork_safe
def check_compressed_indices(
    meta: CompressedMeta, compressed: torch.Tensor, plain: torch.Tensor, *,
    estimate: bool = False, values: torch.Tensor | None = None,
) -> CompressedMeta:
    """Check 5.1-5.6 with one host sync; on failure raise the first violation with its location.

    ``estimate=True`` (size was omitted): the plain extent is estimated in the same sync, and the
    returned meta carries the resolved size. ``values`` (the tensor's values, which passed the
    metadata stage with ``meta``) lets the check use torch's native checker where that is the
    faster path (see :func:`native_compressed_ok`); without it the vectorised path runs.
    """
    if values is not None and not estimate and _native_accepts(meta, compressed, plain, values):
        return meta
    c, p = _flatten_batch(meta, compressed, plain)
    if c.numel() == 0 and not estimate:
        return meta  # empty batch: nothing to check
    if estimate:
        # Without a size the plain extent is max + 1, which must exist (an index of 2**63 - 1
        # has none: 5.5); a zero-size block dim on the plain side has no plain slot at all.
        plain_block = meta.blocksize[1] if meta.info.row_compressed else meta.blocksize[0]
        bound = 0 if plain_block == 0 else INT64_MAX
        est = _estimate_plain_extent(c, p)
        ok = compressed_flags(c, p, meta.nnz, bound)
        flag, extent = torch.stack([ok.to(torch.int64), est]).tolist()
        if not flag:
            raise diagnose_compressed(meta, c, p, bound)
        resolved = _with_plain_extent(meta, int(extent))
        check_index_capacity(meta.info, compressed.dtype, meta.nnz, meta.n_compressed,
                             resolved.n_plain)
        if numel_overflows(resolved.size):
            raise fail(meta.info.layout, "3.1", f"estimated size {resolved.size} has more "
                        "than 2**63 - 1 elements", size=resolved.size)
        return resolved
    if not bool(compressed_flags(c, p, meta.nnz, meta.n_plain)):
        raise diagnose_compressed(meta, c, p, meta.n_plain)
    return meta


def _with_plain_extent(meta: CompressedMeta, extent: int) -> CompressedMeta:
    m = len(meta.batch)
    size = list(meta.size)
    dim, b = (m + 1, meta.blocksize[1]) if meta.info.row_compressed else (m, meta.blocksize[0])
    size[dim] = extent * b
    return CompressedMeta(meta.info, tuple(size), meta.batch, meta.blocksize, meta.dense,
                          meta.n_compressed, extent, meta.nnz)


@fork_safe
def check_coo_indices(
    meta: CooMeta, indices: torch.Tensor, *, is_coalesced: bool, estimate: bool = False,
    values: torch.Tensor | None = None,
) -> CooMeta:
    """Check COO 5.1-5.3 with one host sync (5.3 only when marked coalesced).

    ``estimate=True`` (size was omitted): the sparse extents (max + 1) are read in the same sync.
    ``values``: as for :func:`check_compressed_indices` (see :func:`native_coo_ok`).
    """
    s, nnz = indices.shape
    if nnz == 0:
        return meta
    if (values is not None and not estimate
            and native_coo_ok(meta, indices, values, is_coalesced=is_coalesced)
            and _native_coo_accepts(meta, indices, values, is_coalesced=is_coalesced)):
        return meta
    bad: list[torch.Tensor] = []
    highs: list[torch.Tensor] = []
    for d in range(s):  # loop over sparse dims: a flat aminmax per row is the fastest form
        lo, hi = torch.aminmax(indices[d])
        bad.append(bad_negative(lo))
        if estimate:
            # max + 1 must itself be a valid size: an index of 2**63 - 1 has none (5.2)
            bad.append(bad_too_large(hi, INT64_MAX))
            highs.append(hi.clamp(max=INT64_MAX - 1) + 1)
        else:
            bad.append(bad_too_large(hi, meta.size[d]))
    if is_coalesced:
        bad.append(any_set(coo_bad_order(indices)))
    ok = none_set(*bad)
    if estimate:
        read = torch.stack([ok.to(torch.int64), *highs]).tolist()
        meta = CooMeta(tuple(read[1:]) + tuple(meta.size[s:]), s, nnz)
        flag = bool(read[0])
    else:
        flag = bool(ok)
    if not flag:
        raise diagnose_coo(meta, indices, is_coalesced=is_coalesced)
    if estimate:
        check_coo_size(meta.size)
    return meta


# --------------------------------------------------------------------------------------------
# Whole tensors


def validate_compressed(
    compressed: torch.Tensor,
    plain: torch.Tensor,
    values: torch.Tensor,
    size: Size | None,
    layout: torch.layout,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requested_layout: torch.layout | None = None,
    check_indices: bool = True,
) -> CompressedMeta:
    """All invariants of a compressed tensor given by its members; returns the resolved meta."""
    meta = check_compressed_metadata(
        compressed, plain, values, size, layout, dtype=dtype, device=device,
        requested_layout=requested_layout,
    )
    if check_indices or size is None:
        meta = check_compressed_indices(meta, compressed, plain, estimate=size is None,
                                        values=values)
    return meta


def validate_coo(
    indices: torch.Tensor,
    values: torch.Tensor,
    size: Size | None,
    *,
    is_coalesced: bool,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    check_indices: bool = True,
) -> CooMeta:
    meta = check_coo_metadata(indices, values, size, dtype=dtype, device=device)
    if check_indices or size is None:
        meta = check_coo_indices(meta, indices, is_coalesced=is_coalesced, estimate=size is None,
                                 values=values)
    return meta


@fork_safe
def validate_tensor(t: torch.Tensor, *, check_indices: bool = True) -> None:
    """Validate every invariant of an existing torch sparse tensor (any sparse layout);
    ``check_indices=False``: the O(1) metadata invariants only (index data known valid). The
    tensor's own dtype and device are the requested ones (1.4 / 4.x): its members must agree
    with them (torch 2.13's ``t.data = other`` on a compressed tensor changes its dtype and
    keeps its old members)."""
    if t.layout == torch.sparse_coo:
        validate_coo(t._indices(), t._values(), tuple(t.shape), is_coalesced=t.is_coalesced(),
                     dtype=t.dtype, device=t.device, check_indices=check_indices)
    elif t.layout in COMPRESSED_LAYOUTS:
        compressed, plain = compressed_members(t)
        validate_compressed(compressed, plain, t.values(), tuple(t.shape), t.layout,
                            dtype=t.dtype, device=t.device, check_indices=check_indices)
    else:
        raise TypeError(f"expected a sparse tensor, got layout {t.layout}")


__all__ = [
    "NATIVE_MAX_NNZ_COO",
    "check_compressed_indices",
    "check_contiguous_compressed",
    "check_coo_indices",
    "fork_safe",
    "in_forked_child",
    "native_compressed_ok",
    "native_coo_ok",
    "native_enabled",
    "set_native",
    "validate_compressed",
    "validate_coo",
    "validate_tensor",
]

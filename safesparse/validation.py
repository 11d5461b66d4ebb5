"""The validation engine: every invariant of :mod:`safesparse.invariants`, checked once.

Two stages, for every layout:

1. **Metadata** (O(1), no device access): dtypes, layouts, dims, shapes, devices, strides. The
   first violated id, in catalog order, is raised at once.
2. **Index data** (O(nnz), vectorised torch ops, no Python loop over nnz or rows). The *fast
   path* reduces all index invariants to one boolean tensor and reads it with a single
   device-to-host sync. Only when that flag is false does the *diagnostic path* run: it evaluates
   the same violation masks one invariant at a time, in id order, and reports the first violating
   batch / row / position / value.

Every index invariant is expressed once, as a ``_bad_*`` mask helper; the fast path reduces the
masks with ``any()`` and the diagnostic path looks for their first ``True``. The one shortcut on
the fast path is documented at :func:`_compressed_flags`.

Nothing here calls a torch sparse kernel: all work is on the strided member tensors, and every
data-dependent gather or scatter index is clamped into range first, so even hostile index values
cannot make the checker itself read out of bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, NamedTuple

import torch

from .errors import InvariantError
from .invariants import COMPRESSED_LAYOUTS, layout_name

INDEX_DTYPES: Final = (torch.int32, torch.int64)
SUPPORTED_DEVICE_TYPES: Final = ("cpu", "cuda")
_UNSUPPORTED_VALUE_DTYPES: Final = frozenset(
    getattr(torch, name)
    for name in (
        "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
        "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    )
    if hasattr(torch, name)
)

Size = tuple[int, ...]
_INT64_MAX: Final = 2**63 - 1
_INT32_MAX: Final = 2**31 - 1
_LARGE: Final = 1 << 16  # masks at least this long are reduced through uint8 (see _any)


def numel_overflows(size: Size) -> bool:
    """Whether torch's numel (multiplied dim by dim, in order) overflows int64 for ``size``."""
    n = 1
    for extent in size:
        n *= extent
        if n > _INT64_MAX:
            return True
    return False


def index_contiguous(t: torch.Tensor) -> bool:
    """3.5 / 3.6: contiguous per batch, torch's own rule: unit stride on the last dim (even
    where its size is 1); the batch dims may have any strides (a slice of a wider tensor)."""
    return t.dim() == 0 or t.stride(-1) == 1


# --------------------------------------------------------------------------------------------
# Layout vocabulary


@dataclass(frozen=True)
class LayoutInfo:
    """Names and geometry of one compressed layout."""

    layout: torch.layout
    compressed_name: str  # "crow_indices" / "ccol_indices"
    plain_name: str  # "col_indices" / "row_indices"
    line: str  # what one compressed entry is: "row", "column", "block row", ...
    blocked: bool
    row_compressed: bool  # CSR/BSR: compressed dim is the rows

    @property
    def name(self) -> str:
        return layout_name(self.layout)


LAYOUTS: Final[dict[torch.layout, LayoutInfo]] = {
    torch.sparse_csr: LayoutInfo(
        torch.sparse_csr, "crow_indices", "col_indices", "row", False, True
    ),
    torch.sparse_csc: LayoutInfo(
        torch.sparse_csc, "ccol_indices", "row_indices", "column", False, False
    ),
    torch.sparse_bsr: LayoutInfo(
        torch.sparse_bsr, "crow_indices", "col_indices", "block row", True, True
    ),
    torch.sparse_bsc: LayoutInfo(
        torch.sparse_bsc, "ccol_indices", "row_indices", "block column", True, False
    ),
}


def compressed_members(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (compressed, plain) index members of a torch compressed sparse tensor."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The values member of a sparse tensor of any layout (COO's even when uncoalesced)."""
    return t._values() if t.layout == torch.sparse_coo else t.values()


def members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The member tensors of a plain sparse tensor, the one place that knows them per layout:
    ``(indices, values)`` for COO, ``(compressed, plain, values)`` for the compressed layouts."""
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    return (*compressed_members(t), t.values())


# --------------------------------------------------------------------------------------------
# Results of the metadata stage


class CompressedMeta(NamedTuple):
    """What the metadata stage established about a compressed tensor."""

    info: LayoutInfo
    size: Size
    batch: Size
    blocksize: tuple[int, int]
    dense: Size
    n_compressed: int
    n_plain: int
    nnz: int


class CooMeta(NamedTuple):
    size: Size
    sparse_dim: int
    nnz: int


def _fail(
    layout: torch.layout, iid: str, detail: str = "", /, **location: object
) -> InvariantError:
    return InvariantError(layout, iid, detail, location=location)


def _shape(t: torch.Tensor) -> Size:
    return tuple(t.shape)


def _check_device(
    layout: torch.layout, device: torch.device,
    members: tuple[tuple[str, str, torch.Tensor], ...],
) -> None:
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise _fail(layout, "4.1", f"got device {device}", device=str(device))
    for iid, name, member in members:
        if member.device != device:
            raise _fail(
                layout, iid, f"{name} is on {member.device}, the tensor on {device}",
                member=name, device=str(member.device),
            )


def _batch_dims(compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor) -> int:
    """M, the number of batch dims, from the index members.

    When the two index members disagree on their number of dims, the one whose leading shape
    agrees with the leading dims of ``values`` decides, so a single malformed member is reported
    under its own id (3.2 or 3.3) rather than as a size mismatch.
    """
    mc, mp = compressed.dim() - 1, plain.dim() - 1
    if mc == mp:
        return mc
    for m, member in ((mc, compressed), (mp, plain)):
        if m >= 0 and values.dim() >= m and _shape(member)[:-1] == _shape(values)[:m]:
            return m
    return mc if mc >= 0 else mp


def check_compressed_metadata(
    compressed: torch.Tensor,
    plain: torch.Tensor,
    values: torch.Tensor,
    size: Size | None,
    layout: torch.layout,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requested_layout: torch.layout | None = None,
) -> CompressedMeta:
    """Check ids 1.x-4.x of a compressed tensor; raise the first violation in id order.

    ``size=None`` estimates the shape (the plain extent is left 0 here; the index stage
    resolves it). ``dtype``/``device``/``requested_layout`` are what the caller asked for.
    The stages run in id order: 1.x dtypes, 2.x layouts, 3.x shapes and strides (with the
    int32 capacity half of 1.3, which needs the shapes), 4.x devices.
    """
    if size is not None and (requested_layout is None or requested_layout == layout):
        meta = _accept_compressed_metadata(compressed, plain, values, size, layout, dtype, device)
        if meta is not None:
            return meta
    return _ordered_compressed_metadata(compressed, plain, values, size, layout, dtype=dtype,
                                        device=device, requested_layout=requested_layout)


def _ordered_compressed_metadata(
    compressed: torch.Tensor,
    plain: torch.Tensor,
    values: torch.Tensor,
    size: Size | None,
    layout: torch.layout,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    requested_layout: torch.layout | None = None,
) -> CompressedMeta:
    """:func:`check_compressed_metadata` stage by stage, in id order (the reference)."""
    lay = requested_layout if requested_layout is not None else layout
    info = LAYOUTS.get(lay)
    if info is None:
        raise _fail(
            layout if layout in LAYOUTS else torch.sparse_csr, "2.4",
            f"requested layout {lay}", layout=str(lay),
        )
    index_dtype = _check_compressed_dtypes(info, compressed, plain, values, dtype)
    _check_compressed_layouts(info, compressed, plain, values, layout)
    meta = _check_compressed_shapes(info, compressed, plain, values, size)
    check_index_capacity(info, index_dtype, meta.nnz, meta.n_compressed, meta.n_plain)
    _check_device(lay, device if device is not None else values.device, (
        ("4.2", info.compressed_name, compressed),
        ("4.3", info.plain_name, plain),
        ("4.4", "values", values),
    ))
    return meta


def _accept_compressed_metadata(
    compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor, size: Size,
    layout: torch.layout, dtype: torch.dtype | None, device: torch.device | None,
) -> CompressedMeta | None:
    """The common case of :func:`check_compressed_metadata` in few operations: the meta when
    every 1.x-4.x invariant visibly holds (explicit size, non-empty blocks), else None, and
    the id-ordered stages decide. It accepts nothing they would reject and returns the same
    meta (tests/test_fast_path.py compares the two)."""
    info = LAYOUTS.get(layout)
    if info is None:
        return None
    idt, vdt = compressed.dtype, values.dtype
    if (idt != plain.dtype or idt not in INDEX_DTYPES or vdt in _UNSUPPORTED_VALUE_DTYPES
            or (dtype is not None and vdt != dtype)):
        return None
    if (compressed.layout != torch.strided or plain.layout != torch.strided
            or values.layout != torch.strided):
        return None
    cshape, pshape, vshape = compressed.shape, plain.shape, values.shape
    m = len(cshape) - 1
    size = tuple(size)
    if m < 0 or len(pshape) != m + 1 or len(size) < m + 2:
        return None
    nnz = pshape[m]
    if info.blocked:
        if len(vshape) < m + 3:
            return None
        b0, b1 = vshape[m + 1], vshape[m + 2]
        if b0 <= 0 or b1 <= 0:
            return None
    else:
        b0 = b1 = 1
    rows, cols = size[m], size[m + 1]
    if rows % b0 or cols % b1 or min(size) < 0 or numel_overflows(size):
        return None
    nc, npl = (rows // b0, cols // b1) if info.row_compressed else (cols // b1, rows // b0)
    batch, dense = size[:m], size[m + 2:]
    if (cshape != (*batch, nc + 1) or pshape != (*batch, nnz)
            or vshape != ((*batch, nnz, b0, b1, *dense) if info.blocked
                          else (*batch, nnz, *dense))):
        return None
    # stricter than 3.5-3.7 (fully contiguous members): anything else takes the ordered stages;
    # a contiguous member has unit last stride unless its last dim has size 0 or 1
    if not (compressed.is_contiguous() and plain.is_contiguous() and values.is_contiguous()
            and (nc > 0 or compressed.stride(-1) == 1)
            and (nnz > 1 or plain.stride(-1) == 1)):
        return None
    if idt == torch.int32 and max(nnz, nc, npl) > _INT32_MAX:
        return None
    dev = values.device
    if (not (values.is_cpu or values.is_cuda) or (device is not None and device != dev)
            or compressed.device != dev or plain.device != dev):
        return None
    return tuple.__new__(CompressedMeta, (info, size, batch, (b0, b1), dense, nc, npl, nnz))


def _check_compressed_dtypes(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    dtype: torch.dtype | None,
) -> torch.dtype:
    """1.1-1.5; returns the index dtype (the first member's dtype that is a valid one)."""
    lay = info.layout
    cdt, pdt = compressed.dtype, plain.dtype
    index_dtype = cdt if cdt in INDEX_DTYPES or pdt not in INDEX_DTYPES else pdt
    if cdt != index_dtype:
        raise _fail(lay, "1.1", f"{info.compressed_name} is {cdt}, {info.plain_name} is {pdt}",
                    dtype=str(cdt))
    if pdt != index_dtype:
        raise _fail(lay, "1.2", f"{info.plain_name} is {pdt}, {info.compressed_name} is {cdt}",
                    dtype=str(pdt))
    if index_dtype not in INDEX_DTYPES:
        raise _fail(lay, "1.3", f"got {index_dtype}", dtype=str(index_dtype))
    vdt = values.dtype
    if dtype is not None and vdt != dtype:
        raise _fail(lay, "1.4", f"values are {vdt}, requested {dtype}")
    if vdt in _UNSUPPORTED_VALUE_DTYPES:
        raise _fail(lay, "1.5", f"got {vdt}", dtype=str(vdt))
    return index_dtype


def _check_compressed_layouts(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    layout: torch.layout,
) -> None:
    """2.1-2.4: strided members, and the layout is the requested one."""
    lay = info.layout
    if compressed.layout != torch.strided:
        raise _fail(lay, "2.1", f"{info.compressed_name} has layout {compressed.layout}")
    if plain.layout != torch.strided:
        raise _fail(lay, "2.2", f"{info.plain_name} has layout {plain.layout}")
    if values.layout != torch.strided:
        raise _fail(lay, "2.3", f"values has layout {values.layout}")
    if layout != lay:
        raise _fail(lay, "2.4", f"got {layout}", layout=str(layout))


def _check_compressed_shapes(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    size: Size | None,
) -> CompressedMeta:
    """3.1-3.10, in id order; returns the meta (1.3 capacity and 4.x are checked after)."""
    lay = info.layout
    m = _batch_dims(compressed, plain, values)
    if m < 0:
        raise _fail(lay, "3.2", f"{info.compressed_name} has 0 dims")
    cshape, pshape, vshape = _shape(compressed), _shape(plain), _shape(values)
    blocksize: tuple[int, int] = (
        (vshape[m + 1], vshape[m + 2]) if info.blocked and len(vshape) >= m + 3 else (1, 1)
    )
    size = _compressed_size(info, m, cshape, vshape, blocksize, size)
    n = len(size) - m - 2
    _check_compressed_dims(info, compressed, plain, values, m, n)
    batch = size[:m]
    n_compressed, n_plain = _block_extents(info, size, m, blocksize, cshape)
    if cshape != (*batch, n_compressed + 1):
        raise _fail(lay, "3.8", f"{info.compressed_name} shape {cshape}, expected "
                    f"{(*batch, n_compressed + 1)}", shape=cshape)
    nnz = pshape[-1]
    if pshape != (*batch, nnz):
        raise _fail(lay, "3.9", f"{info.plain_name} shape {pshape}, expected "
                    f"{(*batch, nnz)}", shape=pshape)
    dense = size[m + 2:]
    expected_v = (*batch, nnz, *blocksize, *dense) if info.blocked else (*batch, nnz, *dense)
    if vshape != expected_v:
        raise _fail(lay, "3.10", f"values shape {vshape}, expected {expected_v}", shape=vshape)
    return CompressedMeta(info, size, batch, blocksize, dense, n_compressed, n_plain, nnz)


def _compressed_size(
    info: LayoutInfo, m: int, cshape: Size, vshape: Size, blocksize: tuple[int, int],
    size: Size | None,
) -> Size:
    """3.1: the size (estimated from the member shapes when omitted) holds M batch dims and
    two sparse dims divisible by the blocksize, and its numel fits int64."""
    lay = info.layout
    if size is None:
        # Estimation: everything but the plain extent comes from the member shapes.
        nblock = 2 if info.blocked else 0
        if len(vshape) < m + 1 + nblock:
            raise _fail(lay, "3.4", f"values have {len(vshape)} dims, need at least "
                        f"{m + 1 + nblock}")
        nc = cshape[-1] - 1 if cshape else 0
        sparse = (nc * blocksize[0], 0) if info.row_compressed else (0, nc * blocksize[1])
        size = cshape[:-1] + sparse + vshape[m + 1 + nblock:]
    else:
        size = tuple(size)
    if len(size) < m + 2 or min(size, default=0) < 0:
        raise _fail(lay, "3.1", f"size {size} cannot hold {m} batch dims and 2 sparse dims",
                    size=size)
    if numel_overflows(size):
        raise _fail(lay, "3.1", f"size {size} has more than 2**63 - 1 elements", size=size)
    for dim, b in ((m, blocksize[0]), (m + 1, blocksize[1])):
        if (b == 0 and size[dim] != 0) or (b > 0 and size[dim] % b):
            raise _fail(lay, "3.1", f"size[{dim}] = {size[dim]} is not divisible by the "
                        f"blocksize {blocksize}", size=size, blocksize=blocksize)
    return size


def _check_compressed_dims(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    m: int, n: int,
) -> None:
    """3.2-3.7: numbers of dims of each member, then their strides."""
    lay = info.layout
    if compressed.dim() != m + 1:
        raise _fail(lay, "3.2", f"{info.compressed_name} has {compressed.dim()} dims, "
                    f"expected {m + 1}")
    if plain.dim() != m + 1:
        raise _fail(lay, "3.3", f"{info.plain_name} has {plain.dim()} dims, expected {m + 1}")
    nblock = 2 if info.blocked else 0
    if values.dim() != m + 1 + nblock + n:
        raise _fail(lay, "3.4", f"values have {values.dim()} dims, expected "
                    f"{m + 1 + nblock + n} (M={m}, N={n})")
    if not index_contiguous(compressed):
        raise _fail(lay, "3.5", f"{info.compressed_name} strides {compressed.stride()}")
    if not index_contiguous(plain):
        raise _fail(lay, "3.6", f"{info.plain_name} strides {plain.stride()}")
    if not values_layout_ok(values, m, info.blocked):
        raise _fail(lay, "3.7", f"values shape {_shape(values)} has strides {values.stride()}")


def _block_extents(
    info: LayoutInfo, size: Size, m: int, blocksize: tuple[int, int], cshape: Size
) -> tuple[int, int]:
    """(n_compressed, n_plain) in blocks. A zero-size block dim leaves the compressed extent
    to the compressed member's shape and no addressable plain slot."""
    b0, b1 = blocksize
    nrows = size[m] // b0 if b0 else None
    ncols = size[m + 1] // b1 if b1 else None
    nc_opt, np_opt = (nrows, ncols) if info.row_compressed else (ncols, nrows)
    n_compressed = nc_opt if nc_opt is not None else max(cshape[-1] - 1, 0)
    return n_compressed, (np_opt if np_opt is not None else 0)


def check_index_capacity(
    info: LayoutInfo, index_dtype: torch.dtype, nnz: int, n_compressed: int, n_plain: int
) -> None:
    """1.3, second half: int32 indices must be able to hold nnz and both block extents (the
    shapes they describe are only known once the 3.x checks passed)."""
    if index_dtype == torch.int32 and max(nnz, n_compressed, n_plain) > _INT32_MAX:
        raise _fail(info.layout, "1.3", f"int32 indices cannot address nnz = {nnz}, "
                    f"n_compressed = {n_compressed}, n_plain = {n_plain}",
                    dtype=str(index_dtype))


def values_layout_ok(values: torch.Tensor, batch_dims: int, blocked: bool) -> bool:
    """Invariant 3.7: contiguous, or (blocked) contiguous with the two block dims swapped.

    Only meaningful for strided values with the block dims present (2.3 / 3.4 come first);
    anything else is reported as satisfying 3.7 so that those ids are the ones raised.
    """
    if values.layout != torch.strided or values.is_contiguous():
        return True
    if not blocked:
        return False
    if values.dim() < batch_dims + 3 or batch_dims < 0:
        return True
    return values.transpose(batch_dims + 1, batch_dims + 2).is_contiguous()


def check_coo_metadata(
    indices: torch.Tensor,
    values: torch.Tensor,
    size: Size | None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> CooMeta:
    """Check ids 1.x-4.x of a COO tensor (``size=None``: sparse extents resolved later)."""
    lay = torch.sparse_coo
    if indices.dtype != torch.int64:
        raise _fail(lay, "1.1", f"got {indices.dtype}", dtype=str(indices.dtype))
    if values.dtype in _UNSUPPORTED_VALUE_DTYPES or (dtype is not None and values.dtype != dtype):
        raise _fail(lay, "1.2", f"values are {values.dtype}"
                    + (f", requested {dtype}" if dtype is not None else ""))
    if indices.layout != torch.strided:
        raise _fail(lay, "2.1", f"indices have layout {indices.layout}")
    if values.layout != torch.strided:
        raise _fail(lay, "2.2", f"values have layout {values.layout}")
    if indices.dim() != 2:
        raise _fail(lay, "3.1", f"indices have {indices.dim()} dims")
    s, nnz = _shape(indices)
    if size is None:
        size = (0,) * s + _shape(values)[1:]
    if s > len(size):  # S = 0 is allowed, as in torch (one value per entry, no index data)
        raise _fail(lay, "3.2", f"sparse_dim {s} with size {tuple(size)}", size=tuple(size))
    if values.dim() < 1 or values.shape[0] != nnz:
        raise _fail(lay, "3.3", f"indices shape {(s, nnz)} but values hold "
                    f"{values.shape[0] if values.dim() else 0} entries")
    expected_v = (nnz, *tuple(size[s:]))
    if _shape(values) != expected_v:
        raise _fail(lay, "3.4", f"values shape {_shape(values)}, expected {expected_v}",
                    shape=_shape(values))
    dev = device if device is not None else values.device
    if dev.type not in SUPPORTED_DEVICE_TYPES:
        raise _fail(lay, "4.1", f"got device {dev}", device=str(dev))
    if indices.device != dev or values.device != dev:
        raise _fail(lay, "4.2", f"indices on {indices.device}, values on {values.device}")
    check_coo_size(tuple(size))
    return CooMeta(tuple(size), s, nnz)


def check_coo_size(size: Size) -> None:
    """COO 3.2 beyond the dim count: a size torch can represent (non-negative, numel fits)."""
    if any(x < 0 for x in size) or numel_overflows(size):
        raise _fail(torch.sparse_coo, "3.2", f"size {size} is negative or has more than "
                    "2**63 - 1 elements", size=size)


# --------------------------------------------------------------------------------------------
# Index-data invariants: one mask helper per invariant, shared by fast and diagnostic paths.


def _le_bound(x: torch.Tensor, bound: int) -> torch.Tensor:
    """``x <= bound`` without the python-int overflow of narrow index dtypes."""
    if bound >= torch.iinfo(x.dtype).max:
        return torch.ones_like(x, dtype=torch.bool)
    return x <= bound


def _bad_first(c: torch.Tensor) -> torch.Tensor:
    """5.1 per batch: compressed[..., 0] != 0. ``c`` is (B, n_compressed + 1)."""
    return c[:, 0] != 0


def _bad_last(c: torch.Tensor, nnz: int) -> torch.Tensor:
    """5.2 per batch: compressed[..., -1] != nnz (1.3 guarantees nnz fits the index dtype)."""
    return c[:, -1] != nnz


def _row_counts(c: torch.Tensor) -> torch.Tensor:
    """Entries per compressed line, in int64 so hostile int32 data cannot wrap around."""
    return c.to(torch.int64).diff(dim=1)


def _bad_counts(c: torch.Tensor, n_plain: int) -> torch.Tensor:
    """5.3 as stated, per (batch, line i): compressed[i+1] - compressed[i] is < 0 or > n_plain."""
    d = _row_counts(c)
    return (d < 0) | (d > n_plain)


def _bad_lines(c: torch.Tensor, nnz: int, n_plain: int) -> torch.Tensor:
    """5.3 per (batch, line i): the count compressed[i+1] - compressed[i] is < 0 or > n_plain.

    Every compressed value must then lie in [0, nnz]; checking that too keeps hostile int64
    values from wrapping the differences around into range (int32 values are widened first,
    so their differences are exact).
    """
    bad = _bad_counts(c, n_plain)
    if c.dtype == torch.int64:
        nxt = c[:, 1:]
        bad |= (nxt < 0) | (nxt > nnz)
    return bad


def _bad_order(c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """5.6 per (batch, position j-1): p[j] <= p[j-1] with j not the start of a line.

    Shape (B, nnz); the last column is padding, the target of line starts that are not
    interior positions (empty leading/trailing lines, or hostile compressed values).
    """
    nnz = p.shape[1]
    if nnz < 2:
        return torch.zeros_like(p, dtype=torch.bool)
    bad = torch.empty_like(p, dtype=torch.bool)
    bad[:, -1] = False
    torch.le(p[:, 1:], p[:, :-1], out=bad[:, :-1])
    starts = c[:, 1:-1].to(torch.int64) - 1  # pair (j-1, j) where line starts at j
    pad = nnz - 1
    starts = torch.where((starts < 0) | (starts >= pad), pad, starts)
    rows = torch.arange(0, bad.numel(), nnz, device=p.device).unsqueeze(1)
    bad.view(-1).index_fill_(0, (starts + rows).reshape(-1), False)
    return bad


def _bad_negative(p: torch.Tensor) -> torch.Tensor:
    """5.4 / COO 5.1: index < 0."""
    return p < 0


def _bad_too_large(p: torch.Tensor, bound: int | torch.Tensor) -> torch.Tensor:
    """5.5 / COO 5.2: index >= bound (bound broadcast per row for COO)."""
    if isinstance(bound, int):
        return ~_le_bound(p, bound - 1) if bound > 0 else torch.ones_like(p, dtype=torch.bool)
    return p >= bound


def _coo_bad_order(indices: torch.Tensor) -> torch.Tensor:
    """COO 5.3 per position j-1: index tuple j is not lexicographically after tuple j-1."""
    s, nnz = indices.shape
    if nnz < 2 or s == 0:
        # with no sparse dim every index tuple is the empty tuple: any two are duplicates
        return torch.full((max(nnz - 1, 0),), s == 0, dtype=torch.bool, device=indices.device)
    prev, nxt = indices[:, :-1], indices[:, 1:]
    after = nxt[0] > prev[0]
    tie = nxt[0] == prev[0]
    for d in range(1, s):  # loop over sparse dims, not over nnz
        after |= tie & (nxt[d] > prev[d])
        if d < s - 1:
            tie &= nxt[d] == prev[d]
    return ~after


# --------------------------------------------------------------------------------------------
# Fast path


def _any(mask: torch.Tensor) -> torch.Tensor:
    """``mask.any()`` as a 0-dim bool tensor. Large masks go through a uint8 max: torch's bool
    ``any`` is not vectorised on CPU, and the max is ~30x faster at 1e7 elements."""
    if mask.numel() < _LARGE:
        return mask.any()
    return mask.reshape(-1).view(torch.uint8).amax() != 0


def _none(*bad: torch.Tensor) -> torch.Tensor:
    """True when none of the 0-dim ``bad`` flags is set (one stacked reduction)."""
    if not bad:  # nothing to check (COO with sparse_dim 0, not marked coalesced)
        return torch.ones((), dtype=torch.bool)
    return ~torch.stack([b.reshape(()) for b in bad]).any()


def _compressed_flags(c: torch.Tensor, p: torch.Tensor, nnz: int, n_plain: int) -> torch.Tensor:
    """All compressed index invariants as one 0-dim bool tensor (no sync).

    5.4/5.5 are violated by some plain index exactly when they are violated by the minimum or
    the maximum, so their predicates are applied to ``aminmax`` results; the other invariants
    reduce their masks (5.1-5.3 are per line: O(rows)).
    """
    bad = [_any(_bad_first(c)), _any(_bad_last(c, nnz)), _any(_bad_lines(c, nnz, n_plain))]
    if p.numel():
        bad.append(_any(_bad_order(c, p)))
        lo, hi = torch.aminmax(p)
        bad += [_bad_negative(lo), _bad_too_large(hi, n_plain)]
    return _none(*bad)


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
#: parallel regions), so it runs at every size; for COO the vectorised path wins from ~2**15
#: (uncoalesced 2**15: native 81 µs, vectorised 51 µs; coalesced 1e7: 0.4-0.6x torch's).
NATIVE_MAX_NNZ_COO: dict[bool, int] = {True: 1 << 15, False: 1 << 14}
_native_enabled = True


def set_native(enabled: bool) -> bool:
    """Allow (default) or forbid the native checker; returns the previous setting (tests)."""
    global _native_enabled
    previous, _native_enabled = _native_enabled, bool(enabled)
    return previous


def native_compressed_ok(meta: CompressedMeta, compressed: torch.Tensor, plain: torch.Tensor,
                         values: torch.Tensor) -> bool:
    """Whether torch's native checker may run the index stage of this (metadata-checked) input.

    Besides size and device: every dim and block dim non-zero (no empty batch, no zero-size
    block, no empty dense dim), members fully contiguous, and ``n_plain + nnz`` below the index
    dtype's maximum, so no difference of two compressed offsets can wrap around in its arithmetic.
    """
    # min(size) > 0 also excludes zero-size blocks: 3.1 allows a zero block dim only with a
    # zero sparse extent
    return (
        _native_enabled
        and values.is_cpu
        and compressed.is_contiguous()
        and plain.is_contiguous()
        and min(meta.size) > 0
        and meta.n_plain + meta.nnz < (_INT32_MAX if compressed.dtype == torch.int32
                                       else _INT64_MAX)
    )


def _offsets_in_bounds(meta: CompressedMeta, compressed: torch.Tensor) -> bool:
    """Whether every compressed offset lies in ``[0, nnz]`` (one host sync). torch's native
    checker reads the plain indices of each line *before* it has checked the offsets of the
    later lines, so offsets outside that range make it read outside the plain indices (a
    segfault, e.g. BSR crow ``[0, 3, -1, 2, 0]`` with no plain index at all)."""
    n = compressed.numel()
    if n == 0:
        return True
    if n <= 512:  # (the native path is CPU-only) a short list is cheaper than two aten ops
        offsets = compressed.view(-1).tolist()
        return bool(min(offsets) >= 0 and max(offsets) <= meta.nnz)
    lo, hi = torch.aminmax(compressed)
    low, high = torch.stack((lo, hi)).tolist()
    return bool(low >= 0 and high <= meta.nnz)


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
        est = torch.maximum(est, p.max().to(torch.int64).clamp(max=_INT64_MAX - 1) + 1)
    if c.shape[1] > 1 and c.numel():
        est = torch.maximum(est, _row_counts(c).max())
    return est


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
    if (values is not None and not estimate
            and native_compressed_ok(meta, compressed, plain, values)
            and _offsets_in_bounds(meta, compressed)):
        try:
            torch._validate_sparse_compressed_tensor_args(
                compressed, plain, values, meta.size, meta.info.layout)
            return meta
        except Exception:  # rejected: the vectorised path decides and reports
            pass
    c, p = _flatten_batch(meta, compressed, plain)
    if c.numel() == 0 and not estimate:
        return meta  # empty batch: nothing to check
    if estimate:
        # Without a size the plain extent is max + 1, which must exist (an index of 2**63 - 1
        # has none: 5.5); a zero-size block dim on the plain side has no plain slot at all.
        plain_block = meta.blocksize[1] if meta.info.row_compressed else meta.blocksize[0]
        bound = 0 if plain_block == 0 else _INT64_MAX
        est = _estimate_plain_extent(c, p)
        ok = _compressed_flags(c, p, meta.nnz, bound)
        flag, extent = torch.stack([ok.to(torch.int64), est]).tolist()
        if not flag:
            raise diagnose_compressed(meta, c, p, bound)
        resolved = _with_plain_extent(meta, int(extent))
        check_index_capacity(meta.info, compressed.dtype, meta.nnz, meta.n_compressed,
                             resolved.n_plain)
        if numel_overflows(resolved.size):
            raise _fail(meta.info.layout, "3.1", f"estimated size {resolved.size} has more "
                        "than 2**63 - 1 elements", size=resolved.size)
        return resolved
    if not bool(_compressed_flags(c, p, meta.nnz, meta.n_plain)):
        raise diagnose_compressed(meta, c, p, meta.n_plain)
    return meta


def _with_plain_extent(meta: CompressedMeta, extent: int) -> CompressedMeta:
    m = len(meta.batch)
    size = list(meta.size)
    dim, b = (m + 1, meta.blocksize[1]) if meta.info.row_compressed else (m, meta.blocksize[0])
    size[dim] = extent * b
    return CompressedMeta(meta.info, tuple(size), meta.batch, meta.blocksize, meta.dense,
                          meta.n_compressed, extent, meta.nnz)


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
        bad.append(_bad_negative(lo))
        if estimate:
            # max + 1 must itself be a valid size: an index of 2**63 - 1 has none (5.2)
            bad.append(_bad_too_large(hi, _INT64_MAX))
            highs.append(hi.clamp(max=_INT64_MAX - 1) + 1)
        else:
            bad.append(_bad_too_large(hi, meta.size[d]))
    if is_coalesced:
        bad.append(_any(_coo_bad_order(indices)))
    ok = _none(*bad)
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
# Diagnostic path: runs only after the fast path failed; may sync as often as it likes.


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of ``mask`` in row-major order, or None."""
    hit = mask.nonzero()
    return tuple(int(x) for x in hit[0].tolist()) if hit.shape[0] else None


def _batch_index(meta: CompressedMeta, b: int) -> tuple[int, ...]:
    idx: list[int] = []
    for extent in reversed(meta.batch):
        idx.append(b % extent)
        b //= extent
    return tuple(reversed(idx))


def _where(meta: CompressedMeta, b: int) -> str:
    return f"batch {_batch_index(meta, b)}, " if meta.batch else ""


def diagnose_compressed(
    meta: CompressedMeta, c: torch.Tensor, p: torch.Tensor, n_plain: int
) -> InvariantError:
    """The first violated index invariant of a compressed tensor (5.1 ... 5.6) with location."""
    info, lay = meta.info, meta.info.layout
    cn, pn = info.compressed_name, info.plain_name
    hit = _first(_bad_first(c))
    if hit is not None:
        (b,) = hit
        v = int(c[b, 0])
        return _fail(lay, "5.1", f"{_where(meta, b)}{cn}[0] = {v}",
                     batch=_batch_index(meta, b), position=0, value=v)
    hit = _first(_bad_last(c, meta.nnz))
    if hit is not None:
        (b,) = hit
        v = int(c[b, -1])
        return _fail(lay, "5.2", f"{_where(meta, b)}{cn}[{meta.n_compressed}] = {v}, "
                     f"nnz = {meta.nnz}", batch=_batch_index(meta, b),
                     position=meta.n_compressed, value=v)
    # A line whose count is out of range first; the [0, nnz] guard of _bad_lines flags the
    # line *before* an out-of-range offset, whose own count may be fine.
    hit = _first(_bad_counts(c, n_plain))
    counts_ok = hit is None
    if counts_ok:
        hit = _first(_bad_lines(c, meta.nnz, n_plain))
    if hit is not None:
        b, i = hit
        lo, hi = int(c[b, i]), int(c[b, i + 1])
        what = (f"{cn}[{i + 1}] = {hi} lies outside [0, nnz = {meta.nnz}]" if counts_ok
                else f"{cn}[{i + 1}] - {cn}[{i}] = {hi} - {lo} = {hi - lo}, n_plain = {n_plain}")
        return _fail(lay, "5.3", f"{_where(meta, b)}{info.line} {i}: {what}",
                     batch=_batch_index(meta, b), **{info.line.replace(" ", "_"): i},
                     position=i + 1, value=hi - lo)
    for iid, mask in (
        ("5.4", _bad_negative(p)),
        ("5.5", _bad_too_large(p, n_plain)),
    ):
        hit = _first(mask)
        if hit is not None:
            b, j = hit
            return _located(meta, c, p, iid, b, j, f"{pn}[{j}] = {int(p[b, j])}"
                            + (f", n_plain = {n_plain}" if iid == "5.5" else ""))
    hit = _first(_bad_order(c, p))
    if hit is not None:
        b, j = hit
        return _located(meta, c, p, "5.6", b, j + 1,
                        f"{pn}[{j + 1}] = {int(p[b, j + 1])} does not exceed "
                        f"{pn}[{j}] = {int(p[b, j])}")
    raise AssertionError("fast path rejected a tensor the diagnostic path accepts")


def _located(meta: CompressedMeta, c: torch.Tensor, p: torch.Tensor, iid: str, b: int, j: int,
             what: str) -> InvariantError:
    line = int(torch.searchsorted(c[b].contiguous(), j, right=True)) - 1
    info = meta.info
    return _fail(info.layout, iid, f"{_where(meta, b)}{info.line} {line}, position {j}: {what}",
                 batch=_batch_index(meta, b), **{info.line.replace(" ", "_"): line},
                 position=j, value=int(p[b, j]))


def diagnose_coo(meta: CooMeta, indices: torch.Tensor, *, is_coalesced: bool) -> InvariantError:
    lay = torch.sparse_coo
    hit = _first(_bad_negative(indices).t())
    if hit is not None:
        j, d = hit
        return _fail(lay, "5.1", f"position {j}, sparse dim {d}: indices[{d}, {j}] = "
                     f"{int(indices[d, j])}", position=j, dim=d, value=int(indices[d, j]))
    bounds = torch.tensor(meta.size[:meta.sparse_dim], dtype=torch.int64,
                          device=indices.device).unsqueeze(1)
    hit = _first(_bad_too_large(indices, bounds).t())
    if hit is not None:
        j, d = hit
        return _fail(lay, "5.2", f"position {j}, sparse dim {d}: indices[{d}, {j}] = "
                     f"{int(indices[d, j])}, size[{d}] = {meta.size[d]}",
                     position=j, dim=d, value=int(indices[d, j]))
    if is_coalesced:
        hit = _first(_coo_bad_order(indices))
        if hit is not None:
            (j,) = hit
            cur, prev = indices[:, j + 1].tolist(), indices[:, j].tolist()
            return _fail(lay, "5.3", f"position {j + 1}: index {tuple(cur)} does not follow "
                         f"{tuple(prev)}", position=j + 1, value=tuple(cur))
    raise AssertionError("fast path rejected a tensor the diagnostic path accepts")


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


def validate_tensor(t: torch.Tensor, *, check_indices: bool = True) -> None:
    """Validate every invariant of an existing torch sparse tensor (any sparse layout);
    ``check_indices=False``: the O(1) metadata invariants only (index data known valid)."""
    if t.layout == torch.sparse_coo:
        validate_coo(t._indices(), t._values(), tuple(t.shape), is_coalesced=t.is_coalesced(),
                     check_indices=check_indices)
    elif t.layout in COMPRESSED_LAYOUTS:
        compressed, plain = compressed_members(t)
        validate_compressed(compressed, plain, t.values(), tuple(t.shape), t.layout,
                            check_indices=check_indices)
    else:
        raise TypeError(f"expected a sparse tensor, got layout {t.layout}")


__all__ = [
    "INDEX_DTYPES",
    "LAYOUTS",
    "NATIVE_MAX_NNZ_COO",
    "SUPPORTED_DEVICE_TYPES",
    "CompressedMeta",
    "CooMeta",
    "LayoutInfo",
    "check_compressed_indices",
    "check_compressed_metadata",
    "check_coo_indices",
    "check_coo_metadata",
    "check_coo_size",
    "check_index_capacity",
    "compressed_members",
    "diagnose_compressed",
    "diagnose_coo",
    "index_contiguous",
    "members",
    "native_compressed_ok",
    "native_coo_ok",
    "numel_overflows",
    "set_native",
    "validate_compressed",
    "validate_coo",
    "validate_tensor",
    "values_layout_ok",
    "values_of",
]

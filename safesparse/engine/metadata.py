"""The metadata stage of validation: every O(1) invariant, checked without reading index data.

Dtypes, layouts, dims, shapes, devices and strides of the member tensors (catalog ids 1.x-4.x,
and 3.x of COO), in catalog order: the first violated id is raised at once, before anything
reads the index data. Also the vocabulary every other module uses to take a sparse tensor
apart (:data:`LAYOUTS`, :func:`members`, :func:`values_of`; the members by layout:
:func:`safesparse.base.layouts.index_members`).

The O(nnz) index stage is :mod:`safesparse.engine.validation`; the location of a violation is found
by :mod:`safesparse.engine.diagnose`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Final, NamedTuple

import torch

from ..base.layouts import compressed_members, layout_name
from ..catalog.errors import InvariantError

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
INT64_MAX: Final = 2**63 - 1
INT32_MAX: Final = 2**31 - 1


def numel_overflows(size: Size) -> bool:
    """Whether torch's numel (multiplied dim by dim, in order) overflows int64 for ``size``."""
    total = prod(size)
    if total and -INT64_MAX <= total <= INT64_MAX:
        return False  # (no zero extent: no partial product is larger in size than the total)
    n = 1
    for extent in size:
        n *= extent
        if n > INT64_MAX:
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


def fail(
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
        raise fail(layout, "4.1", f"got device {device}", device=str(device))
    for iid, name, member in members:
        if member.device != device:
            raise fail(
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
        raise fail(
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
    every 1.x-4.x invariant visibly holds (explicit size, non-empty blocks, fully contiguous
    members on the CPU or CUDA), else None, and the id-ordered stages decide. It accepts
    nothing they would reject and returns the same meta (tests/engine/test_fast_path.py compares the
    two). Written for speed: every factory call on members in their final form runs it."""
    info = LAYOUTS.get(layout)
    if info is None:
        return None
    idt = compressed.dtype
    vdt = values.dtype
    if (idt is not plain.dtype or (idt is not _INT64 and idt is not _INT32)
            or vdt in _UNSUPPORTED_VALUE_DTYPES or (dtype is not None and vdt != dtype)
            or compressed.layout is not _STRIDED or plain.layout is not _STRIDED
            or values.layout is not _STRIDED):
        return None
    cshape = compressed.shape
    pshape = plain.shape
    vshape = values.shape
    m = len(cshape) - 1
    if type(size) is not tuple:
        size = tuple(size)
    if m < 0 or len(pshape) != m + 1 or len(size) < m + 2:
        return None
    nnz = pshape[m]
    rows = size[m]
    cols = size[m + 1]
    if info.blocked:
        if len(vshape) < m + 3:
            return None
        b0 = vshape[m + 1]
        b1 = vshape[m + 2]
        if b0 <= 0 or b1 <= 0 or rows % b0 or cols % b1:
            return None
        block = (b0, b1)
        vd = m + 3  # the values' first dense dim
    else:
        b0 = b1 = 1
        block = _UNIT_BLOCK
        vd = m + 1
    # (torch.Size slices cost ~0.1 µs each: the common cases compare extents one by one)
    if len(size) == m + 2:  # no dense dims
        dense: Size = ()
        if len(vshape) != vd or vshape[m] != nnz:
            return None
    else:
        dense = size[m + 2:]
        if len(vshape) != vd + len(dense) or vshape[m] != nnz or vshape[vd:] != dense:
            return None
    if min(size) < 0 or numel_overflows(size):
        return None
    if info.row_compressed:
        nc, npl = rows // b0, cols // b1
    else:
        nc, npl = cols // b1, rows // b0
    if not m:
        batch: Size = ()
    elif m == 1:
        batch = size[:1]
        b = size[0]
        if cshape[0] != b or pshape[0] != b or vshape[0] != b:
            return None
    else:
        batch = size[:m]
        if cshape[:m] != batch or pshape[:m] != batch or vshape[:m] != batch:
            return None
    if cshape[m] != nc + 1:
        return None
    # stricter than 3.5-3.7 (fully contiguous members): anything else takes the ordered stages;
    # a contiguous member has unit last stride unless its last dim has size 0 or 1
    if not (compressed.is_contiguous() and plain.is_contiguous() and values.is_contiguous()
            and (nc > 0 or compressed.stride(-1) == 1)
            and (nnz > 1 or plain.stride(-1) == 1)):
        return None
    if idt is _INT32 and (nnz > INT32_MAX or nc > INT32_MAX or npl > INT32_MAX):
        return None
    if values.is_cpu:  # (device objects are slow to make: the CPU is told by flags)
        if not (compressed.is_cpu and plain.is_cpu) or (device is not None
                                                         and device.type != "cpu"):
            return None
    else:
        dev = values.device
        if (not values.is_cuda or (device is not None and device != dev)
                or compressed.device != dev or plain.device != dev):
            return None
    return tuple.__new__(CompressedMeta, (info, size, batch, block, dense, nc, npl, nnz))


_INT64 = torch.int64
_UNIT_BLOCK: Final = (1, 1)
_INT32 = torch.int32
_STRIDED = torch.strided


def _check_compressed_dtypes(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    dtype: torch.dtype | None,
) -> torch.dtype:
    """1.1-1.5; returns the index dtype (the first member's dtype that is a valid one)."""
    lay = info.layout
    cdt, pdt = compressed.dtype, plain.dtype
    index_dtype = cdt if cdt in INDEX_DTYPES or pdt not in INDEX_DTYPES else pdt
    if cdt != index_dtype:
        raise fail(lay, "1.1", f"{info.compressed_name} is {cdt}, {info.plain_name} is {pdt}",
                    dtype=str(cdt))
    if pdt != index_dtype:
        raise fail(lay, "1.2", f"{info.plain_name} is {pdt}, {info.compressed_name} is {cdt}",
                    dtype=str(pdt))
    if index_dtype not in INDEX_DTYPES:
        raise fail(lay, "1.3", f"got {index_dtype}", dtype=str(index_dtype))
    vdt = values.dtype
    if dtype is not None and vdt != dtype:
        raise fail(lay, "1.4", f"values are {vdt}, requested {dtype}")
    if vdt in _UNSUPPORTED_VALUE_DTYPES:
        raise fail(lay, "1.5", f"got {vdt}", dtype=str(vdt))
    return index_dtype


def _check_compressed_layouts(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    layout: torch.layout,
) -> None:
    """2.1-2.4: strided members, and the layout is the requested one."""
    lay = info.layout
    if compressed.layout != torch.strided:
        raise fail(lay, "2.1", f"{info.compressed_name} has layout {compressed.layout}")
    if plain.layout != torch.strided:
        raise fail(lay, "2.2", f"{info.plain_name} has layout {plain.layout}")
    if values.layout != torch.strided:
        raise fail(lay, "2.3", f"values has layout {values.layout}")
    if layout != lay:
        raise fail(lay, "2.4", f"got {layout}", layout=str(layout))


def _check_compressed_shapes(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    size: Size | None,
) -> CompressedMeta:
    """3.1-3.10, in id order; returns the meta (1.3 capacity and 4.x are checked after)."""
    lay = info.layout
    m = _batch_dims(compressed, plain, values)
    if m < 0:
        raise fail(lay, "3.2", f"{info.compressed_name} has 0 dims")
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
        raise fail(lay, "3.8", f"{info.compressed_name} shape {cshape}, expected "
                    f"{(*batch, n_compressed + 1)}", shape=cshape)
    nnz = pshape[-1]
    if pshape != (*batch, nnz):
        raise fail(lay, "3.9", f"{info.plain_name} shape {pshape}, expected "
                    f"{(*batch, nnz)}", shape=pshape)
    dense = size[m + 2:]
    expected_v = (*batch, nnz, *blocksize, *dense) if info.blocked else (*batch, nnz, *dense)
    if vshape != expected_v:
        raise fail(lay, "3.10", f"values shape {vshape}, expected {expected_v}", shape=vshape)
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
            raise fail(lay, "3.4", f"values have {len(vshape)} dims, need at least "
                        f"{m + 1 + nblock}")
        nc = cshape[-1] - 1 if cshape else 0
        sparse = (nc * blocksize[0], 0) if info.row_compressed else (0, nc * blocksize[1])
        size = cshape[:-1] + sparse + vshape[m + 1 + nblock:]
    else:
        size = tuple(size)
    if len(size) < m + 2 or min(size, default=0) < 0:
        raise fail(lay, "3.1", f"size {size} cannot hold {m} batch dims and 2 sparse dims",
                    size=size)
    if numel_overflows(size):
        raise fail(lay, "3.1", f"size {size} has more than 2**63 - 1 elements", size=size)
    for dim, b in ((m, blocksize[0]), (m + 1, blocksize[1])):
        if (b == 0 and size[dim] != 0) or (b > 0 and size[dim] % b):
            raise fail(lay, "3.1", f"size[{dim}] = {size[dim]} is not divisible by the "
                        f"blocksize {blocksize}", size=size, blocksize=blocksize)
    return size


def _check_compressed_dims(
    info: LayoutInfo, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
    m: int, n: int,
) -> None:
    """3.2-3.7: numbers of dims of each member, then their strides."""
    lay = info.layout
    if compressed.dim() != m + 1:
        raise fail(lay, "3.2", f"{info.compressed_name} has {compressed.dim()} dims, "
                    f"expected {m + 1}")
    if plain.dim() != m + 1:
        raise fail(lay, "3.3", f"{info.plain_name} has {plain.dim()} dims, expected {m + 1}")
    nblock = 2 if info.blocked else 0
    if values.dim() != m + 1 + nblock + n:
        raise fail(lay, "3.4", f"values have {values.dim()} dims, expected "
                    f"{m + 1 + nblock + n} (M={m}, N={n})")
    if not index_contiguous(compressed):
        raise fail(lay, "3.5", f"{info.compressed_name} strides {compressed.stride()}")
    if not index_contiguous(plain):
        raise fail(lay, "3.6", f"{info.plain_name} strides {plain.stride()}")
    if not values_layout_ok(values, m, info.blocked):
        raise fail(lay, "3.7", f"values shape {_shape(values)} has strides {values.stride()}")


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
    if index_dtype == torch.int32 and max(nnz, n_compressed, n_plain) > INT32_MAX:
        raise fail(info.layout, "1.3", f"int32 indices cannot address nnz = {nnz}, "
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
    if indices.dtype is not _INT64:
        raise fail(lay, "1.1", f"got {indices.dtype}", dtype=str(indices.dtype))
    vdt = values.dtype
    if vdt in _UNSUPPORTED_VALUE_DTYPES or (dtype is not None and vdt != dtype):
        raise fail(lay, "1.2", f"values are {vdt}"
                    + (f", requested {dtype}" if dtype is not None else ""))
    if indices.layout is not _STRIDED:
        raise fail(lay, "2.1", f"indices have layout {indices.layout}")
    if values.layout is not _STRIDED:
        raise fail(lay, "2.2", f"values have layout {values.layout}")
    ishape = indices.shape
    if len(ishape) != 2:
        raise fail(lay, "3.1", f"indices have {len(ishape)} dims")
    s, nnz = ishape
    vshape = tuple(values.shape)
    size = tuple((0,) * s + vshape[1:]) if size is None else tuple(size)
    if s > len(size):  # S = 0 is allowed, as in torch (one value per entry, no index data)
        raise fail(lay, "3.2", f"sparse_dim {s} with size {size}", size=size)
    if not vshape or vshape[0] != nnz:
        raise fail(lay, "3.3", f"indices shape {(s, nnz)} but values hold "
                    f"{vshape[0] if vshape else 0} entries")
    if vshape[1:] != size[s:]:
        expected_v = (nnz, *size[s:])
        raise fail(lay, "3.4", f"values shape {vshape}, expected {expected_v}", shape=vshape)
    if device is None and values.is_cpu:  # (device objects are slow to make: flags tell)
        if not indices.is_cpu:
            raise fail(lay, "4.2", f"indices on {indices.device}, values on {values.device}")
    else:
        dev = device if device is not None else values.device
        if dev.type not in SUPPORTED_DEVICE_TYPES:
            raise fail(lay, "4.1", f"got device {dev}", device=str(dev))
        if indices.device != dev or values.device != dev:
            raise fail(lay, "4.2", f"indices on {indices.device}, values on {values.device}")
    check_coo_size(size)
    return tuple.__new__(CooMeta, (size, s, nnz))


def check_coo_size(size: Size) -> None:
    """COO 3.2 beyond the dim count: a size torch can represent (non-negative, numel fits)."""
    if any(x < 0 for x in size) or numel_overflows(size):
        raise fail(torch.sparse_coo, "3.2", f"size {size} is negative or has more than "
                    "2**63 - 1 elements", size=size)


__all__ = [
    "INDEX_DTYPES",
    "INT32_MAX",
    "INT64_MAX",
    "LAYOUTS",
    "SUPPORTED_DEVICE_TYPES",
    "CompressedMeta",
    "CooMeta",
    "LayoutInfo",
    "Size",
    "check_compressed_metadata",
    "check_coo_metadata",
    "check_coo_size",
    "check_index_capacity",
    "fail",
    "index_contiguous",
    "members",
    "numel_overflows",
    "values_layout_ok",
    "values_of",
]

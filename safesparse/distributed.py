"""Sparse tensors across processes: ``torch.distributed`` with validation on receipt.

A peer process is "data from elsewhere" as much as a file is: a buggy or hostile peer can send
index data that would crash the first kernel reading it. Every function here sends a sparse
tensor as a small **header** (an int64 tensor: layout, shape, dtypes, nnz, blocksize, coalesced
flag, dense dims; never a pickle) followed by its **members** as dense tensors, and every
receiver

1. checks the header before it allocates anything (known layout and dtypes, non-negative sizes,
   member sizes within ``max_bytes``), so a peer cannot make it allocate terabytes;
2. receives the members into buffers of its own, and
3. builds the tensor through the safe factories, which validate every invariant (one host sync)
   before torch sees the data.

A refusal raises :class:`~safesparse.InvariantError` (an invariant is broken: the error names
the source rank in its message and in ``err.location["source_rank"]``) or :class:`TransferError`
(a header that describes no tensor this process will allocate). Nothing sparse is built from
refused data.

The functions take the same ``group`` and (global) rank arguments as ``torch.distributed`` and
run on the group's device: CPU for gloo, the current CUDA device for NCCL. Members travel as flat
``uint8`` views of their data (no copy for contiguous members), so every dtype works on every
backend. There are no host loops over nnz; a receiver synchronises once to read the headers
and once to validate.

Every rank of a collective must call it, as with any collective: a rank that raises before the
exchange (say, because its own tensor is invalid) leaves the others waiting until the group's
timeout; a receiver that refuses a header does not receive that peer's members, so the peer's
sends wait until the timeout too. Results do not require grad (communication detaches).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist
from torch._C import DisableTorchFunctionSubclass

from .base.layouts import BLOCK_LAYOUTS, SPARSE_LAYOUTS, compressed_members, extents
from .catalog.errors import InvariantError
from .engine.metadata import members
from .factories.core import sparse_compressed_tensor, sparse_coo_tensor
from .tensor.core import SafeSparseTensor, validate

__all__ = [
    "HEADER_LEN",
    "MAX_DIMS",
    "TransferError",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_sparse_state",
    "default_max_bytes",
    "recv",
    "send",
]

_SPARSE: Final = frozenset(SPARSE_LAYOUTS)

if not dist.is_available():  # pragma: no cover - torch builds without distributed support
    raise ImportError("safesparse.distributed needs a torch build with torch.distributed")

Group = dist.ProcessGroup | None

#: The most dims a sent tensor may have (the header has room for this many sizes).
MAX_DIMS: Final = 64
_MAGIC: Final = 0x5353_5350_4152_5345  # "SSSPARSE"
_VERSION: Final = 1
# header fields
_F_MAGIC, _F_VERSION, _F_LAYOUT, _F_DTYPE, _F_INDEX_DTYPE, _F_NDIM = range(6)
_F_NNZ, _F_SPLIT, _F_DENSE, _F_B0, _F_B1, _F_COALESCED = range(6, 12)
_F_SHAPE: Final = 12
_INT64_MAX: Final = 2**63 - 1
#: Length of a header (int64 elements).
HEADER_LEN: Final = _F_SHAPE + MAX_DIMS

_LAYOUTS: Final = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc)
_DTYPES: Final = tuple(
    getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
        "float64", "complex32", "complex64", "complex128", "uint16", "uint32", "uint64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)
_INDEX_DTYPES: Final = (torch.int32, torch.int64)


class TransferError(ValueError, RuntimeError):
    """A peer sent a header that describes no tensor this process will allocate: an unknown
    protocol, layout or dtype code, members larger than ``max_bytes``, or members whose
    strides would overflow int64 (a zero-size dim next to a 2**63 - 1 one).

    Attributes:
        source_rank: the (global) rank the header came from.
    """

    def __init__(self, message: str, *, source_rank: int) -> None:
        self.source_rank = source_rank
        super().__init__(f"{message} (from rank {source_rank})")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_transfer_error, (str(self), self.source_rank))


def _rebuild_transfer_error(message: str, source_rank: int) -> TransferError:
    err = TransferError("", source_rank=source_rank)
    err.args = (message,)
    return err


# ---------------------------------------------------------------------------------------------
# Devices and limits


def _comm_device(group: Group) -> torch.device:
    """The device the group's backend communicates on: CUDA for NCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_max_bytes(device: torch.device) -> int:
    """The default receive limit: the device's total memory (CUDA) or the machine's physical
    memory (CPU). A header asking for more than this is refused before anything is allocated."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def _global_rank(group: Group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# ---------------------------------------------------------------------------------------------
# Headers


def _members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The member tensors of a sparse tensor, plain and detached: (indices, values) for COO,
    (compressed, plain, values) otherwise."""
    with DisableTorchFunctionSubclass():
        return members(t.detach())


def _header(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    with DisableTorchFunctionSubclass():
        shape = tuple(t.shape)
        if len(shape) > MAX_DIMS:
            raise ValueError(f"cannot send a tensor with {len(shape)} dims (at most {MAX_DIMS})")
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send values of dtype {t.dtype}")
        h = [0] * HEADER_LEN
        h[_F_MAGIC], h[_F_VERSION] = _MAGIC, _VERSION
        h[_F_LAYOUT] = _LAYOUTS.index(t.layout)
        h[_F_DTYPE] = _DTYPES.index(t.dtype)
        h[_F_NDIM] = len(shape)
        h[_F_DENSE] = t.dense_dim()
        h[_F_B0] = h[_F_B1] = 1
        if t.layout == torch.sparse_coo:
            h[_F_INDEX_DTYPE] = _INDEX_DTYPES.index(torch.int64)
            h[_F_NNZ] = t._nnz()
            h[_F_SPLIT] = t.sparse_dim()
            h[_F_COALESCED] = int(t.is_coalesced())
        else:
            compressed, plain = compressed_members(t)
            h[_F_INDEX_DTYPE] = _INDEX_DTYPES.index(compressed.dtype)
            h[_F_NNZ] = plain.shape[-1]
            m = compressed.dim() - 1
            h[_F_SPLIT] = m
            if t.layout in BLOCK_LAYOUTS:
                h[_F_B0], h[_F_B1] = t.values().shape[m + 1: m + 3]
        h[_F_SHAPE: _F_SHAPE + len(shape)] = shape
        return torch.tensor(h, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class _Plan:
    """What a sane header describes: the layout, size and member shapes/dtypes to receive."""

    layout: torch.layout
    size: tuple[int, ...]
    coalesced: bool
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * _itemsize(d)
                     for s, d in zip(self.shapes, self.dtypes, strict=True))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _plan(h: Sequence[int], src: int, op: str) -> _Plan:
    """Check a received header before anything is allocated for it (O(1), no device access).

    Only what is needed to allocate the members is checked here; every invariant is checked by
    the factories once the members are in.
    """
    if len(h) != HEADER_LEN or h[_F_MAGIC] != _MAGIC or h[_F_VERSION] != _VERSION:
        raise TransferError(f"{op}: not a safesparse header (protocol {_VERSION})",
                            source_rank=src)
    if not 0 <= h[_F_LAYOUT] < len(_LAYOUTS):
        raise TransferError(f"{op}: unknown layout code {h[_F_LAYOUT]}", source_rank=src)
    layout = _LAYOUTS[h[_F_LAYOUT]]
    coo = layout == torch.sparse_coo

    def refuse(iid: str, detail: str) -> InvariantError:
        return InvariantError(layout, iid, detail, op=f"{op} from rank {src}",
                              location={"source_rank": src})

    if not 0 <= h[_F_DTYPE] < len(_DTYPES):
        raise refuse("1.2" if coo else "1.5", f"unknown values dtype code {h[_F_DTYPE]}")
    dtype = _DTYPES[h[_F_DTYPE]]
    if not 0 <= h[_F_INDEX_DTYPE] < len(_INDEX_DTYPES):
        raise refuse("1.1" if coo else "1.3", f"unknown index dtype code {h[_F_INDEX_DTYPE]}")
    index_dtype = _INDEX_DTYPES[h[_F_INDEX_DTYPE]]
    ndim, nnz, split, dense = h[_F_NDIM], h[_F_NNZ], h[_F_SPLIT], h[_F_DENSE]
    size_id = "3.2" if coo else "3.1"
    if not 0 <= ndim <= MAX_DIMS:
        raise refuse(size_id, f"{ndim} dims")
    size = tuple(h[_F_SHAPE: _F_SHAPE + ndim])
    if any(s < 0 for s in size):
        raise refuse(size_id, f"size {size} is negative")
    if nnz < 0:
        raise refuse("3.3" if coo else "3.9", f"nnz = {nnz}")
    if coo:
        if index_dtype != torch.int64:
            raise refuse("1.1", f"got {index_dtype}")
        if not (1 <= split <= ndim and dense == ndim - split):
            raise refuse("3.2", f"sparse_dim {split}, dense_dim {dense} with size {size}")
        coo_shapes: tuple[tuple[int, ...], ...] = ((split, nnz), (nnz, *size[split:]))
        return _addressable(_Plan(layout, size, bool(h[_F_COALESCED]), coo_shapes,
                                  (torch.int64, dtype)), src, op)
    blocked = layout in BLOCK_LAYOUTS
    b0, b1 = (h[_F_B0], h[_F_B1]) if blocked else (1, 1)
    if split < 0 or dense < 0 or split + 2 + dense != ndim or b0 < 0 or b1 < 0:
        raise refuse("3.1", f"size {size} with {split} batch dims, {dense} dense dims and "
                     f"blocksize {(b0, b1)}")
    batch = size[:split]
    rows, cols = size[split], size[split + 1]
    n_compressed = extents(layout, rows, cols, b0, b1)[0]
    shapes = (
        (*batch, n_compressed + 1),
        (*batch, nnz),
        (*batch, nnz, *((b0, b1) if blocked else ()), *size[split + 2:]),
    )
    return _addressable(_Plan(layout, size, False, shapes, (index_dtype, index_dtype, dtype)),
                        src, op)


def _addressable(plan: _Plan, src: int, op: str) -> _Plan:
    """``plan``, if every member can be laid out: torch computes a contiguous tensor's strides
    as products of the later extents (an extent of 0 counting as 1), so a zero-size dim next
    to a 2**63 - 1 one allocates nothing and still overflows them."""
    for shape in plan.shapes:
        if math.prod(max(s, 1) for s in shape) > _INT64_MAX:
            raise TransferError(f"{op}: the header describes a {plan.layout} tensor of size "
                                f"{plan.size} whose member of shape {shape} cannot be laid out "
                                "(its strides overflow int64)", source_rank=src)
    return plan


def _check_limit(plans: Sequence[tuple[int, _Plan]], max_bytes: int, op: str, *,
                 total: int | None = None) -> None:
    """Refuse before allocating when the members would take more than ``max_bytes``
    (``total``: the bytes actually to be allocated, when that is more than the members')."""
    if not plans:
        return  # nothing is received
    if total is None:
        total = sum(sum(p.nbytes) for _, p in plans)
    if total > max_bytes:
        src = max(plans, key=lambda rp: sum(rp[1].nbytes))[0]
        raise TransferError(f"{op}: the header asks for {total} bytes of members, more than "
                            f"max_bytes = {max_bytes}", source_rank=src)


def _read_headers(headers: Sequence[torch.Tensor]) -> list[list[int]]:
    """All headers in one host sync."""
    rows: list[list[int]] = torch.stack(list(headers)).tolist()
    return rows


# ---------------------------------------------------------------------------------------------
# Members as bytes


def _as_bytes(member: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A flat uint8 view of ``member`` on ``device`` (a copy only if it is not contiguous)."""
    m = member.to(device).contiguous().reshape(-1)
    return m.view(torch.uint8) if m.numel() else torch.empty(0, dtype=torch.uint8, device=device)


def _from_bytes(buf: torch.Tensor, nbytes: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """The member received as bytes in ``buf``, as a tensor (a view, no copy)."""
    flat = buf[:nbytes] if buf.numel() != nbytes else buf
    if dtype == torch.bool:
        # a bool must be 0 or 1: any other byte from a peer would be undefined behaviour in
        # torch's kernels, so map it to True (in place, on this process's own buffer)
        flat.clamp_(max=1)
    return flat.view(dtype).view(shape)


def _build(plan: _Plan, members: Sequence[torch.Tensor], src: int, op: str) -> SafeSparseTensor:
    """Validate the received members (safe factories) and build the tensor."""
    try:
        if plan.layout == torch.sparse_coo:
            indices, values = members
            return sparse_coo_tensor(indices, values, plan.size, is_coalesced=plan.coalesced)
        compressed, plain, values = members
        return sparse_compressed_tensor(compressed, plain, values, plan.size, layout=plan.layout)
    except InvariantError as err:
        out = err.with_context(op=f"{op} from rank {src}")
        out.location["source_rank"] = src
        raise out from None


def _prepare(tensor: torch.Tensor, device: torch.device
             ) -> tuple[SafeSparseTensor, torch.Tensor, list[torch.Tensor]]:
    """Validate a tensor about to be sent (free for a checked one): the checked tensor on
    ``device``, its header and its members as bytes."""
    t = validate(validate(tensor).to(device))
    return t, _header(t, device), [_as_bytes(m, device) for m in _members(t)]


# ---------------------------------------------------------------------------------------------
# Point to point


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    """Send a sparse tensor (any layout, batched or hybrid) to rank ``dst``.

    ``tensor`` is validated first (free if it is checked). Pair with :func:`recv`.
    """
    device = _comm_device(group)
    _, header, members = _prepare(tensor, device)
    dist.send(header, dst, group=group, tag=tag)
    for m in members:
        if m.numel():
            dist.send(m, dst, group=group, tag=tag)


def _receive(header: torch.Tensor, src: int, op: str, device: torch.device,
             max_bytes: int | None, transfer: Callable[[torch.Tensor], object]) -> SafeSparseTensor:
    """The receiving side of one tensor from ``src``: plan from its header, bound the memory it
    asks for, ``transfer`` each non-empty member into a fresh buffer, build and validate."""
    (row,) = _read_headers([header])
    plan = _plan(row, src, op)
    limit = default_max_bytes(device) if max_bytes is None else max_bytes
    _check_limit([(src, plan)], limit, op)
    members = []
    for shape, dtype, nbytes in zip(plan.shapes, plan.dtypes, plan.nbytes, strict=True):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            transfer(buf)
        members.append(_from_bytes(buf, nbytes, shape, dtype))
    return _build(plan, members, src, op)


def recv(src: int | None = None, group: Group = None, tag: int = 0, *,
         max_bytes: int | None = None) -> SafeSparseTensor:
    """Receive a sparse tensor sent by :func:`send` from ``src`` (any rank if ``None``).

    Returns a checked :class:`SafeSparseTensor` on the group's device. Raises
    :class:`InvariantError` or :class:`TransferError` naming the source rank when the data is
    refused; nothing sparse is built from it. ``max_bytes`` bounds the member memory a header
    may ask for (default :func:`default_max_bytes`).
    """
    device = _comm_device(group)
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    sender = dist.recv(header, src, group=group, tag=tag)
    src_rank = sender if src is None else src
    return _receive(header, src_rank, "recv", device, max_bytes,
                    lambda buf: dist.recv(buf, src_rank, group=group, tag=tag))


# ---------------------------------------------------------------------------------------------
# Collectives


def broadcast(tensor: torch.Tensor | None, src: int, group: Group = None, *,
              max_bytes: int | None = None) -> SafeSparseTensor:
    """Broadcast a sparse tensor from rank ``src`` to every rank of the group.

    Unlike ``dist.broadcast``, this returns the tensor (receivers pass ``None`` or anything: it
    is ignored). On ``src`` the result is ``tensor`` itself, validated (free if checked) and on
    the group's device; elsewhere a new checked :class:`SafeSparseTensor`, or
    :class:`InvariantError` / :class:`TransferError` naming ``src``.
    """
    device = _comm_device(group)
    if dist.get_rank() == src:
        if tensor is None:
            raise TypeError("broadcast: the source rank must pass a sparse tensor")
        t, header, members = _prepare(tensor, device)
        dist.broadcast(header, src, group=group)
        for m in members:
            if m.numel():
                dist.broadcast(m, src, group=group)
        return t
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    return _receive(header, src, "broadcast", device, max_bytes,
                    lambda buf: dist.broadcast(buf, src, group=group))


def all_gather(tensor: torch.Tensor, group: Group = None, *,
               max_bytes: int | None = None) -> list[SafeSparseTensor]:
    """Gather one sparse tensor from every rank; every rank gets the list, by group rank.

    The tensors may differ in layout, shape, dtype and nnz. Each rank's own entry is its
    ``tensor`` (validated, on the group's device); every other entry is validated on receipt,
    and a refusal raises :class:`InvariantError` / :class:`TransferError` naming its rank.
    ``max_bytes`` bounds what is allocated for them: ``world_size`` buffers per member, each
    as large as the largest rank's member.
    """
    device = _comm_device(group)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    own_tensor, header, mine = _prepare(tensor, device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    rows = _read_headers(headers)
    plans: list[_Plan] = []  # this rank's own header is checked too: it is cheap
    for r, row in enumerate(rows):
        plans.append(_plan(row, _global_rank(group, r), "all_gather"))
    n_members = max(len(p.shapes) for p in plans)
    # every member slot is gathered into one buffer per rank, padded to the widest member:
    # that (world * widest), not the members' own size, is what a peer's header costs here
    widths = [max(p.nbytes[k] if k < len(p.shapes) else 0 for p in plans)
              for k in range(n_members)]
    limit = default_max_bytes(device) if max_bytes is None else max_bytes
    _check_limit([(_global_rank(group, r), p) for r, p in enumerate(plans) if r != me], limit,
                 "all_gather", total=world * sum(widths))
    got: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for k in range(n_members):
        sizes = [p.nbytes[k] if k < len(p.shapes) else 0 for p in plans]
        width = widths[k]
        if width == 0:
            for r, p in enumerate(plans):
                if k < len(p.shapes):
                    got[r].append(_from_bytes(torch.empty(0, dtype=torch.uint8, device=device),
                                              0, p.shapes[k], p.dtypes[k]))
            continue
        own = mine[k] if k < len(mine) else torch.empty(0, dtype=torch.uint8, device=device)
        if own.numel() != width:
            padded = torch.zeros(width, dtype=torch.uint8, device=device)
            padded[: own.numel()] = own
            own = padded
        # a fresh output buffer for this rank too: all_gather writes every output, and this
        # rank's input may be a view of its own index members
        bufs = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(bufs, own, group=group)
        for r, p in enumerate(plans):
            if k < len(p.shapes):
                got[r].append(_from_bytes(bufs[r], sizes[r], p.shapes[k], p.dtypes[k]))
    out: list[SafeSparseTensor] = []
    for r, p in enumerate(plans):
        if r == me:
            out.append(own_tensor)
        else:
            out.append(_build(p, got[r], _global_rank(group, r), "all_gather"))
    return out


def all_reduce(tensor: torch.Tensor, group: Group = None, *,
               max_bytes: int | None = None) -> SafeSparseTensor:
    """Sum a COO tensor over the group; every rank gets the same checked, coalesced result.

    Every rank's indices and values are gathered (validated on receipt, see :func:`all_gather`),
    concatenated and coalesced by torch; the coalesced result is validated before it is
    returned. All ranks must pass tensors of the same shape, sparse dim and dtype. Unlike
    ``dist.all_reduce``, the input is not modified: the sum is returned.
    """
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"all_reduce expects a sparse COO tensor, got layout {tensor.layout}")
    parts = [p.detach() for p in all_gather(tensor, group, max_bytes=max_bytes)]
    me = dist.get_rank(group)
    with DisableTorchFunctionSubclass():
        ref = parts[me]
        for r, p in enumerate(parts):
            if (p.layout != ref.layout or p.shape != ref.shape or p.dtype != ref.dtype
                    or p.sparse_dim() != ref.sparse_dim()):
                raise ValueError(
                    f"all_reduce: rank {_global_rank(group, r)} has a {p.layout} tensor of "
                    f"shape {tuple(p.shape)}, sparse_dim {p.sparse_dim()}, dtype {p.dtype}; "
                    f"this rank has {tuple(ref.shape)}, {ref.sparse_dim()}, {ref.dtype}")
        # Every part was validated for this very shape, so their concatenation satisfies the
        # index invariants (5.1, 5.2); it is not marked coalesced and never leaves this function.
        indices = torch.cat([p._indices() for p in parts], dim=1)
        values = torch.cat([p._values() for p in parts], dim=0)
        summed = torch.sparse_coo_tensor(indices, values, ref.shape, check_invariants=False)
        coalesced = summed.coalesce()
    # coalesce built new indices: trusted only once validated
    return validate(coalesced)


def broadcast_sparse_state(module: torch.nn.Module, src: int = 0, group: Group = None, *,
                           max_bytes: int | None = None) -> list[str]:
    """Broadcast every sparse buffer and sparse parameter of ``module`` from rank ``src``,
    validated on receipt, replacing this rank's (in place in the module); returns their names.

    ``DistributedDataParallel`` cannot broadcast sparse buffers (torch refuses them), so build it
    with ``broadcast_buffers=False`` and call this first. Every rank must hold the same module
    structure.
    """
    names: list[str] = []
    for kind, items in (("buffer", module.named_buffers()), ("param", module.named_parameters())):
        for name, tensor in list(items):
            if tensor is None or tensor.layout not in _SPARSE:
                continue
            received = broadcast(tensor.detach(), src, group, max_bytes=max_bytes)
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner)
            if kind == "buffer":
                sub._buffers[attr] = received
            else:
                sub._parameters[attr] = torch.nn.Parameter(received,
                                                           requires_grad=tensor.requires_grad)
            names.append(name)
    return names

"""The load session: what one validating ``torch.load`` sees while torch reads a file.

:class:`_LoadMode` (a torch function mode) hands the members of every sparse tensor torch
rebuilds to the safe factories; :class:`_BuildWatch` (a dispatch mode, when the file may run
code) sees what torch's C++ code builds. Refused tensors become :class:`SparseRecord`s, never
tensors; see :mod:`safesparse.files` for the whole design.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..base import originals as _originals
from ..base.layouts import SPARSE_LAYOUTS, index_members
from ..catalog.errors import InvariantError
from ..engine.metadata import members
from ..factories.core import (
    sparse_bsc_tensor,
    sparse_bsr_tensor,
    sparse_compressed_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)
from ..tensor.core import SafeSparseTensor, _is_sparse, is_checked, validate
from .limits import oversized_member
from .owned import own_copy

# Members of tensors that were not built


@dataclass(eq=False)
class _Unbuilt:
    """The members of a sparse tensor as a file gives them, with no tensor built from them.

    ``members`` are the raw objects for the index and value members, in torch's order
    (``(indices, values)`` for COO, ``(compressed, plain, values)`` otherwise); ``given_size``
    and ``coalesced`` are as given too. The member accessors of a torch sparse tensor are there
    so that torch's own post-load pass (when ``torch.sparse.check_sparse_tensor_invariants`` is
    enabled) can step past the object.
    """

    layout: torch.layout
    members: tuple[Any, ...]
    given_size: Any
    coalesced: Any

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The size the file states, when it is a sequence of ints."""
        size = self.given_size
        if isinstance(size, Sequence) and all(isinstance(s, int) for s in size):
            return tuple(size)
        return None

    @property
    def nnz(self) -> int | None:
        """The number of specified elements the index members state, when they do."""
        member = self.members[0] if self.layout == torch.sparse_coo else self.members[1]
        if isinstance(member, torch.Tensor) and member.dim() >= 1:
            return int(member.shape[-1])
        return None

    # torch's accessor names, for ``torch._utils._validate_loaded_sparse_tensors``
    def size(self) -> Any:
        return self.given_size

    def is_coalesced(self) -> Any:
        return self.coalesced

    def _indices(self) -> Any:
        return self.members[0]

    def _values(self) -> Any:
        return self.members[-1]

    def values(self) -> Any:
        return self.members[-1]

    def crow_indices(self) -> Any:
        return self.members[0]

    def ccol_indices(self) -> Any:
        return self.members[0]

    def col_indices(self) -> Any:
        return self.members[1]

    def row_indices(self) -> Any:
        return self.members[1]


@dataclass(eq=False)
class SparseRecord(_Unbuilt):
    """A sparse tensor of a file that was refused: the members and the :class:`InvariantError`
    they raised. Nothing was built from them, or (``tainted``) torch built a tensor that no
    torch function was then allowed to touch."""

    error: InvariantError

    def __repr__(self) -> str:
        return f"SparseRecord({self.error})"


@dataclass(eq=False)
class _Pending(_Unbuilt):
    """A sparse tensor of a legacy-format file whose data torch has not read yet."""

    build: Callable[[], SafeSparseTensor]

    def __repr__(self) -> str:
        return f"_Pending({self.layout}, size={self.given_size})"


LEGACY_SAFE_MESSAGE = (
    "a SafeSparseTensor in a legacy-format checkpoint (torch.save(..., "
    "_use_new_zipfile_serialization=False)) cannot be validated while torch.load reads it: "
    "torch rebuilds the tensor before it reads the data. Load the file with safesparse.load(), "
    "which validates once the data is read, or save it again in torch's default format."
)
LEGACY_WRAPPED_MESSAGE = (
    "torch.load wrapped a sparse tensor of a legacy-format checkpoint (in an nn.Parameter, say) "
    "before reading its data, so safesparse could not validate it first; save the checkpoint "
    "again in torch's default (zip) format."
)
_LEGACY_LOAD_CODE = getattr(getattr(torch.serialization, "_legacy_load", None), "__code__", None)


def _data_not_read_yet() -> bool:
    """Whether a tensor is being rebuilt by torch's legacy-format loader, which reads the
    storages only after the whole pickle (``torch.serialization._legacy_load`` on the stack).

    (torch also marks such storages ``_torch_load_uninitialized``, but never clears the mark,
    and storages unpickled by value come from a nested legacy load: the mark cannot tell.)
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LEGACY_LOAD_CODE:
            return True
        frame = frame.f_back
    return False


# ---------------------------------------------------------------------------------------------
# The load session and its torch function mode


_local = threading.local()

#: Progress callback: (sparse tensors seen so far, layout, shape of the latest).
OnSparse = Callable[[int, torch.layout, tuple[int, ...] | None], None]


@dataclass(eq=False)
class _Built:
    """A sparse tensor that a torch function other than the factories built while loading."""

    tensor: torch.Tensor
    op: str | None
    item: SafeSparseTensor | SparseRecord | None = None  # None: data not read yet (legacy)


@dataclass(eq=False)
class _Session:
    """What one validating ``torch.load`` saw: refused, pending and otherwise-built tensors."""

    on_sparse: OnSparse | None = None
    #: give every sparse tensor its own copy of its index members before validating them
    #: (``mmap=True``: the loaded tensors map the file, which another process can rewrite)
    own_indices: bool = False
    rejected: list[SparseRecord] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
    built: dict[int, _Built] = field(default_factory=dict)  # by id of the built tensor
    tainted: dict[int, SparseRecord] = field(default_factory=dict)  # by index data pointer
    count: int = 0

    def attempt(
        self,
        layout: torch.layout,
        members: tuple[Any, ...],
        size: Any,
        coalesced: Any,
        build: Callable[[], SafeSparseTensor],
    ) -> SafeSparseTensor | SparseRecord | _Pending:
        """Run ``build`` (a validating factory call) now, or once the data has been read."""
        if _data_not_read_yet():
            pending = _Pending(layout, members, size, coalesced, build)
            self.pending.append(pending)
            return pending
        return self.run(layout, members, size, coalesced, build)

    def run(
        self,
        layout: torch.layout,
        members: tuple[Any, ...],
        size: Any,
        coalesced: Any,
        build: Callable[[], SafeSparseTensor],
    ) -> SafeSparseTensor | SparseRecord:
        """Run ``build``; on an invariant violation, record it (nothing is built)."""
        try:
            out: SafeSparseTensor | SparseRecord = build()
        except InvariantError as err:
            out = SparseRecord(layout, members, size, coalesced, err)
            self.rejected.append(out)
        self.progress(layout, out.shape if isinstance(out, SparseRecord) else tuple(out.shape))
        return out

    def progress(self, layout: torch.layout, shape: tuple[int, ...] | None) -> None:
        self.count += 1
        if self.on_sparse is not None:
            self.on_sparse(self.count, layout, shape)

    def resolve_pending(self) -> dict[int, SafeSparseTensor | SparseRecord]:
        """Validate (and build) the pending tensors, now that torch has read their data."""
        return {
            id(p): self.run(p.layout, p.members, p.given_size, p.coalesced, p.build)
            for p in self.pending
        }

    def note_built(self, t: torch.Tensor, op: str | None) -> None:
        """A sparse tensor built by ``op`` (if known) outside the factories: validate it now
        (building read no index data); an invalid one is tainted (see :meth:`check_args`)."""
        if id(t) in self.built:
            return
        entry = self.built[id(t)] = _Built(t, op)
        if _data_not_read_yet():
            return  # validated by the walk, once torch has read the data
        with _trusted():
            entry.item = self.adopt(t, op)

    def adopt(self, t: torch.Tensor, op: str | None) -> SafeSparseTensor | SparseRecord:
        """Validate ``t``; an invalid one is tainted: recorded by its index data too, so that
        an alias of it that no op built (an ``nn.Parameter``) is known as the same tensor."""
        known = self.tainted_record(t)
        if known is not None:
            return known
        try:
            out: SafeSparseTensor | SparseRecord = _adopt(t, self.own_indices)
        except InvariantError as err:
            if op is not None:
                err = err.with_context(op=f"{op}, while loading")
            out = SparseRecord(t.layout, _members_of(t), tuple(t.shape), None, err)
            self.rejected.append(out)
            for m in _index_members(t):
                if m.data_ptr():
                    self.tainted[m.data_ptr()] = out
        self.progress(t.layout, tuple(t.shape))
        return out

    def tainted_record(self, t: torch.Tensor) -> SparseRecord | None:
        """The record of the tainted tensor whose index data ``t`` (sparse) shares, if any."""
        if not self.tainted:
            return None
        for m in _index_members(t):
            record = self.tainted.get(m.data_ptr())
            if record is not None:
                return record
        return None

    def screen(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before torch function ``name`` runs: a sparse argument built where no mode saw it
        (a legacy typed constructor, when the dispatch watch is off) is validated first; then
        :meth:`check_args`."""
        if name in _METADATA:  # reads no index data (torch's post-load pass calls these on
            return  # the tensors of its global list, stale ones of other loads included)
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                if a.layout is not torch.strided:
                    self._screen_one(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, torch.Tensor) and x.layout is not torch.strided:
                        self._screen_one(x)
        if self.built:
            self.check_args(name, args, kwargs)

    def _screen_one(self, x: torch.Tensor) -> None:
        if (x.layout in SPARSE_LAYOUTS and id(x) not in self.built
                and not (isinstance(x, SafeSparseTensor) and is_checked(x))):
            self.note_built(x, None)

    def check_args(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse to run op ``name`` on a built tensor that is invalid or not validated yet,
        or on any tensor on the index data of an invalid one."""
        if not self.built or name in _METADATA:
            return
        for a in (*args, *kwargs.values()):
            for x in a if isinstance(a, (list, tuple)) else (a,):
                if not _is_sparse(x):
                    continue
                entry = self.built.get(id(x))
                if entry is not None and entry.tensor is x and entry.item is None:
                    raise RuntimeError(LEGACY_WRAPPED_MESSAGE)
                record = self.tainted_record(x)
                if record is not None:
                    raise record.error.with_context(op=f"{name}, while loading")


# Operations (aten ops, torch functions, properties) that read no index data: metadata and the
# O(1) member accessors (torch's own post-load validator calls them before it validates) and
# aliasing (nn.Parameter detaches).
_METADATA = frozenset({
    "size", "stride", "dim", "sparse_dim", "dense_dim", "is_coalesced", "_nnz", "_indices",
    "_values", "indices", "values", "crow_indices", "col_indices", "ccol_indices",
    "row_indices", "numel", "detach", "alias", "_dimI", "_dimV", "sym_size", "sym_numel",
    "sym_stride", "sym_storage_offset", "storage_offset", "is_pinned", "requires_grad_",
    "layout", "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim",
    "is_sparse", "is_sparse_csr", "is_cuda", "is_meta", "is_quantized", "is_nested", "names",
})


def _op_name(func: Any) -> str:
    name = getattr(func, "_opname", None) or getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):  # a property: name the descriptor, not its getter
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


def _session() -> _Session | None:
    session: _Session | None = getattr(_local, "session", None)
    return session


@contextlib.contextmanager
def _trusted() -> Iterator[None]:
    """safesparse's own factory calls: they validated before they call torch."""
    _local.trusted = getattr(_local, "trusted", 0) + 1
    try:
        yield
    finally:
        _local.trusted -= 1


def _is_trusted() -> bool:
    return bool(getattr(_local, "trusted", 0))


# torch constructor -> (safe factory with the same signature, layout it builds or None)
_FACTORIES: dict[Callable[..., Any], tuple[Callable[..., SafeSparseTensor], torch.layout | None]]
_FACTORIES = {
    torch.sparse_coo_tensor: (sparse_coo_tensor, torch.sparse_coo),
    torch.sparse_compressed_tensor: (sparse_compressed_tensor, None),
    torch.sparse_csr_tensor: (sparse_csr_tensor, torch.sparse_csr),
    torch.sparse_csc_tensor: (sparse_csc_tensor, torch.sparse_csc),
    torch.sparse_bsr_tensor: (sparse_bsr_tensor, torch.sparse_bsr),
    torch.sparse_bsc_tensor: (sparse_bsc_tensor, torch.sparse_bsc),
}
# torch's own post-load validators (run only when check_sparse_tensor_invariants is enabled):
# every sparse tensor of the load is validated by safesparse, the refused ones are never built
_TORCH_VALIDATORS = frozenset({
    torch._validate_sparse_coo_tensor_args,
    torch._validate_sparse_compressed_tensor_args,
    torch._validate_sparse_csr_tensor_args,
    torch._validate_sparse_csc_tensor_args,
    torch._validate_sparse_bsr_tensor_args,
    torch._validate_sparse_bsc_tensor_args,
})


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, *names: str) -> Any:
    if len(args) > i:
        return args[i]
    return next((kwargs[n] for n in names if n in kwargs), None)


class _LoadMode(TorchFunctionMode):
    """Sees every torch function called while a file is read (see the module doc)."""

    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = tuple(args), dict(kwargs or {})
        if _is_trusted():
            return func(*args, **kwargs)
        entry = _FACTORIES.get(func)
        if entry is not None:
            return self._construct(entry[0], entry[1], args, kwargs)
        if func in _TORCH_VALIDATORS:
            return None
        name = _op_name(func)
        self.session.screen(name, args, kwargs)
        out = func(*args, **kwargs)
        for x in out if isinstance(out, (list, tuple)) else (out,):
            if _is_sparse(x) and not (isinstance(x, SafeSparseTensor) and is_checked(x)):
                self.session.note_built(x, name)
        return out

    def _construct(
        self,
        factory: Callable[..., SafeSparseTensor],
        layout: torch.layout | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> SafeSparseTensor | SparseRecord | _Pending:
        kwargs.pop("check_invariants", None)  # always checked
        if layout == torch.sparse_coo:
            members = (_arg(args, kwargs, 0, "indices"), _arg(args, kwargs, 1, "values"))
            size, coalesced = _arg(args, kwargs, 2, "size"), kwargs.get("is_coalesced")
        else:
            members = tuple(_arg(args, kwargs, i) for i in range(3))
            size, coalesced = _arg(args, kwargs, 3, "size"), None
        lay = layout if layout is not None else kwargs.get("layout", torch.strided)
        claims = oversized_member(lay, members)
        if claims is not None:  # refused before any copy: a view claiming more than the file
            def refuse() -> SafeSparseTensor:
                raise claims

            return self.session.run(lay, members, size, coalesced, refuse)

        if self.session.own_indices:  # (mmap=True) validated and kept on copies
            n = 1 if layout == torch.sparse_coo else 2
            args = (*(own_copy(a) if isinstance(a, torch.Tensor) else a for a in args[:n]),
                    *args[n:])
            for name in ("indices", "compressed_indices", "plain_indices", "crow_indices",
                         "col_indices", "ccol_indices", "row_indices"):
                if isinstance(kwargs.get(name), torch.Tensor):
                    kwargs[name] = own_copy(kwargs[name])

        def build() -> SafeSparseTensor:
            with _trusted():
                return factory(*args, **kwargs)

        return self.session.attempt(lay, members, size, coalesced, build)


class _BuildWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every aten op run while a file is read, whoever called it (a legacy constructor
    runs its op from C++, past the torch function mode): validates each sparse tensor an op
    builds outside the safe factories, and refuses any op on one that is invalid."""

    def __init__(self, session: _Session) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.session = session

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = tuple(args), dict(kwargs or {})
        if _is_trusted():
            return func(*args, **kwargs)
        name = _op_name(func)
        self.session.check_args(name, args, kwargs)
        out = func(*args, **kwargs)
        for x in out if isinstance(out, (list, tuple)) else (out,):
            if _is_sparse(x):
                self.session.note_built(x, f"aten.{name}")
        return out


def _on_copied_indices(t: torch.Tensor) -> torch.Tensor:
    """``t`` (plain) rebuilt, unvalidated, on copies of its index members; values shared."""
    if t.layout == torch.sparse_coo:
        return _originals.sparse_coo_tensor(
            own_copy(t._indices()), t._values(), t.shape, check_invariants=False,
            is_coalesced=t.is_coalesced())
    compressed, plain, values = members(t)
    return _originals.sparse_compressed_tensor(
        own_copy(compressed), own_copy(plain), values, t.shape, layout=t.layout,
        dtype=values.dtype, device=values.device, check_invariants=False)


def _members_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with DisableTorchFunctionSubclass():
        return members(t)


def _index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with DisableTorchFunctionSubclass():
        return index_members(t)


def _adopt(t: torch.Tensor, own_indices: bool = False) -> SafeSparseTensor:
    """Validate a sparse tensor built outside the safe path; a leaf keeps requires_grad.
    ``own_indices``: validate (and return) it rebuilt on copies of its index members."""
    if isinstance(t, SafeSparseTensor) and not own_indices:
        return validate(t)
    leaf_grad = t.requires_grad and t.is_leaf
    with DisableTorchFunctionSubclass():
        plain = torch.Tensor._make_subclass(torch.Tensor, t.detach(), False)
        if own_indices:
            plain = _on_copied_indices(plain)
    out = validate(plain)
    if leaf_grad:
        out.requires_grad_(True)
    return out

"""Files from elsewhere: ``ss.load``, ``ss.save`` and the loader behind ``python -m safesparse
check``.

A checkpoint is untrusted input. ``torch.load`` rebuilds every sparse tensor in a file with
``torch._utils._rebuild_sparse_tensor``, which calls ``torch.sparse_coo_tensor`` /
``torch.sparse_compressed_tensor`` with ``check_invariants=False``; torch validates the result
afterwards only when ``torch.sparse.check_sparse_tensor_invariants`` is enabled globally (it is
not by default). So a file whose CSR column index is ``10**9`` loads silently, and the first
kernel that reads it (``t @ dense``) reads far out of bounds.

How the data is intercepted
---------------------------
Everything here runs ``torch.load`` itself, unchanged (its ``weights_only`` unpickler with its
allowlist, opcode restrictions and user safe globals, ``map_location``, the zip and legacy
formats), inside a :class:`~torch.overrides.TorchFunctionMode` (:class:`_LoadMode`). The mode
sees every torch function called while the file is read, whichever pickled function called it
(torch's rebuild function, an allowlisted user global, ours):

* the factories through which torch turns loaded member tensors into a sparse tensor get the
  raw members (indices, values, size, coalesced flag) handed to the safe factories instead,
  which check every invariant on the strided members and only then build the tensor with
  torch's factory (a checked :class:`SafeSparseTensor`). When a check fails, *nothing is built*:
  the mode returns a :class:`SparseRecord` (the layout, the raw members and the
  :class:`InvariantError`) in place of the tensor, and loading goes on;
* any other torch function that returns a sparse tensor builds it (building reads no index
  data) and the result is validated at once, and so is any sparse tensor a torch function
  receives that the mode has not seen (a legacy constructor's, built from C++), before the
  function runs. A valid one is noted as built; an invalid one is *tainted*: any later torch
  function that receives it while the file is still being read (other than metadata
  accessors) raises its :class:`InvariantError` instead of running, so no kernel ever reads its
  index data. Where the file may run code of its own (``weights_only`` not ``True``),
  :class:`_BuildWatch`, a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, also sees
  every aten operator, which validates a legacy constructor's tensor as it is built and refuses
  operators that torch's C++ code runs on a tainted one. (With ``weights_only=True`` the
  unpickler can only put such a tensor in containers the walk reaches, and a mode on every
  operator costs time on every tensor of every file.)

After ``torch.load`` returns, :class:`_Walk` goes through the whole loaded object: dicts of any
kind (``OrderedDict`` state dicts, ``Counter``, ``defaultdict``) *and their keys*, lists, tuples,
named tuples, sets, frozensets, deques, the attributes (``__dict__`` and ``__slots__``) of other
objects and of tensors. It names every sparse tensor by its key path (``['layer.weight']``,
``['s']{0}`` for an element of a set, ``['w'].keys()[0]`` for a dict key, ``.weight`` for an
attribute), validates any it has not seen validated (a sparse ``nn.Parameter``, say), and puts
the checked :class:`SafeSparseTensor` in its place, rebuilding immutable containers (tuples,
frozensets) and dict keys where needed. A tensor built while reading that the walk cannot reach
still counts: an invalid one refuses the load (with no key path); so nothing can be hidden.

Aliasing
--------
``torch.load`` gives every tensor of a file its own version counter, even when two share a
storage; safesparse's checked state watches the counters of a tensor's index members. A file
can therefore pair a sparse tensor with a dense tensor (or another sparse tensor's values, or
other index members) on the same bytes as its index members: a write through that other tensor
would change the index data without any counter safesparse watches moving. The walk compares
the byte ranges of every tensor it reaches with the index members of every checked sparse
tensor; a checked tensor whose index storage is shared with anything else (other than tensors
on the very same index members, which share its checked state) gets a private copy of its index
members (a clone, validated again), so no returned object aliases it. :attr:`Found.aliased_with`
names what it shared storage with; ``check`` reports it.

The legacy file format (``torch.save(..., _use_new_zipfile_serialization=False)``, the default
before torch 1.6) writes the storages *after* the pickle, so torch rebuilds its sparse tensors
before their data has been read. There the mode builds nothing either: it returns a pending
record, and the members are validated (and the tensor built) once ``torch.load`` has read the
storages, before the object is handed back. A pending tensor that torch wraps during loading
(a sparse ``nn.Parameter`` in a legacy file) cannot be validated first, so such a file is
refused with a ``RuntimeError``; plain ``torch.load`` of a legacy file holding a
``SafeSparseTensor`` is refused the same way (``ss.load`` reads it).

Why this route rather than a custom unpickler: a ``find_class`` override (or a copy of torch's
weights-only unpickler) would have to re-implement torch's allowlist and its opcode restrictions
and follow them from release to release, and torch refuses a ``pickle_module`` with
``weights_only=True``; the mode leaves all of that to torch, is thread-local (no global state is
patched), and sees construction itself, whichever pickled function asked for it.

``torch.load`` is called through a reference taken when this module is imported, so that
wrapping ``torch.load`` later (enforce mode does) never makes this loader call itself.

Saving for plain torch
----------------------
:func:`save` is ``torch.save`` of :func:`unwrap_all`: every ``SafeSparseTensor`` in dicts, lists,
tuples and sets becomes the plain torch tensor, so the file names no safesparse global and
``torch.load(f, weights_only=True)`` reads it where safesparse is not installed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import InvariantError
from .factories import (
    sparse_bsc_tensor,
    sparse_bsr_tensor,
    sparse_compressed_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)
from .invariants import COMPRESSED_LAYOUTS, SPARSE_LAYOUTS
from .tensor import SafeSparseTensor, is_checked, unwrap, validate
from .validation import compressed_members, members

__all__ = [
    "Found",
    "LoadResult",
    "OnSparse",
    "SparseRecord",
    "load",
    "load_and_validate",
    "save",
    "unwrap_all",
]

#: torch's own loader, as it was when safesparse was imported (enforce mode wraps torch.load).
_torch_load = torch.load
_torch_save = torch.save


# ---------------------------------------------------------------------------------------------
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
            out: SafeSparseTensor | SparseRecord = _adopt(t)
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


def _is_sparse(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.layout in SPARSE_LAYOUTS


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


def _members_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with DisableTorchFunctionSubclass():
        return members(t)


def _index_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _members_of(t)[:-1]


def _adopt(t: torch.Tensor) -> SafeSparseTensor:
    """Validate a sparse tensor built outside the safe path; a leaf keeps requires_grad."""
    if isinstance(t, SafeSparseTensor):
        return validate(t)
    leaf_grad = t.requires_grad and t.is_leaf
    with DisableTorchFunctionSubclass():
        plain = torch.Tensor._make_subclass(torch.Tensor, t.detach(), False)
    out = validate(plain)
    if leaf_grad:
        out.requires_grad_(True)
    return out


# ---------------------------------------------------------------------------------------------
# Key paths


@dataclass(frozen=True)
class PathKey:
    """One step of a key path: ``kind`` is ``"item"`` (a mapping value, by key), ``"index"``
    (a sequence item), ``"attr"`` (an attribute), ``"set_item"`` (the ``n``-th element of a set,
    in iteration order) or ``"dict_key"`` (the ``n``-th key of a dict)."""

    kind: str
    key: Any

    def __str__(self) -> str:
        if self.kind in ("item", "index"):
            return f"[{self.key!r}]"
        if self.kind == "attr":
            return f".{self.key}"
        if self.kind == "set_item":
            return f"{{{self.key}}}"
        return f".keys()[{self.key}]"

    def to_json(self) -> Any:
        """A JSON value: the key itself for mapping keys and indices (so that a plain path can
        be followed with ``obj[k]``), else a one-entry object naming the kind."""
        if self.kind == "index" or (
            self.kind == "item"
            and (self.key is None or isinstance(self.key, (str, int, float, bool)))
        ):
            return self.key
        if self.kind == "item":
            return {"key": repr(self.key)}
        return {self.kind: self.key}


Path = tuple[PathKey, ...]


def path_str(path: Path) -> str:
    return "".join(str(k) for k in path)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Found:
    """One sparse tensor found in a loaded object.

    ``keys`` is its key path (empty for the object itself), or ``None`` for a tensor built while
    reading that the walk could not reach (inside an object it cannot look into, or dropped).
    ``item`` is a checked :class:`SafeSparseTensor` or a :class:`SparseRecord`.
    ``aliased_with`` names the other loaded tensors that shared storage with its index members
    (then ``item`` is a copy with index members of its own).
    """

    keys: Path | None
    item: SafeSparseTensor | SparseRecord
    aliased_with: tuple[str, ...] = ()

    @property
    def path(self) -> str | None:
        """The key path as a string, e.g. ``"['layer.weight']"``; ``""`` for the object itself."""
        return None if self.keys is None else path_str(self.keys)

    @property
    def error(self) -> InvariantError | None:
        if isinstance(self.item, SparseRecord):
            err = self.item.error
            return err.with_context(path=self.path) if self.path else err
        return None


@dataclass(frozen=True)
class LoadResult:
    """The loaded object, with valid sparse tensors wrapped (refused ones as records), every
    sparse tensor found, and how many dense tensors the walk saw."""

    obj: Any
    found: list[Found]
    aborted: BaseException | None = None  # what stopped torch.load after a refused tensor
    unplaced: int = 0  # valid pending tensors the walk could not put back (legacy format)
    dense: int = 0  # strided tensors in the object


def load_and_validate(
    f: Any, *, on_sparse: OnSparse | None = None, **kwargs: Any
) -> LoadResult:
    """``torch.load(f, **kwargs)`` with every sparse tensor validated before it is used.

    Never raises :class:`InvariantError`: a refused tensor stays a :class:`SparseRecord` in the
    returned object and in ``found``. Any other error of ``torch.load`` propagates, except that
    one caused by a refused tensor (torch wrapping it in a Parameter, say) is reported as that
    tensor (``found`` then lists the refused tensors only, with no key path).
    ``on_sparse(count, layout, shape)`` is called after each sparse tensor is validated.
    """
    session = _Session(on_sparse=on_sparse)
    prior = _session()
    _local.session = session
    try:
        # The dispatch watch sees what torch's C++ code builds (legacy typed constructors), at a
        # cost per operator; with weights_only=True the unpickler can only put such a tensor in
        # containers the walk reaches, and the function mode validates it before any use.
        watch = (_BuildWatch(session) if kwargs.get("weights_only") is not True
                 else contextlib.nullcontext())
        with _LoadMode(session), watch:
            obj = _torch_load(f, **kwargs)
    except Exception as exc:
        if session.rejected:
            return LoadResult(None, [Found(None, r) for r in session.rejected], aborted=exc)
        if session.pending or any(b.item is None for b in session.built.values()):
            raise RuntimeError(LEGACY_WRAPPED_MESSAGE) from exc
        raise
    finally:
        _local.session = prior
    try:
        return _Walk(session, session.resolve_pending()).run(obj)
    except RecursionError:
        raise RuntimeError(
            "the loaded object is nested too deeply for safesparse to check every tensor in it"
        ) from None


# ---------------------------------------------------------------------------------------------
# The walk


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
          torch.device, torch.layout, torch.memory_format, torch.Size, range, slice)
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.CodeType, types.FrameType, types.GeneratorType,
           types.CoroutineType)
_STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)


def _extent(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage data pointer, first byte, end byte) of a strided tensor's data, if any."""
    if t.layout != torch.strided or t.numel() == 0 or t.device.type == "meta":
        return None
    with DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
        size = t.element_size()
        last = sum(int(n - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True))
        start = int(t.storage_offset()) * size
        return int(storage.data_ptr()), start, start + (last + 1) * size


def _storage_extent(s: Any) -> tuple[int, int, int] | None:
    """(data pointer, 0, size in bytes) of a storage object in the loaded structure."""
    untyped = s._untyped_storage if isinstance(s, torch.storage.TypedStorage) else s
    if untyped.device.type == "meta" or untyped.nbytes() == 0:
        return None
    return untyped.data_ptr(), 0, untyped.nbytes()


def _index_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The exact index members of a sparse tensor: tensors with the same key share their
    checked state (a write through either is seen by both)."""
    return tuple((m.data_ptr(), tuple(m.shape), m.stride(), m.dtype, m.device)
                 for m in _index_members(t))


@dataclass(eq=False)
class _Sparse:
    keys: Path
    item: SafeSparseTensor | SparseRecord
    aliased_with: list[str] = field(default_factory=list)


class _Walk:
    """Goes through a loaded object twice: once to find (and validate) every tensor and decide
    what replaces what, once to put the replacements in place."""

    def __init__(self, session: _Session,
                 resolved: dict[int, SafeSparseTensor | SparseRecord]) -> None:
        self.session = session
        self.resolved = resolved
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # keeps every visited object alive, so ids stay unique
        self.sparse: dict[int, _Sparse] = {}  # by id of the object in the loaded structure
        self.dense: list[tuple[Path, torch.Tensor]] = []
        self.storages: list[tuple[Path, Any]] = []
        self.replace: dict[int, Any] = {}

    # -- pass 1: find --------------------------------------------------------------------

    def find(self, node: Any, path: Path) -> None:
        if isinstance(node, _ATOMS) or id(node) in self.seen:
            return
        self.seen.add(id(node))
        self.keep.append(node)
        if isinstance(node, (_Pending, SparseRecord)):
            self._found(node, path)
        elif isinstance(node, torch.Tensor):
            if node.layout in SPARSE_LAYOUTS:
                self._found(node, path)
            elif node.layout == torch.strided:
                self.dense.append((path, node))
            grad = node.grad if node.is_leaf else None  # .grad of a non-leaf warns
            if grad is not None:
                self.find(grad, (*path, PathKey("attr", "grad")))
            self._find_attrs(node, path)
        elif isinstance(node, _STORAGES):
            self.storages.append((path, node))
        elif isinstance(node, dict):
            for i, (k, v) in enumerate(list(node.items())):
                self.find(k, (*path, PathKey("dict_key", i)))
                self.find(v, (*path, PathKey("item", k)))
            self._find_attrs(node, path)
        elif isinstance(node, (list, tuple, collections.deque)):
            fields = getattr(node, "_fields", None) if isinstance(node, tuple) else None
            for i, v in enumerate(list(node)):
                step = PathKey("attr", fields[i]) if fields else PathKey("index", i)
                self.find(v, (*path, step))
            if not isinstance(node, tuple):
                self._find_attrs(node, path)
        elif isinstance(node, (set, frozenset)):
            for i, v in enumerate(list(node)):
                self.find(v, (*path, PathKey("set_item", i)))
            self._find_attrs(node, path)
        elif not isinstance(node, _OPAQUE):
            self._find_attrs(node, path)

    def _find_attrs(self, node: Any, path: Path) -> None:
        for name, value in _attributes(node):
            self.find(value, (*path, PathKey("attr", name)))

    def _found(self, node: Any, path: Path) -> None:
        item: SafeSparseTensor | SparseRecord
        if isinstance(node, _Pending):
            item = self.resolved[id(node)]
        elif isinstance(node, SparseRecord):
            item = node
        else:
            built = self.session.built.get(id(node))
            if built is not None and built.tensor is node and built.item is not None:
                item = built.item
            elif isinstance(node, SafeSparseTensor) and is_checked(node):
                item = node
            else:
                item = self.session.adopt(node, None)
                if built is not None and built.tensor is node:
                    built.item = item
        self.sparse[id(node)] = _Sparse(path, item)
        if item is not node:
            self.replace[id(node)] = item

    # -- aliasing ------------------------------------------------------------------------

    def unshare(self) -> None:
        """Give every checked tensor whose index storage another tensor shares its own copy."""
        checked = [(s, s.item) for s in self.sparse.values()
                   if isinstance(s.item, SafeSparseTensor)]
        if not checked:
            return
        # byte ranges of the index members of each checked tensor, by storage
        ranges: dict[int, list[tuple[int, int, _Sparse, tuple[Any, ...]]]] = {}
        for s, t in checked:
            key = _index_key(t)
            for m in _index_members(t):
                ext = _extent(m)
                if ext is not None:
                    ranges.setdefault(ext[0], []).append((ext[1], ext[2], s, key))
        # everything else that can write those bytes
        writers: list[tuple[str, tuple[int, int, int] | None, tuple[Any, ...] | None]] = [
            (path_str(p) or "<root>", _extent(t), None) for p, t in self.dense]
        writers += [(path_str(p) or "<root>", _storage_extent(st), None)
                    for p, st in self.storages]
        for s, t in checked:
            where = path_str(s.keys) or "<root>"
            key = _index_key(t)
            writers.append((f"{where} (values)", _extent(_members_of(t)[-1]), None))
            writers += [(f"{where} (index members)", _extent(m), key) for m in _index_members(t)]
        for name, ext, wkey in writers:
            if ext is None:
                continue
            for start, end, s, key in ranges.get(ext[0], ()):
                if wkey == key or not (ext[1] < end and start < ext[2]):
                    continue  # the same index members: one shared checked state
                if name not in s.aliased_with:
                    s.aliased_with.append(name)
        for s, t in checked:
            if s.aliased_with:
                copy_ = _with_own_indices(t)
                for obj_id, other in self.sparse.items():
                    if other is s:
                        self.replace[obj_id] = copy_
                s.item = copy_

    # -- pass 2: put in place ------------------------------------------------------------

    def put(self, node: Any, memo: dict[int, Any]) -> Any:
        if isinstance(node, _ATOMS):
            return node
        if id(node) in memo:
            return memo[id(node)]
        if id(node) in self.replace:
            memo[id(node)] = self.replace[id(node)]
            return memo[id(node)]
        memo[id(node)] = node
        out = node
        if isinstance(node, torch.Tensor):
            self._put_attrs(node, memo)
        elif isinstance(node, dict):
            items = list(node.items())
            new = [(self.put(k, memo), self.put(v, memo)) for k, v in items]
            if any(nk is not k for (k, _), (nk, _) in zip(items, new, strict=True)):
                node.clear()
                for k, v in new:  # not update(): Counter.update adds
                    node[k] = v
            else:
                for (k, v), (_, nv) in zip(items, new, strict=True):
                    if nv is not v:
                        node[k] = nv
            self._put_attrs(node, memo)
        elif isinstance(node, (list, collections.deque)):
            for i, v in enumerate(list(node)):
                nv = self.put(v, memo)
                if nv is not v:
                    node[i] = nv
            self._put_attrs(node, memo)
        elif isinstance(node, tuple):
            new_items = [self.put(v, memo) for v in node]
            if any(n is not v for n, v in zip(new_items, node, strict=True)):
                out = _rebuild_tuple(node, new_items)
        elif isinstance(node, set):
            new_items = [self.put(v, memo) for v in list(node)]
            if any(n is not v for n, v in zip(new_items, list(node), strict=True)):
                node.clear()
                node.update(new_items)
            self._put_attrs(node, memo)
        elif isinstance(node, frozenset):
            new_items = [self.put(v, memo) for v in list(node)]
            if any(n is not v for n, v in zip(new_items, list(node), strict=True)):
                out = type(node)(new_items)
        elif not isinstance(node, _OPAQUE):
            self._put_attrs(node, memo)
        memo[id(node)] = out
        return out

    def _put_attrs(self, node: Any, memo: dict[int, Any]) -> None:
        for name, value in _attributes(node):
            new = self.put(value, memo)
            if new is not value:
                _set_attribute(node, name, new)

    # -- the whole walk ------------------------------------------------------------------

    def run(self, obj: Any) -> LoadResult:
        self.find(obj, ())
        # built tensors the walk did not reach: validated all the same (an invalid one refuses
        # the load); a valid one was an intermediate (wrapped in a Parameter, dropped, ...)
        reached = {id(s.item) for s in self.sparse.values()}
        loose: list[Found] = []
        for entry in self.session.built.values():
            if id(entry.tensor) in self.sparse:
                continue
            if entry.item is None:
                entry.item = self.session.adopt(entry.tensor, entry.op)
            if isinstance(entry.item, SparseRecord) and id(entry.item) not in reached:
                loose.append(Found(None, entry.item))
        self.unshare()
        if self.replace:
            obj = self.put(obj, {})
        found = [Found(s.keys, s.item, tuple(s.aliased_with)) for s in self.sparse.values()]
        reached |= {id(s.item) for s in self.sparse.values()}
        placed = {id(p) for p in self.session.pending if id(p) in self.sparse}
        unplaced = [self.resolved[id(p)] for p in self.session.pending if id(p) not in placed]
        valid_unplaced = [t for t in unplaced if isinstance(t, SafeSparseTensor)]
        found += [Found(None, t) for t in valid_unplaced]
        found += loose
        found += [Found(None, r) for r in self.session.rejected
                  if id(r) not in reached and all(r is not f.item for f in loose)]
        return LoadResult(obj, found, unplaced=len(valid_unplaced), dense=len(self.dense))


def _attributes(node: Any) -> list[tuple[str, Any]]:
    """The instance attributes of an object (``__dict__`` and ``__slots__``), minus
    safesparse's own bookkeeping on a SafeSparseTensor."""
    out: list[tuple[str, Any]] = []
    d = getattr(node, "__dict__", None)
    if isinstance(d, dict):
        out += [(k, v) for k, v in d.items()
                if isinstance(k, str) and k != "_ss" and not k.startswith("_ss_")]
    for cls in type(node).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__") or not isinstance(name, str):
                continue
            with contextlib.suppress(AttributeError):
                out.append((name, object.__getattribute__(node, name)))
    return out


def _set_attribute(node: Any, name: str, value: Any) -> None:
    d = getattr(node, "__dict__", None)
    if isinstance(d, dict) and name in d:
        d[name] = value
    else:
        object.__setattr__(node, name, value)


def _rebuild_tuple(node: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if hasattr(node, "_fields"):  # named tuple
        rebuilt: tuple[Any, ...] = type(node)(*items)
        return rebuilt
    if type(node) is tuple:
        return tuple(items)
    try:
        return type(node)(items)
    except Exception:  # a tuple subclass with another constructor
        return tuple(items)


def _with_own_indices(t: SafeSparseTensor) -> SafeSparseTensor:
    """``t`` rebuilt on copies of its index members (validated again), same values."""
    leaf_grad = t.requires_grad and t.is_leaf
    with DisableTorchFunctionSubclass():
        plain = unwrap(t).detach()
        values = _members_of(plain)[-1]
        if plain.layout == torch.sparse_coo:
            out = sparse_coo_tensor(plain._indices().clone(), values, tuple(plain.shape),
                                    is_coalesced=plain.is_coalesced())
        else:
            compressed, plain_idx = compressed_members(plain)
            out = sparse_compressed_tensor(compressed.clone(), plain_idx.clone(), values,
                                           tuple(plain.shape), layout=plain.layout)
    if leaf_grad:
        out.requires_grad_(True)
    return out


def load(f: Any, **kwargs: Any) -> Any:
    """``torch.load`` that validates every sparse tensor in the file before returning it.

    A checkpoint is untrusted input: ``torch.load`` builds sparse tensors without checking their
    indices, and the first kernel that reads a malformed one may read out of bounds. ``ss.load``
    runs ``torch.load`` itself (``weights_only=True`` unless you pass ``weights_only=False``)
    and validates every sparse tensor anywhere in the loaded object (dicts and their keys,
    lists, tuples, sets, state dicts, object attributes, legacy constructors, nested) before
    anything uses it. Each is returned as a checked :class:`SafeSparseTensor`; one whose index
    storage another loaded tensor shares gets its own copy of its index members. Everything
    else is returned as ``torch.load`` gives it.

    Example::

        state = ss.load("model.pt", map_location="cpu")
        model.load_state_dict(state)  # the model's sparse tensors stay checked

    Args:
        f: a file name, path or file-like object, as for ``torch.load``.
        **kwargs: keyword arguments of ``torch.load`` (``map_location``, ``weights_only``,
            ``mmap`` ...).

    Returns:
        The loaded object, with every sparse tensor a checked ``SafeSparseTensor``.

    Raises:
        InvariantError: a sparse tensor breaks an invariant; ``str(err)`` and ``err.path``
            name its key path, e.g. ``['layer.weight']``.
        RuntimeError: a legacy-format file holds sparse tensors where they cannot be put back
            validated (save it again in torch's default format).
        pickle.UnpicklingError: ``torch.load`` refused the file (e.g. ``weights_only=True``
            and an unsupported global), as with ``torch.load``.
    """
    kwargs.setdefault("weights_only", True)
    result = load_and_validate(f, **kwargs)
    for found in result.found:
        err = found.error
        if err is not None:
            raise err from result.aborted
    if result.unplaced:
        raise RuntimeError(
            "a legacy-format checkpoint holds sparse tensors where safesparse cannot put the "
            "validated tensors back (inside a set or an object); save it again in torch's "
            "default (zip) format"
        )
    return result.obj


# ---------------------------------------------------------------------------------------------
# Saving for plain torch


def _plain(t: SafeSparseTensor) -> torch.Tensor:
    plain = unwrap(t).detach()
    if t.requires_grad and t.is_leaf:
        return torch.nn.Parameter(plain, requires_grad=True)  # torch keeps it as a Parameter
    return plain


def unwrap_all(obj: Any) -> Any:
    """``obj`` with every :class:`SafeSparseTensor` replaced by the plain torch tensor (no copy
    of tensor data; a leaf that requires grad becomes an ``nn.Parameter``).

    Goes through dicts (``OrderedDict`` state dicts keep their ``_metadata``), lists, tuples,
    named tuples, sets and deques, copying each container that holds a replaced tensor and
    leaving ``obj`` itself unchanged. Other objects are returned as they are: for a model, pass
    its ``state_dict()``.

    Args:
        obj: any object, typically a state dict.

    Returns:
        ``obj`` (or a copy of each container on the way to a replaced tensor) holding no
        ``SafeSparseTensor``.
    """
    return _unwrap(obj, {})


def _unwrap(node: Any, memo: dict[int, Any]) -> Any:
    if isinstance(node, _ATOMS):
        return node
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = node
    out = node
    if isinstance(node, SafeSparseTensor):
        out = _plain(node)
    elif isinstance(node, dict):
        items = [(_unwrap(k, memo), _unwrap(v, memo)) for k, v in node.items()]
        if any(nk is not k or nv is not v
               for (k, v), (nk, nv) in zip(node.items(), items, strict=True)):
            out = copy.copy(node)  # keeps the type and attributes (_metadata)
            out.clear()
            for k, v in items:  # not update(): Counter.update adds
                out[k] = v
    elif isinstance(node, (list, collections.deque, set, frozenset, tuple)):
        old = list(node)
        new = [_unwrap(v, memo) for v in old]
        if any(n is not v for n, v in zip(new, old, strict=True)):
            if isinstance(node, tuple):
                out = _rebuild_tuple(node, new)
            elif isinstance(node, collections.deque):
                out = collections.deque(new, maxlen=node.maxlen)
            else:
                out = type(node)(new)
    memo[id(node)] = out
    return out


def save(obj: Any, f: Any, **kwargs: Any) -> None:
    """``torch.save(unwrap_all(obj), f, **kwargs)``: a checkpoint plain torch can load.

    The file holds no safesparse globals, so ``torch.load(f, weights_only=True)`` opens it
    where safesparse is not installed (a serving stack, a teammate); ``ss.load`` gives back
    checked tensors.

    Args:
        obj: the object to save, e.g. ``model.state_dict()``.
        f: a file name, path or file-like object, as for ``torch.save``.
        **kwargs: keyword arguments of ``torch.save``.

    Returns:
        None.
    """
    _torch_save(unwrap_all(obj), f, **kwargs)


# ---------------------------------------------------------------------------------------------
# Unpickling SafeSparseTensor (the reducing side and its registration: safesparse.pickling)


def _build(layout: torch.layout, data: tuple[Any, ...], requires_grad: bool) -> SafeSparseTensor:
    if layout == torch.sparse_coo:
        indices, values, size, *rest = data
        return sparse_coo_tensor(indices, values, size, is_coalesced=rest[0] if rest else None,
                                 requires_grad=requires_grad)
    if layout in COMPRESSED_LAYOUTS:
        compressed, plain, values, size = data
        return sparse_compressed_tensor(compressed, plain, values, size, layout=layout,
                                        requires_grad=requires_grad)
    raise NotImplementedError(f"rebuilding a sparse tensor with layout {layout}")


def _rebuild_safe_sparse(
    layout: torch.layout, data: tuple[Any, ...], requires_grad: bool = False
) -> SafeSparseTensor | SparseRecord | _Pending:
    """Unpickle a SafeSparseTensor: validate the members, then build (InvariantError if bad).

    Inside ``ss.load`` / ``check`` a violation is recorded instead of raised, so that it can be
    reported with its key path.
    """

    def build() -> SafeSparseTensor:
        with _trusted():
            return _build(layout, data, requires_grad)

    members = tuple(data[:2] if layout == torch.sparse_coo else data[:3])
    session = _session()
    if session is None:
        if _data_not_read_yet():
            raise RuntimeError(LEGACY_SAFE_MESSAGE)
        return build()
    size_at = 2 if layout == torch.sparse_coo else 3
    size = data[size_at] if len(data) > size_at else None
    coalesced = data[3] if layout == torch.sparse_coo and len(data) > 3 else None
    return session.attempt(layout, members, size, coalesced, build)

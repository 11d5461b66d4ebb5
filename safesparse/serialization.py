"""Files from elsewhere: pickling of ``SafeSparseTensor``, ``ss.load`` and the loader behind
``python -m safesparse check``.

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
sees the one call through which torch turns loaded member tensors into a sparse tensor, before
torch runs it:

* it hands the raw members (indices, values, size, coalesced flag) to the safe factories, which
  check every invariant of the catalog on the strided members and only then build the tensor
  with torch's factory (a checked :class:`SafeSparseTensor`);
* when a check fails, *nothing is built*: the mode returns a :class:`SparseRecord` (the layout,
  the raw members and the :class:`InvariantError`) in place of the tensor, and loading goes on.

After ``torch.load`` returns, the loaded object is walked with ``torch.utils._pytree`` (dicts,
lists, tuples, named tuples, ``OrderedDict`` state dicts, nested) to name every sparse tensor by
its key path, e.g. ``['layer.weight']``. ``ss.load`` raises the first record's error with that
path; ``check`` reports every tensor. So no sparse tensor ever exists for index data that was not
validated, and no torch kernel other than the validator's own reductions over the strided members
touches it.

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
and follow them from release to release; the mode leaves all of that to torch, is thread-local
(no global state is patched), and intercepts the construction itself, whichever pickled function
asked for it (torch's rebuild function, an allowlisted user global, ours).

Limits: torch's legacy typed constructors (``torch.sparse.FloatTensor(indices, values, size)``),
which ``torch.save`` never writes but the weights-only unpickler accepts, build a COO tensor
without going through the factory (building reads no index data). Nothing reads such a tensor's
index data before the walk validates it from its members, like any sparse tensor it finds.

Pickling
--------
``SafeSparseTensor.__reduce_ex__`` reduces to :func:`_rebuild_safe_sparse` with the layout, the
member tensors, the size and ``requires_grad``, never a "checked" flag: unpickling validates
again, always. :func:`_rebuild_safe_sparse` is registered with
``torch.serialization.add_safe_globals`` when this module is imported, so
``torch.load(f, weights_only=True)`` accepts files holding ``SafeSparseTensor`` once safesparse
is imported.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode

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
from .tensor import SafeSparseTensor, is_checked, validate
from .validation import compressed_members

__all__ = [
    "Found",
    "LoadResult",
    "OnSparse",
    "SparseRecord",
    "load",
    "load_and_validate",
    "reduce_safe_sparse",
]


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
    """A sparse tensor of a file, refused before anything was built: the members and the
    :class:`InvariantError` they raised."""

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
class _Session:
    """What one validating ``torch.load`` saw: refused and pending tensors, a progress hook."""

    on_sparse: OnSparse | None = None
    rejected: list[SparseRecord] = field(default_factory=list)
    pending: list[_Pending] = field(default_factory=list)
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
        self.count += 1
        try:
            out: SafeSparseTensor | SparseRecord = build()
        except InvariantError as err:
            out = SparseRecord(layout, members, size, coalesced, err)
            self.rejected.append(out)
        if self.on_sparse is not None:
            shape = out.shape if isinstance(out, SparseRecord) else tuple(out.shape)
            self.on_sparse(self.count, layout, shape)
        return out

    def resolve_pending(self) -> dict[int, SafeSparseTensor | SparseRecord]:
        """Validate (and build) the pending tensors, now that torch has read their data."""
        return {
            id(p): self.run(p.layout, p.members, p.given_size, p.coalesced, p.build)
            for p in self.pending
        }

    def is_unbuilt_member(self, obj: Any) -> bool:
        return any(obj is m for u in (*self.rejected, *self.pending) for m in u.members)


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
# torch's own post-load validators (run only when check_sparse_tensor_invariants is enabled)
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
    """Routes sparse construction during a load through the safe factories (see module doc)."""

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
        if not _is_trusted():
            entry = _FACTORIES.get(func)
            if entry is not None:
                return self._construct(entry[0], entry[1], args, kwargs)
            if func in _TORCH_VALIDATORS and any(
                self.session.is_unbuilt_member(a) for a in args
            ):
                return None  # refused or pending: ours to validate, never torch's to read
        return func(*args, **kwargs)

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


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class Found:
    """One sparse tensor found in a loaded object.

    ``path`` is the pytree key path (``"['layer.weight']"``; ``""`` for the object itself), or
    ``None`` for a refused tensor that the walk could not reach (inside a set, a Parameter ...).
    ``item`` is a checked :class:`SafeSparseTensor` or a :class:`SparseRecord`.
    """

    path: str | None
    item: SafeSparseTensor | SparseRecord

    @property
    def error(self) -> InvariantError | None:
        if isinstance(self.item, SparseRecord):
            err = self.item.error
            return err.with_context(path=self.path) if self.path else err
        return None


@dataclass(frozen=True)
class LoadResult:
    """The loaded object, with valid sparse tensors wrapped, and every sparse tensor found."""

    obj: Any
    found: list[Found]
    aborted: BaseException | None = None  # what stopped torch.load after a refused tensor
    unplaced: int = 0  # valid pending tensors the walk could not put back (legacy format)


def load_and_validate(
    f: Any, *, on_sparse: OnSparse | None = None, **kwargs: Any
) -> LoadResult:
    """``torch.load(f, **kwargs)`` with every sparse tensor validated before it is built.

    Never raises :class:`InvariantError`: a refused tensor stays a :class:`SparseRecord` in the
    returned object and in ``found``. Any other error of ``torch.load`` propagates, except that
    one caused by a refused tensor (torch wrapping it in a Parameter, say) is reported as that
    tensor (``found`` then lists the refused tensors only, with ``path=None``).
    ``on_sparse(count, layout, shape)`` is called after each sparse tensor is validated.
    """
    session = _Session(on_sparse=on_sparse)
    prior = _session()
    _local.session = session
    try:
        with _LoadMode(session):
            obj = torch.load(f, **kwargs)
    except Exception as exc:
        if session.rejected:
            return LoadResult(None, [Found(None, r) for r in session.rejected], aborted=exc)
        if session.pending:
            raise RuntimeError(LEGACY_WRAPPED_MESSAGE) from exc
        raise
    finally:
        _local.session = prior
    return _walk(obj, session, session.resolve_pending())


def _walk(
    obj: Any, session: _Session, resolved: dict[int, SafeSparseTensor | SparseRecord]
) -> LoadResult:
    leaves, _ = pytree.tree_flatten_with_path(obj)
    found: list[Found] = []
    seen: set[int] = set()
    for keypath, leaf in leaves:
        path = pytree.keystr(keypath)
        if isinstance(leaf, _Pending):
            seen.add(id(leaf))
            out = resolved[id(leaf)]
            seen.add(id(out))
            found.append(Found(path, out))
            if isinstance(out, SafeSparseTensor):
                obj = _replace_at(obj, keypath, out)
        elif isinstance(leaf, SparseRecord):
            seen.add(id(leaf))
            found.append(Found(path, leaf))
        elif isinstance(leaf, torch.Tensor) and leaf.layout in SPARSE_LAYOUTS:
            if isinstance(leaf, SafeSparseTensor) and is_checked(leaf):
                found.append(Found(path, leaf))
                continue
            try:
                adopted = _adopt(leaf)
            except InvariantError as err:
                record = SparseRecord(leaf.layout, _members_of(leaf), tuple(leaf.shape),
                                      None, err)
                found.append(Found(path, record))
                continue
            found.append(Found(path, adopted))
            if adopted is not leaf:
                obj = _replace_at(obj, keypath, adopted)
    unplaced = [resolved[id(p)] for p in session.pending if id(p) not in seen]
    valid_unplaced = [t for t in unplaced if isinstance(t, SafeSparseTensor)]
    found += [Found(None, t) for t in valid_unplaced]
    found += [Found(None, r) for r in session.rejected if id(r) not in seen]
    return LoadResult(obj, found, unplaced=len(valid_unplaced))


def _members_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            return (t._indices(), t._values())
        return (*compressed_members(t), t.values())


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


def _replace_at(node: Any, keypath: Sequence[Any], value: Any) -> Any:
    """``node`` with the leaf at ``keypath`` replaced: in place in dicts and lists (so state-dict
    metadata such as ``OrderedDict._metadata`` survives), rebuilt for tuples."""
    if not keypath:
        return value
    key, rest = keypath[0], keypath[1:]
    child = key.get(node)
    new_child = _replace_at(child, rest, value)
    if new_child is child:
        return node
    if isinstance(key, pytree.MappingKey) and isinstance(node, MutableMapping):
        node[key.key] = new_child
        return node
    if isinstance(key, pytree.SequenceKey) and isinstance(node, MutableSequence):
        node[key.idx] = new_child
        return node
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # named tuple
        fields: tuple[str, ...] = node._fields
        name = key.name if isinstance(key, pytree.GetAttrKey) else fields[key.idx]
        replaced: Any = node._replace(**{name: new_child})  # type: ignore[attr-defined]
        return replaced
    if isinstance(key, pytree.SequenceKey) and isinstance(node, tuple):
        items = list(node)
        items[key.idx] = new_child
        return type(node)(items)
    raise TypeError(f"cannot replace an item of {type(node).__name__} at {key}")


def load(f: Any, **kwargs: Any) -> Any:
    """``torch.load`` (``weights_only=True`` by default) that validates every sparse tensor.

    Every sparse tensor anywhere in the loaded object (dicts, lists, tuples, state dicts, nested)
    is validated before it is built, and returned as a checked :class:`SafeSparseTensor`. A
    violation raises :class:`InvariantError` naming the key path, e.g. ``['layer.weight']``.
    Keyword arguments are those of ``torch.load``.
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
# Pickling SafeSparseTensor


def reduce_safe_sparse(t: torch.Tensor) -> tuple[Any, ...]:
    """``__reduce_ex__`` of SafeSparseTensor: the members and size, never a checked flag."""
    with DisableTorchFunctionSubclass():
        plain = t.detach()
        data: tuple[Any, ...]
        if plain.layout == torch.sparse_coo:
            data = (plain._indices(), plain._values(), tuple(plain.shape), plain.is_coalesced())
        elif plain.layout in COMPRESSED_LAYOUTS:
            data = (*compressed_members(plain), plain.values(), tuple(plain.shape))
        else:
            raise TypeError(f"cannot pickle a SafeSparseTensor with layout {plain.layout}")
    return (_rebuild_safe_sparse, (plain.layout, data, bool(t.requires_grad)))


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


torch.serialization.add_safe_globals([_rebuild_safe_sparse])

"""The deep walk: finds every sparse tensor in a loaded object (validating any not yet
validated), gives checked tensors whose index storage something else shares their own copy,
and puts the checked tensors in place."""

from __future__ import annotations

import collections
import contextlib
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import SPARSE_LAYOUTS, compressed_members
from ..factories.core import sparse_compressed_tensor, sparse_coo_tensor
from ..tensor.core import SafeSparseTensor, is_checked, unwrap
from .owned import own_copy
from .results import Found, LoadResult, Path, PathKey, path_str
from .session import SparseRecord, _index_members, _members_of, _Pending, _Session

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
            with DisableTorchFunctionSubclass():  # metadata reads: never the guard
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
            out = sparse_coo_tensor(own_copy(plain._indices()), values, tuple(plain.shape),
                                    is_coalesced=plain.is_coalesced())
        else:
            compressed, plain_idx = compressed_members(plain)
            out = sparse_compressed_tensor(own_copy(compressed), own_copy(plain_idx), values,
                                           tuple(plain.shape), layout=plain.layout)
    if leaf_grad:
        out.requires_grad_(True)
    return out

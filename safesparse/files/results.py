"""Key paths and what a validating load returns: :class:`Found`, :class:`LoadResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..catalog.module_geometry import GeometryError
from ..tensor.core import SafeSparseTensor
from .session import SparseRecord


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
class ModuleMatrix:
    """One ``safesparse.nn`` module's saved matrix found in a loaded object (its index
    members and values beside its geometry, :mod:`safesparse.files.modules`) and the
    validation's verdict.

    ``keys`` is the key path of the mapping (state dict) that holds it (empty: the loaded
    object itself), ``prefix`` the module's key prefix in it (``"fc1."``); ``layout`` and
    ``shape`` are the geometry's (``None`` when it is damaged); ``member`` is the member an
    error is about (``"plain_indices"``, ``"_extra_state"`` ...).
    """

    keys: Path
    prefix: str
    layout: torch.layout | None
    shape: tuple[int, int] | None
    nnz: int | None
    error: InvariantError | GeometryError | None = None
    member: str | None = None

    def key(self, member: str) -> str:
        """The state-dict key of one of its members, e.g. ``"fc1.plain_indices"``."""
        return self.prefix + member

    def path(self, member: str) -> str:
        """The key path of one of its members in the loaded object, e.g.
        ``"['fc1.plain_indices']"``."""
        return path_str((*self.keys, PathKey("item", self.key(member))))


@dataclass(frozen=True)
class LoadResult:
    """The loaded object, with valid sparse tensors wrapped (refused ones as records), every
    sparse tensor found, and how many dense tensors the walk saw."""

    obj: Any
    found: list[Found]
    aborted: BaseException | None = None  # what stopped torch.load after a refused tensor
    unplaced: int = 0  # valid pending tensors the walk could not put back (legacy format)
    dense: int = 0  # strided tensors in the object
    #: the ``safesparse.nn`` module matrices (state dict triples beside their geometry)
    modules: list[ModuleMatrix] = field(default_factory=list)

    @property
    def first_error(self) -> InvariantError | GeometryError | None:
        """The first refusal: a sparse tensor's, else a module matrix's (naming its key)."""
        for f in self.found:
            if f.error is not None:
                return f.error
        for m in self.modules:
            if m.error is not None:
                return m.error
        return None

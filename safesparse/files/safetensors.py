"""Sparse tensors in safetensors files: no pickle, every layout, validated on the way in.

The public names are imported from :mod:`safesparse.safetensors`, which re-exports them from
here. They mirror ``safetensors.torch``: :func:`save_file`, :func:`load_file`, :func:`save` and
:func:`load`, with the same names and arguments. Dense tensors are stored exactly as
``safetensors`` stores them. A sparse tensor (COO, CSR, CSC, BSR, BSC; batched and hybrid) is
stored as its member tensors, which are ordinary dense tensors, plus one metadata entry, so
plain ``safetensors.torch.load_file`` reads the file where safesparse is absent. ``ss.load``
and ``ss.load_and_validate`` read a path ending in ``.safetensors`` through here (``torch.load``
itself hands such a path to plain safetensors, which would return the loose members).

On-disk naming (format version 1)
---------------------------------
For a sparse tensor saved under the key ``K``:

* its members are stored as ``K.__ss_<member>``, with torch's accessor names: COO
  ``indices`` and ``values``; CSR and BSR ``crow_indices``, ``col_indices``, ``values``; CSC and
  BSC ``ccol_indices``, ``row_indices``, ``values`` (``K.__ss_crow_indices`` ...);
* the file's metadata (the header's ``__metadata__`` section, a string-to-string map) holds
  the entry ``__ss_sparse__:K`` whose value is a JSON object: ``{"format": 1, "layout":
  "sparse_csr", "size": [...]}``, plus ``"coalesced": true|false`` for COO.

Key names containing ``.__ss_`` and metadata names starting with ``__ss_`` are reserved:
:func:`save_file` refuses them in what it is given. :func:`load_file` refuses, with a
:class:`FormatError` naming the key, any entry it cannot read (malformed JSON, an unknown
format version, layout or field, a size that is not a list of non-negative integers, a
wrong index dtype), missing members, tensors named as members that no entry claims, and an
entry for a key that also holds a dense tensor. It never drops a tensor silently. The members
are then handed to the validating factories, which check every invariant (sizes that do not
fit the members included) before torch builds anything: an invalid tensor raises
:class:`~safesparse.InvariantError` naming its key.

``safetensors`` is an optional dependency: ``pip install "safesparse[safetensors]"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import BY_TORCH_NAME, INDEX_MEMBERS, SPARSE_LAYOUTS, TORCH_NAMES
from ..catalog.errors import InvariantError, source_name
from ..engine.metadata import members
from ..factories.core import sparse_compressed_tensor, sparse_coo_tensor
from ..tensor.core import SafeSparseTensor, is_checked, unwrap, validate
from .atomic import replacing
from .modules import module_matrices
from .owned import own_copy
from .results import Found, LoadResult, PathKey
from .session import SparseRecord

__all__ = [
    "FORMAT_VERSION",
    "FormatError",
    "load",
    "load_and_validate",
    "load_file",
    "save",
    "save_file",
]

#: The version of the on-disk naming written in each sparse tensor's metadata entry.
FORMAT_VERSION = 1
#: A member of the sparse tensor ``K`` is stored as ``K + MEMBER_SEP + member name``.
MEMBER_SEP = ".__ss_"
#: The metadata entry of the sparse tensor ``K`` is ``METADATA_PREFIX + K``.
METADATA_PREFIX = "__ss_sparse__:"
_RESERVED_METADATA = "__ss_"

_MEMBERS: dict[torch.layout, tuple[str, ...]] = {
    layout: (*INDEX_MEMBERS[layout], "values") for layout in SPARSE_LAYOUTS
}
_MAX_DIM = 2**63 - 1

INSTALL_HINT = (
    "safesparse.safetensors needs the safetensors package: "
    'pip install "safesparse[safetensors]" (or pip install safetensors)'
)


class FormatError(ValueError):
    """A safetensors file whose sparse entries do not follow safesparse's on-disk naming
    (malformed or unknown metadata, missing or unclaimed members, a name collision). The
    message names the key; nothing from the file is returned."""

    __module__ = "safesparse.safetensors"  # printed and pickled by its public name


def _st() -> ModuleType:
    """``safetensors.torch``, or an ImportError that says how to install it."""
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return st


def _where(key: str) -> str:
    return f"sparse tensor {key!r}"


# ---------------------------------------------------------------------------------------------
# Saving


def _checked_plain(key: str, t: torch.Tensor) -> torch.Tensor:
    """The plain torch tensor of ``t``, validated first unless it is checked."""
    if not (isinstance(t, SafeSparseTensor) and is_checked(t)):
        try:
            t = validate(t)
        except InvariantError as err:
            raise err.with_context(path=str(PathKey("item", key))) from None
    with DisableTorchFunctionSubclass():
        return unwrap(t).detach()


def _flatten(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """What plain safetensors saves: sparse tensors split into members, with their entries."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"expected a dict of str -> torch.Tensor, got {type(tensors).__name__}")
    meta: dict[str, str] = {}
    for name, value in (metadata or {}).items():
        if isinstance(name, str) and name.startswith(_RESERVED_METADATA):
            raise ValueError(f"metadata name {name!r}: names starting with "
                             f"{_RESERVED_METADATA!r} are reserved for safesparse")
        meta[name] = value
    flat: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise ValueError(f"key {key!r}: safetensors keys are strings")
        if MEMBER_SEP in key:
            raise ValueError(f"key {key!r}: names containing {MEMBER_SEP!r} are reserved for "
                             "the members of sparse tensors")
        if not (isinstance(t, torch.Tensor) and t.layout in SPARSE_LAYOUTS):
            flat[key] = t  # dense, or not a tensor: safetensors decides, as it would
            continue
        plain = _checked_plain(key, t)
        spec: dict[str, Any] = {"format": FORMAT_VERSION, "layout": TORCH_NAMES[plain.layout],
                                "size": list(plain.shape)}
        if plain.layout == torch.sparse_coo:
            spec["coalesced"] = bool(plain.is_coalesced())
        with DisableTorchFunctionSubclass():
            parts = members(plain)
        for name, member in zip(_MEMBERS[plain.layout], parts, strict=True):
            flat[key + MEMBER_SEP + name] = member.contiguous()
        meta[METADATA_PREFIX + key] = json.dumps(spec, separators=(",", ":"))
    return flat, (meta if meta or metadata is not None else None)


def save_file(
    tensors: Mapping[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """``safetensors.torch.save_file`` that also stores sparse tensors, refusing invalid ones.

    Every sparse tensor that is not checked is validated first; then the file is written
    through a temporary file in the same directory, renamed over ``filename`` at the end, so
    an error leaves no file and no partial file. Plain ``safetensors.torch.load_file`` reads
    the result: a sparse tensor ``K`` appears as its members ``K.__ss_crow_indices`` ...

    Example::

        from safesparse.safetensors import load_file, save_file
        save_file({"w": sparse_weight, "b": bias}, "model.safetensors")
        state = load_file("model.safetensors")  # checked SafeSparseTensor under "w"

    Args:
        tensors: key -> tensor; dense tensors must be contiguous (as for safetensors),
            sparse tensors may be of any layout, batched or hybrid.
        filename: the file to write.
        metadata: text-only metadata, as for safetensors; names starting with ``__ss_`` are
            reserved.

    Returns:
        None.

    Raises:
        InvariantError: a sparse tensor breaks an invariant; ``err.path`` names its key.
        ValueError: a key contains ``.__ss_`` or a metadata name starts with ``__ss_``
            (reserved), or safetensors refuses a dense tensor.
        ImportError: the safetensors package is not installed.
    """
    st = _st()
    flat, meta = _flatten(tensors, metadata)
    with replacing(filename) as tmp:
        st.save_file(flat, tmp, metadata=meta)


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``safetensors.torch.save`` that also stores sparse tensors: the file's bytes.

    Args:
        tensors: key -> tensor, as for :func:`save_file`.
        metadata: text-only metadata, as for :func:`save_file`.

    Returns:
        The bytes of a safetensors file (see :func:`save_file`).

    Raises:
        InvariantError: a sparse tensor breaks an invariant; ``err.path`` names its key.
        ValueError: a reserved key or metadata name, or safetensors refuses a dense tensor.
        ImportError: the safetensors package is not installed.
    """
    st = _st()
    flat, meta = _flatten(tensors, metadata)
    data: bytes = st.save(flat, metadata=meta)
    return data


# ---------------------------------------------------------------------------------------------
# Loading


def _parse_entry(key: str, text: str) -> tuple[torch.layout, tuple[int, ...], bool | None]:
    """(layout, size, coalesced) from the metadata entry of ``key``; FormatError if malformed."""
    where = _where(key)
    if MEMBER_SEP in key:
        raise FormatError(f"{where}: names containing {MEMBER_SEP!r} are reserved for members")
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        raise FormatError(f"{where}: its metadata entry is not valid JSON: {text[:80]!r}") from None
    if not isinstance(spec, dict):
        raise FormatError(f"{where}: its metadata entry is not a JSON object")
    version = spec.get("format")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise FormatError(f"{where}: unknown format version {version!r} (this safesparse "
                          f"reads version {FORMAT_VERSION}; a newer safesparse may read it)")
    name = spec.get("layout")
    layout = BY_TORCH_NAME.get(name) if isinstance(name, str) else None
    if layout is None:
        raise FormatError(f"{where}: unknown layout {name!r} (expected one of "
                          f"{', '.join(sorted(BY_TORCH_NAME))})")
    fields = {"format", "layout", "size"} | ({"coalesced"} if layout == torch.sparse_coo else set())
    unknown = sorted(str(k) for k in spec if k not in fields)
    if unknown:
        raise FormatError(f"{where}: unknown metadata field(s) {', '.join(unknown)}")
    size = spec.get("size")
    if not (isinstance(size, list) and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_DIM for s in size)):
        raise FormatError(f"{where}: size must be a list of non-negative integers, got {size!r}")
    coalesced = None
    if layout == torch.sparse_coo:
        coalesced = spec.get("coalesced")
        if not isinstance(coalesced, bool):
            raise FormatError(f"{where}: coalesced must be true or false, got {coalesced!r}")
    return layout, tuple(size), coalesced


def _check_index_dtype(key: str, layout: torch.layout, name: str, m: torch.Tensor) -> None:
    allowed = (torch.int64,) if layout == torch.sparse_coo else (torch.int32, torch.int64)
    if m.dtype not in allowed:
        want = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise FormatError(f"{_where(key)}: member {name} has dtype "
                          f"{str(m.dtype).removeprefix('torch.')}, expected {want}")


def _build(key: str, layout: torch.layout, size: tuple[int, ...], coalesced: bool | None,
           parts: tuple[torch.Tensor, ...]) -> SafeSparseTensor | SparseRecord:
    """The checked tensor, or the record of the invariant its members break (nothing built).

    The index members are copied first (:func:`~safesparse.files.owned.own_copy`): the file's
    tensors map the file, which another process can rewrite under a checked tensor (a deploy
    copying a new model over it); the values stay mapped (SPEC 4)."""
    parts = (*(own_copy(m) for m in parts[:-1]), parts[-1])
    try:
        if layout == torch.sparse_coo:
            return sparse_coo_tensor(parts[0], parts[1], size, is_coalesced=coalesced)
        return sparse_compressed_tensor(parts[0], parts[1], parts[2], size, layout=layout)
    except InvariantError as err:
        return SparseRecord(layout, parts, size, coalesced, err)


def _rebuild(flat: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> LoadResult:
    """Rebuild the sparse tensors of a safetensors file from its tensors and metadata.

    Invalid tensors stay :class:`~safesparse.files.SparseRecord` s (never built) in the result
    and in ``found``; :class:`FormatError` for anything that breaks the on-disk naming.
    """
    entries = {name[len(METADATA_PREFIX):]: text for name, text in (metadata or {}).items()
               if name.startswith(METADATA_PREFIX)}
    owner: dict[str, str] = {}  # member name -> key of its sparse tensor
    built: dict[str, SafeSparseTensor | SparseRecord] = {}
    layouts: dict[str, torch.layout] = {}
    for key, text in entries.items():
        layout, size, coalesced = _parse_entry(key, text)
        layouts[key] = layout
        if key in flat:
            raise FormatError(f"{_where(key)}: the file also stores a dense tensor named {key!r}")
        names = [key + MEMBER_SEP + m for m in _MEMBERS[layout]]
        missing = [n for n in names if n not in flat]
        if missing:
            raise FormatError(f"{_where(key)} ({TORCH_NAMES[layout]}): missing member(s) "
                              f"{', '.join(repr(n) for n in missing)}")
        parts = tuple(flat[n] for n in names)
        for n, m in zip(_MEMBERS[layout][:-1], parts, strict=False):
            _check_index_dtype(key, layout, n, m)
        owner.update(dict.fromkeys(names, key))
        built[key] = _build(key, layout, size, coalesced, parts)
    extra = [n for n in flat if MEMBER_SEP in n and n not in owner]
    if extra:
        key = extra[0].split(MEMBER_SEP, 1)[0]
        more = f" ({len(extra) - 1} more such tensors)" if len(extra) > 1 else ""
        if key in layouts:
            raise FormatError(f"tensor {extra[0]!r} is not a member of {_where(key)}: a "
                              f"{TORCH_NAMES[layouts[key]]} tensor has "
                              f"{', '.join(_MEMBERS[layouts[key]])}{more}")
        raise FormatError(f"tensor {extra[0]!r} is named as a member of a sparse tensor, but no "
                          f"entry of the file's metadata describes {key!r}{more}")
    out: dict[str, Any] = {}
    found: list[Found] = []
    dense = 0
    for name, t in flat.items():
        of = owner.get(name)
        if of is None:
            out[name] = t
            dense += 1
        elif of not in out:
            out[of] = built[of]
            found.append(Found((PathKey("item", of),), built[of]))
    return LoadResult(out, found, dense=dense, modules=module_matrices(out))


def _raise_first(result: LoadResult, loaded_by: str | None = None) -> dict[str, Any]:
    err = result.first_error
    if err is not None:
        raise err if loaded_by is None else err.with_context(loaded_by=loaded_by)
    obj: dict[str, Any] = result.obj
    return obj


def _read_file(filename: str | os.PathLike[str], device: str | int | torch.device
               ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    st = _st()
    dev = str(device) if isinstance(device, torch.device) else device
    with st.safe_open(os.fspath(filename), framework="pt", device=dev) as f:
        metadata: dict[str, str] | None = f.metadata()
        get_all = getattr(f, "get_tensors", None)  # safetensors >= 0.6; one call, as load_file
        names = f.keys()
        flat: dict[str, torch.Tensor] = (
            get_all() if get_all is not None else {k: f.get_tensor(k) for k in names})
    return flat, metadata


def load_and_validate(filename: str | os.PathLike[str],
                      device: str | int | torch.device = "cpu") -> LoadResult:
    """Read a safetensors file and validate every sparse tensor in it, raising for none: an
    invalid one stays a record in ``found`` (what ``python -m safesparse check`` reports).

    Args:
        filename: the safetensors file.
        device: where the tensors are put, as for ``safetensors.torch.load_file``.

    Returns:
        A :class:`~safesparse.files.LoadResult` whose ``obj`` is the key -> tensor dict.

    Raises:
        FormatError: the file's sparse entries break the on-disk naming.
        ImportError: the safetensors package is not installed.
    """
    return _rebuild(*_read_file(filename, device))


def load_file(filename: str | os.PathLike[str],
              device: str | int | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` that rebuilds sparse tensors, validated.

    Dense tensors come back as safetensors gives them; each sparse tensor is rebuilt from its
    members through the validating factories and returned as a checked
    :class:`~safesparse.SafeSparseTensor`. The matrices of ``safesparse.nn`` state dicts (a
    layer's index members and values beside its geometry) are validated too.

    Args:
        filename: the safetensors file.
        device: where the tensors are put (``"cpu"``, ``"cuda:0"``, an index ...).

    Returns:
        key -> tensor.

    Raises:
        InvariantError: a sparse tensor, or a ``safesparse.nn`` layer's saved matrix, breaks
            an invariant; ``err.path`` names its key (``['fc1.plain_indices']``).
        ValueError: a ``safesparse.nn`` layer's saved geometry is damaged
            (``GeometryError``, naming its key).
        FormatError: the file's sparse entries break the on-disk naming (see the module doc).
        ImportError: the safetensors package is not installed.
    """
    return _raise_first(load_and_validate(filename, device),
                        f"safesparse.safetensors.load_file from {source_name(filename)}")


def load(data: bytes) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load`` that rebuilds sparse tensors, validated (on the CPU).

    Args:
        data: the bytes of a safetensors file.

    Returns:
        key -> tensor, as for :func:`load_file`.

    Raises:
        InvariantError: a sparse tensor breaks an invariant; ``err.path`` names its key.
        FormatError: the file's sparse entries break the on-disk naming.
        ImportError: the safetensors package is not installed.
    """
    st = _st()
    flat: dict[str, torch.Tensor] = st.load(data)  # checks the header and the byte ranges
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return _raise_first(_rebuild(flat, metadata))

"""``torch.export`` archives (``.pt2``, written by ``torch.export.save``): recognised, and the
sparse matrices of their ``safesparse`` operators vetted without unpickling anything.

``torch.export.load`` is not for untrusted files: it unpickles parts of the archive (pickled
weights and constants, custom objects) with ``weights_only=False``. So ``python -m safesparse
check`` reads the archive itself, with the ``zipfile`` module and JSON only:

* ``<root>/archive_format`` holds ``pt2``: the file is a torch.export archive;
* ``<root>/models/<name>.json`` is each serialized program: its graph signature maps the
  graph's inputs to parameter, buffer and constant names, and each ``safesparse`` operator
  node names its index members and values (inputs ``compressed``, ``plain``, ``values``), its
  layout and its sizes (``out_features`` / ``in_features``, or ``n_rows`` / ``n_cols``);
* ``<root>/data/weights/<name>_weights_config.json`` and ``data/constants/...`` describe each
  stored tensor (file, dtype, sizes, strides, offset); a tensor stored raw is read from its
  bytes (its strides and offset checked against the bytes first), a pickled one is not read.

Each operator's members then go through the safe factory, which checks the indices before
torch builds anything, exactly as for a state dict; the result is a
:class:`~safesparse.files.LoadResult` whose ``modules`` are those matrices (keys: the
parameter and buffer names, ``fc1.plain_indices``). What cannot be read this way (a member
stored pickled, a symbolic size, an archive with no program) is an :class:`ArchiveError`.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..base.layouts import BY_SHORT_NAME, COMPRESSED_LAYOUTS
from ..catalog.errors import InvariantError
from ..catalog.module_geometry import MEMBER_NAMES, member_of, values_disagree
from .limits import entry_cap, json_cap, oversized_member, read_entry, vet_zip
from .results import LoadResult, ModuleMatrix

__all__ = ["PORTABLE_KEY", "ArchiveError", "is_export_archive", "read_export_archive"]

#: the key of a program's ``custom`` graph metadata under which ``ss.portable`` lists the
#: members of the operators it replaced (``compressed``, ``plain``, ``values``: stored names;
#: ``layout``; ``size``): a portable program holds no ``safesparse`` operator to find them by
PORTABLE_KEY = "safesparse.matrices"

_SIZES = (("out_features", "in_features"), ("n_rows", "n_cols"))
#: torch.export's serialized dtype codes (torch._export.serde.schema.ScalarType) that can
#: hold index members or values
_DTYPES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64,
           6: torch.float16, 7: torch.float32, 8: torch.float64, 12: torch.bool,
           13: torch.bfloat16}
#: The most a one-word entry (``archive_format``, ``byteorder``) may hold.
_SMALL = 64
_INPUT_KINDS = {"parameter": "parameter_name", "buffer": "buffer_name",
                "tensor_constant": "tensor_constant_name"}


class ArchiveError(ValueError):
    """A torch.export archive whose sparse matrices safesparse cannot read without running
    or unpickling anything from it; the message says what."""


def _root(z: zipfile.ZipFile) -> str | None:
    for name in z.namelist():
        if name.endswith("archive_format") and name.count("/") == 1:
            try:
                if read_entry(z, name, _SMALL).strip() == b"pt2":
                    return name[: -len("archive_format")]
            except (OSError, zipfile.BadZipFile, RuntimeError, ValueError):
                return None
    return None


def is_export_archive(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a zip archive written by ``torch.export.save``."""
    try:
        with zipfile.ZipFile(path) as z:
            return _root(z) is not None
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _ints(items: Any, what: str) -> list[int]:
    if not isinstance(items, list):
        raise ArchiveError(f"{what}: not a list")
    out = []
    for item in items:
        value = item.get("as_int") if isinstance(item, dict) else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArchiveError(f"{what}: {item!r} is not a plain integer (a symbolic size)")
        out.append(value)
    return out


class _Payloads:
    """The tensors of one payload directory (weights or constants), read on demand, each
    within what its description needs and the archive's cap (:mod:`.limits`)."""

    def __init__(self, z: zipfile.ZipFile, base: str, config_name: str) -> None:
        self.z, self.base = z, base
        self.size = _archive_size(z)
        try:
            config = (json.loads(read_entry(z, config_name, json_cap(self.size)))
                      if config_name in z.namelist() else {})
        except (ValueError, RecursionError):
            raise ArchiveError(f"{config_name} is not valid JSON") from None
        entries = config.get("config", {}) if isinstance(config, dict) else None
        if not isinstance(entries, dict):
            raise ArchiveError(f"{config_name}: no 'config' object")
        self.entries: dict[str, Any] = entries

    def get(self, fqn: str) -> torch.Tensor:
        meta = self.entries.get(fqn)
        if not isinstance(meta, dict):
            raise ArchiveError(f"{fqn}: not described in the archive")
        if meta.get("use_pickle"):
            raise ArchiveError(f"{fqn} is stored pickled; safesparse does not unpickle an "
                               "archive it vets")
        tm = meta.get("tensor_meta")
        name = meta.get("path_name")
        if not isinstance(tm, dict) or not isinstance(name, str):
            raise ArchiveError(f"{fqn}: no tensor description")
        code = tm.get("dtype")
        dtype = _DTYPES.get(code) if isinstance(code, int) else None
        if dtype is None:
            raise ArchiveError(f"{fqn}: unsupported dtype code {tm.get('dtype')!r}")
        sizes = _ints(tm.get("sizes"), f"{fqn} sizes")
        strides = _ints(tm.get("strides"), f"{fqn} strides")
        offset = _ints([tm.get("storage_offset")], f"{fqn} storage offset")[0]
        item = torch.empty((), dtype=dtype).element_size()
        try:
            declared = self.z.getinfo(self.base + name).file_size
            if 0 not in sizes and len(sizes) == len(strides) and min([*strides, offset, 0]) >= 0:
                needs = (offset + 1 + sum((s - 1) * st for s, st in zip(
                    sizes, strides, strict=True))) * item
                if declared < needs:  # (refused unread)
                    raise ArchiveError(f"{fqn}: sizes {sizes} and strides {strides} from "
                                       f"offset {offset} need {needs} bytes; "
                                       f"{self.base + name} declares {declared}")
            data = read_entry(self.z, self.base + name, entry_cap(self.size))
        except (KeyError, OSError, zipfile.BadZipFile) as exc:
            raise ArchiveError(f"{fqn}: cannot read {self.base + name}: {exc}") from None
        if len(data) % item:
            raise ArchiveError(f"{fqn}: {len(data)} bytes is not a whole number of {dtype}")
        numel = len(data) // item
        if len(sizes) != len(strides) or min([*sizes, *strides, offset, 0]) < 0:
            raise ArchiveError(f"{fqn}: sizes {sizes}, strides {strides}, offset {offset}")
        if 0 not in sizes and offset + sum((s - 1) * st for s, st in zip(
                sizes, strides, strict=True)) >= numel:
            raise ArchiveError(f"{fqn}: sizes {sizes} and strides {strides} from offset "
                               f"{offset} reach past its {numel} stored elements")
        flat = (torch.frombuffer(bytearray(data), dtype=dtype) if numel
                else torch.empty(0, dtype=dtype))
        return flat.as_strided(sizes, strides, offset)


def _operators(program: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """Each ``safesparse`` operator node of a serialized program, with the graph's map from
    input names to parameter / buffer / constant names."""
    gm = program.get("graph_module")
    if not isinstance(gm, dict):
        raise ArchiveError("the program has no graph_module")
    names: dict[str, str] = {}
    for spec in (gm.get("signature") or {}).get("input_specs", []):
        for kind, field in _INPUT_KINDS.items():
            entry = spec.get(kind) if isinstance(spec, dict) else None
            if isinstance(entry, dict):
                arg = entry.get("arg") or {}
                if isinstance(arg.get("name"), str) and isinstance(entry.get(field), str):
                    names[arg["name"]] = entry[field]
    for node in (gm.get("graph") or {}).get("nodes", []):
        target = node.get("target") if isinstance(node, dict) else None
        if isinstance(target, str) and target.startswith("torch.ops.safesparse."):
            args: dict[str, Any] = {i["name"]: i.get("arg") for i in node.get("inputs", [])
                                    if isinstance(i, dict) and isinstance(i.get("name"), str)}
            yield args, names


def _portable(program: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """The matrices ``ss.portable`` listed in the program's metadata (:data:`PORTABLE_KEY`),
    as :func:`_operators` gives an operator node's (stored names standing for the inputs)."""
    meta = ((program.get("graph_module") or {}).get("metadata") or {}).get("custom")
    try:
        listed = json.loads(meta).get(PORTABLE_KEY, []) if isinstance(meta, str) else []
    except (ValueError, RecursionError, AttributeError):
        raise ArchiveError("the program's custom metadata is not a JSON object") from None
    out = []
    for entry in listed if isinstance(listed, list) else []:
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, list) or len(size) != 2:
            raise ArchiveError(f"{PORTABLE_KEY}: an entry without a size")
        members = ("compressed", "plain", "values")
        args = {m: {"as_tensor": {"name": entry.get(m)}} for m in members}
        args |= {"layout": {"as_string": entry.get("layout")},
                 "n_rows": {"as_int": size[0]}, "n_cols": {"as_int": size[1]}}
        names = {entry[m]: entry[m] for m in members if isinstance(entry.get(m), str)}
        out.append((args, names))
    return out


def _matrix_of(args: dict[str, Any], names: dict[str, str]
               ) -> tuple[tuple[str, str, str], torch.layout, tuple[int, int]] | None:
    """The members' names, layout and size of one operator node; ``None`` when its members
    are not stored in the archive (inputs of the program)."""
    fqns = []
    for member in ("compressed", "plain", "values"):
        arg = args.get(member)
        tensor = arg.get("as_tensor") if isinstance(arg, dict) else None
        name = tensor.get("name") if isinstance(tensor, dict) else None
        if name not in names:
            return None
        fqns.append(names[name])
    layout_arg = args.get("layout")
    code = layout_arg.get("as_string") if isinstance(layout_arg, dict) else None
    layout = BY_SHORT_NAME.get(code) if isinstance(code, str) else None
    if layout is None or layout not in COMPRESSED_LAYOUTS:
        raise ArchiveError(f"a safesparse operator on {fqns[0]} has no known layout")
    for rows, cols in _SIZES:
        if rows in args and cols in args:
            size = _ints([args[rows], args[cols]], f"the size of the matrix of {fqns[0]}")
            return (fqns[0], fqns[1], fqns[2]), layout, (size[0], size[1])
    raise ArchiveError(f"a safesparse operator on {fqns[0]} has no size")


def _vet(fqns: tuple[str, str, str], layout: torch.layout, size: tuple[int, int],
         members: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> ModuleMatrix:
    from ..factories import sparse_compressed_tensor

    head = fqns[0].removesuffix(MEMBER_NAMES[0])
    standard = all(f == head + n for f, n in zip(fqns, MEMBER_NAMES, strict=True))
    prefix = head if standard else ""  # (safesparse.nn modules: "fc1." + the member names)
    nnz = int(members[1].shape[0]) if members[1].dim() == 1 else None
    error: InvariantError | None = values_disagree(layout, None, members[2])
    if error is None:  # a view claiming more than the archive holds: before any copy
        error = oversized_member(layout, members)
    if error is None:
        try:
            sparse_compressed_tensor(*members, size, layout=layout)
        except InvariantError as err:
            error = err
    if error is None:
        return ModuleMatrix((), prefix, layout, size, nnz)
    member = member_of(error)
    key = prefix + member if standard else dict(zip(MEMBER_NAMES, fqns, strict=True))[member]
    return ModuleMatrix((), "" if not standard else prefix, layout, size, nnz,
                        error.with_context(path=key), member if standard else key)


def read_export_archive(path: str | os.PathLike[str]) -> LoadResult:
    """Vet the sparse matrices of the ``safesparse`` operators of a torch.export archive.

    Returns a :class:`LoadResult` whose ``obj`` maps the names of the members read to them,
    ``modules`` the matrices with their verdicts, ``dense`` the number of the archive's other
    tensors (not read).

    Raises:
        ArchiveError: not a torch.export archive, or its matrices cannot be read without
            unpickling (see the module doc).
    """
    if sys.byteorder != "little":
        raise ArchiveError("torch.export archives are little-endian; this machine is not")
    with zipfile.ZipFile(path) as z:
        vet_zip(z, _archive_size(z))  # entries declaring more than a multiple of the archive
        root = _root(z)
        if root is None:
            raise ArchiveError("not a torch.export archive (no archive_format 'pt2')")
        names = z.namelist()
        if len(set(names)) != len(names):  # (a reader may take either of two same-named
            # entries: what check reads would not be what torch.export.load reads)
            raise ArchiveError("the archive holds two entries of the same name")
        programs = [n for n in names if n.startswith(root + "models/") and n.endswith(".json")]
        if not programs:
            raise ArchiveError("a torch.export archive with no exported program in it (an "
                               "AOTInductor package holds compiled code, which check cannot "
                               "vet)")
        byteorder = root + "byteorder"
        if byteorder in names and read_entry(z, byteorder, _SMALL).strip() not in (
                b"little", b""):
            raise ArchiveError("the archive's tensors are not little-endian")
        tensors: dict[str, torch.Tensor] = {}
        stored = 0  # tensors the archive stores (weights and constants)
        modules: list[ModuleMatrix] = []
        seen: set[tuple[tuple[str, str, str], torch.layout, tuple[int, int]]] = set()
        for program_name in programs:
            model = program_name[len(root + "models/"):-len(".json")]
            text = read_entry(z, program_name, json_cap(_archive_size(z)))
            try:
                program = json.loads(text)
            except (ValueError, RecursionError):
                raise ArchiveError(f"{program_name} is not valid JSON") from None
            if not isinstance(program, dict):
                raise ArchiveError(f"{program_name} is not a JSON object")
            stores = [
                _Payloads(z, root + "data/weights/",
                          f"{root}data/weights/{model}_weights_config.json"),
                _Payloads(z, root + "data/constants/",
                          f"{root}data/constants/{model}_constants_config.json"),
            ]
            stored += sum(len(store.entries) for store in stores)
            operators = list(_operators(program))
            if text.count(b'"torch.ops.safesparse.') > len(operators):
                raise ArchiveError("safesparse operators inside nested graphs (torch.cond, "
                                   "...) are not vetted by check")
            for args, input_names in [*operators, *_portable(program)]:
                found = _matrix_of(args, input_names)
                if found is None or found in seen:  # (one report per matrix and geometry)
                    continue
                fqns, layout, size = found
                seen.add(found)
                members = tuple(_read(stores, f) for f in fqns)
                tensors.update(zip(fqns, members, strict=True))
                modules.append(_vet(fqns, layout, size, (members[0], members[1], members[2])))
    return LoadResult(tensors, [], dense=stored - len(tensors), modules=modules)


def _archive_size(z: zipfile.ZipFile) -> int:
    """The size of the archive ``z`` reads, in bytes."""
    fp = z.fp
    if fp is None:
        return 0
    here = fp.tell()
    try:
        return int(fp.seek(0, os.SEEK_END))
    finally:
        fp.seek(here)


def _read(stores: list[_Payloads], fqn: str) -> torch.Tensor:
    for store in stores:
        if fqn in store.entries:
            return store.get(fqn)
    raise ArchiveError(f"{fqn}: not stored in the archive")

"""``safesparse`` command line: ``check`` vets checkpoints, ``demo`` shows it on a tampered file,
``info`` says which kernels compute the sparse products.

``python -m safesparse check PATH...`` loads each file (and each checkpoint file found in a
directory, recursively) with ``torch.load(weights_only=True, map_location="cpu")`` through
:func:`safesparse.files.load_and_validate`, so every sparse tensor's members are
validated before torch builds the tensor or anything uses it, and a tensor that fails is never
built at all, or never touched (see :mod:`safesparse.files`). It prints one line per
sparse tensor and a summary, or one JSON document with ``--json``.

A ``.safetensors`` file (or any file that starts like one) is read with
:func:`safesparse.safetensors.load_and_validate` instead: no pickle at all, the same report.
``--allow-global MODULE.NAME`` admits extra globals under ``weights_only=True``; ``--quiet``
prints only the failures and the summary.

Exit status: 0 when every sparse tensor of every file is valid, 1 when any is invalid or shares
its index storage with another tensor of the file, 2 when a file cannot be read (missing, not a
torch checkpoint, refused by ``weights_only``); 2 wins over 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from .base import originals as _originals
from .base.layouts import layout_name
from .catalog.errors import source_name
from .files import Found, LoadResult, SparseRecord, load_and_validate
from .files.export_archive import is_export_archive, read_export_archive
from .files.results import ModuleMatrix
from .files.safetensors import load_and_validate as safetensors_load_and_validate
from .tensor.core import unwrap

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_UNREADABLE = 2

#: Files at least this large get a progress line on stderr (when stderr is a terminal).
PROGRESS_MIN_BYTES = 32 * 2**20
#: Seconds between two updates of the progress line.
PROGRESS_INTERVAL_S = 0.1
#: Files a directory argument is searched for (recursively). ``.bin`` is a common name for
#: other formats too: such a file is checked only if it starts like a torch checkpoint.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".pt2")
#: How reports name a file written by ``torch.export.save``.
EXPORT_ARCHIVE = "torch.export archive (.pt2, torch.export.save)"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (?P<name>[\w.]+)")


# ---------------------------------------------------------------------------------------------
# Reports


@dataclass
class TensorReport:
    """One sparse tensor of a file: where it is, what it is, and whether it is valid."""

    key: str | None  # key path; "" for the file's top-level object; None: unreachable
    layout: str
    shape: list[int] | None
    nnz: int | None
    valid: bool
    invariant: str | None = None
    message: str | None = None
    location: dict[str, Any] | None = None
    key_path: list[Any] | None = None  # the key path as a list of keys (JSON values)
    aliased_with: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Valid, and its index storage shared with no other tensor of the file."""
        return self.valid and not self.aliased_with

    @property
    def display_key(self) -> str:
        if self.key is None:
            return "<unknown>"
        return self.key or "<root>"

    @property
    def verdict(self) -> str:
        if not self.valid:
            return "INVALID " + "; ".join((self.message or "").splitlines())
        if self.aliased_with:
            return (f"ALIASED index storage shared with {', '.join(self.aliased_with)} "
                    "(ss.load gives it a copy of its own)")
        return "OK"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "key_path": self.key_path,
            "layout": self.layout,
            "shape": self.shape,
            "nnz": self.nnz,
            "ok": self.ok,
            "valid": self.valid,
            "invariant": self.invariant,
            "message": self.message,
            "location": self.location,
            "aliased_with": list(self.aliased_with),
        }


@dataclass
class FileReport:
    """One file: an error when it cannot be read, else its sparse tensors."""

    path: str
    error: str | None = None
    tensors: list[TensorReport] = field(default_factory=list)
    dense: int = 0  # dense (strided) tensors read
    kind: str | None = None  # what the file is, when not a checkpoint: "torch.export archive"

    @property
    def ok(self) -> bool:
        return self.error is None and all(t.ok for t in self.tensors)

    @property
    def invalid(self) -> int:
        return sum(not t.valid for t in self.tensors)

    @property
    def aliased(self) -> int:
        return sum(t.valid and bool(t.aliased_with) for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "error": self.error,
            "dense": self.dense,
            "kind": self.kind,
            "tensors": [t.to_json() for t in self.tensors],
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _tensor_report(found: Found, loaded_by: str | None = None) -> TensorReport:
    """``loaded_by``: the checker and file, for the message (its repair hint speaks of a
    corrupt file)."""
    item = found.item
    key_path = None if found.keys is None else [_jsonable(k.to_json()) for k in found.keys]
    if isinstance(item, SparseRecord):
        err = item.error if loaded_by is None else item.error.with_context(loaded_by=loaded_by)
        return TensorReport(
            key=found.path,
            key_path=key_path,
            layout=layout_name(item.layout),
            shape=None if item.shape is None else list(item.shape),
            nnz=item.nnz,
            valid=False,
            invariant=err.invariant,
            message=str(err),
            location=_jsonable(err.location),
        )
    plain = unwrap(item)
    return TensorReport(
        key=found.path,
        key_path=key_path,
        layout=layout_name(plain.layout),
        shape=list(plain.shape),
        nnz=int(plain._nnz()),
        valid=True,
        aliased_with=list(found.aliased_with),
    )


# ---------------------------------------------------------------------------------------------
# Progress


class _Progress:
    """A single self-overwriting status line on a terminal's stderr."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.last = 0.0
        self.shown = False

    def show(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last = now
        self.shown = True
        self.stream.write(f"\r\x1b[K{self.label}: {text}")
        self.stream.flush()

    def on_sparse(self, count: int, layout: torch.layout, shape: tuple[int, ...] | None) -> None:
        where = "" if shape is None else f" {tuple(shape)}"
        self.show(f"{_plural(count, 'sparse tensor')} checked (last: {layout_name(layout)}{where})")

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _wants_progress(path: Path, stream: TextIO) -> bool:
    try:
        return stream.isatty() and path.stat().st_size >= PROGRESS_MIN_BYTES
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Checking


def _read_error(exc: BaseException) -> str:
    text = _ANSI.sub("", str(exc))
    if text.startswith("Weights only load failed"):
        # torch wraps the unpickler's reason in advice; keep the reason only
        marker = "WeightsUnpickler error:"
        rest = text.split(marker, 1)[1] if marker in text else text
        paragraphs = [p.strip() for p in rest.split("\n\n") if p.strip()]
        reasons = [p for p in paragraphs if not p.startswith("Check the documentation")]
        if marker not in text:
            reasons = reasons[-1:]
        detail = reasons[0].splitlines()[0] if reasons else text.splitlines()[0]
        unsupported = _UNSUPPORTED_GLOBAL.search(detail)
        if unsupported is not None:  # torch's advice names Python calls; a shell user has ours
            name = unsupported["name"]
            detail = (f"{name} is not an allowed global; if you trust this file, "
                      f"admit it with --allow-global {name}")
        return f"refused by torch.load(weights_only=True): {detail}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _looks_like_torch_file(path: Path) -> bool:
    """torch.save writes a zip archive (PK..) or, in the legacy format, a pickle (0x80 ..)."""
    with path.open("rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def _looks_like_safetensors(path: Path) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and the
    header, a JSON object."""
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8


def _load_safetensors(p: Path) -> LoadResult:
    return safetensors_load_and_validate(p, device="cpu")


def resolve_global(name: str) -> Any:
    """The object ``MODULE.NAME`` names (``NAME`` may be dotted: ``mod.Class.attr``), for
    ``--allow-global``. Imports the longest importable module prefix.

    Raises:
        ValueError: nothing of that name can be imported.
    """
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ValueError(f"cannot import {name!r} (expected MODULE.NAME, e.g. collections.OrderedDict)")


def check_file(path: str | os.PathLike[str], *, display: str | None = None,
               progress_stream: TextIO | None = None,
               allow_globals: Sequence[Any] = ()) -> FileReport:
    """Validate every sparse tensor of one checkpoint without building any invalid one.

    ``allow_globals`` are objects admitted by ``torch.load(weights_only=True)`` for this file
    (``torch.serialization.safe_globals``); a safetensors file needs none."""
    p = Path(path)
    report = FileReport(display if display is not None else str(path))
    if not p.exists():
        report.error = "no such file"
        return report
    if not p.is_file():
        report.error = "not a regular file"
        return report
    stream = progress_stream if progress_stream is not None else sys.stderr
    progress = _Progress(stream, report.path) if _wants_progress(p, stream) else None
    if is_export_archive(p):
        return _check_export_archive(p, report)
    try:
        is_safetensors = p.suffix.lower() == ".safetensors" or _looks_like_safetensors(p)
        if not is_safetensors and not _looks_like_torch_file(p):
            report.error = ("not a torch checkpoint (neither a zip archive nor a pickle) "
                            "nor a safetensors file")
            return report
        if progress is not None:
            progress.show(f"loading {p.stat().st_size / 2**20:.1f} MiB", force=True)
        allowed = (torch.serialization.safe_globals(list(allow_globals)) if allow_globals
                   else contextlib.nullcontext())
        with warnings.catch_warnings(), allowed:
            warnings.filterwarnings("ignore", message=".*support is in beta state.*")
            if is_safetensors:
                result = _load_safetensors(p)
            else:
                result = load_and_validate(
                    p, weights_only=True, map_location="cpu",
                    on_sparse=None if progress is None else progress.on_sparse,
                )
    except Exception as exc:
        report.error = _read_error(exc)
        return report
    finally:
        if progress is not None:
            progress.done()
    by = _checked_by(p)
    report.tensors = [_tensor_report(found, by) for found in result.found]
    report.tensors += [_module_report(m, by) for m in result.modules]
    report.dense = result.dense
    return report


def _check_export_archive(p: Path, report: FileReport) -> FileReport:
    """A ``torch.export`` archive: its ``safesparse`` operators' matrices, read without
    unpickling anything (:mod:`safesparse.files.export_archive`)."""
    report.kind = EXPORT_ARCHIVE
    try:
        result = read_export_archive(p)
    except Exception as exc:  # (ArchiveError, or the zip's own errors)
        report.error = f"{EXPORT_ARCHIVE}: {_read_error(exc)}"
        return report
    report.tensors = [_module_report(m, _checked_by(p)) for m in result.modules]
    report.dense = result.dense
    return report


def _checked_by(p: Path) -> str:
    """How a refusal names ``check`` and the file (by its base name) as its loader."""
    return f"check from {source_name(p.name)}"


def _module_report(m: ModuleMatrix, loaded_by: str | None = None) -> TensorReport:
    """A ``safesparse.nn`` module's saved matrix (its dense triple and geometry), reported as
    one sparse tensor: the key names the member an invalid one breaks (its geometry, when
    that is damaged)."""
    err = m.error
    if err is not None and loaded_by is not None:
        err = err.with_context(loaded_by=loaded_by)
    member = ("{compressed_indices,plain_indices,values}" if err is None or m.member is None
              else m.member)
    key = m.path(member) if m.keys else m.key(member)  # (a nested state dict: its key path)
    return TensorReport(
        key=key, key_path=[key], layout="?" if m.layout is None else layout_name(m.layout),
        shape=None if m.shape is None else list(m.shape), nnz=m.nnz, valid=err is None,
        invariant=getattr(err, "invariant", None),
        message=None if err is None else str(err),
        location=_jsonable(getattr(err, "location", None)))


def find_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint files under ``directory``, recursively, sorted: names ending in
    :data:`CHECKPOINT_SUFFIXES` (a ``.bin`` only if it starts like a torch file). Hidden
    directories are skipped and symbolic links to directories are not followed."""
    found: list[Path] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            suffix = path.suffix.lower()
            if suffix not in CHECKPOINT_SUFFIXES or not path.is_file():
                continue
            if suffix == ".bin":  # a .bin safetensors file is named .safetensors, by custom
                try:
                    if not _looks_like_torch_file(path):
                        continue
                except OSError:
                    pass  # unreadable: reported by check_file
            found.append(path)
    return found


def check_files(paths: Sequence[str | os.PathLike[str]],
                allow_globals: Sequence[Any] = ()) -> list[FileReport]:
    """Check each file; a directory stands for the checkpoint files in it (recursively)."""
    reports: list[FileReport] = []
    for path in paths:
        if Path(path).is_dir():
            files = find_checkpoints(path)
            if not files:
                reports.append(FileReport(
                    str(path), error="no checkpoint files ("
                    + ", ".join(CHECKPOINT_SUFFIXES) + ") in this directory"))
            reports += [check_file(f, allow_globals=allow_globals) for f in files]
        else:
            reports.append(check_file(path, allow_globals=allow_globals))
    return reports


def exit_code(reports: Sequence[FileReport]) -> int:
    if any(r.error is not None for r in reports):
        return EXIT_UNREADABLE
    if any(r.invalid or r.aliased for r in reports):
        return EXIT_INVALID
    return EXIT_OK


def summary(reports: Sequence[FileReport]) -> dict[str, int]:
    tensors = sum(len(r.tensors) for r in reports)
    invalid = sum(r.invalid for r in reports)
    return {
        "files": len(reports),
        "tensors": tensors,
        "valid": tensors - invalid,
        "invalid": invalid,
        "aliased": sum(r.aliased for r in reports),
        "dense": sum(r.dense for r in reports),
        "unreadable": sum(r.error is not None for r in reports),
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_text(reports: Sequence[FileReport], *, quiet: bool = False) -> str:
    """The human-readable report: a header per file, one line per sparse tensor, a summary.
    ``quiet``: only the files that cannot be read, the tensors that are not OK (under their
    file's header) and the summary."""
    lines: list[str] = []
    for report in reports:
        if report.error is not None:
            lines.append(f"{report.path}: cannot read: {report.error}")
            continue
        if quiet and report.ok:
            continue
        kind = "" if report.kind is None else f"{report.kind}, "
        lines.append(f"{report.path}: {kind}{_plural(len(report.tensors), 'sparse tensor')}, "
                     f"{_plural(report.dense, 'dense tensor')}")
        rows = [
            (
                t.display_key,
                t.layout,
                "?" if t.shape is None else str(tuple(t.shape)),
                "nnz ?" if t.nnz is None else f"nnz {t.nnz}",
                t.verdict,
            )
            for t in report.tensors
            if not (quiet and t.ok)
        ]
        widths = [max((len(row[i]) for row in rows), default=0) for i in range(4)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append("  " + "  ".join([*cells, row[4]]))
    s = summary(reports)
    counts = f"{s['valid']} valid, {s['invalid']} invalid"
    if s["aliased"]:
        counts += f", {s['aliased']} aliased"
    lines.append(
        f"summary: {_plural(s['files'], 'file')}, "
        f"{_plural(s['tensors'], 'sparse tensor')} checked ({counts}), "
        f"{_plural(s['dense'], 'dense tensor')}, {s['unreadable']} unreadable"
    )
    return "\n".join(lines)


def format_json(reports: Sequence[FileReport]) -> str:
    doc = {"files": [r.to_json() for r in reports], "summary": summary(reports)}
    return json.dumps(doc, indent=2)


def run_check(paths: Sequence[str], *, as_json: bool = False, out: TextIO | None = None,
              quiet: bool = False, allow_globals: Sequence[Any] = ()) -> int:
    reports = check_files(paths, allow_globals)
    stream = out if out is not None else sys.stdout
    code = exit_code(reports)
    try:
        text = format_json(reports) if as_json else format_text(reports, quiet=quiet)
        stream.write(text + "\n")
        stream.flush()
    except BrokenPipeError:  # `check ... | head`: the reader left; the status still counts
        _silence_stdout()
    return code


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at devnull so that the interpreter's final flush
    does not fail again (the recipe of the Python docs, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


# ---------------------------------------------------------------------------------------------
# Demo


TAMPERED_COLUMN = 10**9


def write_demo_checkpoint(path: str | os.PathLike[str]) -> None:
    """A small state dict: a valid BSR and a valid COO tensor, a tampered CSR tensor whose
    column index is 10**9 in a 3 x 3 matrix (built with torch's unchecked factory, the way a
    corrupted or malicious file would carry it), and a dense bias."""
    from .tensor.core import validate

    blocks = torch.tensor([[1.0, 2.0, 0.0, 0.0, 3.0, 4.0],
                           [5.0, 6.0, 0.0, 0.0, 7.0, 8.0],
                           [0.0, 0.0, 9.0, 1.0, 0.0, 0.0],
                           [0.0, 0.0, 2.0, 3.0, 0.0, 0.0]])
    bsr = unwrap(validate(blocks.to_sparse_bsr((2, 2))))
    coo = unwrap(validate(torch.tensor([[0.0, 1.5, 0.0, 0.0],
                                        [0.0, 0.0, 0.0, -2.0],
                                        [3.0, 0.0, 0.0, 0.0]]).to_sparse()))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*support is in beta state.*")
        tampered = _originals.sparse_csr_tensor(  # torch's own, also under enforce mode
            torch.tensor([0, 1, 2, 3]), torch.tensor([0, TAMPERED_COLUMN, 2]),
            torch.tensor([1.0, 2.0, 3.0]), (3, 3), check_invariants=False,
        )
    torch.save({"encoder.weight": bsr, "embedding.weight": coo, "decoder.weight": tampered,
                "decoder.bias": torch.zeros(3)}, path)


def run_demo(out: TextIO | None = None, keep: str | os.PathLike[str] | None = None) -> int:
    """Write the demo checkpoint, check it and explain what was caught.

    Args:
        out: where to write (default: standard output).
        keep: a directory to write ``checkpoint.pt`` into and leave it there (created if
            missing); by default it goes to a temporary directory, removed at the end, and no
            path that will not exist is printed.

    Returns:
        0 when the tampered tensor was caught, as it should be.
    """
    stream = out if out is not None else sys.stdout

    def say(text: str = "") -> None:
        stream.write(text + "\n")

    with contextlib.ExitStack() as stack:
        if keep is None:
            directory = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="safesparse-demo-")))
            shown = "checkpoint.pt"
            where = ("Wrote checkpoint.pt (in a temporary directory, removed when the demo "
                     "ends; `demo --keep DIR` keeps it), a state dict with")
        else:
            directory = Path(keep)
            directory.mkdir(parents=True, exist_ok=True)
            shown = str(directory / "checkpoint.pt")
            where = f"Wrote {shown}, a state dict with"
        path = directory / "checkpoint.pt"
        write_demo_checkpoint(path)
        say("safesparse demo: a checkpoint with two valid sparse tensors and a tampered one.")
        say()
        say(where)
        say("  encoder.weight    a valid BSR tensor")
        say("  embedding.weight  a valid COO tensor")
        say(f"  decoder.weight    a CSR tensor whose column index was changed to {TAMPERED_COLUMN}")
        say("  decoder.bias      a dense tensor")
        say()
        say(f"$ python -m safesparse check {shown}")
        report = check_file(path, display=shown)
        say(format_text([report]))
        say()
    bad = [t for t in report.tensors if not t.ok]
    caught = (
        report.error is None
        and len(report.tensors) == 3
        and [t.key for t in bad] == ["['decoder.weight']"]
        and bad[0].invariant == "5.5"
    )
    if not caught:
        say("demo: unexpected result; the tampered tensor was not reported as expected")
        return EXIT_INVALID
    say("What was caught:")
    say(f"  ['decoder.weight'] stores column {TAMPERED_COLUMN} in a 3 x 3 matrix: invariant 5.5")
    say("  (plain indices < n_plain) is broken, at the position the line above names.")
    say("  torch.load(f, weights_only=True) accepts this file without complaint, and the first")
    say("  `weight @ x` reads memory far past the end of x: the process dies with a segfault.")
    say("  safesparse validated each tensor's index members as they came out of the file, before")
    say("  torch built a sparse tensor from them; the tampered one was never built, so no torch")
    say("  kernel touched it. `check` exits 1 on such a file; ss.load raises InvariantError.")
    say()
    say("Check your own files: python -m safesparse check model.pt checkpoints/ [--json]")
    stream.flush()
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Entry point


def _version() -> str:
    from . import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safesparse",
        description="Validate the sparse tensors of PyTorch checkpoints before using them.",
    )
    parser.add_argument("--version", action="version", version=f"safesparse {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = sub.add_parser(
        "check",
        help="validate every sparse tensor in checkpoint files",
        description=(
            "Load each FILE with torch.load(weights_only=True, map_location='cpu'), validating "
            "every sparse tensor before torch builds it; a .safetensors file is read with no "
            "pickle at all. A directory is searched recursively "
            "for " + ", ".join(CHECKPOINT_SUFFIXES) + " files. Exit status: 0 all valid, 1 any "
            "invalid (or sharing its index storage with another tensor), 2 a file cannot be "
            "read."
        ),
    )
    check.add_argument("files", nargs="+", metavar="PATH",
                       help="checkpoint written by torch.save, a .safetensors file, or a "
                       "directory of them")
    check.add_argument("--json", action="store_true", help="print one JSON document")
    check.add_argument("--quiet", "-q", action="store_true",
                       help="print only the failures and the summary (text output)")
    check.add_argument("--allow-global", action="append", default=[], metavar="MODULE.NAME",
                       help="admit this global under torch.load(weights_only=True) (imports "
                       "MODULE; only for files you trust to name it); repeatable")
    sub.add_parser(
        "run", add_help=False,
        help="run a program with enforce mode on: run [--debug] script.py|-m module [args...]",
    )  # parsed by safesparse.enforcement.runner (see main)
    demo = sub.add_parser(
        "demo",
        help="check a small checkpoint with a valid and a tampered tensor",
        description="Write a small checkpoint with a tampered CSR tensor and check it.",
    )
    demo.add_argument("--keep", metavar="DIR", default=None,
                      help="write checkpoint.pt into DIR and keep it (default: a temporary "
                      "directory, removed at the end)")
    sub.add_parser(
        "info",
        help="say which kernels compute the sparse products on CPU, and why",
        description="Print the versions and which kernels run the block products on CPU: "
        "the native ones (instruction set, threads) or torch ops (and why: not built, CPU, "
        "SAFESPARSE_NATIVE=0).",
    )
    return parser


def run_info(out: TextIO | None = None) -> int:
    """``python -m safesparse info``: the versions and which kernels compute the block
    products on CPU (native, with the instruction set and the threads, or torch ops and why)."""
    from .kernels import native

    out = sys.stdout if out is None else out
    st = native.status()
    out.write(f"safesparse {_version()}, torch {torch.__version__}\n")
    out.write(f"block kernels on CPU: {st.describe()}\n")
    for line in _native_origin(native.library_path()):
        out.write(f"  {line}\n")
    out.write(f"bfloat16 products on CPU: {native.bf16_describe()}\n")
    out.write(f"threads: {torch.get_num_threads()} (torch.get_num_threads(); one in a forked "
              "child)\n")
    return EXIT_OK


def _native_origin(library: Path | None) -> list[str]:
    """Where the native library came from: its path and build time, whether it sits in a
    source checkout (an in-place build) or an installed package, and whether it is older than
    the C sources beside it (an in-place build is kept by a reinstall that could not compile,
    ``CC=false``, and loaded as it is); an installed library's sources are not compared (the
    install writes them after the library)."""
    if library is None:
        return []
    built = library.stat().st_mtime
    when = datetime.datetime.fromtimestamp(built, datetime.timezone.utc)
    checkout = (library.parents[2] / "setup.py").is_file()
    lines = [f"library: {library} (built {when:%Y-%m-%d %H:%M} UTC; "
             f"{'an in-place build in a source checkout' if checkout else 'installed'})"]
    sources = sorted((library.parent / "csrc").glob("*.[ch]"))
    if sources and not checkout:  # (pip writes an installed package's sources after the
        # library: their times say nothing; an installed library is rebuilt whole or not at all)
        lines.append(f"installed with its C sources ({', '.join(s.name for s in sources)}): "
                     "built by the install that wrote them")
        return lines
    newer = [src.name for src in sources if src.stat().st_mtime > built]
    if newer:
        lines.append(f"STALE: {', '.join(newer)} changed after this build; the old kernels "
                     "run (a reinstall that could not compile, CC=false, keeps it): rebuild "
                     "with `python setup.py build_ext --inplace` or `pip install .`")
    elif sources:
        lines.append(f"up to date with its C sources ({', '.join(s.name for s in sources)})")
    else:
        lines.append("its C sources are not installed beside it: not compared")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the program's own arguments are not ours to parse
        from .enforcement.runner import main as run_main

        return run_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        # torch flags CSR/CSC/BSR/BSC as beta on first use; not news to someone vetting files
        warnings.filterwarnings("ignore", message=".*support is in beta state.*")
        if args.command == "check":
            try:
                allowed = [resolve_global(name) for name in args.allow_global]
            except ValueError as exc:
                parser.error(f"--allow-global: {exc}")  # exits with status 2
            return run_check(args.files, as_json=args.json, quiet=args.quiet,
                             allow_globals=allowed)
        if args.command == "info":
            return run_info()
        if args.command == "demo":
            try:
                return run_demo(keep=args.keep)
            except BrokenPipeError:
                _silence_stdout()
                return EXIT_OK
    raise AssertionError(f"unknown command {args.command!r}")  # argparse refuses it first


__all__ = [
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_UNREADABLE",
    "FileReport",
    "TensorReport",
    "check_file",
    "check_files",
    "find_checkpoints",
    "format_json",
    "format_text",
    "main",
    "resolve_global",
    "run_check",
    "run_demo",
    "run_info",
    "write_demo_checkpoint",
]

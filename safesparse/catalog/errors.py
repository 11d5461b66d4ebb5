"""The error raised for every violated invariant."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

import torch

from .invariants import hint_for, layout_name, lookup


class InvariantError(ValueError, RuntimeError):
    """A sparse tensor breaks an invariant of the catalog.

    Subclasses both :class:`ValueError` and :class:`RuntimeError`, so code written against
    torch's own ``RuntimeError`` keeps working.

    Attributes:
        layout: the sparse layout the invariant belongs to.
        invariant: the catalog id, e.g. ``"5.6"``.
        detail: where and how it is broken (may be empty for metadata invariants).
        location: machine-readable location fields (``batch``, ``row``, ``position``, ``value``...).
        op: the operation that produced or received the tensor (debug mode), else ``None``.
        path: the key path inside a loaded object (``ss.load``), else ``None``.
        built_by: the call that built the tensor and where it was made, e.g.
            ``"torch.sparse_csr_tensor at train.py:12"`` (enforce mode's routes), else ``None``.
        built_in: the module whose code made that call, e.g. ``"torch_geometric.edge_index"``
            (enforce mode's routes; it chooses the repair hint), else ``None``.
        loaded_by: the loader and the file the tensor came from, e.g.
            ``"ss.load from 'model.pt'"``, else ``None``.
        explanation: the violation in plain words, beside the catalog's terms (every index
            invariant, 5.x, found by validation), e.g. *column 1000000000 is out of range for
            3 columns*; else ``""``.
        statement: the invariant in words (from the catalog).
        hint: how to repair such data, where the catalog has a standard way, else ``""``; the
            hint fits the context (:func:`~safesparse.catalog.invariants.hint_for`: data read
            from a file, torch's index conversions, a library that built the tensor).

    ``str(err)`` is a short first line saying what is wrong and where, then the invariant
    and the repair hint on lines of their own. The first line is ``[<LAYOUT> <id>]
    <explanation> (<detail>)`` for the index invariants (the violation in plain words, then
    its location), ``[<LAYOUT> <id>] <detail>`` for the others (the statement when there is
    no detail), followed by the key path, the loader and file, and the operation or the
    building call where there are any; then ``invariant: <statement>`` (when the first line
    did not state it) and ``to repair: <hint>`` (where the catalog has one), e.g.::

        [CSR 5.5] column 1000000000 is out of range for 3 columns (row 1, position 1:
        col_indices[1] = 1000000000, n_plain = 3)
        invariant: plain indices are < n_plain
        to repair: the tensor's size is smaller than its indices; pass a larger size or drop
        those entries

    (the first line is one line; it is wrapped here).

    Args:
        layout: the sparse layout (``torch.sparse_csr`` ...).
        invariant: the catalog id (a key of ``CATALOG["compressed"]`` or ``CATALOG["coo"]``).
        detail: where and how it is broken.
        location: machine-readable location fields.
        op: the operation's name (debug mode).
        path: the key path (``ss.load``).
        built_by: the building call and its place (enforce mode); named in the message instead
            of ``op``.
        built_in: the module of the code that made the building call (enforce mode).
        loaded_by: the loader and the file (``ss.load``, ``torch.load`` in enforce mode,
            ``safesparse.safetensors.load_file``).
        explanation: the violation in plain words (:func:`safesparse.catalog.invariants.explain`).

    Raises:
        KeyError: ``invariant`` is not an id of ``layout``'s catalog family.
        TypeError: ``layout`` is not a sparse layout.
    """

    __module__ = "safesparse"  # printed as ``safesparse.InvariantError``; pickled by that name

    def __init__(
        self,
        layout: torch.layout,
        invariant: str,
        detail: str = "",
        *,
        location: Mapping[str, Any] | None = None,
        op: str | None = None,
        path: str | None = None,
        built_by: str | None = None,
        explanation: str = "",
        loaded_by: str | None = None,
        built_in: str | None = None,
    ) -> None:
        self.layout = layout
        self.invariant = invariant
        self.detail = detail
        self.location: dict[str, Any] = dict(location or {})
        self.op = op
        self.path = path
        self.built_by = built_by
        self.explanation = explanation
        self.loaded_by = loaded_by
        self.built_in = built_in
        super().__init__(self._message())

    @property
    def statement(self) -> str:
        """The invariant in words, from the catalog."""
        return lookup(self.layout, self.invariant).text

    @property
    def hint(self) -> str:
        """How to repair such data (from the catalog), or ``""``."""
        return hint_for(self.layout, self.invariant, self.loaded_by, self.op, self.built_in)

    def _message(self) -> str:
        head = f"[{layout_name(self.layout)} {self.invariant}] "
        if self.explanation:
            what = self.explanation + (f" ({self.detail})" if self.detail else "")
        else:
            what = self.detail or self.statement
        parts = [what]
        if self.path is not None:
            parts.append(f" (at {self.path})")
        if self.loaded_by is not None:
            parts.append(f" (loaded by {self.loaded_by})")
        if self.built_by is not None:
            parts.append(f" (built by {self.built_by})")
        elif self.op is not None:
            parts.append(f" (in op {self.op})")
        lines = [head + _fit(parts, FIRST_LINE_MAX - len(head))]
        if self.explanation or self.detail:
            lines.append(f"invariant: {self.statement}")
        if self.hint:
            lines.append(f"to repair: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._message()

    def with_context(self, *, op: str | None = None, path: str | None = None,
                     built_by: str | None = None,
                     loaded_by: str | None = None,
                     built_in: str | None = None) -> InvariantError:
        """A copy that also names the operation (``op``), key path (``path``), building
        call (``built_by``) and its module (``built_in``) or loader and file (``loaded_by``);
        the layout, id, detail and location are kept."""
        return InvariantError(
            self.layout,
            self.invariant,
            self.detail,
            location=self.location,
            op=op if op is not None else self.op,
            path=path if path is not None else self.path,
            built_by=built_by if built_by is not None else self.built_by,
            explanation=self.explanation,
            loaded_by=loaded_by if loaded_by is not None else self.loaded_by,
            built_in=built_in if built_in is not None else self.built_in,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_error,
            (self.layout, self.invariant, self.detail, self.location, self.op, self.path,
             self.built_by, self.explanation, self.loaded_by, self.built_in),
        )


#: The longest first line of an :class:`InvariantError` (what is wrong and where).
FIRST_LINE_MAX: Final = 200
_ELLIPSIS: Final = "..."
_KEEP: Final = 16  # the fewest characters a shortened part keeps (beside the ellipsis)


def _fit(parts: list[str], limit: int) -> str:
    """``parts`` joined, at most ``limit`` characters: while too long, the longest part is
    shortened in its middle (``head...tail``). A part is long only in rare cases (a key path
    of hundreds of characters, a file's base name near the file system's 255); the error's
    attributes keep every part whole."""
    parts = list(parts)
    while (excess := sum(map(len, parts)) - limit) > 0:
        i = max(range(len(parts)), key=lambda k: len(parts[k]))
        part = parts[i]
        keep = max(len(part) - excess - len(_ELLIPSIS), _KEEP)
        if keep + len(_ELLIPSIS) >= len(part):
            break  # every part is as short as it gets (a limit below a few dozen)
        tail = keep // 2
        parts[i] = part[:keep - tail] + _ELLIPSIS + part[len(part) - tail:]
    return "".join(parts)


def _rebuild_error(
    layout: torch.layout,
    invariant: str,
    detail: str,
    location: dict[str, Any],
    op: str | None,
    path: str | None,
    built_by: str | None = None,
    explanation: str = "",
    loaded_by: str | None = None,
    built_in: str | None = None,
) -> InvariantError:
    return InvariantError(layout, invariant, detail, location=location, op=op, path=path,
                          built_by=built_by, explanation=explanation, loaded_by=loaded_by,
                          built_in=built_in)


def source_name(f: object) -> str:
    """How a message names a file given to a loader: a path by its base name, quoted (the
    caller has the path; a first line stays short), a file object by its name's base name
    (or its type)."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        return repr(os.path.basename(path) or path)
    name = getattr(f, "name", None)
    return repr(os.path.basename(name) or name) if isinstance(name, str) else (
        f"a {type(f).__name__}")


__all__ = [
    "FIRST_LINE_MAX",
    "InvariantError",
    "source_name",
]

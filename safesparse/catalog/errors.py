"""The error raised for every violated invariant."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Final

import torch

from ..base.layouts import layout_name
from .invariants import hint_for, lookup


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
        # what is wrong and where (the location: member, position, value) ...
        if self.explanation:
            what = [self.explanation] + ([f" ({self.detail})"] if self.detail else [])
        else:
            what = [self.detail or self.statement]
        # ... then where the data came from (the provenance), which shortens first
        context = []
        if self.path is not None:
            context.append(f" (at {self.path})")
        if self.loaded_by is not None:
            context.append(f" (loaded by {self.loaded_by})")
        if self.built_by is not None:
            context.append(f" (built by {self.built_by})")
        elif self.op is not None:
            context.append(f" (in op {self.op})")
        full = "".join(what + context)
        first = _fit(what, context, FIRST_LINE_MAX - len(head))
        lines = [head + first]
        if first != full:  # the whole of it, on a line of its own
            lines.append(f"in full: {full.strip()}")
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


def _fit(what: list[str], context: list[str], limit: int) -> str:
    """The first line after its ``[<LAYOUT> <id>]``, at most ``limit`` characters.

    ``what`` (the explanation, then the location in parentheses: member, position, value) is
    kept whole wherever it fits; ``context`` (the key path, the loader and file, the building
    call or op: each `` (<label> <text>)``) is what shortens, each part at a word boundary,
    whole words only, keeping its end (the member of a key path, split before ``.`` and
    ``[``; the file a loader read; the place of a building call), ``...`` standing for what
    was left out: first the key path, then the call, then the loader and file; a part with no
    room for a word keeps its label only, or is left out. Only then the explanation, and last
    the location, lose words from their end. The message's ``in full:`` line and the error's
    attributes keep every part whole."""
    whole = [*what, *context]
    parts = list(whole)
    excess = sum(map(len, parts)) - limit
    rank = {" (at ": 0, " (built by ": 1, " (in op ": 1, " (loaded by ": 2}
    order = sorted(range(len(what), len(parts)),
                   key=lambda i: next(r for k, r in rank.items() if parts[i].startswith(k)))
    # each context part keeps a word while another can give, then its label only; then the
    # what; then the labels go too
    passes = [(list(order), 1), (list(order), 0), (list(range(len(what))), 0),
              (list(order), -1)]
    order += range(len(what))
    for indices, floor in passes:
        for i in indices:
            if excess <= 0:
                break
            labelled = i >= len(what)
            least = len(_shorten(parts[i], 0, labelled=labelled, words=floor))
            short = _shorten(parts[i], max(len(parts[i]) - excess, least), labelled=labelled,
                             words=floor)
            excess -= len(parts[i]) - len(short)
            parts[i] = short
    # what was given beyond the need goes back, the last to shorten first
    for i in reversed(order):
        if excess >= 0:
            break
        longer = _shorten(whole[i], len(parts[i]) - excess, labelled=i >= len(what))
        if len(longer) > len(parts[i]):
            excess += len(longer) - len(parts[i])
            parts[i] = longer
    return "".join(parts)


def _shorten(part: str, room: int, *, labelled: bool, words: int = 0) -> str:
    """``part`` in at most ``room`` characters, whole words only (see :func:`_fit`): a
    context part (``labelled``) keeps its label (``at``, ``loaded by`` ...) and the words at
    its end that fit, the explanation and the location the words at their beginning; a part
    in parentheses keeps them. ``words``: at least that many words are kept, whatever
    ``room`` says (0: a context part keeps its label; -1: it may go whole)."""
    if len(part) <= room:
        return part
    bracketed = part.startswith(" (") and part.endswith(")")
    start, end, text = (" (", ")", part[2:-1]) if bracketed else ("", "", part)
    path = False
    if labelled:
        label, _, text = text.partition(" ")
        if label in ("loaded", "built", "in"):  # two-word labels
            second, _, text = text.partition(" ")
            label = f"{label} {second}"
        start += f"{label} "
        path = label == "at"
    pieces = [w for w in (re.split(r"(?=[.\[])", text) if path else text.split(" ")) if w]
    glue = "" if path else " "
    if labelled:  # the end kept: "... <words>"
        pieces = pieces[::-1]

    def joined(kept: list[str]) -> str:
        if not labelled:
            return f"{start}{glue.join(kept)} {_ELLIPSIS}{end}"
        tail = glue.join(kept[::-1]).lstrip(".")
        return f"{start}{_ELLIPSIS}{glue if not path else ''}{tail}{end}"

    kept: list[str] = []
    for w in pieces:
        if len(kept) >= words and len(joined([*kept, w])) > room:
            break
        kept.append(w)
    if kept:
        return joined(kept)
    shortest = f"{start}{_ELLIPSIS}{end}"
    return shortest if labelled and (words >= 0 or len(shortest) <= room) else ""


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

"""The invariant catalog: the single source of truth for invariant ids and statements.

Every error message, the generated table in ``docs/invariants.md`` and the per-id tests read
their wording from :data:`CATALOG`. The checks themselves live in
:mod:`safesparse.engine.validation`; this module only says *what* must hold.

Compressed layouts (CSR, CSC, BSR, BSC) share one family of ids; "compressed" means the
``crow_indices`` of CSR/BSR or the ``ccol_indices`` of CSC/BSC, "plain" the other index member.
M is the number of batch dims, N the number of dense dims; CSR/CSC are the blocked case with
blocksize (1, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import torch

from ..base.layouts import COMPRESSED_LAYOUTS, layout_name

Family = Literal["compressed", "coo"]


@dataclass(frozen=True)
class Invariant:
    """One invariant of the catalog.

    Attributes:
        family: ``"compressed"`` (CSR, CSC, BSR, BSC) or ``"coo"``.
        id: the catalog id, e.g. ``"5.6"``; errors start with ``[<LAYOUT> <id>]``.
        text: the invariant in words.
        hint: how to repair data that breaks it, where there is a standard way (SciPy and torch
            spellings), else ``""``. :class:`~safesparse.InvariantError` messages end with it.
        words: the index invariants' (5.x) violations in plain words: ``(case, template)``
            pairs, ``""`` the usual case; :func:`explain` fills them in.
    """

    family: Family
    id: str
    text: str
    hint: str = ""
    words: tuple[tuple[str, str], ...] = ()

    def explain(self, case: str = "", **fields: object) -> str:
        """The violation in plain words: the template for ``case`` (``""``: the usual one)
        filled with ``fields`` (see :func:`explain`, which adds the layout's nouns)."""
        return dict(self.words)[case].format(**fields)


def _table(
    family: Family,
    rows: list[tuple[str, str]],
    hints: dict[str, str] | None = None,
    words: dict[str, dict[str, str]] | None = None,
) -> dict[str, Invariant]:
    hints, words = hints or {}, words or {}
    ids = {iid for iid, _ in rows}
    unknown = (set(hints) | set(words)) - ids
    if unknown:
        raise ValueError(f"hints or words for unknown invariants: {sorted(unknown)}")
    return {
        iid: Invariant(family, iid, text, hints.get(iid, ""),
                       tuple(words.get(iid, {}).items()))
        for iid, text in rows
    }


# Repair hints that several ids share (both families speak of the same mistakes).
_HINT_SIZE_TOO_SMALL = (
    "the tensor's size is smaller than its indices; pass a larger size or drop those entries"
)
_HINT_NEGATIVE = (
    "indices count from 0 and never from the end as in Python: drop those entries, or add "
    "the dimension's size to them if they were meant to count from the end"
)
_HINT_RUNNING_TOTALS = (
    "compressed indices are running totals of the entries per row (column for CSC/BSC): "
    "rebuild them from the per-line counts as torch.cat([counts.new_zeros(1), "
    "counts.cumsum(0)]), or build the tensor as COO and convert it (.to_sparse_csr(), "
    "_csc(), _bsr(blocksize), _bsc(blocksize))"
)
_HINT_ONE_DEVICE = "move every member to one device with .to(device) before building the tensor"
_HINT_INDEX_DTYPE = "convert both index tensors to one dtype, e.g. .to(torch.int64)"


COMPRESSED: Final[dict[str, Invariant]] = _table(
    "compressed",
    [
        ("1.1", "compressed indices dtype equals the index dtype"),
        ("1.2", "plain indices dtype equals the index dtype (the two index dtypes agree)"),
        ("1.3", "the index dtype is int32 or int64 (int32 only if nnz and both block extents fit)"),
        ("1.4", "values dtype equals the requested dtype"),
        ("1.5", "values dtype is one torch supports for this layout"),
        ("2.1", "compressed indices are a strided tensor"),
        ("2.2", "plain indices are a strided tensor"),
        ("2.3", "values are a strided tensor"),
        ("2.4", "the layout is the requested sparse compressed layout"),
        (
            "3.1",
            "size == batchsize + (n_compressed * block0, n_plain * block1) + densesize, "
            "with the sparse sizes divisible by the blocksize and at most 2**63 - 1 elements",
        ),
        ("3.2", "compressed indices have M + 1 dims"),
        ("3.3", "plain indices have M + 1 dims"),
        ("3.4", "values have M + 1 + N dims (CSR/CSC) or M + 3 + N dims (BSR/BSC)"),
        ("3.5", "compressed indices are contiguous"),
        ("3.6", "plain indices are contiguous"),
        (
            "3.7",
            "values are contiguous, or (BSR/BSC) contiguous after swapping the two block dims",
        ),
        ("3.8", "compressed indices shape == batchsize + (n_compressed + 1,)"),
        ("3.9", "plain indices shape == batchsize + (nnz,)"),
        ("3.10", "values shape == batchsize + (nnz,) + blocksize + densesize"),
        ("4.1", "the device is one torch supports for the layout"),
        ("4.2", "compressed indices are on the tensor's device"),
        ("4.3", "plain indices are on the tensor's device"),
        ("4.4", "values are on the tensor's device"),
        ("5.1", "compressed[..., 0] == 0"),
        ("5.2", "compressed[..., -1] == nnz"),
        ("5.3", "0 <= compressed[..., i] - compressed[..., i-1] <= n_plain"),
        ("5.4", "plain indices are >= 0"),
        ("5.5", "plain indices are < n_plain"),
        (
            "5.6",
            "plain indices are sorted and distinct within each compressed row/column "
            "of each batch",
        ),
    ],
    {
        "1.1": _HINT_INDEX_DTYPE,
        "1.2": _HINT_INDEX_DTYPE,
        "1.3": "convert the index tensors with .to(torch.int64)",
        "3.1": (
            "pass the size the indices were built for, or size=None to estimate it from them; "
            "for BSR/BSC the two sparse sizes are multiples of the blocksize"
        ),
        "4.2": _HINT_ONE_DEVICE,
        "4.3": _HINT_ONE_DEVICE,
        "4.4": _HINT_ONE_DEVICE,
        "5.1": _HINT_RUNNING_TOTALS,
        "5.2": _HINT_RUNNING_TOTALS,
        "5.3": (
            "check the size first (a row cannot hold more entries than there are columns, "
            "nor a column more than there are rows); otherwise " + _HINT_RUNNING_TOTALS
        ),
        "5.4": _HINT_NEGATIVE,
        "5.5": _HINT_SIZE_TOO_SMALL,
        "5.6": (
            "canonicalise the matrix first: from SciPy, ss.from_scipy(m, canonicalize=True) "
            "or m.sum_duplicates() (or m.sort_indices() when there are no duplicates); in "
            "torch, build it as COO, call .coalesce(), then .to_sparse_csr() (or _csc(), "
            "_bsr(blocksize), _bsc(blocksize))"
        ),
    },
    {
        # The layout's nouns ({line}: "row", {other}: "column", {lines}, {others}, {n_others}:
        # "3 columns", {cname}: "crow_indices"), then what the diagnosis found.
        "5.1": {"": "{cname} must begin with 0, not {value}"},
        "5.2": {"": "{cname} must end with the number of stored entries, {nnz}, not {value}"},
        "5.3": {
            "": "{line} {index} holds {count} entries, but a {line} has only {n_others}",
            "negative": "{cname} decreases at {line} {index}: {previous} then {value}",
            "outside": "{cname}[{position}] = {offset} lies outside the {nnz} stored entries",
        },
        "5.4": {"": "{other} {value} is negative (indices count from 0)"},
        "5.5": {"": "{other} {value} is out of range for {n_others}"},
        "5.6": {
            "": "{other} {value} comes after {other} {previous} in {line} {index}",
            "duplicate": "{other} {value} appears twice in {line} {index}",
        },
    },
)

COO: Final[dict[str, Invariant]] = _table(
    "coo",
    [
        ("1.1", "indices dtype is int64"),
        ("1.2", "values dtype is one torch supports (and equals the requested dtype)"),
        ("2.1", "indices are a strided tensor"),
        ("2.2", "values are a strided tensor"),
        ("3.1", "indices have 2 dims"),
        (
            "3.2",
            "sparse_dim + dense_dim == len(size), with sparse_dim >= 1, and size is "
            "non-negative with at most 2**63 - 1 elements",
        ),
        ("3.3", "indices shape == (sparse_dim, nnz)"),
        ("3.4", "values shape == (nnz,) + size[sparse_dim:]"),
        ("4.1", "the device is one torch supports for the layout"),
        ("4.2", "indices and values are on the same device"),
        ("5.1", "indices are >= 0"),
        ("5.2", "indices[d] < size[d] for each sparse dim d"),
        (
            "5.3",
            "when the tensor is marked coalesced, indices are sorted lexicographically "
            "with no duplicates",
        ),
    ],
    {
        "1.1": "convert the indices with .to(torch.int64)",
        "4.2": _HINT_ONE_DEVICE,
        "5.1": _HINT_NEGATIVE,
        "5.2": _HINT_SIZE_TOO_SMALL,
        "5.3": (
            "build it with is_coalesced=None or False and call .coalesce() (sums duplicates "
            "and sorts the indices), or canonicalise the source first: in SciPy, "
            "m.sum_duplicates()"
        ),
    },
    {
        # Cases: "" (any sparse_dim), "vector" (1 sparse dim), "matrix" (2: {noun} is "row" or
        # "column", {n_nouns} "5 columns"); then what the diagnosis found.
        "5.1": {
            "": "index {value} along dim {dim} is negative (indices count from 0)",
            "matrix": "{noun} {value} is negative (indices count from 0)",
            "vector": "index {value} is negative (indices count from 0)",
        },
        "5.2": {
            "": "index {value} along dim {dim} is out of range for size {bound}",
            "matrix": "{noun} {value} is out of range for {n_nouns}",
            "vector": "index {value} is out of range for size {bound}",
            "uint64": "index {value} along dim {dim} (uint64) is larger than any size can be",
        },
        "5.3": {
            "": "index {index} comes after {previous}, but the tensor is marked coalesced "
                "(sorted)",
            "duplicate": "index {index} appears twice, but the tensor is marked coalesced",
            "rows": "row {index} comes after row {previous}, but the conversion to CSR needs "
                    "the rows sorted",
        },
    },
)

#: The repair hint for index data that came from a file or a state dict (SPEC 2: a corrupt
#: file is not "pass a larger size"): the shape and index invariants (3.x, 5.x) of data that
#: the reading code did not build. ``{source}`` is "file" or "state dict".
_HINT_LOADED = (
    "the {source}'s index data is corrupt or belongs to another model: load the checkpoint "
    "saved by this model (unmodified), or save it again from the model that wrote it; do "
    "not resize the model to fit it"
)
#: How the loaders name themselves in ``InvariantError.loaded_by`` when the data came from a
#: state dict rather than from a file (``SparseLinear.load_state_dict`` ...).
STATE_DICT_LOADER = "load_state_dict"


_HINT_CONVERT_OFFSETS = (
    "{cname} must be running totals of the entries per {line}, from 0 up to the number of "
    "{other} indices: rebuild them before converting, from the sorted {line} indices with "
    "torch._convert_indices_from_coo_to_csr(indices, n_{lines}), or from the per-{line} counts "
    "as torch.cat([counts.new_zeros(1), counts.cumsum(0)])"
)
#: Repair hints that fit the caller better than the catalog's own, by context
#: ``(family, id, context)``. Contexts (:func:`hint_context`): ``"conversion"``, torch's index
#: conversions (``torch._convert_indices_from_coo_to_csr`` / ``_csr_to_coo`` by any route: the
#: caller converts bare index tensors and built no tensor); a module name, the library code
#: that built the tensor under enforce mode (``InvariantError.built_in``). Filled with the
#: layout's nouns (``{line}``, ``{other}``, ``{lines}``, ``{others}``, ``{cname}``, ``{by}``:
#: "row" or "col", ``{other_by}``, ``{to_layout}``: "to_sparse_csr" ...).
CONTEXT_HINTS: Final[dict[tuple[Family, str, str], str]] = {
    ("coo", "5.1", "conversion"): (
        "row indices count from 0: drop the entries with a negative row before converting"
    ),
    ("coo", "5.2", "conversion"): (
        "size is the number of rows the offsets are for: pass the matrix's row count (more "
        "than the largest row index), or drop the entries whose row is out of range before "
        "converting"
    ),
    ("coo", "5.3", "conversion"): (
        "sort the row indices (stable) / coalesce before converting: rows, perm = "
        "torch.sort(rows, stable=True) keeps each row's columns in order (then take cols[perm] "
        "and values[perm]), or coalesce the COO tensor the rows come from (.coalesce())"
    ),
    ("compressed", "5.1", "conversion"): _HINT_CONVERT_OFFSETS,
    ("compressed", "5.2", "conversion"): _HINT_CONVERT_OFFSETS,
    ("compressed", "5.3", "conversion"): _HINT_CONVERT_OFFSETS,
    ("compressed", "5.6", "torch_geometric.edge_index"): (
        "PyG's EdgeIndex built this tensor with its {others} unsorted within a {line}: an "
        "EdgeIndex sorted by {other_by} (sort_order='{other_by}') is re-sorted by {by} with an "
        "unstable sort, which scrambles each {line}'s {others} (edges sorted by {by} only, not "
        "coalesced, give the same); convert through COO instead, "
        "ei.to_sparse_coo(value).coalesce().{to_layout}() (sorts both indices, sums duplicate "
        "edges), or re-sort by {by} with a stable sort first, EdgeIndex(ei.as_tensor(), "
        "sparse_size=ei.sparse_size()).sort_by('{by}', stable=True)[0].{to_layout}()"
    ),
}


def hint_context(op: str | None, built_in: str | None) -> str | None:
    """The context of :data:`CONTEXT_HINTS` that an error raised in ``op`` (the operation)
    for a tensor built by code of module ``built_in`` falls in, or ``None``."""
    if op is not None and "._convert_indices_from_" in op:
        return "conversion"
    return built_in


def hint_for(layout: torch.layout, invariant_id: str, loaded_by: str | None = None,
             op: str | None = None, built_in: str | None = None) -> str:
    """The repair hint that fits where the data came from: the loaded-data hint for the
    shape and index invariants (3.x, 5.x) of data a loader read (``loaded_by``: a file, or a
    state dict when it names :data:`STATE_DICT_LOADER`); the hint of
    :data:`CONTEXT_HINTS` for the operation ``op`` (torch's index conversions) or the module
    ``built_in`` whose code built the tensor, where there is one; else the catalog's hint
    (data built in the program)."""
    inv = lookup(layout, invariant_id)
    if loaded_by is not None and invariant_id.startswith(("3.", "5.")):
        source = "state dict" if STATE_DICT_LOADER in loaded_by.split(" ", 1)[0] else "file"
        return _HINT_LOADED.format(source=source)
    context = hint_context(op, built_in)
    special = CONTEXT_HINTS.get((inv.family, invariant_id, context)) if context else None
    if special is None:
        return inv.hint
    return special.format(**_hint_nouns(layout))


#: What each context of :data:`CONTEXT_HINTS` is, in docs/protecting.md's words.
_CONTEXT_TITLES: Final = {
    "conversion": "torch's index conversions (`torch._convert_indices_from_coo_to_csr` / "
                  "`_csr_to_coo`, every route)",
    "torch_geometric.edge_index": "a tensor built by PyG's `EdgeIndex.to_sparse_csr()` / "
                                  "`to_sparse_csc()` (`torch_geometric.edge_index`)",
}


def render_context_hints() -> str:
    """The hints of :data:`CONTEXT_HINTS` as Markdown (shown for CSR and COO);
    docs/protecting.md embeds exactly this text."""
    lines: list[str] = []
    for context, title in _CONTEXT_TITLES.items():
        lines += [f"- {title}:"]
        ids: dict[tuple[str, str], list[str]] = {}  # (layout name, hint) -> ids sharing it
        for (family, iid, where), text in CONTEXT_HINTS.items():
            if where == context:
                layout = torch.sparse_coo if family == "coo" else torch.sparse_csr
                key = (layout_name(layout), text.format(**_hint_nouns(layout)))
                ids.setdefault(key, []).append(iid)
        lines += [f"  - **[{name} {' / '.join(found)}]** {text}"
                  for (name, text), found in ids.items()]
    return "\n".join(lines) + "\n"


def _hint_nouns(layout: torch.layout) -> dict[str, str]:
    """The nouns :data:`CONTEXT_HINTS` are filled with (compressed layouts; none for COO)."""
    if layout not in _NOUNS:
        return {}
    line, other, cname = _NOUNS[layout]
    by = "row" if cname == "crow_indices" else "col"
    return {"line": line, "other": other, "lines": f"{line}s", "others": f"{other}s",
            "cname": cname, "by": by, "other_by": "col" if by == "row" else "row",
            "to_layout": f"to_sparse_{layout_name(layout).lower()}"}


class Catalog(dict[Family, dict[str, Invariant]]):
    """The invariant catalog: ``CATALOG[family][id]`` is an :class:`Invariant`.

    ``family`` is ``"compressed"`` (CSR, CSC, BSR, BSC: 29 invariants, ``"1.1"`` to ``"5.6"``)
    or ``"coo"`` (13 invariants), each table in id order. A ``dict``, read-only by
    convention; the tables in ``docs/invariants.md`` are rendered from it.

    Example::

        ss.CATALOG["compressed"]["5.6"].text  # the statement of [CSR 5.6], [BSC 5.6], ...
        ss.CATALOG["coo"]["5.3"].hint         # how to repair data that breaks it
    """


CATALOG: Final[Catalog] = Catalog({"compressed": COMPRESSED, "coo": COO})

def family_of(layout: torch.layout) -> Family:
    """The catalog family that governs ``layout``."""
    if layout == torch.sparse_coo:
        return "coo"
    if layout in COMPRESSED_LAYOUTS:
        return "compressed"
    raise TypeError(f"{layout} is not a sparse layout")


def lookup(layout: torch.layout, invariant_id: str) -> Invariant:
    """The catalog entry for ``invariant_id`` under ``layout`` (KeyError if unknown)."""
    return CATALOG[family_of(layout)][invariant_id]


#: The nouns of a compressed layout's plain words: (line, other, compressed member name).
_NOUNS: Final[dict[torch.layout, tuple[str, str, str]]] = {
    torch.sparse_csr: ("row", "column", "crow_indices"),
    torch.sparse_csc: ("column", "row", "ccol_indices"),
    torch.sparse_bsr: ("block row", "block column", "crow_indices"),
    torch.sparse_bsc: ("block column", "block row", "ccol_indices"),
}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def explain(layout: torch.layout, invariant_id: str, case: str = "", **fields: object) -> str:
    """A violation of ``invariant_id`` in plain words, from the catalog's template for
    ``case``, e.g. ``"column 1000000000 is out of range for 3 columns"``.

    Compressed layouts get the nouns of the layout (``line``, ``other``, ``lines``, ``others``,
    ``cname``; ``n_others`` from ``n_plain``); COO gets ``noun`` and ``n_nouns`` (from
    ``dim``, ``bound`` and ``sparse_dim``; a matrix speaks of rows and columns).

    Raises:
        KeyError: the id has no such template, or a field the template needs is missing.
    """
    inv = lookup(layout, invariant_id)
    words: dict[str, object] = {}
    if layout == torch.sparse_coo:
        dim, sparse_dim, bound = fields.get("dim"), fields.get("sparse_dim"), fields.get("bound")
        if case == "" and sparse_dim == 1:
            case = "vector"
        elif case == "" and sparse_dim == 2 and dim in (0, 1) and isinstance(bound, int):
            case = "matrix"
            noun = "row" if dim == 0 else "column"
            words.update(noun=noun, n_nouns=_count(bound, noun))
    else:
        line, other, cname = _NOUNS[layout]
        words.update(line=line, other=other, lines=f"{line}s", others=f"{other}s", cname=cname)
        n_plain = fields.get("n_plain")
        if isinstance(n_plain, int):
            words["n_others"] = _count(n_plain, other)
    return inv.explain(case, **words, **fields)


def render_markdown() -> str:
    """The invariant tables as Markdown; ``docs/invariants.md`` embeds exactly this text."""
    lines: list[str] = []
    titles = {
        "compressed": "Compressed layouts (CSR, CSC, BSR, BSC)",
        "coo": "COO",
    }
    for family, table in CATALOG.items():
        lines += [f"### {titles[family]}", "", "| id | invariant |", "| --- | --- |"]
        lines += [f"| {inv.id} | {inv.text} |" for inv in table.values()]
        lines.append("")
        worded = [inv for inv in table.values() if inv.words]
        if worded:
            lines += [_EXAMPLE_INTRO[family], ""]
            layout = torch.sparse_coo if family == "coo" else torch.sparse_csr
            for inv in worded:
                for case, _ in inv.words:
                    fields = _EXAMPLES.get((family, inv.id, case))
                    if fields is not None:
                        text = explain(layout, inv.id, case, **fields)
                        lines.append(f"- **{inv.id}**{f' ({case})' if case else ''}: {text}")
            lines.append("")
        hinted = [inv for inv in table.values() if inv.hint]
        if hinted:
            lines += ["How to repair data that breaks:", ""]
            lines += [f"- **{inv.id}**: {inv.hint}" for inv in hinted]
            lines.append("")
    return "\n".join(lines)


_EXAMPLE_INTRO: Final[dict[Family, str]] = {
    "compressed": (
        "In plain words, next to the statement, errors say what is wrong with the data (shown "
        "for CSR; CSC swaps rows and columns, BSR and BSC speak of block rows and columns):"
    ),
    "coo": "In plain words (a matrix speaks of rows and columns, a vector of indices):",
}
#: Example fields for the plain words in ``docs/invariants.md`` (family, id, case).
_EXAMPLES: Final[dict[tuple[Family, str, str], dict[str, object]]] = {
    ("compressed", "5.1", ""): {"value": 1},
    ("compressed", "5.2", ""): {"value": 5, "nnz": 4},
    ("compressed", "5.3", ""): {"index": 2, "count": 4, "n_plain": 3},
    ("compressed", "5.3", "negative"): {"index": 2, "previous": 7, "value": 5},
    ("compressed", "5.3", "outside"): {"position": 3, "offset": 7, "nnz": 4},
    ("compressed", "5.4", ""): {"value": -1},
    ("compressed", "5.5", ""): {"value": 1000000000, "n_plain": 3},
    ("compressed", "5.6", ""): {"value": 0, "previous": 2, "index": 0},
    ("compressed", "5.6", "duplicate"): {"value": 2, "index": 0},
    ("coo", "5.1", ""): {"value": -1, "dim": 2},
    ("coo", "5.1", "matrix"): {"noun": "row", "value": -1},
    ("coo", "5.1", "vector"): {"value": -1},
    ("coo", "5.2", ""): {"value": 9, "dim": 2, "bound": 3},
    ("coo", "5.2", "matrix"): {"noun": "column", "value": 7, "n_nouns": "5 columns"},
    ("coo", "5.2", "vector"): {"value": 9, "bound": 3},
    ("coo", "5.2", "uint64"): {"value": 2**63 + 5, "dim": 0},
    ("coo", "5.3", ""): {"index": (0, 1), "previous": (1, 0)},
    ("coo", "5.3", "duplicate"): {"index": (1, 0)},
}


__all__ = [
    "CATALOG",
    "COMPRESSED",
    "CONTEXT_HINTS",
    "COO",
    "STATE_DICT_LOADER",
    "Catalog",
    "Invariant",
    "explain",
    "family_of",
    "hint_context",
    "hint_for",
    "lookup",
    "render_context_hints",
    "render_markdown",
]

"""The invariant catalog, its rendering in docs/invariants.md, and the error type."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

import safesparse as ss
from safesparse.catalog import invariants

DOC = Path(__file__).resolve().parents[2] / "docs" / "invariants.md"
START, END = "<!-- catalog:start -->", "<!-- catalog:end -->"


def _ids(spec: str) -> list[str]:
    """Expand "3.1-3.4, 5.1" into ["3.1", "3.2", "3.3", "3.4", "5.1"]."""
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            major, first = lo.split(".")
            _, last = hi.split(".")
            out += [f"{major}.{k}" for k in range(int(first), int(last) + 1)]
        else:
            out.append(part)
    return out


SPEC_IDS = {
    "compressed": _ids("1.1-1.5, 2.1-2.4, 3.1-3.10, 4.1-4.4, 5.1-5.6"),
    "coo": _ids("1.1, 1.2, 2.1, 2.2, 3.1-3.4, 4.1, 4.2, 5.1-5.3"),
}


def test_id_expansion_helper() -> None:
    assert _ids("3.8-3.10, 4.1") == ["3.8", "3.9", "3.10", "4.1"]


@pytest.mark.parametrize("family", ["compressed", "coo"])
def test_catalog_has_exactly_the_spec_ids(family: str) -> None:
    table = ss.CATALOG[family]
    assert list(table) == SPEC_IDS[family]  # same ids, same (id) order
    assert len(table) == {"compressed": 29, "coo": 13}[family]


@pytest.mark.parametrize("family", ["compressed", "coo"])
def test_catalog_entries_are_consistent(family: str) -> None:
    for iid, inv in ss.CATALOG[family].items():
        assert isinstance(inv, ss.Invariant)
        assert inv.id == iid
        assert inv.family == family
        assert inv.text and inv.text == inv.text.strip()
        assert "|" not in inv.text  # would break the Markdown table


def test_family_tables_are_the_module_constants() -> None:
    assert ss.CATALOG["compressed"] is invariants.COMPRESSED
    assert ss.CATALOG["coo"] is invariants.COO


@pytest.mark.parametrize(
    ("layout", "family"),
    [
        (torch.sparse_coo, "coo"),
        (torch.sparse_csr, "compressed"),
        (torch.sparse_csc, "compressed"),
        (torch.sparse_bsr, "compressed"),
        (torch.sparse_bsc, "compressed"),
    ],
)
def test_lookup_by_layout(layout: torch.layout, family: str) -> None:
    assert invariants.family_of(layout) == family
    for iid in SPEC_IDS[family]:
        assert invariants.lookup(layout, iid) is ss.CATALOG[family][iid]


def test_family_of_strided_is_an_error() -> None:
    with pytest.raises(TypeError):
        invariants.family_of(torch.strided)


def test_render_markdown_lists_every_invariant() -> None:
    text = invariants.render_markdown()
    for family, table in ss.CATALOG.items():
        for inv in table.values():
            assert f"| {inv.id} | {inv.text} |" in text, (family, inv.id)
    assert text.count("| --- | --- |") == 2


# --- docs/invariants.md ------------------------------------------------------------------------


def _embedded_catalog(text: str) -> str:
    assert text.count(START) == 1, f"{DOC.name} needs exactly one {START!r}"
    assert text.count(END) == 1, f"{DOC.name} needs exactly one {END!r}"
    begin, end = text.index(START) + len(START), text.index(END)
    assert begin <= end, "catalog markers are in the wrong order"
    return text[begin:end]


def test_doc_embeds_the_rendered_catalog() -> None:
    embedded = _embedded_catalog(DOC.read_text(encoding="utf-8"))
    expected = invariants.render_markdown()
    assert embedded == "\n" + expected, (
        "docs/invariants.md is out of date with safesparse.catalog.invariants; regenerate the "
        "table between the catalog markers from render_markdown()"
    )


def test_doc_check_detects_drift() -> None:
    """The comparison above is not vacuous: a changed statement is noticed."""
    rendered = invariants.render_markdown()
    tampered = rendered.replace("plain indices are >= 0", "plain indices are > 0")
    assert tampered != rendered
    doc = f"intro\n{START}\n{tampered}{END}\n"
    assert _embedded_catalog(doc) != "\n" + rendered


def test_doc_mentions_every_layout() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name in ("CSR", "CSC", "BSR", "BSC", "COO"):
        assert name in text


# --- InvariantError ----------------------------------------------------------------------------


def test_error_is_value_and_runtime_error() -> None:
    assert issubclass(ss.InvariantError, ValueError)
    assert issubclass(ss.InvariantError, RuntimeError)
    err = ss.InvariantError(torch.sparse_bsr, "5.6")
    with pytest.raises(RuntimeError):
        raise err
    with pytest.raises(ValueError):
        raise err


@pytest.mark.parametrize(
    ("layout", "iid", "prefix"),
    [
        (torch.sparse_bsr, "5.6", "[BSR 5.6]"),
        (torch.sparse_csr, "1.1", "[CSR 1.1]"),
        (torch.sparse_csc, "3.10", "[CSC 3.10]"),
        (torch.sparse_bsc, "4.4", "[BSC 4.4]"),
        (torch.sparse_coo, "5.3", "[COO 5.3]"),
    ],
)
def test_error_message_format(layout: torch.layout, iid: str, prefix: str) -> None:
    err = ss.InvariantError(layout, iid, "somewhere specific")
    assert err.layout == layout
    assert err.invariant == iid
    msg = str(err)
    assert msg.startswith(prefix + " ")
    assert invariants.lookup(layout, iid).text in msg
    assert "somewhere specific" in msg
    assert err.args and str(err.args[0]) == msg


def test_error_pickles() -> None:
    err = ss.InvariantError(
        torch.sparse_bsr, "5.6", "batch (1,), block row 2, position 4",
        location={"batch": (1,), "block_row": 2, "position": 4, "value": 1},
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ss.InvariantError
    assert back.layout == torch.sparse_bsr
    assert back.invariant == "5.6"
    assert back.location == err.location
    assert str(back) == str(err)


def test_error_from_a_factory_pickles() -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], size=(2, 3))
    back = pickle.loads(pickle.dumps(excinfo.value))
    assert (back.layout, back.invariant) == (torch.sparse_csr, "5.6")
    assert str(back) == str(excinfo.value)
    assert re.match(r"^\[CSR 5\.6\] ", str(back))


def test_with_context_keeps_identity_and_adds_names() -> None:
    err = ss.InvariantError(torch.sparse_csr, "5.5", "row 0, position 0")
    ctx = err.with_context(op="add", path="['w']")
    assert (ctx.layout, ctx.invariant) == (err.layout, err.invariant)
    assert "add" in str(ctx) and "['w']" in str(ctx)
    assert str(ctx).startswith("[CSR 5.5] ")

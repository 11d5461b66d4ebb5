"""Repair hints that fit the caller (issue 47, item 6; SPEC 2: "a repair hint that fits the
context").

The catalog's hints speak to a program building its own tensor ("call .coalesce()", "pass a
larger size"). Under enforce mode two callers built no tensor: code converting bare index
tensors with torch's index conversions, and a library (PyG's ``EdgeIndex``) whose own re-sort
produced the data. Their refusals carry hints of their own, from the catalog
(``CONTEXT_HINTS``), listed in docs/protecting.md from ``render_context_hints()``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import safesparse as ss
from safesparse.catalog import invariants

ROOT = Path(__file__).resolve().parents[2]
SORT_HINT = "sort the row indices (stable) / coalesce before converting"
CATALOG_COO_5_3 = invariants.lookup(torch.sparse_coo, "5.3").hint


def _refusal(call: object) -> ss.InvariantError:
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        call()  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize("route", ["torch", "aten", "aten.default", "VF", "int8"])
def test_unsorted_rows_of_a_conversion_get_the_sort_hint(route: str) -> None:
    rows = torch.tensor([0, 2, 1])
    call = {
        "torch": lambda: torch._convert_indices_from_coo_to_csr(rows, 3),
        "aten": lambda: torch.ops.aten._convert_indices_from_coo_to_csr(rows, 3),
        "aten.default": lambda: torch.ops.aten._convert_indices_from_coo_to_csr.default(rows, 3),
        "VF": lambda: torch._VF._convert_indices_from_coo_to_csr(rows, 3),
        "int8": lambda: torch._convert_indices_from_coo_to_csr(rows.to(torch.int8), 3),
    }[route]
    err = _refusal(call)
    assert (err.layout, err.invariant) == (torch.sparse_coo, "5.3")
    assert err.hint.startswith(SORT_HINT) and "stable=True" in err.hint
    assert str(err).endswith("\nto repair: " + err.hint)
    assert CATALOG_COO_5_3 not in str(err)  # "build it with is_coalesced=None ...": no tensor
    back = pickle.loads(pickle.dumps(err))
    assert back.hint == err.hint  # the context (the op) travels with the error


def test_the_sort_hint_works() -> None:
    """Following it: a stable sort of the rows, columns and values permuted alike, converts
    and builds the same matrix as coalescing."""
    rows, cols = torch.tensor([2, 0, 2, 1]), torch.tensor([0, 3, 1, 2])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rows_sorted, perm = torch.sort(rows, stable=True)
    with ss.enforce():
        crow = torch._convert_indices_from_coo_to_csr(rows_sorted, 3)
        csr = torch.sparse_csr_tensor(crow, cols[perm], vals[perm], (3, 4))
    want = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (3, 4),
                                   check_invariants=True).to_dense()
    assert ss.is_checked(csr) and torch.equal(csr.to_dense(), want)


def test_conversion_range_and_offset_refusals_speak_of_converting() -> None:
    err = _refusal(lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 5]), 3))
    assert err.invariant == "5.2" and "before converting" in err.hint
    assert "the tensor's size" not in err.hint
    err = _refusal(lambda: torch._convert_indices_from_csr_to_coo(torch.tensor([0, 9, 2]),
                                                                  torch.tensor([0, 1])))
    assert (err.layout, err.invariant) == (torch.sparse_csr, "5.3")
    assert err.hint.startswith("crow_indices must be running totals of the entries per row")
    err = _refusal(lambda: torch._convert_indices_from_csr_to_coo(
        torch.tensor([1, 1, 2]), torch.tensor([0, 1]), transpose=True))
    assert (err.layout, err.invariant) == (torch.sparse_csc, "5.1")
    assert err.hint.startswith("ccol_indices must be running totals of the entries per column")


def test_a_tensor_the_program_builds_keeps_the_catalogs_hint() -> None:
    """Built here (this module is no library the catalog knows), 5.6 gets the catalog's hint;
    the error names the module that built it."""
    err = _refusal(lambda: torch.sparse_csr_tensor(torch.tensor([0, 2]), torch.tensor([1, 0]),
                                                   torch.ones(2), (1, 2)))
    assert err.invariant == "5.6" and err.built_in == __name__
    assert err.hint == invariants.lookup(torch.sparse_csr, "5.6").hint


def _col_sorted_edges(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    ei = torch.unique(torch.randint(0, n, (2, 2000)), dim=1)  # distinct edges
    return ei[:, ei[1].argsort(stable=True)]


@pytest.mark.parametrize("layout", ["csr", "csc"])
def test_pyg_unstable_resort_names_the_cause_and_a_fix_that_works(layout: str) -> None:
    """``EdgeIndex(sort_order="col").to_sparse_csr()`` (and ``sort_order="row"`` with
    ``.to_sparse_csc()``) re-sorts with an unstable sort: distinct edges, refused as 5.6 with
    the catalog's hint for COO factories on the starting commit. Now the hint names the
    unstable re-sort and two fixes, both of which build the right matrix."""
    pytest.importorskip("torch_geometric")
    from torch_geometric import EdgeIndex

    n = 50
    ei = _col_sorted_edges(n)
    if layout == "csc":
        ei = ei.flip(0)  # sorted by row now; the CSC conversion re-sorts by column
    order = "col" if layout == "csr" else "row"
    convert = f"to_sparse_{layout}"
    e = EdgeIndex(ei, sparse_size=(n, n), sort_order=order)
    err = _refusal(lambda: getattr(e, convert)())
    assert err.invariant == "5.6" and err.built_in == "torch_geometric.edge_index"
    line, other = ("row", "column") if layout == "csr" else ("column", "row")
    assert f"{other}s unsorted within a {line}" in err.hint and "unstable sort" in err.hint
    assert f"ei.to_sparse_coo(value).coalesce().{convert}()" in err.hint
    assert f".sort_by('{'row' if layout == 'csr' else 'col'}', stable=True)" in err.hint
    want = torch.sparse_coo_tensor(ei, torch.ones(ei.shape[1]), (n, n),
                                   check_invariants=True).to_dense()
    with ss.enforce():
        e = EdgeIndex(ei, sparse_size=(n, n), sort_order=order)
        by_coo = getattr(e.to_sparse_coo().coalesce(), convert)()
        stable = getattr(EdgeIndex(e.as_tensor(), sparse_size=e.sparse_size()).sort_by(
            "row" if layout == "csr" else "col", stable=True)[0], convert)()
    for fixed in (by_coo, stable):
        assert ss.is_checked(fixed) and torch.equal(fixed.to_dense(), want)


def test_docs_list_the_context_hints() -> None:
    text = (ROOT / "docs" / "protecting.md").read_text(encoding="utf-8")
    start, end = "<!-- context-hints:start -->\n", "<!-- context-hints:end -->"
    assert text.count(start) == 1 and text.count(end) == 1
    embedded = text[text.index(start) + len(start):text.index(end)]
    assert embedded == invariants.render_context_hints(), (
        "docs/protecting.md is out of date: regenerate the list between the context-hints "
        "markers from safesparse.catalog.invariants.render_context_hints()")
    assert SORT_HINT in embedded and "unstable sort" in embedded

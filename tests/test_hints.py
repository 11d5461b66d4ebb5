"""Repair hints: catalog entries may say how to fix data that breaks them (one source of truth
in safesparse.invariants); InvariantError messages end with the hint."""

from __future__ import annotations

import pickle

import pytest
import torch

import safesparse as ss
from safesparse import invariants

HINTED = {("compressed", "5.6"), ("coo", "5.3")}


def test_exactly_the_canonicalisation_invariants_have_hints() -> None:
    hinted = {(fam, iid) for fam, table in ss.CATALOG.items()
              for iid, inv in table.items() if inv.hint}
    assert hinted == HINTED


@pytest.mark.parametrize(("family", "iid"), sorted(HINTED))
def test_hints_name_the_scipy_and_torch_spellings(family: str, iid: str) -> None:
    hint = ss.CATALOG[family][iid].hint  # type: ignore[index]
    assert "sum_duplicates()" in hint and "coalesce()" in hint
    assert hint == hint.strip() and "|" not in hint and "\n" not in hint


@pytest.mark.parametrize(
    "layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]
)
def test_a_5_6_error_ends_with_the_hint(layout: torch.layout) -> None:
    err = ss.InvariantError(layout, "5.6", "row 0, position 1")
    assert err.hint == invariants.lookup(layout, "5.6").hint
    assert str(err).endswith("; to repair: " + err.hint)
    assert str(err).startswith(f"[{invariants.layout_name(layout)} 5.6] ")


def test_unhinted_errors_have_no_repair_text() -> None:
    err = ss.InvariantError(torch.sparse_csr, "5.5", "row 0, position 0")
    assert err.hint == "" and "to repair" not in str(err)


def test_factory_errors_carry_the_hint_and_it_survives_context_and_pickling() -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], size=(2, 3))
    err = excinfo.value
    assert "sort_indices()" in str(err)
    ctx = err.with_context(path="['w']", op="add")
    assert "['w']" in str(ctx) and str(ctx).endswith(err.hint)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor([[1, 0]], [1.0, 2.0], (2,), is_coalesced=True)
    assert excinfo.value.invariant == "5.3" and "coalesce()" in str(excinfo.value)


def test_the_hint_advice_works_in_torch() -> None:
    """Following the torch spelling of the 5.6 hint gives a valid tensor with the same sum."""
    rows, cols, vals = [0, 0, 0, 1], [2, 0, 2, 1], [1.0, 2.0, 3.0, 4.0]  # unsorted, duplicate
    coo = ss.sparse_coo_tensor([rows, cols], vals, (2, 3)).coalesce()
    csr = coo.to_sparse_csr()
    assert ss.is_checked(ss.validate(csr))
    assert csr.to_dense().tolist() == [[2.0, 0.0, 4.0], [0.0, 4.0, 0.0]]


def test_rendered_catalog_lists_the_hints() -> None:
    text = invariants.render_markdown()
    for family, iid in HINTED:
        assert f"- **{iid}**: {ss.CATALOG[family][iid].hint}" in text  # type: ignore[index]


def test_a_hint_for_an_unknown_id_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        invariants._table("coo", [("1.1", "x")], {"9.9": "y"})

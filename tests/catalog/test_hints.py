"""Messages in plain words and repair hints (one source of truth: safesparse.catalog.invariants).

Every index invariant (5.x, both families) is explained in plain words beside the catalog's
terms ("column 1000000000 is out of range for 3 columns"), and each common refusal ends with
a repair hint; ``str(err)`` still starts with ``[<LAYOUT> <id>] <statement>`` (SPEC 2)."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch

import safesparse as ss
from safesparse.base.layouts import layout_name
from safesparse.catalog import invariants

CANONICALISE = {("compressed", "5.6"), ("coo", "5.3")}
INDEX_IDS = {("compressed", f"5.{i}") for i in range(1, 7)} | {
    ("coo", f"5.{i}") for i in range(1, 4)}
#: The common refusals: every index invariant, index dtypes, a size that does not fit, devices.
HINTED = INDEX_IDS | {("compressed", iid) for iid in ("1.1", "1.2", "1.3", "3.1", "4.2",
                                                      "4.3", "4.4")} | {
    ("coo", "1.1"), ("coo", "4.2")}
OUT_OF_RANGE = ("the tensor's size is smaller than its indices; pass a larger size or drop "
                "those entries")


def test_the_common_refusals_have_hints() -> None:
    hinted = {(fam, iid) for fam, table in ss.CATALOG.items()
              for iid, inv in table.items() if inv.hint}
    assert hinted == HINTED


def test_every_index_invariant_has_plain_words_and_no_other_does() -> None:
    worded = {(fam, iid) for fam, table in ss.CATALOG.items()
              for iid, inv in table.items() if inv.words}
    assert worded == INDEX_IDS
    for fam, iid in INDEX_IDS:
        inv = ss.CATALOG[fam][iid]  # type: ignore[index]
        assert dict(inv.words).get("", "") != ""  # the usual case is always there


def test_out_of_range_hint_is_the_same_for_both_families() -> None:
    assert ss.CATALOG["compressed"]["5.5"].hint == OUT_OF_RANGE
    assert ss.CATALOG["coo"]["5.2"].hint == OUT_OF_RANGE


@pytest.mark.parametrize(("family", "iid"), sorted(CANONICALISE))
def test_canonicalisation_hints_name_the_scipy_and_torch_spellings(family: str, iid: str) -> None:
    hint = ss.CATALOG[family][iid].hint  # type: ignore[index]
    assert "sum_duplicates()" in hint and "coalesce()" in hint


@pytest.mark.parametrize(("family", "iid"), sorted(HINTED))
def test_hints_are_one_line_of_text(family: str, iid: str) -> None:
    hint = ss.CATALOG[family][iid].hint  # type: ignore[index]
    assert hint == hint.strip() and "|" not in hint and "\n" not in hint


def _csr(crow: list[int], col: list[int], size: tuple[int, int]) -> Callable[[], object]:
    return lambda: ss.sparse_csr_tensor(crow, col, [1.0] * len(col), size)


def _csc(ccol: list[int], row: list[int], size: tuple[int, int]) -> Callable[[], object]:
    return lambda: ss.sparse_csc_tensor(ccol, row, [1.0] * len(row), size)


def _bsr_col(value: int) -> Callable[[], object]:
    bsr = torch.ones(4, 4).to_sparse_bsr((2, 2))
    col = bsr.col_indices().clone()
    col[1] = value
    return lambda: ss.sparse_bsr_tensor(bsr.crow_indices(), col, bsr.values(), bsr.shape)


def _coo(indices: list[list[int]], size: tuple[int, ...],
         coalesced: bool | None = None) -> Callable[[], object]:
    return lambda: ss.sparse_coo_tensor(indices, [1.0] * len(indices[0]), size,
                                        is_coalesced=coalesced)


def _rows_to_crow(rows: list[int], size: int) -> Callable[[], object]:
    """torch's COO -> CSR row conversion under enforce mode (it needs the rows sorted)."""
    def convert() -> object:
        with ss.enforce():
            return torch._convert_indices_from_coo_to_csr(torch.tensor(rows), size)
    return convert


# (layout, id, build, the plain words the message must contain)
CASES: list[tuple[torch.layout, str, Callable[[], object], str]] = [
    (torch.sparse_csr, "5.1", _csr([1, 1, 2], [0, 1], (2, 3)),
     "crow_indices must begin with 0, not 1"),
    (torch.sparse_csr, "5.2", _csr([0, 1, 3], [0, 1], (2, 3)),
     "crow_indices must end with the number of stored entries, 2, not 3"),
    (torch.sparse_csr, "5.3", _csr([0, 4, 4], [0, 1, 2, 2], (2, 3)),
     "row 0 holds 4 entries, but a row has only 3 columns"),
    (torch.sparse_csr, "5.3", _csr([0, 2, 1, 2], [0, 1], (3, 3)),
     "crow_indices decreases at row 1: 2 then 1"),
    (torch.sparse_csr, "5.4", _csr([0, 1, 2], [0, -1], (2, 3)),
     "column -1 is negative (indices count from 0)"),
    (torch.sparse_csr, "5.5", _csr([0, 1, 2], [0, 10**9], (2, 3)),
     "column 1000000000 is out of range for 3 columns"),
    (torch.sparse_csr, "5.6", _csr([0, 2, 2], [2, 0], (2, 3)),
     "column 0 comes after column 2 in row 0"),
    (torch.sparse_csr, "5.6", _csr([0, 2, 2], [1, 1], (2, 3)),
     "column 1 appears twice in row 0"),
    (torch.sparse_csc, "5.5", _csc([0, 1, 2], [0, 7], (3, 2)),
     "row 7 is out of range for 3 rows"),
    (torch.sparse_csc, "5.3", _csc([0, 4, 4], [0, 1, 2, 2], (1, 2)),
     "column 0 holds 4 entries, but a column has only 1 row"),
    (torch.sparse_bsr, "5.5", _bsr_col(5),
     "block column 5 is out of range for 2 block columns"),
    (torch.sparse_coo, "5.1", _coo([[0, -1]], (3,)), "index -1 is negative (indices count from 0)"),
    (torch.sparse_coo, "5.1", _coo([[0, 1], [-2, 0]], (2, 3)), "column -2 is negative"),
    (torch.sparse_coo, "5.2", _coo([[0, 1], [5, 1]], (2, 3)),
     "column 5 is out of range for 3 columns"),
    (torch.sparse_coo, "5.2", _coo([[7, 1], [0, 1]], (2, 3)), "row 7 is out of range for 2 rows"),
    (torch.sparse_coo, "5.2", _coo([[0, 1], [0, 1], [9, 0]], (2, 2, 3)),
     "index 9 along dim 2 is out of range for size 3"),
    (torch.sparse_coo, "5.2", _coo([[4]], (3,)), "index 4 is out of range for size 3"),
    (torch.sparse_coo, "5.3", _coo([[1, 0]], (3,), True),
     "index (0,) comes after (1,), but the tensor is marked coalesced"),
    (torch.sparse_coo, "5.3", _coo([[1, 1]], (3,), True),
     "index (1,) appears twice, but the tensor is marked coalesced"),
    (torch.sparse_coo, "5.3", _rows_to_crow([0, 2, 1], 3),
     "row 1 comes after row 2, but the conversion to CSR needs the rows sorted"),
]


@pytest.mark.parametrize(("layout", "iid", "build", "words"), CASES,
                         ids=[f"{layout_name(c[0])}-{c[1]}-{i}"
                              for i, c in enumerate(CASES)])
def test_refusals_speak_plain_words_and_end_with_the_hint(
    layout: torch.layout, iid: str, build: Callable[[], object], words: str,
) -> None:
    with pytest.raises(ss.InvariantError) as info:
        build()
    err = info.value
    assert (err.layout, err.invariant) == (layout, iid)
    inv = invariants.lookup(layout, iid)
    msg = str(err)
    first, *rest = msg.splitlines()
    # the first line says what is wrong and where; then the invariant, then the repair
    assert first.startswith(f"[{layout_name(layout)} {iid}] {words}")
    assert err.explanation == words or err.explanation.startswith(words)
    assert f"{err.explanation} ({err.detail})" in first  # the location stays beside it
    hint = invariants.hint_for(layout, iid, op=err.op)  # (a conversion's hint: its own)
    assert rest == [f"invariant: {inv.text}", f"to repair: {hint}"] and hint
    assert hint == inv.hint or "_convert_indices_from_" in str(err.op)


def test_every_index_case_of_the_catalog_is_reached_by_a_test() -> None:
    """Each plain-words template a refusal can use appears in CASES (uint64 has its own test;
    5.3 "outside" is the diagnosis's guard against wrapped int64 differences, which 5.1 and
    the per-line counts already rule out, so it is checked through explain())."""
    reached = {(invariants.family_of(layout), iid, words) for layout, iid, _, words in CASES}
    for fam, iid in INDEX_IDS:
        inv = ss.CATALOG[fam][iid]  # type: ignore[index]
        for case, template in inv.words:
            if case in ("uint64", "outside"):
                continue
            head = template.split("{")[0] or template.split("}")[1].split("{")[0]
            assert any(f == fam and i == iid and head in w for f, i, w in reached), (
                fam, iid, case)


def test_explain_fills_the_layout_nouns() -> None:
    assert invariants.explain(torch.sparse_bsc, "5.3", "outside", position=3, offset=7,
                              nnz=4) == "ccol_indices[3] = 7 lies outside the 4 stored entries"
    assert invariants.explain(torch.sparse_csc, "5.5", value=4, n_plain=1) == (
        "row 4 is out of range for 1 row")
    with pytest.raises(KeyError):
        invariants.explain(torch.sparse_csr, "3.7")  # no plain words: not index data


def test_wrapped_uint64_indices_are_explained() -> None:
    indices = torch.tensor([[2**63 + 5]], dtype=torch.uint64)
    with pytest.raises(ss.InvariantError) as info:
        ss.sparse_coo_tensor(indices, [1.0], (3,))
    assert "index 9223372036854775813 along dim 0 (uint64) is larger than any size can be" \
        in str(info.value)


def test_the_example_of_the_issue() -> None:
    """The worked example: the plain words and the out-of-range hint, verbatim."""
    bad = ss.sparse_csr_tensor([0, 1, 2], [0, 10**9], [1.0, 2.0], (2, 3),
                               check_invariants=False)
    with pytest.raises(ss.InvariantError) as info:
        ss.validate(bad)
    assert str(info.value) == (
        "[CSR 5.5] column 1000000000 is out of range for 3 columns (row 1, position 1: "
        "col_indices[1] = 1000000000, n_plain = 3)\n"
        "invariant: plain indices are < n_plain\n"
        "to repair: " + OUT_OF_RANGE)


@pytest.mark.parametrize(
    "layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]
)
def test_a_5_6_error_ends_with_the_hint(layout: torch.layout) -> None:
    err = ss.InvariantError(layout, "5.6", "row 0, position 1")
    assert err.hint == invariants.lookup(layout, "5.6").hint
    assert str(err).endswith("\nto repair: " + err.hint)
    assert str(err).startswith(f"[{layout_name(layout)} 5.6] ")
    assert err.explanation == ""  # only validation knows the values to explain


def test_unhinted_errors_have_no_repair_text() -> None:
    err = ss.InvariantError(torch.sparse_csr, "3.7", "values are not contiguous")
    assert err.hint == "" and "to repair" not in str(err)


def test_factory_errors_carry_the_hint_and_words_through_context_and_pickling() -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], size=(2, 3))
    err = excinfo.value
    assert "sort_indices()" in str(err) and err.explanation
    ctx = err.with_context(path="['w']", op="add")
    assert "['w']" in str(ctx) and str(ctx).endswith(err.hint)
    assert ctx.explanation == err.explanation
    back = pickle.loads(pickle.dumps(ctx))
    assert str(back) == str(ctx) and back.explanation == err.explanation
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor([[1, 0]], [1.0, 2.0], (2,), is_coalesced=True)
    assert excinfo.value.invariant == "5.3" and "coalesce()" in str(excinfo.value)


def test_errors_pickled_before_explanations_existed_still_load() -> None:
    from safesparse.catalog.errors import _rebuild_error

    err = _rebuild_error(torch.sparse_csr, "5.5", "row 0", {}, None, None)
    assert err.explanation == "" and str(err).startswith("[CSR 5.5] ")


def test_the_hint_advice_works_in_torch() -> None:
    """Following the torch spelling of the 5.6 hint gives a valid tensor with the same sum."""
    rows, cols, vals = [0, 0, 0, 1], [2, 0, 2, 1], [1.0, 2.0, 3.0, 4.0]  # unsorted, duplicate
    coo = ss.sparse_coo_tensor([rows, cols], vals, (2, 3)).coalesce()
    csr = coo.to_sparse_csr()
    assert ss.is_checked(ss.validate(csr))
    assert csr.to_dense().tolist() == [[2.0, 0.0, 4.0], [0.0, 4.0, 0.0]]


def test_the_running_totals_advice_works_in_torch() -> None:
    """The 5.1-5.3 hint's recipe rebuilds valid compressed indices from per-row counts."""
    counts = torch.tensor([2, 0, 1])
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    t = ss.sparse_csr_tensor(crow, [0, 2, 1], [1.0, 2.0, 3.0], (3, 3))
    assert ss.is_checked(t) and crow.tolist() == [0, 2, 2, 3]


def test_rendered_catalog_lists_the_hints_and_the_plain_words() -> None:
    text = invariants.render_markdown()
    for family, iid in HINTED:
        assert f"- **{iid}**: {ss.CATALOG[family][iid].hint}" in text  # type: ignore[index]
    assert "- **5.5**: column 1000000000 is out of range for 3 columns" in text
    assert "- **5.2** (matrix): column 7 is out of range for 5 columns" in text


def test_a_hint_or_words_for_an_unknown_id_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        invariants._table("coo", [("1.1", "x")], {"9.9": "y"})
    with pytest.raises(ValueError, match="unknown"):
        invariants._table("coo", [("1.1", "x")], None, {"9.9": {"": "y"}})

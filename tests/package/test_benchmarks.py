"""The benchmark harness's one source of truth: the targets table, the verdicts and summary line,
and the README's cost section, which must come from the generator (benchmarks/readme.py).

Nothing here times anything (speed belongs in benchmarks/): these tests check that the numbers
printed, the targets and the READMEs agree.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import readme  # noqa: E402
import targets  # noqa: E402


@pytest.fixture
def outcomes() -> Iterator[dict[str, list[tuple[float, bool]]]]:
    saved = dict(harness.OUTCOMES)
    harness.OUTCOMES.clear()
    yield harness.OUTCOMES
    harness.OUTCOMES.clear()
    harness.OUTCOMES.update(saved)


# --- the targets table ---------------------------------------------------------------------------


def test_targets_are_well_formed() -> None:
    table = targets.all_targets()
    assert len(table) >= len(targets.TARGETS)
    for key, t in table.items():
        assert t.key == key and re.fullmatch(r"[a-z_]+\.[a-z_]+", key), key
        assert t.limit > 0 and t.unit in targets.UNITS and t.description


def test_group_targets_merge_and_a_duplicate_key_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import group_overhead

    monkeypatch.setattr(group_overhead, "TARGETS",
                        [("overhead.extra", "an extra target", 4.0, "µs")], raising=False)
    assert targets.all_targets()["overhead.extra"].text() == "<= 4 µs"
    monkeypatch.setattr(group_overhead, "TARGETS", [targets.TARGETS[0]])
    with pytest.raises(ValueError, match="defined twice"):
        targets.all_targets()


def test_every_group_file_is_a_group() -> None:
    names = targets.group_modules()
    assert names[:2] == ["group_validate", "group_overhead"]
    assert {p.stem for p in BENCH.glob("group_*.py")} == set(names)
    harness.import_groups()
    assert list(harness.GROUPS)[:5] == ["validate", "overhead", "wrapper", "transpose", "debug"]


def test_every_target_is_judged_by_a_group() -> None:
    """A target nobody measures would never count; its key is passed to judge() somewhere
    (literally, or through a helper of its group: then the key is named again past its
    ``TARGETS`` entry)."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in BENCH.glob("group_*.py"))
    for key in targets.all_targets():
        assert (re.search(rf"judge\(\s*\"{re.escape(key)}\"", sources)
                or sources.count(f'"{key}"') >= 2), key


def test_benchmarks_readme_shows_the_table() -> None:
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    assert text.count(targets.BEGIN) == 1 and text.count(targets.END) == 1
    inner = text.split(targets.BEGIN)[1].split(targets.END)[0]
    assert inner == "\n" + targets.render_markdown() + "\n", (
        "benchmarks/README.md's targets table is out of date: python benchmarks/targets.py "
        "--write")


def test_benchmarks_readme_states_no_target_of_its_own() -> None:
    """Outside the generated table, the prose names targets by key, never by a number."""
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    prose = text.split(targets.BEGIN)[0] + text.split(targets.END)[1]
    assert not re.findall(r"target[^.\n]{0,20}<=\s*\d", prose)


def test_render_markdown_lists_every_target() -> None:
    text = targets.render_markdown()
    for key, t in targets.all_targets().items():
        assert f"| `{key}` |" in text and t.text() in text


# --- verdicts and the summary line ---------------------------------------------------------------


def test_judge_converts_units_and_records(outcomes: dict[str, Any]) -> None:
    assert harness.judge("wrapper.rebuild_overhead", 9e-6) == 1  # 9 µs <= 10 µs
    assert harness.judge("wrapper.rebuild_overhead", 11e-6) == 0
    assert harness.judge("wrapper.spmm_ratio", 1.02) == 1
    assert harness.judge("wrapper.spmm_ratio", 1.05) == 0
    assert harness.judge("wrapper.spmm_ratio", "ERR RuntimeError: x") is None
    assert harness.judge("wrapper.spmm_ratio", None) is None
    assert outcomes["wrapper.rebuild_overhead"] == [(pytest.approx(9.0), True),
                                                    (pytest.approx(11.0), False)]
    assert outcomes["wrapper.spmm_ratio"] == [(pytest.approx(1.02), True),
                                              (pytest.approx(1.05), False)]
    with pytest.raises(KeyError):
        harness.judge("no.such_target", 1.0)


def test_summary_line_counts_what_the_run_measured(outcomes: dict[str, Any]) -> None:
    total = len(targets.all_targets())
    harness.judge("wrapper.spmm_ratio", 1.0)
    harness.judge("wrapper.values_overhead", 1e-6)
    harness.judge("wrapper.values_overhead", 2e-6)  # one miss: the target is missed
    line = harness.summary_line()
    assert line.startswith("targets met: 1/2 (missed: wrapper.values_overhead)")
    assert line.endswith(f"; {total - 2} of {total} not measured by this run")
    for key in targets.all_targets():
        harness.judge(key, 0.0)
    outcomes.pop("wrapper.values_overhead")
    harness.judge("wrapper.values_overhead", 0.0)
    assert harness.summary_line() == f"targets met: {total}/{total}"
    table = harness.targets_table()
    assert len(table.rows) == total and all(row[3] == 1 for row in table.rows)


# --- README.md's cost section --------------------------------------------------------------------


def _fake_results() -> dict[str, Any]:
    """A results structure as run.py builds it, with an extra group the generator ignores."""
    return {
        "header": "# safesparse benchmarks\n\n- torch 2.13.0+cpu, python 3.11.7, Linux x86_64\n"
                  "- safesparse 0.1.0 (from /somewhere)\n- torch threads: 2 (default 2)\n"
                  "- mode: full, sizes: each group's defaults\n- load average at start: 1.0",
        "groups": {
            "validate": [{"title": "validate", "columns": [
                "case", "nnz", "torch checked", "safesparse", "ratio", "ratio (min)",
                "ss factory", "factory ratio", "met", "spread"], "rows": [
                ["CSR int64", 100, 8e-6, 10e-6, 1.25, 1.2, 60e-6, 7.5, 1, 0.1],
                ["CSR int64", 10**6, 2e-3, 2.1e-3, 1.05, 1.0, 2.2e-3, 1.1, 1, 0.1],
                ["CSC int64", 100, 8e-6, 10e-6, 1.25, 1.2, 60e-6, 7.5, 1, 0.1],
                ["COO coalesced", 100, 9e-6, "ERR RuntimeError: x", None, None, 50e-6, 5.5,
                 None, None]]}],
            "overhead": [{"title": "overhead", "columns": [
                "op", "nnz", "torch (µs)", "safesparse (µs)", "overhead (µs)", "ratio",
                "spread"], "rows": [["A * 2", 1000, 10e-6, 25e-6, 15e-6, 2.5, 0.1],
                                    ["A.mT", 1000, 2e-6, 20e-6, 18e-6, 10.0, 0.1]]}],
            "some_new_group": [{"title": "x", "columns": ["a"], "rows": [[1]]}],
        },
        "summary": "targets met: 3/4 (missed: transpose.overhead)",
    }


def test_the_generator_renders_a_run() -> None:
    data = readme.extract(_fake_results())
    assert [row[0] for row in data["validate"]] == ["CSR int64", "CSR int64", "COO coalesced"]
    assert not any("/somewhere" in line for line in data["run"])  # no local paths
    text = readme.render(data)
    assert "| CSR int64 | 100 | 8.0 µs | 10.0 µs | 60.0 µs | 7.50x |" in text
    assert "| CSR int64 | 1e6 | 2.00 ms | 2.10 ms | 2.20 ms | 1.10x |" in text
    assert "| `A.mT` | 1e3 | 2.0 µs | 20.0 µs | +18.0 µs |" in text
    assert "ERR RuntimeError: x" in text  # an error cell stays visible
    assert "`targets met: 3/4 (missed: transpose.overhead)`" in text
    assert "costs 60.0 µs where torch's checker costs 8.0 µs (7.50x)" in text
    with pytest.raises(ValueError, match="validate and overhead"):
        readme.extract({**_fake_results(), "groups": {"validate": []}})


def test_write_replaces_only_the_section(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(f"before\n{readme.BEGIN}\nold\n{readme.END}\nafter\n", encoding="utf-8")
    readme.write(_fake_results(), path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"before\n{readme.BEGIN}\n") and text.endswith(f"{readme.END}\nafter\n")
    assert readme.embedded(text) == readme.extract(_fake_results())
    path.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="exactly one"):
        readme.write(_fake_results(), path)


def test_readme_cost_section_comes_from_the_generator() -> None:
    """README.md's cost section is exactly what the generator renders from the figures embedded
    in it: a figure edited by hand (or a section no run wrote) fails here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(readme.BEGIN) == 1 and text.count(readme.END) == 1
    assert text.index(readme.BEGIN) > text.index("## Cost")
    data = readme.embedded(text)
    assert readme.section(text) == readme.render(data), (
        "README.md's cost section was edited by hand; regenerate it with "
        "`python benchmarks/run.py --readme`")
    assert re.fullmatch(r"targets met: \d+/\d+.*", data["summary"])


def test_the_section_check_is_not_vacuous() -> None:
    data = readme.extract(_fake_results())
    edited = copy.deepcopy(data)
    edited["overhead"][0][3] = 1e-6  # a better figure, typed in
    assert readme.render(edited) != readme.render(data)


def test_every_module_a_group_loads_exists() -> None:
    """``load_safesparse("x")`` in a group names a module of the package (a move of the module
    made the CI smoke run fail there, not here)."""
    import importlib

    names = set()
    for path in BENCH.glob("*.py"):
        names |= set(re.findall(r'load_safesparse\("([\w.]+)"\)', path.read_text("utf-8")))
    assert names, "no group loads a submodule: the pattern is stale"
    for name in sorted(names):
        importlib.import_module(f"safesparse.{name}")

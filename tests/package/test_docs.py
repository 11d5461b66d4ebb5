"""The documentation is executable: README.md, docs/*.md and benchmarks/README.md examples run
as tests.

Every fenced code block whose info string is exactly ``python`` is executed. The blocks of one
file run in order in a single namespace (so an example can use names defined by an earlier one),
inside a fresh temporary working directory. Any other info string (``python no-run``, ``pycon``,
``bash``, ...) marks a block that is shown but not run.

The README's "Set up" commands are also checked against ``.ci/run``, which must run them verbatim
(torch's install line apart: README gives users the CPU wheel's index, CI installs the same
version from PyPI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BENCH_README = ROOT / "benchmarks" / "README.md"
RUNNABLE_FILES = [*DOC_FILES, BENCH_README]

RUNNABLE_INFO = "python"
SHELL_INFOS = {"bash", "sh", "shell", "console"}

_OPEN_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_CLOSE_FENCE = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*$")
_HEADING = re.compile(r"^(?P<level>#{1,6})[ \t]+(?P<title>.*?)[ \t#]*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    info: str  # the info string after the opening fence, stripped
    code: str
    line: int  # 1-based line number of the opening fence

    @property
    def runnable(self) -> bool:
        return self.info == RUNNABLE_INFO


def fenced_blocks(text: str, name: str = "<markdown>") -> list[Block]:
    """The fenced code blocks of a Markdown document, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPEN_FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        j = i + 1
        while True:
            if j == len(lines):
                raise ValueError(f"{name}:{i + 1}: code fence {fence!r} is never closed")
            closing = _CLOSE_FENCE.match(lines[j])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
            ):
                break
            # Content lines lose (at most) the indentation of the opening fence.
            line = lines[j]
            stripped = len(line) - len(line.lstrip(" \t"))
            body.append(line[min(indent, stripped) :])
            j += 1
        code = "\n".join(body) + "\n" if body else ""
        blocks.append(Block(info=opening["info"].strip(), code=code, line=i + 1))
        i = j + 1
    return blocks


def section_line_range(text: str, title: str) -> tuple[int, int]:
    """1-based [start, end) line range of the section under the heading ``title``."""
    lines = text.splitlines()
    in_fence: str | None = None
    start = level = None
    for number, line in enumerate(lines, start=1):
        fence = _OPEN_FENCE.match(line)
        if fence is not None:
            marker = fence["fence"]
            if in_fence is None:
                in_fence = marker
            elif (
                _CLOSE_FENCE.match(line)
                and marker[0] == in_fence[0]
                and len(marker) >= len(in_fence)
            ):
                in_fence = None
            continue
        if in_fence is not None:
            continue
        heading = _HEADING.match(line)
        if heading is None:
            continue
        if start is None:
            if heading["title"].strip().lower() == title.lower():
                start, level = number, len(heading["level"])
        elif level is not None and len(heading["level"]) <= level:
            return start, number
    if start is None:
        raise LookupError(f"no heading {title!r}")
    return start, len(lines) + 1


def _setup_pip_lines() -> list[str]:
    """The ``pip install`` lines of the shell block(s) under README's "Set up" heading."""
    text = README.read_text(encoding="utf-8")
    start, end = section_line_range(text, "Set up")
    commands: list[str] = []
    for block in fenced_blocks(text, README.name):
        if not start < block.line < end or block.info.split(" ")[0] not in SHELL_INFOS:
            continue
        for line in block.code.splitlines():
            command = line.strip().removeprefix("$ ").strip()
            if command.startswith("pip install"):
                commands.append(command)
    return commands


def setup_commands() -> list[str]:
    """README's set-up commands after torch: the ones ``.ci/run`` runs verbatim."""
    return [c for c in _setup_pip_lines() if not c.startswith("pip install torch")]


def torch_command() -> str:
    """README's command that installs torch (the CPU build, for users)."""
    (command,) = [c for c in _setup_pip_lines() if c.startswith("pip install torch")]
    return command


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) if p.parent.name == "benchmarks" else p.name for p in paths]


# --- the parser itself -------------------------------------------------------------------------


def test_fenced_blocks_parser() -> None:
    text = (
        "intro\n"
        "```python\n"
        "x = 1\n"
        "```\n"
        "````python no-run\n"
        "```\n"
        "boom()\n"
        "````\n"
        "- item\n"
        "  ~~~ python\n"
        "  y = x + 1\n"
        "\n"
        "  ~~~\n"
        "```bash\n"
        "$ echo hi\n"
        "```\n"
    )
    blocks = fenced_blocks(text)
    assert [(b.info, b.line) for b in blocks] == [
        ("python", 2),
        ("python no-run", 5),
        ("python", 10),
        ("bash", 14),
    ]
    assert [b.runnable for b in blocks] == [True, False, True, False]
    assert blocks[0].code == "x = 1\n"
    assert blocks[1].code == "```\nboom()\n"
    assert blocks[2].code == "y = x + 1\n\n"
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks("```python\nx = 1\n")


# --- executable examples -----------------------------------------------------------------------


def _restore_debug_mode(previous: bool | None) -> None:
    """Undo ``ss.set_debug`` calls an example forgot to undo, so they cannot leak."""
    ss = sys.modules.get("safesparse")
    if ss is None or not hasattr(ss, "set_debug"):
        return
    ss.set_debug(bool(previous))


def _debug_mode() -> bool | None:
    ss = sys.modules.get("safesparse")
    if ss is None or not hasattr(ss, "is_debug"):
        return None
    return bool(ss.is_debug())


@pytest.mark.parametrize("path", [README, BENCH_README], ids=_ids([README, BENCH_README]))
def test_readmes_have_runnable_examples(path: Path) -> None:
    """Guard against a parser or formatting slip making a README test vacuous."""
    blocks = fenced_blocks(path.read_text(encoding="utf-8"), path.name)
    assert any(block.runnable for block in blocks), f"{path.name} has no ```python block"


@pytest.mark.parametrize("path", RUNNABLE_FILES, ids=_ids(RUNNABLE_FILES))
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [b for b in fenced_blocks(path.read_text(encoding="utf-8"), path.name) if b.runnable]
    if not blocks:
        pytest.skip(f"{path.name} has no ```{RUNNABLE_INFO} blocks")
    if path == BENCH_README:
        # as run.py has it: the benchmark modules import each other by name; groups an example
        # registers are removed afterwards
        monkeypatch.syspath_prepend(str(BENCH_README.parent))
        harness = __import__("harness")
        monkeypatch.setattr(harness, "GROUPS", dict(harness.GROUPS))

    monkeypatch.chdir(tmp_path)
    # Examples may run `python -m safesparse ...` in a subprocess from the temporary directory;
    # make sure it imports this checkout.
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", str(ROOT) if not pythonpath else os.pathsep.join([str(ROOT), pythonpath])
    )
    monkeypatch.delenv("SAFESPARSE_DEBUG", raising=False)
    monkeypatch.delenv("SAFESPARSE_TRACEBACK", raising=False)  # the default, as users see it

    namespace: dict[str, object] = {"__name__": "__main__"}
    debug_before = _debug_mode()
    try:
        for block in blocks:
            # Pad with blank lines so tracebacks point at the Markdown file's own line numbers;
            # the absolute path lets pytest show the failing line of the .md file.
            source = "\n" * block.line + block.code
            exec(compile(source, str(path), "exec"), namespace)
    finally:
        _restore_debug_mode(debug_before)


# --- README set-up commands versus CI ------------------------------------------------------------


def test_readme_setup_commands_are_run_by_ci() -> None:
    commands = setup_commands()
    assert len(commands) == 2, f"expected two `pip install` set-up commands, found {commands}"
    ci_lines = [
        line.strip()
        for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    positions = []
    for command in commands:
        hits = [n for n, line in enumerate(ci_lines) if line.startswith(command)]
        assert hits, f".ci/run does not run the README set-up command verbatim: {command}"
        positions.append(hits[0])
    assert positions == sorted(positions), ".ci/run runs the set-up commands in another order"


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_readme_installs_torch_s_cpu_build_at_the_version_ci_installs() -> None:
    """Users get the exact command for torch's CPU wheel; CI installs the same version from
    PyPI (``pip install torch==X``), so the two cannot name different versions."""
    command = torch_command()
    match = re.fullmatch(r"pip install torch==(\S+) --index-url (\S+)", command)
    assert match is not None, command
    assert match[2] == CPU_INDEX
    ci = CI_SCRIPT.read_text(encoding="utf-8")
    assert re.search(rf"^pip install torch=={re.escape(match[1])}$", ci, re.MULTILINE), (
        "CI does not install the torch version README names")


def test_readme_offers_the_quick_subset_and_it_exists() -> None:
    text = README.read_text(encoding="utf-8")
    start, end = section_line_range(text, "Set up")
    setup = "\n".join(text.splitlines()[start - 1:end - 1])
    assert 'python -m pytest -q -m "not slow"' in setup
    assert re.search(r"about \d minutes", setup)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^markers = \[\n\s+"slow: ', pyproject, re.MULTILINE)
    import conftest  # tests/conftest.py: the modules whose tests are slow

    modules = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    assert modules >= conftest.SLOW_MODULES, conftest.SLOW_MODULES - modules
    assert len(conftest.SLOW_MODULES) < len(modules) / 2


def test_readme_states_the_number_of_tests_collected() -> None:
    """README's "about N tests" is within 10 % of what this session collected (whole suite)."""
    import conftest  # tests/conftest.py records the collection

    every = {p.resolve() for p in (ROOT / "tests").rglob("test_*.py")}
    if conftest.COLLECTED.get("files") != every:
        pytest.skip("the count is checked when the whole suite is collected")
    text = README.read_text(encoding="utf-8")
    found = re.search(r"about ([\d,]+) tests\b", text)
    assert found, "README's 'Set up' no longer says how many tests the suite runs"
    stated = int(found.group(1).replace(",", ""))
    collected = conftest.COLLECTED["count"]
    assert isinstance(collected, int)
    assert abs(stated - collected) <= collected / 10, (
        f"README says about {stated} tests; the suite collects {collected}")


def test_ci_script_is_executable_and_strict() -> None:
    text = CI_SCRIPT.read_text(encoding="utf-8")
    assert text.startswith("#!"), ".ci/run needs a shebang line"
    assert re.search(r"^set -euo pipefail$", text, re.MULTILINE)
    if os.name == "posix":
        assert os.access(CI_SCRIPT, os.X_OK), ".ci/run is not executable"
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not available")
    result = subprocess.run([bash, "-n", str(CI_SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- links -------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", RUNNABLE_FILES, ids=_ids(RUNNABLE_FILES))
def test_relative_links_resolve(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # Links inside code blocks are not links.
    for block in fenced_blocks(text, path.name):
        text = text.replace(block.code, "")
    broken = []
    for match in _LINK.finditer(text):
        target = match["target"].split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # in-page anchor, or an absolute URL (https:, mailto:, ...)
        if not (path.parent / target).exists():
            broken.append(match["target"])
    assert not broken, f"{path.name} links to missing files: {broken}"


# --- counted lists -------------------------------------------------------------------------------

_NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
_COUNTED = re.compile(
    rf"\b(?P<n>{'|'.join(_NUMBERS)})\s+(?:ways|kinds|steps)\b", re.IGNORECASE)


def counted_lists(text: str) -> list[tuple[int, int, int]]:
    """(line, announced, found) for each "N ways/kinds/steps" that a list or table follows:
    the count of the first bulleted list (top-level items) or table (body rows) after it, in
    the same section (before the next heading)."""
    lines = text.splitlines()
    out = []
    for number, line in enumerate(lines):
        for match in _COUNTED.finditer(line):
            items = rows = 0
            started = False
            for follow in lines[number + 1:]:
                if _HEADING.match(follow):
                    break
                if follow.startswith("- "):
                    items += 1
                    started = True
                elif follow.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", follow):
                    rows += 1
                    started = True
                elif started and not follow.startswith(("  ", "|")):
                    break
            if started:
                found = items if items else rows - 1  # a table's first row is its header
                out.append((number + 1, _NUMBERS[match["n"].lower()], found))
    return out


def test_counted_lists_parser() -> None:
    text = "Three ways:\n\n- a\n- b\n  more b\n- c\n\nafter\n\n## Four ways\n\n| w | x |\n" \
           "| --- | --- |\n| 1 | 2 |\n| 3 | 4 |\n"
    assert counted_lists(text) == [(1, 3, 3), (10, 4, 2)]


@pytest.mark.parametrize("path", RUNNABLE_FILES, ids=_ids(RUNNABLE_FILES))
def test_announced_counts_match_the_lists(path: Path) -> None:
    """"gives you three ways" followed by four bullets was a slip; so is any such count."""
    wrong = [c for c in counted_lists(path.read_text(encoding="utf-8")) if c[1] != c[2]]
    assert not wrong, f"{path.name}: (line, announced, listed) {wrong}"

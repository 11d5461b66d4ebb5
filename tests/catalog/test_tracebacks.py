"""Short tracebacks (safesparse.catalog.tracebacks): an uncaught InvariantError is shown without
safesparse's frames, by default, in plain Python, under ``python -m safesparse run``, in
threads and under pytest; ``SAFESPARSE_TRACEBACK=full`` (and pytest's ``--full-trace``) show
everything. Nothing runs on the happy path. The programs that fail run in child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest
import torch

import safesparse as ss
from safesparse.catalog import tracebacks

PACKAGE = os.path.dirname(os.path.abspath(ss.__file__))
ROOT = os.path.dirname(PACKAGE)

#: An unmodified program (torch only) that builds invalid data two calls deep.
UNMODIFIED = """\
import torch


def build(n):
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1000000000])
    return torch.sparse_csr_tensor(crow, col, torch.ones(2), (n, 3), check_invariants=False)


def main():
    adjacency = build(2)
    print(adjacency @ torch.ones(3, 1))


main()
"""

#: A program using safesparse whose refusal comes from the guard, deep in torch's dispatch.
WITH_SAFESPARSE = """\
import torch
import safesparse as ss


def layer(w, x):
    return torch.mm(w, x)


w = ss.sparse_csr_tensor([0, 1, 2], [0, 10**9], [1.0, 2.0], (2, 3), check_invariants=False)
layer(w, torch.ones(3, 1))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SAFESPARSE_TRACEBACK", "SAFESPARSE_ENFORCE", "SAFESPARSE_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONWARNINGS"] = "ignore"  # torch's beta-state warning is not what is measured
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def _ours(stderr: str) -> list[str]:
    """The traceback lines that name a file of the safesparse package."""
    return [line for line in stderr.splitlines()
            if line.lstrip().startswith("File ") and PACKAGE in line]


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "train.py"
    path.write_text(UNMODIFIED, encoding="utf-8")
    yield path


def test_a_refused_unmodified_script_under_run_prints_a_short_traceback(
    script: Path,
) -> None:
    result = _run(["-m", "safesparse", "run", script.name], script.parent)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) <= 14, result.stderr  # (the error: 3 lines, what + rule + repair)
    assert _ours(result.stderr) == [], result.stderr
    assert lines[0] == "Traceback (most recent call last):"
    assert [line.split(", in ")[-1] for line in lines if line.startswith("  File ")] == [
        "<module>", "main", "build"]  # the user's frames stay, in order
    assert any(line.startswith("safesparse.InvariantError: [CSR 5.5] ")
               for line in lines)
    assert tracebacks.NOTE in lines


def test_full_shows_every_frame_under_run(script: Path) -> None:
    result = _run(["-m", "safesparse", "run", script.name], script.parent,
                  SAFESPARSE_TRACEBACK="full")
    assert result.returncode == 1
    # (enforce mode's factory route raises its refusal at its own boundary: one frame of ours,
    # which the default hides)
    assert len(_ours(result.stderr)) >= 1, result.stderr
    assert tracebacks.NOTE not in result.stderr
    assert "[CSR 5.5]" in result.stderr


def test_plain_python_shows_the_users_frames_only(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(WITH_SAFESPARSE, encoding="utf-8")
    result = _run([path.name], tmp_path)
    assert result.returncode == 1
    assert _ours(result.stderr) == [], result.stderr
    frames = [line for line in result.stderr.splitlines() if line.startswith("  File ")]
    assert [f.split(", in ")[-1] for f in frames] == ["<module>", "layer"]
    assert "(in op mm, argument 0)" in result.stderr and tracebacks.NOTE in result.stderr
    assert "torch" + os.sep not in "".join(frames)  # torch's frames that safesparse called


def test_plain_python_full(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(WITH_SAFESPARSE, encoding="utf-8")
    result = _run([path.name], tmp_path, SAFESPARSE_TRACEBACK="FULL")
    assert result.returncode == 1 and _ours(result.stderr), result.stderr


def test_an_unknown_value_shows_everything_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(WITH_SAFESPARSE, encoding="utf-8")
    result = _run([path.name], tmp_path, SAFESPARSE_TRACEBACK="brief")
    assert result.returncode == 1 and _ours(result.stderr)
    assert "SAFESPARSE_TRACEBACK='brief' is neither 'short' nor 'full'" in result.stderr


def test_other_errors_keep_their_traceback(tmp_path: Path) -> None:
    path = tmp_path / "other.py"
    path.write_text("import safesparse as ss\nss.sparse_csr_tensor([0, 1], [0], [1.0], (1, 1.5))\n",
                    encoding="utf-8")
    result = _run([path.name], tmp_path)
    assert result.returncode == 1 and "TypeError" in result.stderr
    assert _ours(result.stderr), result.stderr  # not an InvariantError: left as Python shows it
    assert tracebacks.NOTE not in result.stderr


PYTEST_FILE = """\
import torch


def build():
    return torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]),
                                   torch.ones(2), (2, 3), check_invariants=False)


def test_model():
    assert build() is not None
"""


@pytest.mark.parametrize("extra", [[], ["--tb=native"]])
def test_pytest_enforce_reports_without_safesparse_frames(
    tmp_path: Path, extra: list[str],
) -> None:
    (tmp_path / "test_user.py").write_text(PYTEST_FILE, encoding="utf-8")
    # safesparse's plugin named with -p, other plugins left out (test_protect.py's
    # test_pytest_option finds it through its entry point, among the installed plugins)
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "safesparse_hooks.pytest_plugin",
            "--safesparse=enforce", "-q", *extra, "test_user.py"]
    result = _run(args, tmp_path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "[CSR 5.5]" in out and "test_user.py" in out
    assert PACKAGE not in out, out
    full = _run([*args[:-1], "--full-trace", "test_user.py"], tmp_path,
                PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert PACKAGE in full.stdout + full.stderr


def test_uncaught_errors_in_threads_are_short(tmp_path: Path) -> None:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent("""\
        import threading
        import safesparse as ss

        def work():
            ss.validate(ss.sparse_csr_tensor([0, 1], [5], [1.0], (1, 2), check_invariants=False))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        """), encoding="utf-8")
    result = _run([path.name], tmp_path)
    assert "[CSR 5.5]" in result.stderr and "in work" in result.stderr
    assert _ours(result.stderr) == [], result.stderr


# --- in process ---------------------------------------------------------------------------------


def _caught() -> ss.InvariantError:
    bad = ss.sparse_csr_tensor([0, 1, 2], [0, 10**9], [1.0, 2.0], (2, 3), check_invariants=False)
    try:
        torch.mm(bad, torch.ones(3, 1))
    except ss.InvariantError as err:
        return err
    raise AssertionError("not refused")


def _files(tb: TracebackType | None) -> list[str]:
    return [os.path.abspath(f.filename) for f in traceback.extract_tb(tb)]


def test_shorten_removes_safesparse_frames_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracebacks.ENV, raising=False)
    err = _caught()
    before = _files(err.__traceback__)
    assert any(f.startswith(PACKAGE) for f in before)
    head = tracebacks.shorten(err)
    after = _files(head)
    assert after == [__file__] and _files(err.__traceback__) == after
    assert tracebacks.shorten(err) is head  # a second time changes nothing
    assert getattr(err, "__notes__", [tracebacks.NOTE]).count(tracebacks.NOTE) == 1


def test_shorten_leaves_errors_alone_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tracebacks.ENV, "full")
    err = _caught()
    before = _files(err.__traceback__)
    assert tracebacks.shorten(err) is err.__traceback__
    assert _files(err.__traceback__) == before and not getattr(err, "__notes__", [])


def test_shorten_reaches_an_invariant_error_in_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracebacks.ENV, raising=False)
    try:
        try:
            ss.validate(ss.sparse_coo_tensor([[3]], [1.0], (2,), check_invariants=False))
        except ss.InvariantError as inner:
            raise KeyError("wrapped") from inner
    except KeyError as outer:
        head = tracebacks.shorten(outer)
        assert head is outer.__traceback__  # the user's own error is left as it is
        cause = outer.__cause__
        assert isinstance(cause, ss.InvariantError)
        assert _files(cause.__traceback__) == [__file__]


def test_the_error_an_operation_raises_hides_safesparse_handled_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(tracebacks.ENV, raising=False)

    def internal() -> None:  # stands for safesparse's own code: handles one error, raises one
        try:
            {}["missing"]
        except KeyError:
            raise ss.InvariantError(torch.sparse_coo, "5.1", "position 0") from None

    monkeypatch.setattr(tracebacks, "_OURS", (__file__,))  # this file plays safesparse
    try:
        try:
            {}["x"]
        except KeyError:
            internal()
    except ss.InvariantError as err:
        tracebacks.shorten(err)
        assert err.__suppress_context__  # only "ours" frames in its context: not shown


def test_nothing_runs_on_the_happy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Operations, refusals the program catches and validation never call the filter."""
    calls: list[object] = []
    monkeypatch.setattr(tracebacks, "shorten", lambda *a, **k: calls.append(a))
    a = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], (2, 3))
    for _ in range(3):
        (a @ torch.ones(3, 1)).sum()
        a.mT.to_dense()
        ss.validate(a)
        with pytest.raises(ss.InvariantError):
            ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], (2, 3))
    assert calls == []


def test_the_hooks_are_installed_once_and_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Other code may wrap sys.excepthook after safesparse, torch.distributed does, calling
    ours in turn; so the hooks are installed afresh here.)"""
    import threading

    seen: list[TracebackType | None] = []
    monkeypatch.setattr(sys, "excepthook", lambda t, v, tb: seen.append(tb))
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    tracebacks.install()
    hook, thread_hook = sys.excepthook, threading.excepthook
    assert getattr(hook, "_safesparse", False) and getattr(thread_hook, "_safesparse", False)
    tracebacks.install()
    assert (sys.excepthook, threading.excepthook) == (hook, thread_hook)  # idempotent
    monkeypatch.delenv(tracebacks.ENV, raising=False)
    err = _caught()
    sys.excepthook(type(err), err, err.__traceback__)
    assert _files(seen[0]) == [__file__]  # the previous hook got the short traceback

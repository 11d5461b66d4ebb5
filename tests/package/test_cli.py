"""``python -m safesparse check`` / ``demo``: report lines, JSON, exit codes, progress, and the
segfault that plain torch does not prevent (run in subprocesses)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli import run_cli

import safesparse as ss
from safesparse import cli

ROOT = Path(__file__).resolve().parents[2]


def unchecked_csr(col: list[int], n: int = 3) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.arange(len(col) + 1), torch.tensor(col),
                                   torch.ones(len(col)), (n, n), check_invariants=False)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """good.pt (valid tensors of several layouts), bad.pt (one tampered CSR), plain.pt (no sparse
    tensor), text.txt (not a checkpoint), evil.pt and other.pt (globals weights_only refuses:
    from a blocked module, and one not allowlisted)."""
    out = {name: tmp_path / name for name in
           ("good.pt", "bad.pt", "plain.pt", "text.txt", "evil.pt", "other.pt")}
    eye = torch.eye(4)
    torch.save({
        "enc": {"weight": ss.unwrap(ss.validate(eye.to_sparse_bsr((2, 2))))},
        "emb": [eye.to_sparse(), (eye.to_sparse_csc(),)],
        "step": 3,
    }, out["good.pt"])
    torch.save({"ok": eye.to_sparse_csr(), "decoder.weight": unchecked_csr([0, 10**9, 1])},
               out["bad.pt"])
    torch.save({"w": torch.ones(2)}, out["plain.pt"])
    out["text.txt"].write_text("not a checkpoint\n")
    torch.save({"f": os.system}, out["evil.pt"])
    torch.save({"f": io.StringIO}, out["other.pt"])
    return out


# --- text report and exit codes ----------------------------------------------------------------


def test_valid_file_exits_0_with_one_line_per_sparse_tensor(files: dict[str, Path]) -> None:
    code, out = run_cli("check", files["good.pt"])
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{files['good.pt']}: 3 sparse tensors, 0 dense tensors"
    body = [line.split() for line in lines[1:4]]
    assert [row[0] for row in body] == ["['enc']['weight']", "['emb'][0]", "['emb'][1][0]"]
    assert [row[1] for row in body] == ["BSR", "COO", "CSC"]
    assert all(" ".join(row[2:]) == "(4, 4) nnz " + row[-2] + " OK" for row in body)
    assert [row[-2] for row in body] == ["2", "4", "4"]
    assert lines[4] == ("summary: 1 file, 3 sparse tensors checked (3 valid, 0 invalid), "
                        "0 dense tensors, 0 unreadable")


def test_invalid_file_exits_1_and_names_invariant_and_location(files: dict[str, Path]) -> None:
    code, out = run_cli("check", files["bad.pt"])
    assert code == 1
    bad = next(line for line in out.splitlines() if "decoder.weight" in line)
    assert bad.split()[:5] == ["['decoder.weight']", "CSR", "(3,", "3)", "nnz"]
    assert "INVALID [CSR 5.5] column 1000000000 is out of range for 3 columns (row 1, " \
           "position 1: col_indices[1] = 1000000000, n_plain = 3) (loaded by check from " \
           "'bad.pt'); invariant: plain indices are < n_plain; to repair: the file's index " \
           "data is corrupt or belongs to another model" in bad
    ok = next(line for line in out.splitlines() if "['ok']" in line)
    assert ok.rstrip().endswith("OK")
    assert out.splitlines()[-1].endswith("(1 valid, 1 invalid), 0 dense tensors, 0 unreadable")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("missing.pt", "no such file"),
        ("text.txt", "not a torch checkpoint"),
        ("evil.pt", "refused by torch.load(weights_only=True): Trying to load unsupported "
                    "GLOBAL posix.system whose module posix is blocked."),
        ("other.pt", "refused by torch.load(weights_only=True): _io.StringIO is not an allowed "
                     "global; if you trust this file, admit it with --allow-global _io.StringIO"),
    ],
)
def test_unreadable_file_exits_2(files: dict[str, Path], tmp_path: Path, name: str,
                                 reason: str) -> None:
    path = tmp_path / name
    code, out = run_cli("check", path)
    assert code == 2
    assert out.splitlines()[0].startswith(f"{path}: cannot read: {reason}")
    assert out.splitlines()[-1].endswith("0 invalid), 0 dense tensors, 1 unreadable")


def test_a_truncated_file_and_an_empty_directory_are_unreadable(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(files["good.pt"].read_bytes()[:200])
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = run_cli("check", empty, truncated)
    assert code == 2
    assert f"{truncated}: cannot read: " in out
    assert (f"{empty}: cannot read: no checkpoint files "
            "(.pt, .pth, .ckpt, .bin, .safetensors, .pt2)" in out)


def test_unreadable_wins_over_invalid_and_every_file_is_reported(files: dict[str, Path]) -> None:
    code, out = run_cli("check", files["good.pt"], files["bad.pt"], files["text.txt"],
                    files["plain.pt"])
    assert code == 2
    assert f"{files['plain.pt']}: 0 sparse tensors, 1 dense tensor" in out
    assert out.splitlines()[-1] == (
        "summary: 4 files, 5 sparse tensors checked (4 valid, 1 invalid), 1 dense tensor, "
        "1 unreadable")
    assert run_cli("check", files["good.pt"], files["plain.pt"])[0] == 0
    assert run_cli("check", files["good.pt"], files["bad.pt"])[0] == 1


def test_legacy_format_file(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.eye(2).to_sparse_csr(), "b": unchecked_csr([0, 10**9, 1])}, path,
               _use_new_zipfile_serialization=False)
    code, out = run_cli("check", path)
    assert code == 1
    assert "['a']" in out.splitlines()[1] and out.splitlines()[1].endswith("OK")
    assert "['b']" in out.splitlines()[2] and "INVALID [CSR 5.5]" in out.splitlines()[2]


def test_file_holding_a_bare_tensor(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save(unchecked_csr([2, 0, 5]), path)
    code, out = run_cli("check", path)
    assert code == 1 and out.splitlines()[1].split()[:2] == ["<root>", "CSR"]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["check"], ["frobnicate"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    assert "usage: safesparse" in capsys.readouterr().err


# --- JSON --------------------------------------------------------------------------------------

TENSOR_KEYS = {"key", "key_path", "layout", "shape", "nnz", "ok", "valid", "invariant",
               "message", "location", "aliased_with"}


def test_json_document_schema(files: dict[str, Path]) -> None:
    code, out = run_cli("check", "--json", files["good.pt"], files["bad.pt"], files["evil.pt"])
    assert code == 2
    doc = json.loads(out)
    assert set(doc) == {"files", "summary"}
    assert doc["summary"] == {"files": 3, "tensors": 5, "valid": 4, "invalid": 1, "aliased": 0,
                              "dense": 0, "unreadable": 1}
    good, bad, evil = doc["files"]
    for entry, path in zip(doc["files"], ("good.pt", "bad.pt", "evil.pt"), strict=True):
        assert set(entry) == {"path", "ok", "error", "dense", "kind", "tensors"}
        assert entry["path"] == str(files[path])
    assert good["ok"] is True and good["error"] is None
    assert bad["ok"] is False and bad["error"] is None
    assert evil["ok"] is False and "posix is blocked" in evil["error"]
    assert evil["tensors"] == []
    for t in good["tensors"] + bad["tensors"]:
        assert set(t) == TENSOR_KEYS
        assert isinstance(t["key"], str) and t["layout"] in {"COO", "CSR", "CSC", "BSR", "BSC"}
        assert all(isinstance(s, int) for s in t["shape"]) and isinstance(t["nnz"], int)
    assert good["tensors"][0] == {
        "key": "['enc']['weight']", "key_path": ["enc", "weight"], "layout": "BSR",
        "shape": [4, 4], "nnz": 2, "ok": True, "valid": True, "invariant": None,
        "message": None, "location": None, "aliased_with": [],
    }
    assert [t["key_path"] for t in good["tensors"][1:]] == [["emb", 0], ["emb", 1, 0]]
    tampered = bad["tensors"][1]
    assert tampered["key"] == "['decoder.weight']" and tampered["ok"] is False
    assert tampered["key_path"] == ["decoder.weight"] and tampered["valid"] is False
    assert tampered["invariant"] == "5.5" and tampered["message"].startswith("[CSR 5.5]")
    assert tampered["location"] == {"batch": [], "row": 1, "position": 1, "value": 10**9}
    assert (tampered["shape"], tampered["nnz"]) == ([3, 3], 3)


def test_json_for_a_valid_file_exits_0(files: dict[str, Path]) -> None:
    code, out = run_cli("check", "--json", files["good.pt"])
    assert code == 0 and json.loads(out)["summary"]["invalid"] == 0


# --- progress ----------------------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_only_on_a_terminal_for_large_files(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tty: bool
) -> None:
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(cli, "PROGRESS_INTERVAL_S", 0.0)
    err = FakeTerminal(tty)
    report = cli.check_file(files["bad.pt"], progress_stream=err)
    assert report.invalid == 1
    if tty:
        assert "loading" in err.getvalue() and "2 sparse tensors checked" in err.getvalue()
        assert "1 sparse tensor checked (last" in err.getvalue()  # singular
        assert err.getvalue().endswith("\r\x1b[K")  # the status line is cleared at the end
    else:
        assert err.getvalue() == ""


def test_no_progress_for_small_files(files: dict[str, Path]) -> None:
    err = FakeTerminal(True)
    cli.check_file(files["good.pt"], progress_stream=err)
    assert err.getvalue() == ""


# --- demo --------------------------------------------------------------------------------------


def test_demo_catches_the_tampered_tensor_and_exits_0() -> None:
    code, out = run_cli("demo")
    assert code == 0
    assert "checkpoint.pt: 3 sparse tensors, 1 dense tensor" in out
    assert "['encoder.weight']" in out and "['embedding.weight']" in out
    assert "INVALID [CSR 5.5]" in out and "What was caught" in out
    assert sum(line.rstrip().endswith(" OK") for line in out.splitlines()) == 2


def test_demo_prints_no_path_that_is_gone_when_it_ends() -> None:
    code, out = run_cli("demo")
    assert code == 0
    assert tempfile.gettempdir() not in out and "safesparse-demo-" not in out
    assert "Wrote checkpoint.pt (in a temporary directory, removed when the demo ends" in out
    assert "$ python -m safesparse check checkpoint.pt" in out


def test_demo_keep_leaves_the_checkpoint_it_names(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    code, out = run_cli("demo", "--keep", target)
    assert code == 0
    kept = target / "checkpoint.pt"
    assert kept.is_file()
    assert f"Wrote {kept}, a state dict with" in out
    assert f"$ python -m safesparse check {kept}" in out
    check_code, check_out = run_cli("check", kept)
    assert check_code == 1 and "INVALID [CSR 5.5]" in check_out


def test_console_script_points_at_main() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'safesparse = "safesparse.cli:main"' in text


# --- the segfault, in subprocesses -------------------------------------------------------------


def _no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _python(code: str | None, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv: list[Any] = [sys.executable]
    argv += ["-c", textwrap.dedent(code)] if code is not None else []
    argv += [str(a) for a in args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=_no_core_dump if os.name == "posix" else None)


def test_tampered_file_crashes_plain_torch_but_not_safesparse(tmp_path: Path) -> None:
    path = tmp_path / "tampered.pt"
    torch.save({"decoder.weight": unchecked_csr([0, 10**9, 1])}, path)

    plain = _python(
        """
        import sys, torch
        w = torch.load(sys.argv[1], weights_only=True)["decoder.weight"]
        print("loaded without complaint", flush=True)
        w @ torch.ones(3, 1)
        print("survived", flush=True)
        """,
        path, cwd=tmp_path,
    )
    assert "loaded without complaint" in plain.stdout, plain.stderr
    checked = _python(None, "-m", "safesparse", "check", path, cwd=tmp_path)
    assert checked.returncode == 1, checked.stderr
    line = next(x for x in checked.stdout.splitlines() if "decoder.weight" in x)
    assert "INVALID [CSR 5.5]" in line and "col_indices[1] = 1000000000" in line
    assert "Traceback" not in checked.stderr and "Error" not in checked.stderr

    if plain.returncode == 0 or os.name != "posix":
        pytest.skip("plain torch did not crash on this machine (the safesparse half passed)")
    assert plain.returncode < 0, plain.stderr  # killed by a signal: SIGSEGV / SIGBUS
    assert -plain.returncode in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)
    assert "survived" not in plain.stdout


# --- directories, aliasing, dense counts ----------------------------------------------------------


def test_a_directory_is_searched_recursively(tmp_path: Path, files: dict[str, Path]) -> None:
    root = tmp_path / "ckpts"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.pt").write_bytes(files["good.pt"].read_bytes())
    (root / "sub" / "b.pth").write_bytes(files["plain.pt"].read_bytes())
    (root / "sub" / "deeper" / "c.CKPT").write_bytes(files["bad.pt"].read_bytes())
    (root / "sub" / "model.bin").write_bytes(files["good.pt"].read_bytes())
    (root / "sub" / "tokenizer.bin").write_bytes(b"\x00\x01 not torch")  # another format
    (root / "notes.txt").write_text("not a checkpoint")
    (root / ".git" / "hidden.pt").write_bytes(files["bad.pt"].read_bytes())
    assert cli.find_checkpoints(root) == [root / "a.pt", root / "sub" / "b.pth",
                                          root / "sub" / "model.bin",
                                          root / "sub" / "deeper" / "c.CKPT"]
    code, out = run_cli("check", root)
    assert code == 1
    headers = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert headers == [str(root / "a.pt"), str(root / "sub" / "b.pth"),
                       str(root / "sub" / "model.bin"), str(root / "sub" / "deeper" / "c.CKPT"),
                       "summary"]
    assert out.splitlines()[-1] == (
        "summary: 4 files, 8 sparse tensors checked (7 valid, 1 invalid), 1 dense tensor, "
        "0 unreadable")


def test_aliased_index_storage_is_reported_and_exits_1(tmp_path: Path) -> None:
    w = torch.eye(3).to_sparse_csr()
    path = tmp_path / "alias.pt"
    torch.save({"weight": w, "step_counter": w.col_indices()[:], "bias": torch.zeros(3)}, path)
    code, out = run_cli("check", path)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"{path}: 1 sparse tensor, 2 dense tensors"
    assert lines[1].split()[:2] == ["['weight']", "CSR"]
    assert lines[1].endswith("ALIASED index storage shared with ['step_counter'] "
                             "(ss.load gives it a copy of its own)")
    assert lines[2] == ("summary: 1 file, 1 sparse tensor checked (1 valid, 0 invalid, "
                        "1 aliased), 2 dense tensors, 0 unreadable")
    doc = json.loads(run_cli("check", "--json", path)[1])
    assert doc["summary"]["aliased"] == 1 and doc["files"][0]["ok"] is False
    assert doc["files"][0]["tensors"][0]["aliased_with"] == ["['step_counter']"]


def test_key_paths_in_json_follow_into_the_object(tmp_path: Path) -> None:
    import functools
    import operator

    obj = {"model": {"layers": [{"w": torch.eye(2).to_sparse()}], 3: torch.eye(2).to_sparse()}}
    path = tmp_path / "nested.pt"
    torch.save(obj, path)
    doc = json.loads(run_cli("check", "--json", path)[1])
    key_paths = [t["key_path"] for t in doc["files"][0]["tensors"]]
    assert key_paths == [["model", "layers", 0, "w"], ["model", 3]]
    for kp in key_paths:  # a consumer can follow a plain key path with obj[k]
        assert functools.reduce(operator.getitem, kp, obj).layout == torch.sparse_coo

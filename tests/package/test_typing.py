"""Typing for users: ``mypy --strict`` accepts a script that chains ops on a SafeSparseTensor
(tests/typing/user_script.py) without a single ``cast``, and the script runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "typing" / "user_script.py"


def test_the_user_script_runs() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (the dev extra; .ci/run checks the script)")
def test_mypy_strict_accepts_the_user_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(SCRIPT)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr

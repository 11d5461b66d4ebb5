"""torch's "support is in beta state" warning never points into safesparse: where safesparse's
own code is what first builds a compressed tensor, it is silenced; user code still gets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_no_beta_warning_from_safesparse_lines() -> None:
    err = _run("import safesparse as ss\n"
               "ss.sparse_csr_tensor([0, 1], [0], [1.0], (1, 1))\n")
    assert "beta state" not in err


def test_user_code_still_gets_torch_s_warning() -> None:
    err = _run("import torch, safesparse\n"
               "torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]),\n"
               "                        torch.tensor([1.0]), (1, 1), check_invariants=True)\n")
    assert "beta state" in err and "<string>" in err

"""No warning from safesparse's own import on a NumPy-less install (torch works without NumPy).

NumPy is hidden from a fresh interpreter with ``sys.modules["numpy"] = None``, which makes
torch's NumPy initialisation fail exactly as in an environment without NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDE_NUMPY = "import sys; sys.modules['numpy'] = None\n"


def _stderr(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", HIDE_NUMPY + code],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_importing_safesparse_first_does_not_warn_about_numpy() -> None:
    if "Failed to initialize NumPy" not in _stderr("import torch"):
        pytest.skip("this torch does not warn about a missing NumPy at import")
    err = _stderr(
        "import safesparse as ss\n"
        "a = ss.sparse_csr_tensor([0, 1], [0], [1.0], size=(1, 2))\n"
        "assert ss.is_checked(a)\n"
    )
    assert "NumPy" not in err, err


def test_a_program_that_imports_torch_first_keeps_torchs_warning() -> None:
    """Only the import safesparse causes is quiet: torch's own import is not touched."""
    err = _stderr("import torch\nimport safesparse\n")
    control = _stderr("import torch\n")
    assert ("Failed to initialize NumPy" in err) == ("Failed to initialize NumPy" in control)

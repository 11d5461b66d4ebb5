"""``SAFESPARSE_OMP_PASSIVE=1``: the startup hook sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is
imported, on request only, never over the user's own setting (issue 45, item 4).

Each case runs the ``.pth`` line of this checkout in a child started with ``-S`` (no
site-packages hook ran before), then reports what the environment holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from safesparse_hooks import env

ROOT = Path(__file__).resolve().parents[2]
REPORT = "print(os.environ.get('OMP_WAIT_POLICY', '-'))"


def _run(env_extra: dict[str, str], code_after: str = REPORT) -> subprocess.CompletedProcess[str]:
    pth = (ROOT / "safesparse-startup.pth").read_text()
    code = f"import os\nexec({pth!r})\n{code_after}"
    environ = {k: v for k, v in os.environ.items()
               if k not in (*env.VARIABLES, env.OMP_PASSIVE, env.OMP_WAIT_POLICY)}
    purelib = sysconfig.get_paths()["purelib"]
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), purelib])
    environ.update(env_extra)
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          env=environ, timeout=300)


@pytest.mark.parametrize(("extra", "want"), [
    ({}, "-"),                                                            # never silently
    ({env.OMP_PASSIVE: "0"}, "-"),
    ({env.OMP_PASSIVE: "1"}, "PASSIVE"),
    ({env.OMP_PASSIVE: "on"}, "PASSIVE"),
    ({env.OMP_PASSIVE: "1", env.OMP_WAIT_POLICY: "ACTIVE"}, "ACTIVE"),   # the user's wins
])
def test_the_hook_sets_it_on_request_only(extra: dict[str, str], want: str) -> None:
    proc = _run(extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [want]


def test_set_before_torch_is_imported_without_importing_safesparse() -> None:
    proc = _run({env.OMP_PASSIVE: "1"},
                "import sys\n"
                "print('torch' in sys.modules, 'safesparse' in sys.modules)\n"
                "import torch\n"
                "print(os.environ['OMP_WAIT_POLICY'], 'safesparse' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    # (only the passive request: enforce / debug off, so safesparse is not imported for it)
    assert proc.stdout.split() == ["False", "False", "PASSIVE", "False"]


def test_a_bad_value_is_an_error_naming_the_variable() -> None:
    proc = _run({env.OMP_PASSIVE: "passive"})
    assert proc.returncode == 2
    assert env.OMP_PASSIVE in proc.stderr and proc.stdout == ""


def test_too_late_when_torch_is_imported(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from safesparse_hooks import startup

    monkeypatch.delenv(env.OMP_WAIT_POLICY, raising=False)
    assert "torch" in sys.modules
    assert startup.omp_passive() is False
    assert env.OMP_WAIT_POLICY not in os.environ
    assert "torch is imported already" in capsys.readouterr().err

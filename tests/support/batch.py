"""Short child programs of one test module run in one child process.

Many tests run a program in another process because it could crash (a kernel reading bad
indices is what they rule out) or because it leaves enforce mode's wrappers behind, not
because it needs an interpreter of its own; starting Python and importing torch costs about
two seconds of CPU each time, most of what those tests cost. A :class:`Batch` runs such
programs one after another in a single child (``batch_child.py``), each as ``__main__`` in its
own namespace and empty working directory, and gives each test the
:class:`subprocess.CompletedProcess` it would have had from a child of its own: its exit
status, its stdout and its stderr.

The first test of a batch that asks for a result starts the child; the others read what it
left. The tests of a batch carry ``Batch.mark`` (one xdist group), so one worker runs the child
once. If the child dies (a segfault, an abort), the program it died in gets the child's exit
status, what it printed until then and the child's stderr; the programs after it were not run:
their tests fail, saying so.

A program that must start in a fresh interpreter (the environment read at import, the modules
an import loads, an uncaught error's traceback, ``set_enforce`` left on) keeps its own child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().with_name("batch_child.py")


class Batch:
    """Programs added at import time (:meth:`add`), run together on first :meth:`run`."""

    def __init__(self, name: str, *, env: Mapping[str, str], timeout: float = 600) -> None:
        self.name = name
        self.env = dict(env)
        self.timeout = timeout
        self.mark = pytest.mark.xdist_group(f"batch:{name}")
        self._programs: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._results: dict[str, subprocess.CompletedProcess[str]] | None = None

    def add(self, key: str, code: str, *args: str) -> str:
        """Register ``code`` (dedented) to run with ``sys.argv == [key, *args]``; returns
        ``key`` (what :meth:`run` takes)."""
        if key in self._programs:
            raise ValueError(f"batch {self.name!r} already has a program {key!r}")
        if self._results is not None:
            raise RuntimeError(f"batch {self.name!r} has already run; add programs at import")
        self._programs[key] = (textwrap.dedent(code), args)
        return key

    def run(self, key: str) -> subprocess.CompletedProcess[str]:
        """What program ``key`` did: as if it had run alone in ``python -c``."""
        if self._results is None:
            self._results = self._run_all()
        return self._results[key]

    def _run_all(self) -> dict[str, subprocess.CompletedProcess[str]]:
        keys = list(self._programs)
        spec = [{"key": k, "code": self._programs[k][0], "args": list(self._programs[k][1])}
                for k in keys]
        with tempfile.TemporaryDirectory(prefix=f"batch-{self.name}-") as tmp:
            outdir = Path(tmp)
            (outdir / "spec.json").write_text(json.dumps(spec))
            try:
                child = subprocess.run(
                    [sys.executable, str(CHILD), str(outdir / "spec.json"), str(outdir)],
                    capture_output=True, text=True, env=self.env, cwd=tmp,
                    timeout=self.timeout)
                status, child_err = child.returncode, child.stderr
            except subprocess.TimeoutExpired as expired:
                status = -9
                child_err = f"the batch's child timed out after {self.timeout} s\n" + (
                    expired.stderr.decode(errors="replace")
                    if isinstance(expired.stderr, bytes) else expired.stderr or "")
            results: dict[str, subprocess.CompletedProcess[str]] = {}
            died_in: str | None = None
            for i, key in enumerate(keys):
                out, err, rc = (outdir / f"{i}.out", outdir / f"{i}.err", outdir / f"{i}.rc")
                args = [sys.executable, "-c", f"<batch {self.name!r} program {key!r}>"]
                if rc.exists():
                    results[key] = subprocess.CompletedProcess(
                        args, int(rc.read_text()), out.read_text(), err.read_text())
                elif out.exists():
                    died_in = key
                    results[key] = subprocess.CompletedProcess(
                        args, status if status else 1, out.read_text(),
                        err.read_text() + f"\n[the batch's child ended in this program, "
                        f"exit status {status}]\n{child_err}")
                else:
                    results[key] = subprocess.CompletedProcess(
                        args, status if status else 1, "",
                        f"not run: the batch's child ended in program {died_in!r} "
                        f"(exit status {status})\n{child_err}")
        return results


def child_env(root: Path, *, drop: tuple[str, ...] = (), minimal: bool = False) -> dict[str, str]:
    """An environment for a child that imports safesparse from ``root``: this process's
    environment less the variables in ``drop`` (or only ``PATH`` when ``minimal``), with
    ``root`` first on ``PYTHONPATH``."""
    if minimal:
        return {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ["PYTHONPATH"] = os.pathsep.join([str(root), environ.get("PYTHONPATH", "")])
    return environ

"""Two gloo processes on this machine running one worker script: their JSON results by rank.

Each rank runs ``python WORKER RANK 2 STORE OUT_JSON`` in ``tmp`` (a ``file://`` rendezvous,
gloo on the loopback interface: no address beyond this machine), under a timeout; a rank that
fails or writes nothing fails the test with its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

Results = dict[int, dict[str, Any]]


def run_two_ranks(worker: Path, tmp: Path, timeout: float) -> Results:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(tmp / "store"),
             str(tmp / f"{rank}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results: Results = {}
    for rank, p in enumerate(procs):
        path = tmp / f"{rank}.json"
        if p.returncode != 0 or not path.exists():
            pytest.fail(f"rank {rank} exited with {p.returncode}:\n{outputs[rank][-6000:]}")
        results[rank] = json.loads(path.read_text())
    return results

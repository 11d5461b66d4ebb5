"""Two gloo processes on this machine running one worker script: their JSON results by rank.

Both sides of the protocol: :func:`run_two_ranks` (the test) starts each rank as
``python WORKER RANK 2 STORE OUT_JSON`` in ``tmp`` (a ``file://`` rendezvous, gloo on the
loopback interface: no address beyond this machine), under a timeout; a rank that fails or
writes nothing fails the test with its output. The worker script registers its scenarios and
calls :func:`serve`, which runs them in order on every rank and writes their results.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

Result = dict[str, Any]
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
    import pytest  # (not in the ranks, which only serve)

    results: Results = {}
    for rank, p in enumerate(procs):
        path = tmp / f"{rank}.json"
        if p.returncode != 0 or not path.exists():
            pytest.fail(f"rank {rank} exited with {p.returncode}:\n{outputs[rank][-6000:]}")
        results[rank] = json.loads(path.read_text())
    return results


def serve(scenarios: list[Callable[[int], Result]], *, timeout_s: float,
          barrier_each: bool) -> None:
    """The rank's side: ``sys.argv`` is ``WORKER RANK WORLD STORE OUT_JSON [NAME ...]`` (the
    names: run only those scenarios). Each scenario runs in order and its return value, or
    the error it raised, is recorded (``OUT_JSON.partial`` after each, ``OUT_JSON`` at the
    end); with ``barrier_each`` the ranks meet after every scenario, else once at the end."""
    import torch
    import torch.distributed as dist

    rank, world, init_file, out_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                        Path(sys.argv[4]))
    only = set(sys.argv[5:])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    results: Result = {}
    partial = out_path.with_suffix(".partial")
    try:
        for fn in scenarios:
            if only and fn.__name__ not in only:
                continue
            start = time.perf_counter()
            try:
                results[fn.__name__] = {"ok": True, "value": fn(rank)}
            except Exception:
                results[fn.__name__] = {"ok": False, "error": traceback.format_exc()}
            results[fn.__name__]["seconds"] = time.perf_counter() - start  # diagnostics only
            partial.write_text(json.dumps(results))
            if barrier_each:
                dist.barrier()
        if not barrier_each:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    out_path.write_text(json.dumps(results))

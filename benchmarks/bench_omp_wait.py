"""What ``OMP_WAIT_POLICY=PASSIVE`` (``SAFESPARSE_OMP_PASSIVE=1``) costs and saves (issue 45).

GNU OpenMP reads the policy once, when torch loads it, so each configuration runs in its own
child process: OpenMP's default policy and ``PASSIVE``, at one and two threads. Each child times,
interleaved, min of rounds, by the wall clock (threads are the question) and the process's CPU
time: ``SparseLinear`` (1024 x 1024, 25 % of 16 x 16 blocks, bias) forward + backward at batch
256 against ``nn.Linear``, and both forwards at batch 1 under ``no_grad`` (many short parallel
regions: where sleeping threads cost their wake-up)::

    python benchmarks/bench_omp_wait.py            # the four configurations, one table
    python benchmarks/bench_omp_wait.py --rounds 9

On a busy machine the default policy's spinning threads take turns from the thread that has the
work; on a quiet one ``PASSIVE`` pays a wake-up per parallel region. Run it where it matters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(threads: int, rounds: int) -> dict[str, list[float]]:
    import torch
    from torch import nn

    import safesparse as ss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lin = nn.Linear(1024, 1024)
    layer = ss.nn.SparseLinear.from_dense(lin, 16, 0.25)
    x = torch.randn(256, 1024, requires_grad=True)
    gy = torch.randn(256, 1024)
    one = torch.randn(1, 1024)

    def no_grad(m: nn.Module) -> Callable[[], object]:
        def f() -> object:
            with torch.no_grad():
                return m(one)
        return f

    fns: dict[str, tuple[Callable[[], object], int]] = {
        "sparse fwd+bwd 256": (lambda: torch.autograd.grad(layer(x), [x, *layer.parameters()],
                                                           gy), 10),
        "dense fwd+bwd 256": (lambda: torch.autograd.grad(lin(x), [x, *lin.parameters()], gy),
                              10),
        "sparse fwd 1": (no_grad(layer), 500),
        "dense fwd 1": (no_grad(lin), 500),
    }
    best = {k: [float("inf"), float("inf")] for k in fns}
    for f, _ in fns.values():
        f()
        f()
    for _ in range(rounds):
        for name, (f, n) in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                f()
            wall, cpu = (time.perf_counter() - w0) / n, (time.process_time() - c0) / n
            best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.rounds)))
        return 0
    rows = []
    for policy in ("default", "PASSIVE"):
        for threads in (1, 2):
            environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy != "default":
                environ["OMP_WAIT_POLICY"] = policy
            environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
            out = subprocess.run([sys.executable, __file__, "--child", str(threads), "--rounds",
                                  str(args.rounds)], env=environ, capture_output=True,
                                 text=True, check=True, timeout=1800)
            rows.append((policy, threads, json.loads(out.stdout.strip().splitlines()[-1])))
    names = list(rows[0][2])
    print("| OMP_WAIT_POLICY | threads | " + " | ".join(f"{n} wall / cpu (ms)" for n in names)
          + " |")
    print("|---|---|" + "---|" * len(names))
    for policy, threads, best in rows:
        cells = " | ".join(f"{best[n][0] * 1e3:.3f} / {best[n][1] * 1e3:.3f}" for n in names)
        print(f"| {policy} | {threads} | {cells} |")
    print(f"\nload average: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

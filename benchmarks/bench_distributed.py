"""Cost of a validated broadcast of a sparse CSR tensor against plain dist.broadcast.

Standalone script (no pytest): starts 2 gloo processes on 127.0.0.1 (file store in a temporary
directory) and times, on the receiving rank, from a barrier to the received tensor:

* ``plain``: ``dist.broadcast`` of crow_indices, col_indices and values into buffers allocated
  beforehand (the receiver must know the shapes; nothing is checked);
* ``plain, new buffers``: the same into buffers allocated for each message (what any receiver
  that returns a new tensor pays: fresh memory is page-faulted in as it is written);
* ``validate only``: ``ss.sparse_csr_tensor`` on members already received (no communication);
* ``plain + validate``: ``plain``, then ``ss.sparse_csr_tensor`` on the received members (what a
  receiver that validates with the factories pays, shapes still known in advance);
* ``ssd.broadcast``: ``safesparse.distributed.broadcast`` (header, allocation, members, one
  validation).

Usage: ``python benchmarks/bench_distributed.py [--nnz 1e6] [--rows 100000] [--repeat 15]``.
Each process uses ``--threads`` torch threads (default 1: two processes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import safesparse as ss
import safesparse.distributed as ssd


def make_csr(nnz: int, rows: int, cols: int, seed: int = 0) -> ss.SafeSparseTensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.multinomial(torch.ones(rows), nnz, replacement=True, generator=g)
    per_row = torch.bincount(counts, minlength=rows).clamp(max=cols)
    crow = torch.zeros(rows + 1, dtype=torch.int64)
    crow[1:] = per_row.cumsum(0)
    n = int(crow[-1])
    # sorted distinct columns per row: row-local offsets spread over the columns
    row_of = torch.repeat_interleave(torch.arange(rows), per_row)
    pos = torch.arange(n) - crow[row_of]
    step = (cols // per_row.clamp(min=1))[row_of]
    col = pos * step
    vals = torch.randn(n, generator=g)
    return ss.sparse_csr_tensor(crow, col, vals, (rows, cols))


def timed(fn: object, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return times


def worker(rank: int, store: str, args: argparse.Namespace, out: dict[str, list[float]]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    t = make_csr(int(args.nnz), args.rows, args.cols)
    members = [t.crow_indices(), t.col_indices(), t.values()]
    bufs = [torch.empty_like(m) for m in members]

    def plain() -> None:
        for m, b in zip(members, bufs, strict=True):
            dist.broadcast(m if rank == 0 else b, 0)

    def plain_new() -> None:
        for m in members:
            dist.broadcast(m if rank == 0 else torch.empty_like(m), 0)

    def plain_validate() -> None:
        plain()
        if rank == 1:
            # dist.broadcast wrote the buffers without bumping their version counters, so the
            # cache would still hold the previous iteration's proof: forget it
            ss.clear_cache()
            ss.sparse_csr_tensor(bufs[0], bufs[1], bufs[2], t.shape)

    def validate_only() -> None:
        if rank == 1:
            ss.clear_cache()
            ss.sparse_csr_tensor(bufs[0], bufs[1], bufs[2], t.shape)

    def validated() -> None:
        got = ssd.broadcast(t if rank == 0 else None, 0)
        assert ss.is_checked(got)

    methods = (("plain", plain), ("plain, new buffers", plain_new),
               ("validate only", validate_only), ("plain + validate", plain_validate),
               ("ssd.broadcast", validated))
    results: dict[str, list[float]] = {name: [] for name, _ in methods}
    for _, fn in methods:
        timed(fn, 2)  # warm up
    for _ in range(args.repeat):  # interleaved, so that load from elsewhere hits all alike
        for name, fn in methods:
            results[name] += timed(fn, 1)
    if rank == 1:
        out.update(results)
        out["nnz"] = [float(t._nnz())]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnz", type=float, default=1e6)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--cols", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=2)
        results = dict(out)
    nnz = int(results.pop("nnz")[0])
    print(f"torch {torch.__version__}, 2 gloo processes, {args.threads} thread(s) each, "
          f"CSR {args.rows}x{args.cols}, nnz {nnz}, float32 values, int64 indices; "
          f"receiver time from a barrier, median (min) of {args.repeat}")
    base = statistics.median(results["plain"])
    print(f"{'':20} {'median ms':>10} {'min ms':>8} {'ratio':>6}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:20} {med * 1e3:10.2f} {min(times) * 1e3:8.2f} {med / base:6.2f}")


if __name__ == "__main__":
    main()

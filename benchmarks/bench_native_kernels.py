"""The native block kernels alone, against torch's dense GEMMs: one thread, CPU time.

    python benchmarks/bench_native_kernels.py [--batches 1,8,32,256,4096] [--densities 5,10,25]
        [--size 1024 | --shapes 768x768,3072x768,768x3072] [--block 16] [--rounds 7]
        [--threads 1] [--cold] [--dtype float32 | bfloat16] [--lib PATH --abi N]

For each density and batch, the three products of ``y = x W^T`` with ``W`` a BSR matrix
(``size`` x ``size``, ``block`` x ``block`` blocks, a random pattern at that density): forward,
gradient to the input (``g W``, the pattern read by block columns), gradient to the values;
each called straight through ctypes (no Python layers: the kernel's own cost), side by side with
``x @ W.T``, ``g @ W`` and ``g.T @ x`` of the dense ``W`` in one process, interleaved, the min
of ``rounds`` rounds (``time.process_time``: CPU time, honest on a loaded machine). Prints the
ratio to dense per product and for fwd+bwd. ``--lib`` measures another build of the library
(``--abi 1``: the argument lists before the bounds checks) beside this one, for A/B figures:
the columns ``other`` and ``ratio new/other``. ``--threads 2 --wall`` measures the two-thread
split (wall time; the last line says whether the busy-machine back-off has fired).

``--shapes OUTxIN,...``: rectangular weights (``W`` OUT x IN: the encoder layer's 768x768,
3072x768 and 768x3072 at 128 rows, one sequence's inference) instead of ``size`` x ``size``.
``--cold``: every timed call (one call, not a loop) after a 48 MiB write that evicts the caches,
as a layer meets its weights and operands after a dense model's step (the layer tables
interleave each sparse call with a dense one): the misses a kernel does not hide show here,
not in the warm loop. ``--dtype bfloat16``: the bfloat16 kernels (``ss_product_bf16``,
``ss_values_grad_bf16``: AVX512_BF16, float32 sums) against bfloat16 dense GEMMs. The column
``GF/s`` is the kernel's arithmetic rate (2 x batch x stored blocks x block area per product):
against the FMA limit of one core (about 100 GFLOP/s float32 on a Zen 4 core at the clock
these machines run, which MKL's dense GEMM reaches at 80; about 230 in bfloat16 with
vdpbf16ps).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from safesparse.kernels import native
from safesparse.kernels.pattern import by_rows

I64, PTR, INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def load(path: str, abi: int) -> Any:
    lib = ctypes.CDLL(path)
    if abi == 1:
        lib.ss_product.argtypes = [I64, I64, I64, PTR, PTR, PTR, PTR, I64, I64, I64, PTR, INT,
                                   I64, I64, I64, I64, PTR, INT, I64, I64, PTR, INT]
        lib.ss_values_grad.argtypes = [I64, I64, I64, PTR, PTR, PTR, I64, I64, PTR, I64, I64,
                                       I64, INT, PTR, INT]
    else:  # the two products' signatures only (an older build may lack later functions)
        lib.ss_product.argtypes = [I64, I64, I64, I64, PTR, PTR, PTR, PTR, I64, I64, I64, PTR,
                                   INT, I64, I64, I64, I64, PTR, INT, I64, I64, PTR, INT]
        lib.ss_values_grad.argtypes = [I64, I64, I64, I64, I64, PTR, PTR, PTR, I64, I64, PTR,
                                       I64, I64, I64, INT, PTR, INT]
    lib.ss_product.restype = INT
    lib.ss_values_grad.restype = INT
    if not hasattr(lib, "ss_product_bf16"):  # (a build before the bfloat16 kernels)
        return lib
    lib.ss_product_bf16.argtypes = [I64, I64, I64, PTR, PTR, PTR, I64, I64, PTR, I64, I64, I64,
                                    I64, PTR, I64, I64, I64, PTR, I64, I64, PTR, INT]
    lib.ss_values_grad_bf16.argtypes = [I64, I64, I64, PTR, PTR, I64, I64, PTR, I64, I64, PTR,
                                        I64, I64, I64, PTR, INT]
    lib.ss_product_bf16.restype = INT
    lib.ss_values_grad_bf16.restype = INT
    return lib


class Problem:
    """One BSR weight, its pattern data as the operators cache it, and the operands."""

    def __init__(self, size: int, block: int, density: float, batch: int, seed: int,
                 n_in: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_out, n_in = size, size if n_in is None else n_in
        nbr, nbc = n_out // block, n_in // block
        mask = torch.rand(nbr, nbc, generator=gen) < density
        dense = torch.randn(n_out, n_in, generator=gen) * mask.repeat_interleave(
            block, 0).repeat_interleave(block, 1)
        dense = dense.to(dtype)
        w = dense.to_sparse_bsr((block, block))
        self.dense = dense
        self.dtype = dtype
        self.crow = w.crow_indices().contiguous()
        self.col = w.col_indices().contiguous()
        self.vals = w.values().contiguous()
        self.ptr, self.rows_t, self.order = by_rows(self.crow, self.col, nbc)
        self.outer = torch.repeat_interleave(self.crow.diff(), output_size=self.col.numel())
        self.nnzb, self.nbr, self.nbc, self.block, self.batch = (
            self.col.numel(), nbr, nbc, block, batch)
        self.n_out, self.n_in = n_out, n_in
        self.x = torch.randn(batch, n_in, generator=gen).to(dtype)
        self.g = torch.randn(batch, n_out, generator=gen).to(dtype)
        self.y = torch.empty(batch, n_out, dtype=dtype)
        self.gx = torch.empty(batch, n_in, dtype=dtype)
        self.gv = torch.empty(self.nnzb, block, block, dtype=dtype)

    def calls(self, lib: Any, abi: int) -> dict[str, Callable[[], int]]:
        b, n, o, i = self.block, self.batch, self.n_out, self.n_in
        bs2, bs = b * b, b
        nnz = [self.nnzb] if abi >= 2 else []
        dims = [o, i] if abi >= 2 else []
        vp = self.vals.data_ptr()
        if self.dtype == torch.bfloat16:
            return self._calls_bf16(lib)

        def fwd() -> int:
            return int(lib.ss_product(self.nbr, b, b, *nnz, self.crow.data_ptr(),
                                      self.col.data_ptr(), None, vp, bs2, bs, 1,
                                      self.x.data_ptr(), 0, 1, i, i, n, self.y.data_ptr(), 0, 1,
                                      o, None, torch.get_num_threads()))

        def bwd_in() -> int:
            return int(lib.ss_product(self.nbc, b, b, *nnz, self.ptr.data_ptr(),
                                      self.rows_t.data_ptr(), self.order.data_ptr(), vp, bs2, 1,
                                      bs, self.g.data_ptr(), 0, 1, o, o, n, self.gx.data_ptr(),
                                      0, 1, i, None, torch.get_num_threads()))

        def bwd_vals() -> int:
            return int(lib.ss_values_grad(self.nnzb, b, b, *dims, self.outer.data_ptr(),
                                          self.col.data_ptr(), self.g.data_ptr(), 1, o,
                                          self.x.data_ptr(), 1, i, n, 0, self.gv.data_ptr(),
                                          torch.get_num_threads()))

        return {"fwd": fwd, "grad_in": bwd_in, "grad_vals": bwd_vals}

    def _calls_bf16(self, lib: Any) -> dict[str, Callable[[], int]]:
        b, n, o, i, nnzb = self.block, self.batch, self.n_out, self.n_in, self.nnzb
        vp, th = self.vals.data_ptr(), torch.get_num_threads

        def fwd() -> int:
            return int(lib.ss_product_bf16(self.nbr, b, b, self.crow.data_ptr(),
                                           self.col.data_ptr(), None, nnzb, self.nbc, vp, nnzb,
                                           b * b, b, 1, self.x.data_ptr(), 1, i, n,
                                           self.y.data_ptr(), 1, o, None, th()))

        def bwd_in() -> int:
            return int(lib.ss_product_bf16(self.nbc, b, b, self.ptr.data_ptr(),
                                           self.rows_t.data_ptr(), self.order.data_ptr(), nnzb,
                                           self.nbr, vp, nnzb, b * b, 1, b, self.g.data_ptr(), 1,
                                           o, n, self.gx.data_ptr(), 1, i, None, th()))

        def bwd_vals() -> int:
            return int(lib.ss_values_grad_bf16(nnzb, b, b, self.outer.data_ptr(),
                                               self.col.data_ptr(), self.nbr, self.nbc,
                                               self.g.data_ptr(), 1, o, self.x.data_ptr(), 1, i,
                                               n, self.gv.data_ptr(), th()))

        return {"fwd": fwd, "grad_in": bwd_in, "grad_vals": bwd_vals}

    def dense_calls(self) -> dict[str, Callable[[], Any]]:
        w, x, g = self.dense, self.x, self.g
        return {"fwd": lambda: torch.mm(x, w.t()), "grad_in": lambda: torch.mm(g, w),
                "grad_vals": lambda: torch.mm(g.t(), x)}


CLOCK = time.process_time


_EVICT: list[torch.Tensor] = []


def cpu_time(fn: Callable[[], Any], reps: int, cold: bool = False) -> float:
    if cold:  # one call after a write larger than the caches (this process's L2 and L3 share)
        if not _EVICT:
            _EVICT.append(torch.empty(12 << 20))
        _EVICT[0].fill_(1.0)
        t0 = CLOCK()
        fn()
        return CLOCK() - t0
    t0 = CLOCK()
    for _ in range(reps):
        fn()
    return (CLOCK() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,256,1024,4096")
    ap.add_argument("--densities", default="5,10,25")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--shapes", default=None,
                    help="OUTxIN weights, comma-separated (instead of --size)")
    ap.add_argument("--cold", action="store_true",
                    help="each timed call after evicting the caches (one call, not a loop)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true",
                    help="wall time instead of CPU time (for --threads 2 on a quiet machine)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--lib", default=None, help="another build of the library (A/B)")
    ap.add_argument("--abi", type=int, default=2, help="the --lib build's argument lists")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    if not native.available():
        raise SystemExit(f"native kernels: {native.status().reason}")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not native.reads_bf16(dtype, torch.sparse_bsr):
        raise SystemExit("no bfloat16 kernels on this machine (AVX512_BF16)")
    mine = native._lib
    other = load(args.lib, args.abi) if args.lib else None
    shapes = ([tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
              if args.shapes else [(args.size, args.size)])
    print(f"# {native.status().describe()}; threads {args.threads}; "
          f"{', '.join(f'{o}x{i}' for o, i in shapes)}, "
          f"{args.block}x{args.block} blocks, {args.dtype}; min of {args.rounds} rounds, "
          f"{'wall' if args.wall else 'CPU'} time"
          f"{', caches evicted before each call' if args.cold else ''}")
    head = (f"{'shape':>9} {'dens':>4} {'batch':>5} {'product':>9} {'dense us':>9} "
            f"{'kernel us':>9} {'ratio':>6} {'GF/s':>5}")
    print(head + (f" {'other us':>9} {'new/other':>9}" if other else ""))
    for (n_out, n_in), dens, batch in ((sh, int(d), int(b)) for sh in shapes
                                       for d in args.densities.split(",")
                                       for b in args.batches.split(",")):
        if n_out % args.block or n_in % args.block:
            raise SystemExit(f"{n_out}x{n_in}: not whole {args.block}x{args.block} blocks")
        p = Problem(n_out, args.block, dens / 100, batch, seed=dens, n_in=n_in, dtype=dtype)
        work = 2.0 * batch * n_out * n_in
        flop = 2.0 * batch * p.nnzb * args.block * args.block
        reps = max(1, int(2e8 / work))
        kern = p.calls(mine, 2)
        alt = p.calls(other, args.abi) if other else None
        dense = p.dense_calls()
        best: dict[tuple[str, str], float] = {}
        for rnd in range(args.rounds):
            for name in kern:
                runs = [("dense", dense[name]), ("kernel", kern[name]),
                        *((("other", alt[name]),) if alt else ())]
                # each in turn first (the one after the dense GEMM finds colder caches)
                runs = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
                for tag, fn in runs:
                    fn()
                    t = cpu_time(fn, reps, args.cold)
                    best[tag, name] = min(best.get((tag, name), t), t)
        for name in (*kern, "fwd+bwd"):
            if name == "fwd+bwd":
                d = sum(best["dense", k] for k in kern)
                k_ = sum(best["kernel", k] for k in kern)
                o = sum(best["other", k] for k in kern) if alt else 0.0
            else:
                d, k_ = best["dense", name], best["kernel", name]
                o = best["other", name] if alt else 0.0
            per = flop * (3 if name == "fwd+bwd" else 1)
            line = (f"{f'{n_out}x{n_in}':>9} {dens:>4} {batch:>5} {name:>9} {d * 1e6:>9.1f} "
                    f"{k_ * 1e6:>9.1f} {k_ / d:>6.3f} {per / k_ / 1e9:>5.1f}")
            if alt:
                line += f" {o * 1e6:>9.1f} {k_ / o:>9.3f}"
            print(line, flush=True)
    regions, serial_until = native.region_stats()
    fired = serial_until > regions
    print(f"# parallel regions so far {regions}; busy-machine back-off "
          f"{'active' if fired else 'not active'} (one thread up to region {serial_until})")


if __name__ == "__main__":
    main()

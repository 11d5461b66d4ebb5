"""bfloat16 computed in bfloat16 (issue 45, item 3): kernels and ``SparseLinear`` against bf16
``nn.Linear``, one thread, CPU time, interleaved rounds (min), side by side in one process.

    python benchmarks/bench_bf16.py [--batch 256] [--rounds 15] [--size 1024] [--block 16]
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_bf16.py --memory [--size 4096]

Rows per density: the three kernels (forward ``x @ W.T``, gradient to the input ``g @ W``,
gradient to the values) through ``safesparse.kernels.blocks`` with the proof's cache, against
the dense bf16 products ``x @ W.T``, ``g @ W``, ``g.T @ x``; then the layer (forward + backward
of ``SparseLinear.from_dense``, BSR blocks, with bias) against ``nn.Linear``'s. Each is measured
with the bf16 kernels (``bf16``) and on the float32 route with its copies (``f32 route``: the
bf16 kernels turned off in the same process); float16 keeps the float32 route (its dense
products on CPU are far slower than bf16's, so its row is against dense bf16). The arithmetic's
ratio is the density.

``--memory``: the peak resident memory of one training step (forward + backward, gradients
set to None before it) over the step's floor (values gradient + input gradient + output +
bias gradient), from the kernel's high-water mark (reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import best_of

from safesparse.kernels import blocks as bk
from safesparse.kernels import native
from safesparse.kernels.pattern import matrix
from safesparse.nn import SparseLinear


def _switch(on: bool) -> None:
    """The bf16 kernels on (where the CPU has them) or off (the float32 route)."""
    native.status()
    native._bf16_bound = None
    native._bf16_bound = on and native._bf16_library()


def _kernels(layer: SparseLinear, x: torch.Tensor, g: torch.Tensor) -> Callable[[], object]:
    w = matrix(layer.layout, layer.compressed_indices, layer.plain_indices,
               layer.values.detach(), layer.out_features, layer.in_features)
    cache: dict[object, object] = {}

    def run() -> object:
        bk.linear(w, x, cache=cache)
        bk.linear_grad_input(w, g, cache=cache)
        return bk.linear_grad_values(w, g, x, cache=cache)
    return run


def _dense_kernels(w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        x @ w.T
        g @ w
        return g.T @ x
    return run


def _step(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], object]:
    xs = x.clone().requires_grad_()

    def run() -> object:
        layer(xs).backward(g)
        return None
    return run


def _speed(args: argparse.Namespace, density: float, dtype: torch.dtype) -> None:
    n, f = args.batch, args.size
    dense = torch.nn.Linear(f, f, bias=True).to(dtype)
    layer = SparseLinear.from_dense(dense, args.block, density)
    x = torch.randn(n, f, dtype=dtype)
    g = torch.randn(n, f, dtype=dtype)
    if dtype == torch.float16:  # dense float16 on CPU is no baseline: dense bf16 is
        dense = dense.to(torch.bfloat16)
        xb, gb = x.to(torch.bfloat16), g.to(torch.bfloat16)
    else:
        xb, gb = x, g
    fs = {"sk": _kernels(layer, x, g), "dk": _dense_kernels(dense.weight.detach(), xb, gb),
          "sl": _step(layer, x, g), "dl": _step(dense, xb, gb)}
    routes = [("bf16", True), ("f32 route", False)] if dtype == torch.bfloat16 else [
        ("f32 route", False)]
    name = str(dtype).replace("torch.", "")
    for route, on in routes:
        _switch(on)
        t = best_of(fs, args.rounds, time.process_time)
        for what, s, d in (("kernels fwd+bwd", "sk", "dk"), ("layer fwd+bwd", "sl", "dl")):
            print(f"| {density:.2f} | {name} | {what} | {route} | {t[s]:.3f} | {t[d]:.3f} | "
                  f"{t[s] / t[d]:.3f} |")
    _switch(True)


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _step_peak(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    """MiB above the resident memory at the step's start, at its peak."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark := the current resident size
    before = _kib("VmRSS")
    y = layer(x)
    y.backward(g)
    peak = _kib("VmHWM")
    del y
    return (peak - before) / 1024


def _memory(args: argparse.Namespace, density: float) -> None:
    n, f = args.batch, args.size
    dtype = torch.bfloat16
    dense = torch.nn.Linear(f, f, bias=True).to(dtype)
    layer = SparseLinear.from_dense(dense, args.block, density)
    x = torch.randn(n, f, dtype=dtype, requires_grad=True)
    g = torch.randn(n, f, dtype=dtype)
    size = 2  # bytes per bf16 element
    floor = (layer.values.numel() + n * f + n * f + f) * size / 2**20
    dense_floor = (f * f + n * f + n * f + f) * size / 2**20
    for route, on in (("bf16", True), ("f32 route", False)):
        _switch(on)
        # (a copy per route: a layer's eager plan keeps the kernels it was built for, and
        # a copy builds its own at its first call)
        _row(density, "SparseLinear", route, _min_peak(copy.deepcopy(layer), x, g), floor)
    _switch(True)
    _row(density, "nn.Linear", "dense", _min_peak(dense, x, g), dense_floor)


def _min_peak(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    for _ in range(2):
        _step_peak(layer, x, g)
    return min(_step_peak(layer, x, g) for _ in range(3))


def _row(density: float, name: str, route: str, peak: float, floor: float) -> None:
    print(f"| {density:.2f} | {name} | {route} | {peak:.2f} | {floor:.2f} | "
          f"{peak / floor:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--densities", default="0.05,0.10,0.25")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--no-half", action="store_true", help="skip the float16 rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    densities = [float(d) for d in args.densities.split(",")]
    print(f"# {native.status().describe()}; bf16 kernels: {native._bf16_library()}")
    print(f"# {args.size}x{args.size}, {args.block}x{args.block} blocks, batch {args.batch}, "
          f"1 thread; load: {os.getloadavg()}; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}")
    if args.memory:
        print("| density | layer | route | step peak MiB | floor MiB | peak / floor |")
        print("|---|---|---|---|---|---|")
        for density in densities:
            _memory(args, density)
        return
    print(f"CPU time (ms), min of {args.rounds} interleaved rounds")
    print("| density | dtype | what | route | sparse ms | dense bf16 ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for density in densities:
        for dtype in (torch.bfloat16,) if args.no_half else (torch.bfloat16, torch.float16):
            _speed(args, density, dtype)


if __name__ == "__main__":
    main()

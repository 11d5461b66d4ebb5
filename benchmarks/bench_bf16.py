"""bfloat16 computed in bfloat16 (issue 45, item 3): kernels and ``SparseLinear`` against bf16
``nn.Linear``, one thread, CPU time, interleaved rounds (min), side by side in one process.

    python benchmarks/bench_bf16.py [--batch 256] [--rounds 15] [--size 1024] [--block 16]

Rows per density: the three kernels (forward ``x @ W.T``, gradient to the input ``g @ W``,
gradient to the values) through ``safesparse.kernels.blocks`` with the proof's cache, against
the dense bf16 products ``x @ W.T``, ``g @ W``, ``g.T @ x``; then the layer (forward + backward
of ``SparseLinear.from_dense``, BSR blocks) against ``nn.Linear``'s. Each is measured with the
bf16 kernels (``bf16``) and on the float32 route with its copies (``f32 route``: the bf16
kernels turned off in the same process), and float16 (which keeps the float32 route).
The arithmetic's ratio is the density.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import best_of  # noqa: E402

from safesparse.kernels import blocks as bk  # noqa: E402
from safesparse.kernels import native  # noqa: E402
from safesparse.nn import SparseLinear  # noqa: E402


def _switch(on: bool) -> None:
    native._bf16_library()
    native._bf16_bound = on and bool(native._lib.ss_bf16_supported())


def _kernels(layer: SparseLinear, x: torch.Tensor, g: torch.Tensor) -> Callable[[], object]:
    lay = layer.layout
    comp, plain, vals = layer.compressed_indices, layer.plain_indices, layer.values.detach()
    out_f, in_f = layer.out_features, layer.in_features
    cache: dict[object, object] = {}

    def run() -> object:
        bk.linear(x, lay, comp, plain, vals, out_f, in_f, cache=cache)
        bk.linear_grad_input(g, lay, comp, plain, vals, out_f, in_f, cache=cache)
        return bk.linear_grad_values(g, x, lay, comp, plain, vals.shape, out_f, in_f,
                                     cache=cache)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--densities", default="0.05,0.10,0.25")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"# {native.status().describe()}; bf16 kernels: {native._bf16_library()}")
    print(f"# {args.size}x{args.size}, {args.block}x{args.block} blocks, batch {args.batch}, "
          f"1 thread, CPU time (min of {args.rounds}); load: {os.getloadavg()}")
    print("| density | dtype | what | route | sparse ms | dense ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    n, f = args.batch, args.size
    for density in (float(d) for d in args.densities.split(",")):
        for dtype in (torch.bfloat16, torch.float16):
            dense = torch.nn.Linear(f, f, bias=True).to(dtype)
            layer = SparseLinear.from_dense(dense, args.block, density)
            x = torch.randn(n, f, dtype=dtype)
            g = torch.randn(n, f, dtype=dtype)
            w = dense.weight.detach()

            def dense_k() -> object:
                x @ w.T
                g @ w
                return g.T @ x

            xs = x.clone().requires_grad_()
            xd = x.clone().requires_grad_()

            def sparse_l() -> object:
                layer(xs).backward(g)
                return None

            def dense_l() -> object:
                dense(xd).backward(g)
                return None
            routes = (("bf16", True), ("f32 route", False)) if dtype == torch.bfloat16 else (
                ("f32 route", False),)
            for route, on in routes:
                _switch(on)
                t = best_of({"sk": _kernels(layer, x, g), "dk": dense_k, "sl": sparse_l,
                             "dl": dense_l}, args.rounds, time.process_time)
                name = str(dtype).replace("torch.", "")
                print(f"| {density:.2f} | {name} | kernels fwd+bwd | {route} | {t['sk']:.3f} | "
                      f"{t['dk']:.3f} | {t['sk'] / t['dk']:.3f} |")
                print(f"| {density:.2f} | {name} | layer fwd+bwd | {route} | {t['sl']:.3f} | "
                      f"{t['dl']:.3f} | {t['sl'] / t['dl']:.3f} |")
            _switch(True)


if __name__ == "__main__":
    main()

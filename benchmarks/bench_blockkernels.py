"""Speed of the block kernels (safesparse.kernels.blocks) against the dense products they replace.

Standalone script (no pytest). A 1024 x 1024 weight with a random pattern of 16 x 16 blocks
(each block kept with probability ``density``), batch 256, CPU, ``--threads`` torch threads
(default 2). Each row times, side by side in one process, interleaved, min of ``--rounds``:

* ``fwd``: ``blockkernels.linear(w, x)`` against ``x @ W_dense.T``;
* ``fwd+bwd``: ``linear`` + ``linear_grad_input`` + ``linear_grad_values`` against
  ``x @ Wd.T``, ``g @ Wd``, ``g.T @ x`` (an ``nn.Linear``'s forward and backward products);
* ``MKL fwd``: torch's own MKL kernel (``torch.mm`` of a torch BSR / CSR tensor) for the same
  forward, where torch has one (square blocks, CSR), for reference;
* ``torch ops``: the same kernels with the native library off (``native.disabled()``: the
  torch-op kernels, the fallback), fwd+bwd / fwd, in the same rounds.

The first line says which path ``bk`` runs (``native.status()``). Rows with targets (issue 40):
BSR 16 x 16 at 5 %, 10 %, 25 % of blocks; batch 1 and bfloat16 rows at 10 %. Extra rows: BSC 16 x 16
and BSR 16 x 32 at 10 %, CSR at 10 % of elements, and a GCN-like ``A @ x`` (CSR adjacency,
10 000 nodes, ~50 000 edges, 64 features; ``matmul`` + its two gradients against the same with
torch's CSR kernels, ``torch.sparse.mm``).

``--layers`` prints instead docs/models.md's speed table: ``SparseLinear`` (BSR 16 x 16, with a
bias, through the ``safesparse`` operators) / ``nn.Linear`` of the same dtype, 1024 x 1024, per
dtype (float32, bfloat16), batch (256, 1) and stored fraction (5, 10, 25 %): forward under
``no_grad`` and forward + backward (gradients to the input and every parameter), the native
path, the torch-op kernels and plain torch's own BSR forward (``torch.mm(W, x.mT).mT``) beside,
each path in its own interleaved rounds with ``nn.Linear``.

Usage: ``python benchmarks/bench_blockkernels.py [--rounds 20] [--threads 2] [--clock wall]
[--layers [--batches 256,1] [--dtypes float32,bfloat16] [--native-only]]``.
``--clock cpu`` times each call by the calling thread's CPU time (``time.thread_time``): with
``--threads 1`` it is steadier than wall time on a machine shared with other work (it leaves
out the time the thread waits for a core), but it is not what a user waits.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from rounds import best_of as rounds_best_of

from safesparse.kernels import blocks as bk
from safesparse.kernels import native
from safesparse.kernels.pattern import matrix

TARGETS = {0.05: (0.15, 0.13), 0.10: (0.22, 0.20), 0.25: (0.40, 0.36)}


CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter


def best_of(fs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """:func:`rounds.best_of` by this script's clock (``--clock``)."""
    return rounds_best_of(fs, rounds, clock)


def weight(n_out: int, n_in: int, block: tuple[int, int], density: float,
           seed: int = 0) -> torch.Tensor:
    """Dense weight whose nonzeros are a random pattern of blocks (probability ``density``)."""
    gen = torch.Generator().manual_seed(seed)
    r, c = block
    keep = torch.rand(n_out // r, n_in // c, generator=gen) < density
    mask = keep.repeat_interleave(r, 0).repeat_interleave(c, 1)
    return torch.randn(n_out, n_in, generator=gen) * mask


def members(dense: torch.Tensor, layout: torch.layout,
            block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = dense.to_sparse(layout=layout, blocksize=block)
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return s.crow_indices(), s.col_indices(), s.values()
    return s.ccol_indices(), s.row_indices(), s.values()


def linear_row(label: str, layout: torch.layout, block: tuple[int, int] | None,
               density: float, rounds: int, n: int = 1024, batch: int = 256,
               dtype: torch.dtype = torch.float32) -> str:
    wd = weight(n, n, block or (1, 1), density).to(dtype)
    cp, pl, v = members(wd, layout, block)
    cache: dict[object, object] = {}  # what the operators keep with the proof (column order)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, n, generator=gen).to(dtype)
    g = torch.randn(batch, n, generator=gen).to(dtype)
    w = matrix(layout, cp, pl, v, n, n)

    def dense_fb() -> None:
        x @ wd.T
        g @ wd
        g.T @ x

    def sparse_fb() -> None:
        bk.linear(w, x, cache=cache)
        bk.linear_grad_input(w, g, cache=cache)
        bk.linear_grad_values(w, g, x, cache=cache)

    def torch_ops(f: Callable[[], object]) -> Callable[[], object]:
        def run() -> None:
            with native.disabled():
                f()
        return run

    fs: dict[str, Callable[[], object]] = {
        "dense": lambda: x @ wd.T, "sparse": lambda: bk.linear(w, x, cache=cache),
        "dense_fb": dense_fb, "sparse_fb": sparse_fb,
        "ops": torch_ops(lambda: bk.linear(w, x)), "ops_fb": torch_ops(sparse_fb)}
    torch_w = None
    if dtype == torch.float32 and (layout == torch.sparse_csr or (
            layout == torch.sparse_bsr and block and block[0] == block[1])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_w = wd.to_sparse(layout=layout, blocksize=block)
        fs["mkl"] = lambda: torch.mm(torch_w, x.T)
    t = best_of(fs, rounds)
    mkl = f"{t['mkl'] / t['dense']:.2f}" if "mkl" in t else "-"
    fb, fw = t["sparse_fb"] / t["dense_fb"], t["sparse"] / t["dense"]
    ops = f"{t['ops_fb'] / t['dense_fb']:.2f} / {t['ops'] / t['dense']:.2f}"
    target = TARGETS.get(density) if label == "BSR 16x16" else None
    tgt = f"<= {target[0]:.2f} / <= {target[1]:.2f}" if target else "-"
    if label.startswith("BSR 16x16, batch 1"):
        tgt = "- / <= 0.40"
    if label.startswith("BSR 16x16, bfloat16"):
        tgt = "<= 0.50 / -"
    return (f"| {label} | {density:.0%} | {fb:.2f} | {fw:.2f} | {ops} | {mkl} | {tgt} | "
            f"{t['dense_fb']:.3f} / {t['dense']:.3f} |")


def gcn_row(rounds: int, nodes: int = 10_000, edges: int = 50_000, feats: int = 64) -> str:
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, nodes, (2, edges), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = torch.sparse_coo_tensor(idx, torch.rand(edges, generator=gen),
                                    (nodes, nodes)).coalesce().to_sparse_csr()
    cp, pl, v = a.crow_indices(), a.col_indices(), a.values()
    x = torch.randn(nodes, feats, generator=gen)
    g = torch.randn(nodes, feats, generator=gen)
    at = a.mT
    m = matrix(torch.sparse_csr, cp, pl, v, nodes, nodes)
    cache: dict[object, object] = {}  # what the operators keep with the proof (column order)

    def ours() -> None:
        bk.matmul(m, x, cache=cache)
        bk.matmul_grad_input(m, g, cache=cache)
        bk.matmul_grad_values(m, g, x, cache=cache)

    def torch_csr() -> None:
        torch.sparse.mm(a, x)
        torch.sparse.mm(at, g)
        torch.sparse.sampled_addmm(a, g, x.T, beta=0.0)

    t = best_of({"ours_f": lambda: bk.matmul(m, x), "torch_f": lambda: torch.sparse.mm(a, x),
                 "ours": ours, "torch": torch_csr}, rounds)
    return (f"| GCN A @ x vs torch CSR ({a._nnz()} nnz, {feats} cols) | - | "
            f"{t['ours'] / t['torch']:.2f} | {t['ours_f'] / t['torch_f']:.2f} | - | - | "
            f"<= 0.90 / - | {t['torch']:.2f} / {t['torch_f']:.2f} |")


def layer_rows(dtype: torch.dtype, batch: int, density: float, rounds: int,
               others: bool = True) -> str:
    """One row of docs/models.md's speed table (see the module docstring)."""
    from torch import nn

    from safesparse.nn import SparseLinear

    torch.manual_seed(0)
    dense = nn.Linear(1024, 1024).to(dtype)
    layer = SparseLinear.from_dense(nn.Linear(1024, 1024), (16, 16), density).to(dtype)
    w = layer.weight
    plain = torch.sparse_bsr_tensor(w.crow_indices().clone(), w.col_indices().clone(),
                                    w.values().detach().clone(), w.shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 1024, generator=gen).to(dtype).requires_grad_(True)
    gy = torch.randn(batch, 1024, generator=gen).to(dtype)

    def train(m: nn.Module) -> Callable[[], object]:
        inputs = [x, *m.parameters()]
        return lambda: torch.autograd.grad(m(x), inputs, gy)

    def infer(m: nn.Module) -> Callable[[], object]:
        def run() -> None:
            with torch.no_grad():
                m(x)
        return run

    def torch_ops(f: Callable[[], object]) -> Callable[[], object]:
        def run() -> None:
            with native.disabled():
                f()
        return run

    def torch_bsr() -> None:
        with torch.no_grad():
            torch.mm(plain, x.mT)

    # one group per path, each beside nn.Linear: a path's steady state (other paths' large
    # temporaries interleaved between its calls change what its fresh outputs cost)
    base = {"fwd_dense": infer(dense), "fb_dense": train(dense)}
    t = best_of({"fwd": infer(layer), "fb": train(layer), **base}, rounds)
    r = {"fwd": t["fwd"] / t["fwd_dense"], "fb": t["fb"] / t["fb_dense"]}
    dense_ms = (t["fwd_dense"], t["fb_dense"])
    name = str(dtype).replace("torch.", "")
    if not others:
        return (f"| {name} | {batch} | {density:.0%} | {r['fwd']:.3f} | {r['fb']:.3f} | - | - | "
                f"{dense_ms[0]:.3f} / {dense_ms[1]:.3f} |")
    t = best_of({"fwd_ops": torch_ops(infer(layer)), "fb_ops": torch_ops(train(layer)),
                 **base}, rounds)
    r.update(fwd_ops=t["fwd_ops"] / t["fwd_dense"], fb_ops=t["fb_ops"] / t["fb_dense"])
    bsr = "- (no kernel)"
    try:
        torch_bsr()
        t = best_of({"fwd_torch": torch_bsr, "fwd_dense": base["fwd_dense"]}, rounds)
        bsr = f"{t['fwd_torch'] / t['fwd_dense']:.2f}"
    except (RuntimeError, NotImplementedError):
        pass
    return (f"| {name} | {batch} | {density:.0%} | {r['fwd']:.2f} | {r['fb']:.2f} | "
            f"{r['fwd_ops']:.2f} / {r['fb_ops']:.2f} | {bsr} | "
            f"{dense_ms[0]:.3f} / {dense_ms[1]:.3f} |")


def layers_table(rounds: int, dtypes: list[torch.dtype], batches: list[int],
                 others: bool) -> None:
    print("| dtype | batch | blocks stored | forward | forward + backward | torch-op kernels "
          "fwd / fwd+bwd | torch's BSR forward | nn.Linear ms fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for batch in batches:
            for density in (0.05, 0.10, 0.25):
                print(layer_rows(dtype, batch, density, rounds, others), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    parser.add_argument("--layers", action="store_true",
                        help="print docs/models.md's speed table (SparseLinear / nn.Linear)")
    parser.add_argument("--batches", default="256,1", help="--layers: batch sizes")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="--layers: dtypes")
    parser.add_argument("--native-only", action="store_true",
                        help="--layers: skip the torch-op kernels and torch's BSR columns")
    opts = parser.parse_args()
    global clock
    clock = CLOCK[opts.clock]
    torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}, {opts.threads} threads, min of {opts.rounds} "
          f"interleaved rounds, {opts.clock} clock; ratios sparse / dense")
    print(f"kernels: {native.status().describe()}")
    if opts.layers:
        layers_table(opts.rounds, [getattr(torch, d) for d in opts.dtypes.split(",")],
                     [int(b) for b in opts.batches.split(",")], not opts.native_only)
        return
    print("| weight | stored | fwd+bwd | fwd | torch ops fwd+bwd / fwd | MKL fwd | "
          "target fwd+bwd / fwd | dense ms fwd+bwd / fwd |")
    print("|---|---|---|---|---|---|---|---|")
    bsr, bsc, csr = torch.sparse_bsr, torch.sparse_bsc, torch.sparse_csr
    for density in (0.05, 0.10, 0.25):
        print(linear_row("BSR 16x16", bsr, (16, 16), density, opts.rounds), flush=True)
    print(linear_row("BSR 16x16, batch 1", bsr, (16, 16), 0.10, opts.rounds, batch=1),
          flush=True)
    print(linear_row("BSR 16x16, bfloat16", bsr, (16, 16), 0.10, opts.rounds,
                     dtype=torch.bfloat16), flush=True)
    print(linear_row("BSC 16x16", bsc, (16, 16), 0.10, opts.rounds), flush=True)
    print(linear_row("BSR 16x32", bsr, (16, 32), 0.10, opts.rounds), flush=True)
    print(linear_row("CSR (elements)", csr, None, 0.10, opts.rounds), flush=True)
    print(gcn_row(opts.rounds), flush=True)


if __name__ == "__main__":
    main()

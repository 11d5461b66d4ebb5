"""A 2-layer GCN training step with a per-call adjacency: ``ss.compile`` against eager torch.

Standalone script (no pytest). 5,000 nodes, 50,000 distinct edges (CSR), 64 features, weights
64 x 64; a step is ``h = relu(A @ (x @ W1)); y = A @ (h @ W2)``, ``y.square().mean()`` and its
backward. Each call gets another adjacency (``--graphs`` of them, built beforehand, the same
number of edges: one compile), as a GNN's batches do. Variants, side by side in one process,
interleaved, min of ``--rounds``:

* ``eager torch``: plain torch CSR, ``torch.sparse.mm`` (torch's kernels);
* ``eager operand``: ``ss.as_operand(A)`` eagerly (the ``safesparse`` operators);
* ``compiled aot_eager`` / ``compiled inductor``: ``ss.compile(step, fullgraph=True,
  backend=...)`` called on the checked ``SafeSparseTensor``.

Two columns: gradients to the features and weights (``x``, ``W1``, ``W2``), and the same plus
the gradient to the edge values (values that require grad, per call: plain torch builds its
adjacency on them with ``torch.sparse_csr_tensor``, its only way to a values gradient;
safesparse puts them on the operand, ``A.with_values(v)``, O(1)). A third column, ``ss
rebuild``, is the safesparse route through torch's sparse autograd instead (a rebuild
``ss.sparse_csr_tensor(crow, col, v, shape)`` on checked indices, then ``as_operand``): it pays
torch's backward through the factory and ``values()``. The first call of a compiled variant
(compile time) is reported apart.

Usage: ``python benchmarks/bench_gcn.py [--rounds 10] [--threads 1] [--clock cpu]
[--backends aot_eager,inductor]``. ``--clock cpu`` (the default) times by the process's CPU
time (``time.process_time``), steadier than wall time on a shared machine; with ``--threads 1``
it is the one-thread cost.

Measured (torch 2.13.0+cpu, ``python benchmarks/bench_gcn.py --rounds 10``: 1 thread, CPU time,
min of 10 interleaved rounds, ms per step; a shared 2-core machine, load average 7.6-9.9)::

    | variant            | grads to x, W | + edge values  | same, ss rebuild | first calls, s |
    | eager torch        |  7.76 (1.00x) | 84.90 (1.00x)  | 84.38 (0.99x)    | -              |
    | eager operand      |  7.80 (1.01x) | 11.10 (0.13x)  | 87.11 (1.03x)    | -              |
    | compiled aot_eager |  7.68 (0.99x) | 10.15 (0.12x)  | 86.19 (1.02x)    | 4.2 / 0.5      |
    | compiled inductor  |  6.97 (0.90x) | 11.43 (0.13x)  | 85.75 (1.01x)    | 8.5 / 5.1      |

The products are the same kernels eager or compiled; inductor saves ~10 % on the dense work of
the step without values gradients and nothing with them, and costs 5-9 s of compiling per
variant (wall, loaded machine). The edge-values gradient is where the operators differ: torch
spends ~75 ms in its autograd of the factory and ``values()`` (the "ss rebuild" column pays it
too), the operand's ``with_values`` ~3 ms in ``matmul_grad_values``.
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

import safesparse as ss

CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.process_time


def best_of(fs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """:func:`rounds.best_of` by this script's clock (``--clock``)."""
    return rounds_best_of(fs, rounds, clock)


def graphs(n: int, n_edges: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` CSR patterns of ``n_edges`` distinct edges: (crow, col)."""
    out = []
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        flat = torch.randperm(n * n, generator=g)[:n_edges].sort().values
        rows, cols = flat // n, flat % n
        crow = torch.zeros(n + 1, dtype=torch.int64)
        crow[1:] = torch.bincount(rows, minlength=n).cumsum(0)
        out.append((crow, cols))
    return out


def gcn_step(a: torch.Tensor, x: torch.Tensor, w1: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(a @ (x @ w1))
    return (a @ (h @ w2)).square().mean()


def torch_step(a: torch.Tensor, x: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(torch.sparse.mm(a, x @ w1))
    return torch.sparse.mm(a, h @ w2).square().mean()


def main(argv: list[str] | None = None) -> int:
    global clock
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCK), default="cpu")
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--edges", type=int, default=50000)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--graphs", type=int, default=4)
    p.add_argument("--backends", default="aot_eager,inductor")
    args = p.parse_args(argv)
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*beta state.*")
    warnings.filterwarnings("ignore", ".*_stable_hash_for_caching.*")

    n, f = args.nodes, args.features
    patterns = graphs(n, args.edges, args.graphs)
    values = [torch.rand(args.edges) for _ in patterns]
    plain = [torch.sparse_csr_tensor(c, p_, v, (n, n), check_invariants=True)
             for (c, p_), v in zip(patterns, values, strict=True)]
    checked = [ss.sparse_csr_tensor(c.clone(), p_.clone(), v, (n, n))
               for (c, p_), v in zip(patterns, values, strict=True)]
    members = [(t.crow_indices(), t.col_indices()) for t in checked]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, f, generator=g, requires_grad=True)
    w1 = torch.randn(f, f, generator=g, requires_grad=True)
    w2 = torch.randn(f, f, generator=g, requires_grad=True)
    counter = iter(range(1 << 62))

    def pick() -> int:
        return next(counter) % len(patterns)

    # gradients to x, W1, W2
    def run(step: Callable[..., torch.Tensor], mats: list[torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            step(mats[pick()], x, w1, w2).backward()
        return call

    # ... and to the edge values (a new adjacency on values that require grad, per call)
    def run_values(step: Callable[..., torch.Tensor], build: Callable[[int, torch.Tensor],
                   torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            i = pick()
            v = values[i].detach().requires_grad_()
            step(build(i, v), x, w1, w2).backward()
        return call

    def gcn_step_v(a: torch.Tensor, v: torch.Tensor, x: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
        return gcn_step(a.with_values(v), x, w1, w2)  # type: ignore[attr-defined]

    def run_with_values(step: Callable[..., torch.Tensor], mats: list[torch.Tensor]
                        ) -> Callable[[], None]:
        def call() -> None:
            i = pick()
            v = values[i].detach().requires_grad_()
            step(mats[i], v, x, w1, w2).backward()
        return call

    def plain_build(i: int, v: torch.Tensor) -> torch.Tensor:
        c, p_ = patterns[i]
        return torch.sparse_csr_tensor(c, p_, v, (n, n), check_invariants=False)

    def ss_build(i: int, v: torch.Tensor) -> torch.Tensor:
        c, p_ = members[i]
        return ss.sparse_csr_tensor(c, p_, v, (n, n))  # a rebuild: no O(nnz) check

    eager_operand = [ss.as_operand(t) for t in checked]
    fs: dict[str, Callable[[], None]] = {
        "eager torch": run(torch_step, plain),
        "eager operand": run(gcn_step, eager_operand),  # type: ignore[arg-type]
    }
    fv: dict[str, Callable[[], None]] = {
        "eager torch": run_values(torch_step, plain_build),
        "eager operand": run_with_values(gcn_step_v, eager_operand),  # type: ignore[arg-type]
    }
    fr: dict[str, Callable[[], None]] = {
        "eager torch": run_values(torch_step, plain_build),
        "eager operand": run_values(
            lambda a, *r: gcn_step(ss.as_operand(a), *r), ss_build),
    }
    compile_ms: dict[str, tuple[float, float]] = {}
    for backend in [b for b in args.backends.split(",") if b]:
        step = ss.compile(gcn_step, fullgraph=True, backend=backend)
        step_v = ss.compile(gcn_step_v, fullgraph=True, backend=backend)
        step_r = ss.compile(gcn_step, fullgraph=True, backend=backend)
        t0 = time.perf_counter()
        step(checked[0], x, w1, w2).backward()
        t1 = time.perf_counter()
        v0 = values[0].detach().requires_grad_()
        step_v(checked[0], v0, x, w1, w2).backward()
        t2 = time.perf_counter()
        if v0.grad is None:
            raise AssertionError(f"{backend}: no gradient reached the edge values")
        step_r(ss_build(0, values[0].detach().requires_grad_()), x, w1, w2).backward()
        compile_ms[backend] = ((t1 - t0) * 1e3, (t2 - t1) * 1e3)
        fs[f"compiled {backend}"] = run(step, checked)  # type: ignore[arg-type]
        fv[f"compiled {backend}"] = run_with_values(step_v, checked)  # type: ignore[arg-type]
        fr[f"compiled {backend}"] = run_values(step_r, ss_build)

    a = best_of(fs, args.rounds)
    b = best_of(fv, args.rounds)
    r = best_of(fr, args.rounds)
    base_a, base_b = a["eager torch"], b["eager torch"]
    print(f"GCN step, {n} nodes, {args.edges} edges, {f} features, {args.threads} thread(s), "
          f"clock {args.clock}, min of {args.rounds} rounds, ms per step (ratio to eager torch)")
    print()
    print("| variant | grads to x, W | + grads to the edge values | same, ss rebuild | "
          "first calls (compile), wall s |")
    print("|---|---|---|---|---|")
    for k in fs:
        first = compile_ms.get(k.removeprefix("compiled "))
        first_s = f"{first[0] / 1e3:.1f} / {first[1] / 1e3:.1f}" if first else "-"
        print(f"| {k} | {a[k]:.2f} ({a[k] / base_a:.2f}x) | {b[k]:.2f} ({b[k] / base_b:.2f}x) "
              f"| {r[k]:.2f} ({r[k] / base_b:.2f}x) | {first_s} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Group ``overhead``: what the SafeSparseTensor wrapper adds to one operation, op by op.

The everyday operations on a checked CSR tensor (``A * 2``, ``A @ x``, ``A.mT``, a rebuild on
its checked indices, ``A.values()``) next to the same operation on the plain torch tensor, at a
small and a large nnz: the overhead is a constant per call, so the small size shows it best.
Writes the plot ``overhead.png`` next to the validate group's plot. No targets of its own: the
wrapper and transpose groups judge these costs; this table is the README's per-op summary.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from common import DebugOff, checked_csr, make_csr
from harness import (
    SEED,
    Column,
    Config,
    Table,
    diff,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_signed_us,
    fmt_us,
    load_safesparse,
    measure,
    num,
    ratio,
    register,
)

TARGETS: list[tuple[str, str, float, str]] = []  # (this group only reports)

#: (label, safesparse statement, torch statement), built per tensor by :func:`_ops`.
OPS = ("A * 2", "A @ x", "A.mT", "rebuild", "A.values()")
SMALL, LARGE, QUICK_LARGE = 10**3, 10**6, 10**5
COLUMNS = [
    Column("op"), Column("nnz", fmt_n), Column("torch (µs)", fmt_us),
    Column("safesparse (µs)", fmt_us), Column("overhead (µs)", fmt_signed_us),
    Column("ratio", fmt_ratio), Column("spread", fmt_pct),
]

#: results of the last run, for the plot and the README: op -> [(nnz, torch s, safesparse s)]
RESULTS: dict[str, list[tuple[int, float | None, float | None]]] = {}


def _ops(ss: ModuleType, t: torch.Tensor, gen: torch.Generator
         ) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    plain = ss.unwrap(t)
    x = torch.rand(t.shape[1], 32, generator=gen)
    crow, col, size = t.crow_indices(), t.col_indices(), tuple(t.shape)
    pcrow, pcol = plain.crow_indices(), plain.col_indices()
    new_values = torch.rand(plain.values().shape[0], generator=gen)
    safe_ctor, torch_ctor = ss.sparse_csr_tensor, torch.sparse_csr_tensor
    return {
        "A * 2": (lambda: t * 2, lambda: plain * 2),
        "A @ x": (lambda: t @ x, lambda: plain @ x),
        "A.mT": (lambda: t.mT, lambda: plain.transpose(-2, -1)),
        "rebuild": (lambda: safe_ctor(crow, col, new_values, size),
                    lambda: torch_ctor(pcrow, pcol, new_values, size, check_invariants=False)),
        "A.values()": (lambda: t.values(), lambda: plain.values()),
    }


@register("overhead", "per-op overhead of the wrapper on a checked CSR tensor: A * 2, A @ x, "
          "A.mT, rebuild on checked indices, A.values(), vs the same op in torch")
def bench_overhead(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    large = QUICK_LARGE if cfg.quick else LARGE
    if cfg.sizes is not None:
        large = max(min(large, max(cfg.sizes)), SMALL)
    table = Table("overhead: the wrapper's cost per operation (checked CSR, float32)", COLUMNS)
    RESULTS.clear()
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        for nnz in (SMALL, large):
            t = checked_csr(ss, make_csr(nnz, gen))
            ops = _ops(ss, t, gen)
            for op in OPS:
                safe, plain = ops[op]
                tm = measure({"ss": safe, "torch": plain}, cfg, f"overhead {op} nnz={nnz}")
                table.add(op, nnz, tm["torch"], tm["ss"], diff(tm["ss"], tm["torch"]),
                          ratio(tm["ss"], tm["torch"]), tm.max_spread())
                RESULTS.setdefault(op, []).append((nnz, num(tm["torch"]), num(tm["ss"])))
            del t, ops
            gc.collect()
    table.notes += [
        "torch: the same op on ss.unwrap(A) (A.mT: plain.transpose(-2, -1); rebuild: "
        + "torch.sparse_csr_tensor(crow, col, new_values, size, check_invariants=False)). "
        + "safesparse: on the checked A; every result is checked without a validation "
        + "(A @ x is dense).",
        "A @ x: x has 32 columns. rebuild: ss.sparse_csr_tensor(crow, col, new_values, size) "
        + "on A's checked member tensors, fetched once (a cache hit, no O(nnz) check).",
        "overhead = safesparse - torch, per call; it does not grow with nnz, so the small "
        + "row measures it best.",
    ]
    if cfg.plot is not None:
        table.notes.append(write_plot(cfg.plot.with_name("overhead.png")))
    return [table]


def write_plot(path: Path) -> str:
    """Bar chart of :data:`RESULTS`: torch and safesparse time per op at each size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "plot skipped: matplotlib is not installed (pip install matplotlib)"
        print(msg, file=sys.stderr)
        return msg
    sizes = sorted({n for pts in RESULTS.values() for n, _, _ in pts})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.4), squeeze=False)
    for ax, n in zip(axes.flat, sizes, strict=True):
        labels = list(RESULTS)
        rows = [next(p for p in RESULTS[op] if p[0] == n) for op in labels]
        xs = range(len(labels))
        torch_us = [(p[1] or 0.0) * 1e6 for p in rows]
        ss_us = [(p[2] or 0.0) * 1e6 for p in rows]
        ax.bar([x - 0.2 for x in xs], torch_us, width=0.4, label="torch")
        ax.bar([x + 0.2 for x in xs], ss_us, width=0.4, label="safesparse")
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("µs per call", fontsize=8)
        ax.set_title(f"checked CSR, nnz {fmt_n(n)}", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Per-op cost: safesparse's wrapper vs the plain torch tensor (CPU)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot written to {path}"

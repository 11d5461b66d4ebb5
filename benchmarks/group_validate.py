"""Group ``validate``: first validation of fresh index data vs torch's ``check_invariants=True``.

Every layout (COO coalesced and not, CSR, CSC, BSR, BSC), int32 and int64 indices, batched and
hybrid, nnz 1e2 .. 1e7 (BSR/BSC: nnz counts blocks). Optionally writes the plot
``benchmarks/validation.png`` (time vs nnz, safesparse and torch, one panel per case).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from harness import (
    SEED,
    Column,
    Config,
    Table,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_time,
    fmt_verdict,
    judge,
    load_safesparse,
    measure,
    num,
    ratio,
    register,
    target_text,
)
from inputs import CompressedInput, CooInput, make_compressed, make_coo

FULL_SIZES: tuple[int, ...] = (10**2, 10**3, 10**4, 10**5, 10**6, 10**7)
QUICK_SIZES: tuple[int, ...] = (10**2, 10**4)

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
I32, I64 = torch.int32, torch.int64


@dataclass(frozen=True)
class Case:
    label: str
    layout: torch.layout  # torch.sparse_coo for COO
    index_dtype: torch.dtype = I64
    batch: int = 0
    dense: int = 0
    coalesced: bool = True  # COO only


CASES: tuple[Case, ...] = (
    Case("CSR int64", CSR), Case("CSR int32", CSR, I32),
    Case("CSC int64", CSC), Case("CSC int32", CSC, I32),
    Case("BSR 2x2 int64", BSR), Case("BSR 2x2 int32", BSR, I32),
    Case("BSC 2x2 int64", BSC), Case("BSC 2x2 int32", BSC, I32),
    Case("CSR batched (4) int64", CSR, batch=4), Case("CSR hybrid (2) int64", CSR, dense=2),
    Case("BSR batched (4) int32", BSR, I32, batch=4), Case("BSR hybrid (2) int64", BSR, dense=2),
    Case("COO coalesced", torch.sparse_coo), Case("COO uncoalesced", torch.sparse_coo,
                                                  coalesced=False),
    Case("COO hybrid (2) coalesced", torch.sparse_coo, dense=2),
)

COLUMNS = [
    Column("case"), Column("nnz", fmt_n), Column("torch checked", fmt_time),
    Column("safesparse", fmt_time), Column("ratio", fmt_ratio), Column("ratio (min)", fmt_ratio),
    Column("met", fmt_verdict), Column("ss factory", fmt_time),
    Column("factory ratio", fmt_ratio), Column("factory met", fmt_verdict),
    Column("spread", fmt_pct),
]

TORCH_FACTORIES: dict[torch.layout, Callable[..., torch.Tensor]] = {
    CSR: torch.sparse_csr_tensor, CSC: torch.sparse_csc_tensor,
    BSR: torch.sparse_bsr_tensor, BSC: torch.sparse_bsc_tensor,
}
SS_FACTORIES = {CSR: "sparse_csr_tensor", CSC: "sparse_csc_tensor",
                BSR: "sparse_bsr_tensor", BSC: "sparse_bsc_tensor"}


def _statements(case: Case, inp: CompressedInput | CooInput, ss: ModuleType | None,
                validation: ModuleType | None) -> dict[str, Callable[[], object]]:
    """torch checked; safesparse = engine + unchecked build; ss factory = the public factory,
    end to end. Every statement gets fresh index tensors (clones) on every call, as a user
    building from new data does: the factory's cache can never hit, and every column pays the
    same copy."""
    fns: dict[str, Callable[[], object]] = {}
    if isinstance(inp, CooInput):
        i, v, size, co = inp.indices, inp.values, inp.size, case.coalesced
        fns["torch"] = lambda: torch.sparse_coo_tensor(i.clone(), v, size,
                                                       check_invariants=True, is_coalesced=co)
        if validation is not None:
            validate_coo = validation.validate_coo

            def ss_coo() -> object:
                fresh = i.clone()
                validate_coo(fresh, v, size, is_coalesced=co)
                return torch.sparse_coo_tensor(fresh, v, size, check_invariants=False,
                                               is_coalesced=co)

            fns["ss"] = ss_coo
        if ss is not None:
            factory = ss.sparse_coo_tensor
            fns["factory"] = lambda: factory(i.clone(), v, size, is_coalesced=co)
        return fns
    c, p, v, size, lay = inp.compressed, inp.plain, inp.values, inp.size, inp.layout
    tf = TORCH_FACTORIES[lay]
    fns["torch"] = lambda: tf(c.clone(), p.clone(), v, size, check_invariants=True)
    if validation is not None:
        validate_compressed = validation.validate_compressed

        def ss_comp() -> object:
            fc, fp = c.clone(), p.clone()
            validate_compressed(fc, fp, v, size, lay)
            return tf(fc, fp, v, size, check_invariants=False)

        fns["ss"] = ss_comp
    if ss is not None:
        sfac = getattr(ss, SS_FACTORIES[lay])
        fns["factory"] = lambda: sfac(c.clone(), p.clone(), v, size)
    return fns


def _make(case: Case, nnz: int, gen: torch.Generator) -> CompressedInput | CooInput:
    if case.layout == torch.sparse_coo:
        return make_coo(nnz, gen, dense=case.dense)
    return make_compressed(nnz, case.layout, gen, index_dtype=case.index_dtype,
                           batch=case.batch, dense=case.dense)


#: results of the last run, for the plot: case label -> [(nnz, torch, engine, factory)], seconds
RESULTS: dict[str, list[tuple[int, float | None, float | None, float | None]]] = {}
#: the public factory is judged on every case: below this nnz against validate.factory_small,
#: from it up against validate.factory_ratio (SPEC 4)
FACTORY_FROM = 10**4


@register("validate", "first validation of fresh index data: safesparse vs torch's "
          "check_invariants=True, every layout, int32/int64, batched, hybrid, nnz 1e2..1e7")
def bench_validate(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    validation = load_safesparse("engine.validation")
    sizes = cfg.sizes or (QUICK_SIZES if cfg.quick else FULL_SIZES)
    table = Table("validate: first validation vs torch check_invariants=True", COLUMNS)
    gen = torch.Generator().manual_seed(SEED)
    RESULTS.clear()
    for case in CASES:
        for nnz in sizes:
            inp = _make(case, nnz, gen)
            # large inputs: less timing (one call is already tens of ms)
            budget = cfg.min_run_time if nnz < 10**6 else min(cfg.min_run_time, 0.6)
            t = measure(_statements(case, inp, ss, validation), cfg,
                        f"validate {case.label} nnz={fmt_n(nnz)}", min_run_time=budget)
            r = ratio(t.get("ss"), t["torch"])
            r_min = ratio(t.best.get("ss"), t.best.get("torch"))
            best = None if r is None else min(r, r if r_min is None else r_min)
            met = judge("validate.engine_ratio", best)
            f_ratio = ratio(t.get("factory"), t["torch"])
            f_met = judge("validate.factory_ratio" if inp.nnz >= FACTORY_FROM
                          else "validate.factory_small", f_ratio)
            table.add(case.label, inp.nnz, t["torch"], t.get("ss"), r, r_min, met,
                      t.get("factory"), f_ratio, f_met, t.max_spread())
            print(f"validate: {case.label} nnz={fmt_n(inp.nnz)} ratio="
                  f"{'-' if r is None else f'{r:.2f}'}", file=sys.stderr, flush=True)
            RESULTS.setdefault(case.label, []).append((inp.nnz, num(t["torch"]),
                                                       num(t.get("ss")), num(t.get("factory"))))
            del inp
            gc.collect()
    table.notes += [
        "torch checked: torch.sparse_*_tensor(..., check_invariants=True) (COO with "
        + "is_coalesced=True/False; torch checks the order only when told it is coalesced).",
        "safesparse: safesparse.engine.validation.validate_compressed / validate_coo on the "
        + "members, then the unchecked torch build: a first validation plus the build, without the "
        + "SafeSparseTensor wrapper. ratio: safesparse / torch (medians); ratio (min): of the "
        + "fastest blocks. met: the better of the two against validate.engine_ratio ("
        + target_text("validate.engine_ratio") + ").",
        "ss factory: the public ss.sparse_*_tensor, end to end (argument conversion, "
        + "validation, the build, the wrapper and the checked-state bookkeeping): what a user "
        + "pays. factory ratio: ss factory / torch, judged on every case: "
        + "validate.factory_small (" + target_text("validate.factory_small") + ") below nnz "
        + f"{fmt_n(FACTORY_FROM)}, validate.factory_ratio ("
        + target_text("validate.factory_ratio") + ") from there up (SPEC 4).",
        "Every statement gets fresh index tensors (clones) on each call, torch's included, "
        + "so no cache can hit and all columns pay the same copy.",
        "nnz: specified elements (BSR/BSC: 2x2 blocks); ~16 per compressed line, n_plain = "
        + "4 x lines; batched: 4 batches of nnz / 4; hybrid: one dense dim of 2. Values float32.",
        "spread: largest interquartile range / median of the row's statements; above ~20% the "
        + "machine was busy (rerun, or --stat min).",
    ]
    if validation is None:
        table.notes.append("safesparse.engine.validation could not be imported: columns empty.")
    if cfg.plot is not None:
        table.notes.append(write_plot(cfg.plot))
    return [table]


def write_plot(path: Path) -> str:
    """Plot :data:`RESULTS` to ``path``; returns a line for the table notes. matplotlib is
    optional: without it the plot is skipped with a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "plot skipped: matplotlib is not installed (pip install matplotlib)"
        print(msg, file=sys.stderr)
        return msg
    labels = list(RESULTS)
    cols = 4
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(labels):]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, labels, strict=False):
        pts = RESULTS[label]
        for k, name, style in ((1, "torch check_invariants=True", "o--"),
                               (2, "safesparse engine", "s-"),
                               (3, "ss factory (end to end)", "^-")):
            xs = [p[0] for p in pts if p[k] is not None]
            ys = [p[k] * 1e6 for p in pts if p[k] is not None]  # type: ignore[operator]
            ax.loglog(xs, ys, style, label=name, markersize=4)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("nnz (blocks for BSR/BSC)", fontsize=8)
        ax.set_ylabel("first validation (µs)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("First validation of fresh index tensors: torch, safesparse's engine and its "
                 "public factory (CPU)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot written to {path}"

"""Group ``wrapper``: constant costs of the SafeSparseTensor wrapper on a checked CSR tensor."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType

import torch
from common import DebugOff, checked_csr, main_size, make_csr, stats_delta
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
    fmt_text,
    fmt_us,
    fmt_verdict,
    judge,
    load_safesparse,
    measure,
    num,
    ratio,
    register,
    target_text,
)

#: Targets of this group's per-op rows (issue 17), read by the rows below; the lead moves them
#: into benchmarks/targets.py when merging.
TARGETS = [
    ("wrapper.op_overhead", "overhead over torch of `A * 2`, `A @ x`, `.mT`, `.to(float64)`, "
     "the rebuild on checked indices and the guard on a checked input (64x64 10% CSR and "
     "1e4-nnz CSR; worst row)", 10.0, "µs"),
]
SPMM_NNZ, SPMM_NNZ_QUICK = 3 * 10**5, 3 * 10**4

COLUMNS = [
    Column("measurement"), Column("nnz", fmt_n), Column("safesparse (µs)", fmt_us),
    Column("baseline"), Column("baseline (µs)", fmt_us), Column("overhead (µs)", fmt_signed_us),
    Column("ratio", fmt_ratio), Column("target", fmt_text), Column("met", fmt_verdict),
    Column("spread", fmt_pct),
]


@register("wrapper", "SafeSparseTensor overheads: rebuild on checked indices, validate / "
          "is_checked on a checked tensor, SpMM and values() through the wrapper")
def bench_wrapper(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    nnz = main_size(cfg)
    table = Table(f"wrapper: SafeSparseTensor overheads (CSR float32, nnz {fmt_n(nnz)})",
                  COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        inp = make_csr(nnz, gen)
        t = checked_csr(ss, inp)
        _rebuild(table, cfg, ss, t, nnz)
        _validate(table, cfg, ss, t, nnz, gen)
        _spmm_values(table, cfg, ss, t, nnz, gen)
        del inp, t
        gc.collect()
    table.notes += [
        "rebuild: ss.sparse_csr_tensor(crow, col, new_values, size) on the checked tensor's "
        + "index members, fetched once (a training loop's pattern: the pattern is fixed, the "
        + "values change; a cache hit, no O(nnz) index check) vs torch.sparse_csr_tensor(crow, "
        + "col, new_values, size, check_invariants=False / True) on the same plain members.",
        "same, members and shape read in the call: ss.sparse_csr_tensor(t.crow_indices(), "
        + "t.col_indices(), new_values, t.shape); the difference to the row above is the two "
        + "member accesses through the wrapper (each hands out a member, tagged for the "
        + "rebuild).",
        "rebuild skipped validation: ss.stats() around one rebuild, outside the timing "
        + "(validations must stay, skipped must grow); a row marked NOT SKIPPED validated.",
        "validate / is_checked: on the checked tensor itself (the cache hit); validate at two "
        + "sizes, `flat` = large / small (target <= 2x); no torch counterpart.",
        "SpMM: A @ Y (Y has 32 columns) at 3e5 nnz vs the same product on ss.unwrap(A).",
        "GCN step: two PyG GCNConv(normalize=False) layers, cross entropy, backward, SGD, "
        + "on a checked CSR adjacency (ss.validate) vs the plain one, side by side.",
        "values(): t.values() through the wrapper vs p.values() on the plain tensor.",
        "A * 2: a checked 64x64 CSR (about 10% dense) times a scalar, result checked without "
        + "validation, vs the same on the plain tensor: the wrapper's whole per-op cost.",
        "overhead = safesparse - baseline; spread: largest IQR / median of the row's "
        + "statements (above ~20%: busy machine, rerun or use --threads 1 --stat min).",
    ]
    return [table]


def _rebuild(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor, nnz: int) -> None:
    crow, col, size = t.crow_indices(), t.col_indices(), tuple(t.shape)
    plain = ss.unwrap(t)
    pcrow, pcol = plain.crow_indices(), plain.col_indices()
    new_values = torch.rand(nnz, generator=torch.Generator().manual_seed(SEED + 1))
    safe_ctor, torch_ctor = ss.sparse_csr_tensor, torch.sparse_csr_tensor

    def ss_rebuild() -> object:
        return safe_ctor(t.crow_indices(), t.col_indices(), new_values, t.shape)

    fns: dict[str, Callable[[], object]] = {
        "ss": ss_rebuild,
        "ss members": lambda: safe_ctor(crow, col, new_values, size),
        "unchecked": lambda: torch_ctor(pcrow, pcol, new_values, size, check_invariants=False),
        "checked": lambda: torch_ctor(pcrow, pcol, new_values, size, check_invariants=True),
    }
    skipped_ok: bool | None = None
    try:
        validations, skipped = stats_delta(ss, lambda: safe_ctor(crow, col, new_values, size))
        skipped_ok = validations == 0 and skipped > 0
        print(f"wrapper: rebuild on checked indices: validations +{validations}, "
              f"skipped +{skipped} -> {'skipped' if skipped_ok else 'NOT SKIPPED'}", flush=True)
    except Exception as exc:  # reported in the table by measure() below as well
        print(f"wrapper: rebuild stats check failed: {type(exc).__name__}: {exc}", flush=True)
    tm = measure(fns, cfg, f"wrapper rebuild nnz={fmt_n(nnz)}")
    t_ss, t_unchecked, t_checked = num(tm["ss members"]), num(tm["unchecked"]), num(tm["checked"])
    overhead = diff(t_ss, t_unchecked)
    mark = "" if skipped_ok is not False else " (NOT SKIPPED)"
    table.add(f"rebuild on checked index tensors{mark}", nnz, tm["ss members"],
              "torch check_invariants=False", tm["unchecked"], overhead,
              ratio(t_ss, t_unchecked), target_text("wrapper.rebuild_overhead"),
              judge("wrapper.rebuild_overhead", overhead), tm.max_spread())
    r_checked = ratio(t_ss, t_checked)
    table.add(f"rebuild on checked index tensors{mark}", nnz, tm["ss members"],
              "torch check_invariants=True", tm["checked"], diff(t_ss, t_checked),
              r_checked, target_text("wrapper.rebuild_vs_checked"),
              judge("wrapper.rebuild_vs_checked", r_checked), tm.max_spread())
    table.add("  same, members and shape read in the call", nnz, tm["ss"],
              "torch check_invariants=False", tm["unchecked"],
              diff(tm["ss"], t_unchecked), ratio(tm["ss"], t_unchecked),
              "(breakdown: + two accessors, no target)", None, tm.max_spread())


def _validate(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor, nnz: int,
              gen: torch.Generator) -> None:
    small_n = min(10**4, nnz)
    small = checked_csr(ss, make_csr(small_n, gen)) if small_n != nnz else t
    validate, is_checked = ss.validate, ss.is_checked
    fns: dict[str, Callable[[], object]] = {
        "validate small": lambda: validate(small),
        "validate large": lambda: validate(t),
        "is_checked": lambda: is_checked(t),
    }
    try:
        validations, skipped = stats_delta(ss, lambda: validate(t))
        cached = f" (validations +{validations}, skipped +{skipped})"
        if validations:
            cached += " NOT SKIPPED"
    except Exception:
        cached = ""
    tm = measure(fns, cfg, f"wrapper validate nnz={fmt_n(nnz)}")
    v_small, v_large = num(tm["validate small"]), num(tm["validate large"])
    flat = ratio(v_large, v_small)
    table.add("ss.validate(t), t checked", small_n, tm["validate small"], "-", None, None,
              None, target_text("wrapper.validate_checked"),
              judge("wrapper.validate_checked", v_small), tm.max_spread())
    ok_large = judge("wrapper.validate_checked", v_large)
    ok_flat = judge("wrapper.validate_flat", flat)
    table.add(f"ss.validate(t), t checked{cached}", nnz, tm["validate large"], "-", None,
              None, flat, f"{target_text('wrapper.validate_checked')}, flat (ratio = large / "
              f"small {target_text('wrapper.validate_flat')})",
              None if ok_large is None or ok_flat is None else int(bool(ok_large and ok_flat)),
              tm.max_spread())
    table.add("ss.is_checked(t)", nnz, tm["is_checked"], "-", None, None, None, "-", None,
              tm.max_spread())


def _spmm_values(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor, nnz: int,
                 gen: torch.Generator) -> None:
    plain = ss.unwrap(t)
    _spmm(table, cfg, ss, gen)
    fns = {"ss": lambda: t.values(), "plain": lambda: plain.values()}
    tm = measure(fns, cfg, f"wrapper values nnz={fmt_n(nnz)}")
    over = diff(tm["ss"], tm["plain"])
    table.add("t.values()", nnz, tm["ss"], "plain.values()", tm["plain"], over,
              ratio(tm["ss"], tm["plain"]), target_text("wrapper.values_overhead"),
              judge("wrapper.values_overhead", over), tm.max_spread())
    _scalar_mul(table, cfg, ss, gen)
    _per_op(table, cfg, ss, gen)
    _gcn(table, cfg, ss, gen)


def _spmm(table: Table, cfg: Config, ss: ModuleType, gen: torch.Generator) -> None:
    """``A @ Y`` at 3e5 nnz: a product's cost through the wrapper is the fixed per-op cost,
    nothing that grows with nnz (SPEC 4: at most 1.03x torch's from 1e5 nnz up)."""
    nnz = SPMM_NNZ_QUICK if cfg.quick else SPMM_NNZ
    t = checked_csr(ss, make_csr(nnz, gen))
    plain = ss.unwrap(t)
    dense = torch.rand(t.shape[1], 32, generator=gen)
    fns: dict[str, Callable[[], object]] = {"ss": lambda: t @ dense,
                                            "plain": lambda: plain @ dense}
    tm = measure(fns, cfg, f"wrapper spmm nnz={fmt_n(nnz)}")
    r = ratio(tm["ss"], tm["plain"])
    table.add("A @ Y (32 cols)", nnz, tm["ss"], "ss.unwrap(A) @ Y", tm["plain"],
              diff(tm["ss"], tm["plain"]), r, target_text("wrapper.spmm_ratio"),
              judge("wrapper.spmm_ratio", r), tm.max_spread())


def _gcn(table: Table, cfg: Config, ss: ModuleType, gen: torch.Generator) -> None:
    """A GCN training step (PyG) on a checked CSR adjacency vs the plain one: model code's
    view of the per-op cost (PyG reads the adjacency's metadata and calls torch.sparse.mm)."""
    try:
        from torch_geometric.nn import GCNConv
        from torch_geometric.utils import coalesce, to_torch_csr_tensor
    except ImportError:
        table.notes.append("torch_geometric is not installed: no GCN row.")
        return
    nodes, edges = 300, 1500
    ei = coalesce(torch.randint(0, nodes, (2, edges), generator=gen), num_nodes=nodes)
    plain_adj = to_torch_csr_tensor(ei, size=(nodes, nodes))
    safe_adj = ss.validate(plain_adj.clone())
    x = torch.randn(nodes, 64, generator=gen)
    y = torch.randint(0, 8, (nodes,), generator=gen)
    conv1, conv2 = GCNConv(64, 64, normalize=False), GCNConv(64, 8, normalize=False)
    opt = torch.optim.SGD([*conv1.parameters(), *conv2.parameters()], lr=0.01)

    def make(adj: torch.Tensor) -> Callable[[], object]:
        def step() -> object:
            opt.zero_grad()
            out = conv2(conv1(x, adj).relu(), adj)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            return loss

        return step

    tm = measure({"ss": make(safe_adj), "plain": make(plain_adj)}, cfg, "wrapper gcn step")
    r = ratio(tm["ss"], tm["plain"])
    table.add(f"GCN step, {nodes} nodes", edges, tm["ss"], "plain CSR adjacency",
              tm["plain"], diff(tm["ss"], tm["plain"]), r, target_text("wrapper.gcn_step"),
              judge("wrapper.gcn_step", r), tm.max_spread())


def _per_op(table: Table, cfg: Config, ss: ModuleType, gen: torch.Generator) -> None:
    """Issue 17's per-op rows: the overhead over torch of common ops on a checked CSR tensor
    (64x64 at 10% and about 1e4 nnz), and the guard alone on a checked input."""
    for side, density in ((64, 0.1), (1000, 0.01)):
        _per_op_size(table, cfg, ss, gen, side, density)


def _per_op_size(table: Table, cfg: Config, ss: ModuleType, gen: torch.Generator, side: int,
                 density: float) -> None:
    from torch._C import DisableTorchFunctionSubclass

    target = target_text("wrapper.op_overhead") + " (aim 5 µs)"
    dense = (torch.rand(side, side, generator=gen) < density).float()
    a = ss.validate(dense.to_sparse_csr())
    plain = ss.unwrap(a)
    x = torch.rand(side, 8, generator=gen)
    pc, pp = plain.crow_indices(), plain.col_indices()
    nv = torch.rand(int(plain._nnz()), generator=gen)
    size = tuple(plain.shape)
    label = f"{side}x{side} CSR"
    ac, ap = a.crow_indices(), a.col_indices()
    rows: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "A @ x (8 cols)": (lambda: a @ x, lambda: plain @ x),
        ".mT": (lambda: a.mT, lambda: plain.mT),
        ".to(float64)": (lambda: a.to(torch.float64), lambda: plain.to(torch.float64)),
        "rebuild on checked index tensors": (
            lambda: ss.sparse_csr_tensor(ac, ap, nv, size),
            lambda: torch.sparse_csr_tensor(pc, pp, nv, size, check_invariants=False)),
    }
    if side != 64:
        rows["A * 2"] = (lambda: a * 2, lambda: plain * 2)
    guard = getattr(ss.tensor, "guard", None)
    if guard is not None:
        def guarded() -> None:
            with DisableTorchFunctionSubclass():
                guard(torch.Tensor.mul, (a, 2), {})
        rows["the guard on a checked input"] = (guarded, lambda: None)
    for name, (f_ss, f_torch) in rows.items():
        tm = measure({"ss": f_ss, "torch": f_torch}, cfg, f"wrapper {name} {label}")
        over = diff(tm["ss"], tm["torch"])
        table.add(f"{name}, {label}", int(plain._nnz()), tm["ss"], "torch", tm["torch"],
                  over, ratio(tm["ss"], tm["torch"]), target, judge("wrapper.op_overhead", over),
                  tm.max_spread())


def _scalar_mul(table: Table, cfg: Config, ss: ModuleType, gen: torch.Generator) -> None:
    """``A * 2`` on a small matrix: the whole per-op cost of the wrapper (the op keeps the
    index data, so the result is checked without validation)."""
    dense = (torch.rand(64, 64, generator=gen) < 0.1).float()
    a = ss.validate(dense.to_sparse_csr())
    plain = ss.unwrap(a)
    fns: dict[str, Callable[[], object]] = {"ss": lambda: a * 2, "plain": lambda: plain * 2}
    tm = measure(fns, cfg, "wrapper A * 2 (64x64 CSR, 10% dense)")
    over = diff(tm["ss"], tm["plain"])
    table.add("A * 2, 64x64 CSR 10% dense", int(plain._nnz()), tm["ss"], "plain * 2",
              tm["plain"], over, ratio(tm["ss"], tm["plain"]),
              target_text("wrapper.scalar_mul_overhead"),
              judge("wrapper.scalar_mul_overhead", over), tm.max_spread())

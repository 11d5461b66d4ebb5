"""safesparse benchmark suite.

Usage (from the repository root)::

    python benchmarks/run.py                  # every group, full sizes (a few minutes)
    python benchmarks/run.py --quick          # smoke test: small sizes, short timings (< 60 s)
    python benchmarks/run.py --only validate  # one group (repeat --only for several)
    python benchmarks/run.py --sizes 1e5 1e6  # override the nnz sizes
    python benchmarks/run.py --list           # list the registered groups

Every group is a function ``(cfg: Config) -> list[Table]`` registered with ``@register``; the
runner prints each table as Markdown. See ``benchmarks/README.md`` for how to add a group.
Timings are medians of ``torch.utils.benchmark.Timer.blocked_autorange``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils import benchmark as tbench

REPO_ROOT = Path(__file__).resolve().parent.parent
FULL_SIZES: tuple[int, ...] = (10**4, 10**5, 10**6, 10**7)
QUICK_SIZES: tuple[int, ...] = (10**4, 10**5)
SEED = 0

# --------------------------------------------------------------------------------------------
# Framework: configuration, tables, registry, timing


@dataclass(frozen=True)
class Config:
    """What every group gets: the sizes to run and how long to time each statement."""

    quick: bool
    sizes: tuple[int, ...]
    min_run_time: float  # seconds of timing per statement, split over the rounds
    rounds: int  # interleaved rounds per measurement (see measure())
    stat: str  # "median" (default) or "min" of the timed blocks
    threads: int


@dataclass
class Table:
    """One result table; ``rows`` are already formatted cells."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [
            max([len(c)] + [len(r[i]) for r in self.rows if i < len(r)])
            for i, c in enumerate(self.columns)
        ]

        def line(cells: Sequence[str]) -> str:
            padded = [cell.rjust(w) if i else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths, strict=False))]
            return "| " + " | ".join(padded) + " |"

        out = [f"### {self.title}", "", line(self.columns),
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


BenchFn = Callable[[Config], list[Table]]


@dataclass(frozen=True)
class Group:
    name: str
    description: str
    fn: BenchFn


GROUPS: dict[str, Group] = {}
# Problems that make the run fail (exit status 1) after every table has been printed: a statement
# that raised, or safesparse not importable. CI's smoke test relies on this.
PROBLEMS: list[str] = []


def register(name: str, description: str) -> Callable[[BenchFn], BenchFn]:
    """Decorator: add a benchmark group to :data:`GROUPS` under ``name``."""

    def deco(fn: BenchFn) -> BenchFn:
        if name in GROUPS:
            raise ValueError(f"benchmark group {name!r} registered twice")
        GROUPS[name] = Group(name, description, fn)
        return fn

    return deco


@dataclass
class Timings:
    """Result of :func:`measure`: seconds per call of each statement, or an ``"ERR ..."`` cell."""

    values: dict[str, float | str]
    spread: dict[str, float]  # interquartile range / median of the blocks, per timed statement

    def __getitem__(self, name: str) -> float | str:
        return self.values[name]

    def get(self, name: str, default: str = "n/a") -> float | str:
        return self.values.get(name, default)

    def max_spread(self) -> str:
        """The largest relative IQR among the statements, as a table cell ("12%")."""
        return f"{max(self.spread.values()) * 100:.0f}%" if self.spread else "-"


def measure(fns: dict[str, Callable[[], object]], cfg: Config, label: str = "") -> Timings:
    """Seconds per call of each statement in ``fns`` (``cfg.stat`` of the blocks), interleaved.

    Each statement is called once first (warm-up; an exception turns its result into a short
    ``"ERR ..."`` cell and a recorded problem instead of stopping the suite). Then
    ``cfg.rounds`` rounds time every statement in turn with ``Timer.blocked_autorange``
    (rotating the order), and the statistic is taken over all blocks of all rounds.
    Interleaving keeps the ratios between statements meaningful when the load of the machine
    changes during the run.
    """
    values: dict[str, float | str] = {}
    live: list[str] = []
    for name, fn in fns.items():
        try:
            fn()
            live.append(name)
        except Exception as exc:  # a broken statement must not stop the suite
            first = str(exc).splitlines()[0][:60] if str(exc) else ""
            values[name] = f"ERR {type(exc).__name__}: {first}"
            PROBLEMS.append(f"{label} {name}: {type(exc).__name__}: {exc}".strip())
    timers = {name: tbench.Timer(stmt="fn()", globals={"fn": fns[name]},
                                 num_threads=cfg.threads) for name in live}
    blocks: dict[str, list[float]] = {name: [] for name in live}
    per_round = cfg.min_run_time / cfg.rounds
    for r in range(cfg.rounds):
        k = r % len(live) if live else 0
        for name in live[k:] + live[:k]:
            m = timers[name].blocked_autorange(min_run_time=per_round)
            blocks[name] += [t / m.number_per_run for t in m.raw_times]
    spread: dict[str, float] = {}
    for name in live:
        b = blocks[name]
        med = statistics.median(b)
        values[name] = min(b) if cfg.stat == "min" else med
        if len(b) >= 4 and med > 0:
            q = statistics.quantiles(b, n=4)
            spread[name] = (q[2] - q[0]) / med
    return Timings({name: values[name] for name in fns}, spread)


def ms(t: float | str) -> str:
    return t if isinstance(t, str) else f"{t * 1e3:.3f}"


def ns_per(t: float | str, n: int) -> str:
    return "-" if isinstance(t, str) or n == 0 else f"{t * 1e9 / n:.2f}"


def ratio(num: float | str, den: float | str) -> str:
    if isinstance(num, str) or isinstance(den, str) or den == 0:
        return "-"
    return f"{num / den:.2f}x"


def fmt_n(n: int) -> str:
    """``1e4``-style label for round numbers from 1000 up, plain digits otherwise."""
    s = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")
    return s if n >= 1000 and float(s) == n else str(n)


def load_safesparse(submodule: str = "") -> ModuleType | None:
    """Import ``safesparse`` (or ``safesparse.<submodule>``) from this checkout, or None."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    name = f"safesparse.{submodule}" if submodule else "safesparse"
    try:
        return importlib.import_module(name)
    except Exception as exc:  # report, then run what does not need it
        print(f"note: cannot import {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        PROBLEMS.append(f"cannot import {name}: {type(exc).__name__}: {exc}")
        return None


# --------------------------------------------------------------------------------------------
# Input generation (valid, random, int64 indices, vectorised; built once per size)


def random_coords(nnz: int, rows: int, cols: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``nnz`` distinct (row, col) pairs in row-major order, uniformly drawn.

    Draws a few more linear indices than needed, de-duplicates them (``torch.unique`` sorts),
    keeps a random subset of exactly ``nnz`` and re-sorts. No dense ``rows * cols`` buffer.
    """
    space = rows * cols
    if nnz > space:
        raise ValueError(f"nnz={nnz} does not fit a {rows}x{cols} matrix")
    lin = torch.empty(0, dtype=torch.int64)
    extra = max(16, nnz // 50)
    while lin.numel() < nnz:
        draw = torch.randint(0, space, (nnz + extra,), generator=gen, dtype=torch.int64)
        lin = torch.unique(torch.cat([lin, draw]))
        extra *= 2
    if lin.numel() > nnz:
        keep = torch.randperm(lin.numel(), generator=gen)[:nnz]
        lin = lin[keep].sort().values
    return lin // cols, lin % cols


def compressed_from_rows(row: torch.Tensor, nrows: int) -> torch.Tensor:
    crow = torch.zeros(nrows + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(row, minlength=nrows), 0, out=crow[1:])
    return crow


def grid(n: int) -> tuple[int, int]:
    """(rows, cols) for ``n`` entries: ~16 per row, cols = 4 * rows, at least half empty."""
    rows = max(n // 16, 1)
    return rows, max(4 * rows, -(-2 * n // rows), 16)


@dataclass
class CompressedInput:
    compressed: torch.Tensor
    plain: torch.Tensor
    values: torch.Tensor
    size: tuple[int, ...]
    layout: torch.layout
    nnz: int  # stored elements (blocks * block area for BSR)


def make_csr(nnz: int, gen: torch.Generator) -> CompressedInput:
    """~16 entries per row: rows = nnz // 16, cols = 4 * rows."""
    rows, cols = grid(nnz)
    row, col = random_coords(nnz, rows, cols, gen)
    values = torch.rand(nnz, generator=gen)
    return CompressedInput(compressed_from_rows(row, rows), col, values, (rows, cols),
                           torch.sparse_csr, nnz)


def make_bsr(nnz: int, gen: torch.Generator, block: int = 4) -> CompressedInput:
    """4x4 blocks, ``nnz`` stored elements = nnz // 16 blocks, ~16 blocks per block row."""
    nblocks = max(nnz // (block * block), 1)
    brows, bcols = grid(nblocks)
    row, col = random_coords(nblocks, brows, bcols, gen)
    values = torch.rand(nblocks, block, block, generator=gen)
    return CompressedInput(compressed_from_rows(row, brows), col, values,
                           (brows * block, bcols * block), torch.sparse_bsr,
                           nblocks * block * block)


def make_coo(nnz: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """2-D coalesced COO (sorted, distinct), same shape rule as :func:`make_csr`."""
    rows, cols = grid(nnz)
    row, col = random_coords(nnz, rows, cols, gen)
    return torch.stack([row, col]), torch.rand(nnz, generator=gen), (rows, cols)


# --------------------------------------------------------------------------------------------
# Group: validate


VALIDATE_COLUMNS = [
    "layout", "nnz", "torch checked (ms)", "torch unchecked (ms)", "ss engine (ms)",
    "engine+build (ms)", "ratio (engine+build / torch)", "torch ns/nnz", "engine ns/nnz",
    "engine+build ns/nnz", "spread",
]


@register("validate", "first validation of fresh index data: safesparse engine vs torch's "
          "check_invariants=True, CSR / BSR / COO")
def bench_validate(cfg: Config) -> list[Table]:
    validation = load_safesparse("validation")
    table = Table("validate: first full validation vs torch check_invariants=True",
                  VALIDATE_COLUMNS)
    gen = torch.Generator().manual_seed(SEED)
    for nnz in cfg.sizes:
        for make in (make_csr, make_bsr):
            inp = make(nnz, gen)
            _validate_compressed_row(table, cfg, validation, inp)
            del inp
            gc.collect()
        indices, values, size = make_coo(nnz, gen)
        for coalesced in (True, False):
            _validate_coo_row(table, cfg, validation, indices, values, size, coalesced)
        del indices, values
        gc.collect()
    table.notes += [
        "torch checked: torch.sparse_*_tensor(..., check_invariants=True); "
        + "torch unchecked: the same with check_invariants=False (the build alone).",
        "ss engine: safesparse.validation.validate_compressed / validate_coo on the members "
        + "(no checked-state cache involved, so every call is a first validation); "
        + "engine+build: engine, then the unchecked torch build, i.e. what a first "
        + "ss.sparse_*_tensor call costs minus the wrapper.",
        "nnz = stored elements; BSR uses 4x4 blocks (nnz / 16 blocks). Shapes: rows = nnz / 16 "
        + "(block) rows, cols = 4 * rows, ~16 entries per row, int64 indices, float32 values.",
        "COO uncoalesced: is_coalesced=False, so only bounds are checked (no order check).",
        "spread: largest interquartile range / median of the row's four statements; "
        + "above ~20% the machine was busy and the row is unreliable (rerun, or use --stat min).",
        "target: ratio <= 1.5 at nnz >= 1e6.",
    ]
    if validation is None:
        table.notes.append("safesparse.validation could not be imported: engine columns empty.")
    return [table]


def _validate_row(table: Table, cfg: Config, label: str, nnz: int,
                  torch_checked: Callable[[], object], torch_unchecked: Callable[[], object],
                  engine: Callable[[], object] | None) -> None:
    """Time the four statements of one ``validate`` row (interleaved) and add the row."""
    fns: dict[str, Callable[[], object]] = {"checked": torch_checked, "build": torch_unchecked}
    if engine is not None:
        def engine_build() -> object:
            engine()
            return torch_unchecked()

        fns |= {"engine": engine, "both": engine_build}
    t = measure(fns, cfg, f"validate {label} nnz={fmt_n(nnz)}")
    t_engine, t_both = t.get("engine"), t.get("both")
    table.add(label, fmt_n(nnz), ms(t["checked"]), ms(t["build"]), ms(t_engine), ms(t_both),
              ratio(t_both, t["checked"]), ns_per(t["checked"], nnz), ns_per(t_engine, nnz),
              ns_per(t_both, nnz), t.max_spread())


def _validate_compressed_row(table: Table, cfg: Config, validation: ModuleType | None,
                             inp: CompressedInput) -> None:
    c, p, v, size, layout = inp.compressed, inp.plain, inp.values, inp.size, inp.layout
    factory = {torch.sparse_csr: torch.sparse_csr_tensor,
               torch.sparse_bsr: torch.sparse_bsr_tensor}[layout]

    def torch_checked() -> object:
        return factory(c, p, v, size, check_invariants=True)

    def torch_unchecked() -> object:
        return factory(c, p, v, size, check_invariants=False)

    engine: Callable[[], object] | None = None
    if validation is not None:
        validate_compressed = validation.validate_compressed

        def engine() -> object:
            return validate_compressed(c, p, v, size, layout)

    label = {torch.sparse_csr: "CSR", torch.sparse_bsr: "BSR 4x4"}[layout]
    _validate_row(table, cfg, label, inp.nnz, torch_checked, torch_unchecked, engine)


def _validate_coo_row(table: Table, cfg: Config, validation: ModuleType | None,
                      indices: torch.Tensor, values: torch.Tensor, size: tuple[int, int],
                      coalesced: bool) -> None:
    def torch_checked() -> object:
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True,
                                       is_coalesced=coalesced)

    def torch_unchecked() -> object:
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=False,
                                       is_coalesced=coalesced)

    engine: Callable[[], object] | None = None
    if validation is not None:
        validate_coo = validation.validate_coo

        def engine() -> object:
            return validate_coo(indices, values, size, is_coalesced=coalesced)

    label = "COO coalesced" if coalesced else "COO uncoalesced"
    _validate_row(table, cfg, label, values.shape[0], torch_checked, torch_unchecked, engine)


# --------------------------------------------------------------------------------------------
# Shared helpers for the wrapper / transpose / debug groups


def us(t: float | str) -> str:
    """Seconds as a microseconds cell."""
    return t if isinstance(t, str) else f"{t * 1e6:.2f}"


def diff_us(a: float | str, b: float | str) -> str:
    """``a - b`` in microseconds (an overhead), or ``-``."""
    return "-" if isinstance(a, str) or isinstance(b, str) else f"{(a - b) * 1e6:+.2f}"


def diff_ms(a: float | str, b: float | str) -> str:
    return "-" if isinstance(a, str) or isinstance(b, str) else f"{(a - b) * 1e3:+.3f}"


def verdict(ok: bool | None) -> str:
    """Cell for the ``met`` column: ``yes``, ``NO`` or ``-`` (not measured)."""
    return "-" if ok is None else ("yes" if ok else "NO")


def below(t: float | str, limit: float) -> bool | None:
    return None if isinstance(t, str) else t <= limit


def main_size(cfg: Config) -> int:
    """The one size of the wrapper and debug groups: 1e6 (full), 1e5 (quick), or the largest
    ``--sizes`` entry when that is smaller."""
    return min(10**6, max(cfg.sizes))


def checked_csr(ss: ModuleType, inp: CompressedInput) -> torch.Tensor:
    """A checked SafeSparseTensor built by the safe factory (one full validation)."""
    t: torch.Tensor = ss.sparse_csr_tensor(inp.compressed, inp.plain, inp.values, inp.size)
    return t


class DebugOff:
    """Context: debug mode off for the block (a ``SAFESPARSE_DEBUG=1`` environment would
    otherwise turn every cache hit into a full validation), restored on exit."""

    def __init__(self, ss: ModuleType | None) -> None:
        self.ss = ss
        self.saved = False

    def __enter__(self) -> None:
        if self.ss is not None:
            self.saved = bool(self.ss.is_debug())
            self.ss.set_debug(False)

    def __exit__(self, *exc: object) -> None:
        if self.ss is not None:
            self.ss.set_debug(self.saved)


def stats_delta(ss: ModuleType, fn: Callable[[], object]) -> tuple[int, int]:
    """(validations, skipped) counted by ``ss.stats()`` during one call of ``fn``."""
    before = ss.stats()
    fn()
    after = ss.stats()
    return after.validations - before.validations, after.skipped - before.skipped


# --------------------------------------------------------------------------------------------
# Group: wrapper


WRAPPER_COLUMNS = [
    "measurement", "nnz", "safesparse (µs)", "baseline", "baseline (µs)", "overhead (µs)",
    "ratio", "target", "met", "spread",
]


@register("wrapper", "SafeSparseTensor overheads: rebuild on checked indices, validate / "
          "is_checked on a checked tensor, SpMM and values() through the wrapper")
def bench_wrapper(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    nnz = main_size(cfg)
    table = Table(f"wrapper: SafeSparseTensor overheads (CSR float32, nnz {fmt_n(nnz)})",
                  WRAPPER_COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        inp = make_csr(nnz, gen)
        t = checked_csr(ss, inp)
        _wrapper_rebuild(table, cfg, ss, t, nnz)
        _wrapper_validate(table, cfg, ss, t, nnz, gen)
        _wrapper_spmm_values(table, cfg, ss, t, nnz, gen)
        del inp, t
        gc.collect()
    table.notes += [
        "rebuild: ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(), new_values, t.shape) "
        + "on a checked t (cache hit, no O(nnz) index check) vs torch.sparse_csr_tensor(crow, "
        + "col, new_values, size, check_invariants=False / True) on the same plain members.",
        "same, members fetched once outside: ss.sparse_csr_tensor(crow, col, new_values, "
        + "size) with crow = t.crow_indices() etc. taken before the timing, so the difference "
        + "to the row above is the two member accesses through the wrapper.",
        "rebuild skipped validation: ss.stats() around one rebuild, outside the timing "
        + "(validations must stay, skipped must grow); a row marked NOT SKIPPED validated.",
        "validate / is_checked: on the checked tensor itself (the cache hit); validate at two "
        + "sizes, `flat` = large / small (target <= 2x); no torch counterpart.",
        "SpMM: t @ dense (dense has 32 columns) through __torch_function__ vs the same product "
        + "on the plain tensor p = ss.unwrap(t) taken once outside the timing.",
        "values(): t.values() through the wrapper vs p.values() on the plain tensor.",
        "overhead = safesparse - baseline; spread: largest IQR / median of the row's "
        + "statements (above ~20%: busy machine, rerun or use --threads 1 --stat min).",
    ]
    return [table]


def _wrapper_rebuild(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor,
                     nnz: int) -> None:
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
    label = f"wrapper rebuild nnz={fmt_n(nnz)}"
    skipped_ok: bool | None = None
    try:
        validations, skipped = stats_delta(ss, lambda: safe_ctor(crow, col, new_values, size))
        skipped_ok = validations == 0 and skipped > 0
        print(f"wrapper: rebuild on checked indices: validations +{validations}, "
              f"skipped +{skipped} -> {'skipped' if skipped_ok else 'NOT SKIPPED'}", flush=True)
    except Exception as exc:  # reported in the table by measure() below as well
        print(f"wrapper: rebuild stats check failed: {type(exc).__name__}: {exc}", flush=True)
    tm = measure(fns, cfg, label)
    t_ss, t_unchecked, t_checked = tm["ss"], tm["unchecked"], tm["checked"]
    overhead = None if isinstance(t_ss, str) or isinstance(t_unchecked, str) else (
        t_ss - t_unchecked)
    met = None if overhead is None else overhead <= 20e-6
    mark = "" if skipped_ok is not False else " (NOT SKIPPED)"
    table.add(f"rebuild on checked indices{mark}", fmt_n(nnz), us(t_ss),
              "torch check_invariants=False", us(t_unchecked), diff_us(t_ss, t_unchecked),
              ratio(t_ss, t_unchecked), "overhead <= 20 µs (aim <= 5)", verdict(met),
              tm.max_spread())
    table.add(f"rebuild on checked indices{mark}", fmt_n(nnz), us(t_ss),
              "torch check_invariants=True", us(t_checked), diff_us(t_ss, t_checked),
              ratio(t_ss, t_checked), "ratio < 1x (no O(nnz) check)",
              verdict(None if isinstance(t_ss, str) or isinstance(t_checked, str)
                      else t_ss < t_checked), tm.max_spread())
    t_members = tm["ss members"]
    table.add("  same, members fetched once outside", fmt_n(nnz), us(t_members),
              "torch check_invariants=False", us(t_unchecked), diff_us(t_members, t_unchecked),
              ratio(t_members, t_unchecked), "(breakdown, no target)", "-", tm.max_spread())


def _wrapper_validate(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor, nnz: int,
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
    v_small, v_large = tm["validate small"], tm["validate large"]
    flat = ratio(v_large, v_small)
    flat_ok = None if flat == "-" else float(flat.rstrip("x")) <= 2.0
    table.add("ss.validate(t), t checked", fmt_n(small_n), us(v_small), "-", "-", "-", "-",
              "<= 10 µs", verdict(below(v_small, 10e-6)), tm.max_spread())
    ok_large = below(v_large, 10e-6)
    table.add(f"ss.validate(t), t checked{cached}", fmt_n(nnz), us(v_large), "-", "-", "-",
              f"flat {flat}", "<= 10 µs, flat (<= 2x)",
              verdict(None if ok_large is None or flat_ok is None else ok_large and flat_ok),
              tm.max_spread())
    table.add("ss.is_checked(t)", fmt_n(nnz), us(tm["is_checked"]), "-", "-", "-", "-", "-",
              "-", tm.max_spread())


def _wrapper_spmm_values(table: Table, cfg: Config, ss: ModuleType, t: torch.Tensor,
                         nnz: int, gen: torch.Generator) -> None:
    plain = ss.unwrap(t)
    dense = torch.rand(t.shape[1], 32, generator=gen)
    fns: dict[str, Callable[[], object]] = {
        "ss": lambda: t @ dense,
        "plain": lambda: plain @ dense,
    }
    tm = measure(fns, cfg, f"wrapper spmm nnz={fmt_n(nnz)}")
    t_ss, t_plain = tm["ss"], tm["plain"]
    ok = None if isinstance(t_ss, str) or isinstance(t_plain, str) else t_ss <= 1.10 * t_plain
    table.add("t @ dense (32 cols)", fmt_n(nnz), us(t_ss), "ss.unwrap(t) @ dense", us(t_plain),
              diff_us(t_ss, t_plain), ratio(t_ss, t_plain), "ratio <= 1.10x", verdict(ok),
              tm.max_spread())
    fns = {"ss": lambda: t.values(), "plain": lambda: plain.values()}
    tm = measure(fns, cfg, f"wrapper values nnz={fmt_n(nnz)}")
    t_ss, t_plain = tm["ss"], tm["plain"]
    ok = None if isinstance(t_ss, str) or isinstance(t_plain, str) else t_ss - t_plain <= 5e-6
    table.add("t.values()", fmt_n(nnz), us(t_ss), "plain.values()", us(t_plain),
              diff_us(t_ss, t_plain), ratio(t_ss, t_plain), "overhead <= 5 µs", verdict(ok),
              tm.max_spread())


# --------------------------------------------------------------------------------------------
# Group: transpose


TRANSPOSE_COLUMNS = [
    "layout", "op", "nnz", "torch (µs)", "safesparse (µs)", "overhead (µs, target <= 25)",
    "flat ratio (large/small, target <= 2x)", "met", "spread",
]
TRANSPOSE_SMALL = 10**3


@register("transpose", "zero-copy transposes of checked CSR / BSR 4x4 / hybrid CSR: constant "
          "overhead over torch's transpose(-2, -1), flat in nnz")
def bench_transpose(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    large = max(max(cfg.sizes), TRANSPOSE_SMALL)
    table = Table("transpose: .mT / transpose on checked tensors vs torch's transpose(-2, -1)",
                  TRANSPOSE_COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    cases: list[tuple[str, Callable[[int], CompressedInput], int, int]] = [
        # (label, maker, small nnz argument, large nnz argument); BSR counts stored elements,
        # so 1e3 blocks are 16e3 stored elements.
        ("CSR", lambda n: make_csr(n, gen), TRANSPOSE_SMALL, large),
        ("BSR 4x4", lambda n: make_bsr(n, gen), 16 * TRANSPOSE_SMALL, max(large, 16 * 10**3)),
        ("CSR hybrid (dense_dim=1)", lambda n: _hybrid(make_csr(n, gen)), TRANSPOSE_SMALL,
         large),
    ]
    with DebugOff(ss):
        for label, make, n_small, n_large in cases:
            small: dict[str, float | str] = {}
            for n in (n_small, n_large):
                inp = make(n)
                _transpose_rows(table, cfg, ss, label, inp, small)
                del inp
                gc.collect()
    table.notes += [
        "Tensors are checked (built by ss.sparse_*_tensor); the results are checked views "
        + "(no copy, no validation). torch: plain.transpose(-2, -1) on the same tensor "
        + "unwrapped (torch also returns a CSC / BSC view for non-hybrid layouts).",
        "Hybrid CSR has values (nnz, 2): its sparse dims are 0 and 1, so safesparse's op is "
        + "transpose(0, 1); torch refuses any transpose of a hybrid compressed tensor.",
        f"Sizes: small = {fmt_n(TRANSPOSE_SMALL)} stored elements (BSR: "
        + f"{fmt_n(TRANSPOSE_SMALL)} blocks of 4x4), large = the largest --sizes entry "
        + f"({fmt_n(large)}) stored elements. nnz column: stored elements.",
        "overhead = safesparse - torch; flat ratio = safesparse large / safesparse small "
        + "(same op), on the large row.",
    ]
    return [table]


def _hybrid(inp: CompressedInput) -> CompressedInput:
    """The same index data with values (nnz, 2): dense_dim=1."""
    values = torch.rand(inp.values.shape[0], 2)
    return CompressedInput(inp.compressed, inp.plain, values, (*inp.size, 2), inp.layout,
                           inp.nnz)


def _transpose_rows(table: Table, cfg: Config, ss: ModuleType, label: str,
                    inp: CompressedInput, small: dict[str, float | str]) -> None:
    factory = {torch.sparse_csr: ss.sparse_csr_tensor,
               torch.sparse_bsr: ss.sparse_bsr_tensor}[inp.layout]
    t = factory(inp.compressed, inp.plain, inp.values, inp.size)
    plain = ss.unwrap(t)
    hybrid = inp.values.dim() > (3 if inp.layout == torch.sparse_bsr else 1)
    ops: dict[str, Callable[[], object]] = (
        {"transpose(0, 1)": lambda: t.transpose(0, 1)} if hybrid else
        {".mT": lambda: t.mT, "transpose(-2, -1)": lambda: t.transpose(-2, -1)})
    fns: dict[str, Callable[[], object]] = dict(ops)
    torch_refuses = False
    try:
        plain.transpose(-2, -1)
        fns["torch"] = lambda: plain.transpose(-2, -1)
    except RuntimeError:
        torch_refuses = True
    tm = measure(fns, cfg, f"transpose {label} nnz={fmt_n(inp.nnz)}")
    t_torch = "n/a (torch refuses)" if torch_refuses else tm["torch"]
    is_large = bool(small)
    for op in ops:
        t_ss = tm[op]
        if not is_large:
            small[op] = t_ss
        flat = ratio(t_ss, small[op]) if is_large else "-"
        overhead = diff_us(t_ss, t_torch)
        ok_over = None if overhead == "-" else float(overhead) <= 25.0
        ok_flat = None if flat == "-" else float(flat.rstrip("x")) <= 2.0
        oks = [x for x in (ok_over, ok_flat) if x is not None]
        table.add(label, op, fmt_n(inp.nnz), us(t_torch), us(t_ss), overhead, flat,
                  verdict(all(oks) if oks else None), tm.max_spread())


# --------------------------------------------------------------------------------------------
# Group: debug


DEBUG_COLUMNS = ["op", "nnz", "torch plain (ms)", "normal (ms)", "debug (ms)", "overhead (ms)",
                 "ratio (debug / normal)", "spread"]


@register("debug", "per-op cost of debug mode (every sparse result validated): t * 2, t.mT, "
          "t @ dense, t.clone() on checked CSR, outside and inside ss.debug()")
def bench_debug(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    nnz = main_size(cfg)
    table = Table(f"debug: per-op overhead of debug mode (CSR float32, nnz {fmt_n(nnz)})",
                  DEBUG_COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    with DebugOff(ss):
        _debug_rows(table, cfg, ss, nnz)
        gc.collect()
    table.notes += [
        "normal: the op on a checked SafeSparseTensor, debug mode off; debug: the same inside "
        + "`with ss.debug():` (entered per call, a few µs); torch plain: the op on "
        + "ss.unwrap(t), for reference.",
        "In debug mode every sparse result is fully validated (cache ignored): t * 2, t.mT and "
        + "t.clone() pay one O(nnz) validation of the result; t @ dense returns a dense tensor, "
        + "so only the input is checked (a cheap cache lookup while t stays checked).",
        "No target: debug mode is opt-in; the numbers say what it costs per op.",
    ]
    return [table]


def _debug_rows(table: Table, cfg: Config, ss: ModuleType, nnz: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    t = checked_csr(ss, make_csr(nnz, gen))
    dense = torch.rand(t.shape[1], 32, generator=gen)
    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "t * 2": lambda x: x * 2,
        "t.mT": lambda x: x.mT,
        "t @ dense (32 cols)": lambda x: x @ dense,
        "t.clone()": lambda x: x.clone(),
    }
    for name, op in ops.items():
        _debug_row(table, cfg, ss, name, op, t, nnz)


def _debug_row(table: Table, cfg: Config, ss: ModuleType, name: str,
               op: Callable[[torch.Tensor], object], t: torch.Tensor, nnz: int) -> None:
    plain = ss.unwrap(t)
    debug_ctx = ss.debug

    def in_debug() -> object:
        with debug_ctx():
            return op(t)

    fns: dict[str, Callable[[], object]] = {
        "plain": lambda: op(plain),
        "normal": lambda: op(t),
        "debug": in_debug,
    }
    tm = measure(fns, cfg, f"debug {name} nnz={fmt_n(nnz)}")
    table.add(name, fmt_n(nnz), ms(tm["plain"]), ms(tm["normal"]), ms(tm["debug"]),
              diff_ms(tm["debug"], tm["normal"]), ratio(tm["debug"], tm["normal"]),
              tm.max_spread())


# --------------------------------------------------------------------------------------------
# Runner


def parse_size(text: str) -> int:
    value = float(text)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive integer size: {text}")
    return int(value)


def header(cfg: Config, default_threads: int) -> str:
    ss = load_safesparse()
    ss_version = getattr(ss, "__version__", "unknown") if ss is not None else "not importable"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    lines = [
        "# safesparse benchmarks",
        "",
        f"- torch {torch.__version__}, python {platform.python_version()}, "
        + f"{platform.system()} {platform.machine()}",
        f"- safesparse {ss_version} (from {REPO_ROOT})",
        f"- torch threads: {cfg.threads} (default {default_threads}), "
        + f"os.cpu_count(): {os.cpu_count()}, affinity: {affinity}",
        f"- mode: {'quick' if cfg.quick else 'full'}, "
        + f"sizes: {', '.join(fmt_n(s) for s in cfg.sizes)}, "
        + f"timing: {cfg.min_run_time}s per statement in {cfg.rounds} interleaved rounds, "
        + f"{cfg.stat} of blocked_autorange blocks",
        f"- load average at start: {load}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and short timings (CI smoke test, < 60 s)")
    parser.add_argument("--only", action="append", metavar="NAME", choices=sorted(GROUPS),
                        help="run only this group (repeatable)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="N",
                        help="nnz sizes, e.g. 1e4 1e5 (default: 1e4..1e7, quick: 1e4 1e5)")
    parser.add_argument("--min-run-time", type=float, default=None, metavar="S",
                        help="seconds of timing per statement (default 1.0, quick 0.1)")
    parser.add_argument("--rounds", type=int, default=None, metavar="R",
                        help="interleaved timing rounds per measurement (default 5, quick 2)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="statistic over the timed blocks (min: for a loaded machine)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's default)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write all tables as JSON to PATH")
    parser.add_argument("--list", action="store_true", help="list the groups and exit")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse (CSR|BSR|CSC|BSC) tensor support is in beta")

    if args.list:
        for g in GROUPS.values():
            print(f"{g.name}: {g.description}")
        return 0
    default_threads = torch.get_num_threads()
    threads = args.threads if args.threads is not None else default_threads
    torch.set_num_threads(threads)
    sizes = tuple(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else FULL_SIZES)
    min_run_time = args.min_run_time if args.min_run_time is not None else (
        0.1 if args.quick else 1.0)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    cfg = Config(quick=args.quick, sizes=sizes, min_run_time=min_run_time, rounds=max(rounds, 1),
                 stat=args.stat, threads=threads)

    print(header(cfg, default_threads), flush=True)
    results: dict[str, Any] = {"config": asdict(cfg), "torch": torch.__version__, "groups": {}}
    for name in args.only or list(GROUPS):
        group = GROUPS[name]
        start = time.perf_counter()
        tables = group.fn(cfg)
        elapsed = time.perf_counter() - start
        for table in tables:
            print("\n" + table.render(), flush=True)
        print(f"\n_group {name}: {elapsed:.1f} s_", flush=True)
        results["groups"][name] = [asdict(t) for t in tables]
    results["problems"] = PROBLEMS
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if PROBLEMS:
        print("\nFAILED:", *PROBLEMS, sep="\n- ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

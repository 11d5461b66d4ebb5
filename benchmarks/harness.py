"""Benchmark harness: configuration, numeric result tables, interleaved timing, the registry.

A group is a function ``(cfg: Config) -> list[Table]`` registered with :func:`register`. Table
cells are kept as numbers (seconds, ratios, counts) and only formatted when printed, so groups
compare numbers, never re-parse their own output, and ``--json`` writes the raw values.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch.utils import benchmark as tbench

if TYPE_CHECKING:
    from targets import Target

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 0

Cell = float | int | str | None  # None: not measured; str: text or an "ERR ..." cell


@dataclass(frozen=True)
class Config:
    """What every group gets: the sizes to run and how long to time each statement."""

    quick: bool
    sizes: tuple[int, ...] | None  # None: each group's own default sizes
    min_run_time: float  # seconds of timing per statement, split over the rounds
    rounds: int  # interleaved rounds per measurement (see measure())
    stat: str  # "median" (default) or "min" of the timed blocks
    threads: int
    plot: Path | None = None  # where the validate group writes its plot (None: no plot)


# --------------------------------------------------------------------------------------------
# Formatting: one function per column kind; cells stay numbers until rendered


def fmt_text(x: Cell) -> str:
    return "-" if x is None else str(x)


def fmt_ms(x: Cell) -> str:
    return x if isinstance(x, str) else "-" if x is None else f"{x * 1e3:.3f}"


def fmt_us(x: Cell) -> str:
    return x if isinstance(x, str) else "-" if x is None else f"{x * 1e6:.2f}"


def fmt_time(x: Cell) -> str:
    """Seconds with a unit that fits (µs below 1 ms)."""
    if isinstance(x, str) or x is None:
        return fmt_text(x)
    return f"{x * 1e6:.1f} µs" if x < 1e-3 else f"{x * 1e3:.2f} ms"


def fmt_signed_us(x: Cell) -> str:
    return fmt_text(x) if isinstance(x, str) or x is None else f"{x * 1e6:+.2f}"


def fmt_signed_ms(x: Cell) -> str:
    return fmt_text(x) if isinstance(x, str) or x is None else f"{x * 1e3:+.3f}"


def fmt_ratio(x: Cell) -> str:
    return fmt_text(x) if isinstance(x, str) or x is None else f"{x:.2f}x"


def fmt_pct(x: Cell) -> str:
    return fmt_text(x) if isinstance(x, str) or x is None else f"{x * 100:.0f}%"


def fmt_ns(x: Cell) -> str:
    return fmt_text(x) if isinstance(x, str) or x is None else f"{x:.2f}"


def fmt_n(n: Cell) -> str:
    """``1e4``-style label for round numbers from 1000 up, plain digits otherwise."""
    if not isinstance(n, int):
        return fmt_text(n)
    s = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")
    return s if n >= 1000 and float(s) == n else str(n)


def fmt_verdict(x: Cell) -> str:
    """``met`` column: 1 -> yes, 0 -> NO, None -> -."""
    return "-" if x is None else ("yes" if x else "NO") if isinstance(x, int) else str(x)


@dataclass(frozen=True)
class Column:
    name: str
    fmt: Callable[[Cell], str] = fmt_text


@dataclass
class Table:
    """One result table: numeric rows, formatted only by :meth:`render`."""

    title: str
    columns: list[Column]
    rows: list[list[Cell]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Cell) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def render(self) -> str:
        text = [[c.fmt(cell) for c, cell in zip(self.columns, row, strict=True)]
                for row in self.rows]
        names = [c.name for c in self.columns]
        widths = [max([len(n)] + [len(r[i]) for r in text]) for i, n in enumerate(names)]

        def line(cells: Sequence[str]) -> str:
            padded = [cell.rjust(w) if i else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths, strict=True))]
            return "| " + " | ".join(padded) + " |"

        out = [f"### {self.title}", "", line(names),
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in text]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)

    def as_json(self) -> dict[str, object]:
        return {"title": self.title, "columns": [c.name for c in self.columns],
                "rows": self.rows, "notes": self.notes}


# --------------------------------------------------------------------------------------------
# Registry


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


_SAFESPARSE_ROOT: list[Path] = [REPO_ROOT]


def set_safesparse_root(path: Path) -> None:
    """Import safesparse from ``path`` (another checkout, e.g. the code before a change)."""
    _SAFESPARSE_ROOT[0] = path.resolve()


def load_safesparse(submodule: str = "") -> ModuleType | None:
    """Import ``safesparse`` (or ``safesparse.<submodule>``) from the chosen checkout, or None."""
    root = str(_SAFESPARSE_ROOT[0])
    if root not in sys.path:
        sys.path.insert(0, root)
    name = f"safesparse.{submodule}" if submodule else "safesparse"
    try:
        return importlib.import_module(name)
    except Exception as exc:  # report, then run what does not need it
        print(f"note: cannot import {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        PROBLEMS.append(f"cannot import {name}: {type(exc).__name__}: {exc}")
        return None


# --------------------------------------------------------------------------------------------
# Targets (the table is benchmarks/targets.py)


#: Every judged measurement of this run: target key -> [(value in the target's unit, met)].
OUTCOMES: dict[str, list[tuple[float, bool]]] = {}


@functools.cache
def _targets() -> dict[str, Target]:
    from targets import all_targets

    return all_targets()


def target_text(key: str) -> str:
    """The target ``key`` as a table cell, e.g. ``<= 10 µs``."""
    return _targets()[key].text()


def judge(key: str, value: float | str | None) -> Cell:
    """Record ``value`` (seconds or a ratio) against the target ``key``; the ``met`` cell:
    1 (met), 0 (missed), or None (not measured: an error cell or no value)."""
    target = _targets()[key]
    x = num(value)
    if x is None:
        return None
    ok = target.met(x)
    OUTCOMES.setdefault(key, []).append((target.scaled(x), ok))
    return int(ok)


def import_groups() -> list[str]:
    """Import every ``benchmarks/group_*.py`` (each registers its group), in the order of
    ``targets.ORDER``; returns the module names."""
    from targets import group_modules

    names = group_modules()
    modules = [importlib.import_module(name) for name in names]
    # (a group's import may import the others first, through the targets table): reorder
    rank = {m.__name__: i for i, m in enumerate(modules)}
    ordered = sorted(GROUPS.values(), key=lambda g: rank.get(g.fn.__module__, len(rank)))
    GROUPS.clear()
    GROUPS.update((g.name, g) for g in ordered)
    return names


def targets_table() -> Table:
    """One row per target: its limit, the worst value this run measured, and whether every
    measurement met it."""
    table = Table("targets (benchmarks/targets.py)", [
        Column("key"), Column("target"), Column("worst measured"), Column("met", fmt_verdict)])
    for key, target in _targets().items():
        got = OUTCOMES.get(key)
        if not got:
            table.add(key, target.text(), "not measured", None)
            continue
        worst = max(v for v, _ in got)
        shown = f"{worst:.2f} µs" if target.unit == "µs" else f"{worst:.2f}x"
        table.add(key, target.text(), shown, int(all(ok for _, ok in got)))
    return table


def summary_line() -> str:
    """``targets met: k/n`` over the targets this run measured (a target is met when every
    measurement of it is), naming the missed ones."""
    measured = [k for k in _targets() if OUTCOMES.get(k)]
    missed = [k for k in measured if not all(ok for _, ok in OUTCOMES[k])]
    line = f"targets met: {len(measured) - len(missed)}/{len(measured)}"
    if missed:
        line += f" (missed: {', '.join(missed)})"
    unmeasured = len(_targets()) - len(measured)
    if unmeasured:
        line += f"; {unmeasured} of {len(_targets())} not measured by this run"
    return line


# --------------------------------------------------------------------------------------------
# Timing


@dataclass
class Timings:
    """Result of :func:`measure`: seconds per call of each statement, or an ``"ERR ..."`` cell."""

    values: dict[str, float | str]
    best: dict[str, float]  # the fastest block of each timed statement
    spread: dict[str, float]  # interquartile range / median of the blocks, per timed statement

    def __getitem__(self, name: str) -> float | str:
        return self.values[name]

    def get(self, name: str) -> float | str | None:
        return self.values.get(name)

    def max_spread(self) -> float | None:
        """The largest relative IQR among the statements (None when not measured)."""
        return max(self.spread.values()) if self.spread else None


def measure(fns: dict[str, Callable[[], object]], cfg: Config, label: str = "",
            min_run_time: float | None = None) -> Timings:
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
    total = cfg.min_run_time if min_run_time is None else min_run_time
    per_round = total / cfg.rounds
    for r in range(cfg.rounds):
        k = r % len(live) if live else 0
        for name in live[k:] + live[:k]:
            m = timers[name].blocked_autorange(min_run_time=per_round)
            blocks[name] += [t / m.number_per_run for t in m.raw_times]
    spread: dict[str, float] = {}
    best: dict[str, float] = {}
    for name in live:
        b = blocks[name]
        med = statistics.median(b)
        best[name] = min(b)
        values[name] = best[name] if cfg.stat == "min" else med
        if len(b) >= 4 and med > 0:
            q = statistics.quantiles(b, n=4)
            spread[name] = (q[2] - q[0]) / med
    return Timings({name: values[name] for name in fns}, best, spread)


def num(x: float | str | None) -> float | None:
    """A timing as a number, None for an error cell or a missing one."""
    return None if x is None or isinstance(x, str) else x


def ratio(a: float | str | None, b: float | str | None) -> float | None:
    x, y = num(a), num(b)
    return None if x is None or y is None or y == 0 else x / y


def diff(a: float | str | None, b: float | str | None) -> float | None:
    x, y = num(a), num(b)
    return None if x is None or y is None else x - y


def cell(x: float | str | None) -> Cell:
    """A timing as a table cell (the number, or the error text)."""
    return x


def header(cfg: Config, default_threads: int) -> str:
    ss = load_safesparse()
    ss_version = getattr(ss, "__version__", "unknown") if ss is not None else "not importable"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    sizes = "each group's defaults" if cfg.sizes is None else ", ".join(
        fmt_n(s) for s in cfg.sizes)
    lines = [
        "# safesparse benchmarks",
        "",
        f"- torch {torch.__version__}, python {platform.python_version()}, "
        + f"{platform.system()} {platform.machine()}",
        f"- safesparse {ss_version} (from {_SAFESPARSE_ROOT[0]})",
        f"- torch threads: {cfg.threads} (default {default_threads}), "
        + f"os.cpu_count(): {os.cpu_count()}, affinity: {affinity}",
        f"- mode: {'quick' if cfg.quick else 'full'}, sizes: {sizes}, "
        + f"timing: {cfg.min_run_time}s per statement in {cfg.rounds} interleaved rounds, "
        + f"{cfg.stat} of blocked_autorange blocks",
        f"- load average at start: {load}",
    ]
    return "\n".join(lines)

"""Group ``debug``: per-op cost of debug mode (every sparse result validated)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType

import torch
from common import DebugOff, checked_csr, main_size, make_csr
from harness import (
    SEED,
    Column,
    Config,
    Table,
    diff,
    fmt_ms,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_signed_ms,
    load_safesparse,
    measure,
    ratio,
    register,
)

COLUMNS = [Column("op"), Column("nnz", fmt_n), Column("torch plain (ms)", fmt_ms),
           Column("normal (ms)", fmt_ms), Column("debug (ms)", fmt_ms),
           Column("overhead (ms)", fmt_signed_ms), Column("ratio (debug / normal)", fmt_ratio),
           Column("spread", fmt_pct)]


@register("debug", "per-op cost of debug mode (every sparse result validated): t * 2, t.mT, "
          "t @ dense, t.clone() on checked CSR, outside and inside ss.debug()")
def bench_debug(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    nnz = main_size(cfg)
    table = Table(f"debug: per-op overhead of debug mode (CSR float32, nnz {fmt_n(nnz)})",
                  COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    with DebugOff(ss):
        _rows(table, cfg, ss, nnz)
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


def _rows(table: Table, cfg: Config, ss: ModuleType, nnz: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    t = checked_csr(ss, make_csr(nnz, gen))
    plain = ss.unwrap(t)
    dense = torch.rand(t.shape[1], 32, generator=gen)
    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "t * 2": lambda x: x * 2,
        "t.mT": lambda x: x.mT,
        "t @ dense (32 cols)": lambda x: x @ dense,
        "t.clone()": lambda x: x.clone(),
    }
    debug_ctx = ss.debug
    for name, op in ops.items():
        def in_debug(op: Callable[[torch.Tensor], object] = op) -> object:
            with debug_ctx():
                return op(t)

        fns: dict[str, Callable[[], object]] = {
            "plain": lambda op=op: op(plain),  # type: ignore[misc]
            "normal": lambda op=op: op(t),  # type: ignore[misc]
            "debug": in_debug,
        }
        tm = measure(fns, cfg, f"debug {name} nnz={fmt_n(nnz)}")
        table.add(name, nnz, tm["plain"], tm["normal"], tm["debug"],
                  diff(tm["debug"], tm["normal"]), ratio(tm["debug"], tm["normal"]),
                  tm.max_spread())

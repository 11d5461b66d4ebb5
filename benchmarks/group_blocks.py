"""Group ``blocks``: BSR / BSC products with a dense operand, forward and backward.

Side by side in one process: safesparse's block route (safesparse/tensor/blocks.py), torch's own BSR
kernel where it has one (square blocks on CPU, forward only), and the dense matmul of the same
matrix, on a 2048 x 2048 matrix with 5 % of its blocks stored, times a 2048 x 64 operand.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType

import torch
from common import DebugOff
from harness import (
    SEED,
    Cell,
    Column,
    Config,
    Table,
    fmt_ms,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_text,
    fmt_verdict,
    judge,
    load_safesparse,
    measure,
    ratio,
    register,
    target_text,
)

#: (key, description, limit, unit): this group's targets, merged into benchmarks/targets.py.
TARGETS = [
    ("blocks.square_bsr_vs_torch", "square-block BSR @ x, forward: safesparse / torch's BSR "
     "kernel", 1.10, "x"),
    ("blocks.forward_vs_dense", "BSR (non-square blocks) and BSC @ x, forward: safesparse / "
     "dense matmul of the same matrix", 0.5, "x"),
    ("blocks.backward_vs_dense", "BSR and BSC @ x, backward (values and x): safesparse / dense "
     "backward", 1.0, "x"),
]

COLUMNS = [
    Column("layout"), Column("block"), Column("step"), Column("nnz", fmt_n),
    Column("safesparse (ms)", fmt_ms), Column("baseline"), Column("baseline (ms)", fmt_ms),
    Column("ratio", fmt_ratio), Column("target", fmt_text), Column("met", fmt_verdict),
    Column("spread", fmt_pct),
]
SIZE, QUICK_SIZE = 2048, 512
DENSITY = 0.05
K = 64
BLOCKS = [(2, 2), (4, 4), (2, 3), (3, 2), (1, 4)]


@register("blocks", "BSR / BSC @ dense, forward and backward: vs torch's BSR kernel (square "
          "blocks) and vs the dense matmul (2048 x 2048, 5 % blocks, x 2048 x 64)")
def bench_blocks(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    n = QUICK_SIZE if cfg.quick else SIZE
    table = Table(f"blocks: block-sparse {n} x {n} ({DENSITY:.0%} of blocks) @ dense {n} x {K}",
                  COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    blocks = load_safesparse("tensor.blocks")
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        for block in BLOCKS:
            for layout in (torch.sparse_bsr, torch.sparse_bsc):
                _rows(table, cfg, ss, blocks, layout, block, n, gen)
                gc.collect()
    table.notes += [
        "safesparse: `a @ x` on a checked SafeSparseTensor; on CPU, square-block BSR without "
        + "a gradient takes torch's MKL kernel when it is the faster (row `forward, route "
        + "forced`: the block route itself on the same input, the figure the choice rests on).",
        "baseline: torch's BSR kernel (square BSR, forward) or `d @ x` on the dense matrix.",
        "backward: torch.autograd.grad of the product w.r.t. the values (built with "
        + "ss.sparse_bs*_tensor from values that require grad) and x; dense: w.r.t. the dense "
        + "matrix and x. The forward graph is built once, outside the timing.",
        "Rows with blocks of 3 use 2046 (a multiple of 3) for that side. float32.",
    ]
    return [table]


def _operands(layout: torch.layout, block: tuple[int, int], n: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block pattern mask, values, dense matrix) with ``DENSITY`` of the blocks stored."""
    r, c = block
    rows, cols = n // r * r, n // c * c
    mask = torch.rand(rows // r, cols // c, generator=gen) < DENSITY
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(rows, cols, generator=gen) * full
    return mask, full, dense


def _rows(table: Table, cfg: Config, ss: ModuleType, blocks: ModuleType | None,
          layout: torch.layout, block: tuple[int, int], n: int, gen: torch.Generator) -> None:
    _, _, dense = _operands(layout, block, n, gen)
    plain = dense.to_sparse_bsr(block) if layout == torch.sparse_bsr else dense.to_sparse_bsc(
        block)
    a = ss.validate(plain)
    x = torch.randn(dense.shape[1], K, generator=gen)
    name = "BSR" if layout == torch.sparse_bsr else "BSC"
    label = f"{block[0]}x{block[1]}"
    nnz = plain.values().numel()
    square_bsr = layout == torch.sparse_bsr and block[0] == block[1]

    fwd: dict[str, Callable[[], object]] = {
        "ss": lambda: a @ x,
        "dense": lambda: dense @ x,
    }
    if square_bsr:
        fwd["torch"] = lambda: plain @ x
        if blocks is not None:
            fwd["route"] = lambda: blocks._product(a, x, True)
    tm = measure(fwd, cfg, f"blocks {name} {label} forward")
    if square_bsr:
        key = "blocks.square_bsr_vs_torch"
        _add(table, name, label, "forward", nnz, tm["ss"], "torch BSR kernel", tm["torch"],
             key, tm.max_spread())
        if "route" in fwd:
            _add(table, name, label, "forward, route forced", nnz, tm["route"],
                 "torch BSR kernel", tm["torch"], None, tm.max_spread())
        _add(table, name, label, "forward", nnz, tm["ss"], "dense matmul", tm["dense"], None,
             tm.max_spread())
    else:
        _add(table, name, label, "forward", nnz, tm["ss"], "dense matmul", tm["dense"],
             "blocks.forward_vs_dense", tm.max_spread())

    # backward: values (through the factory) and x, vs the dense matrix and x
    compressed, plain_idx = ((a.crow_indices(), a.col_indices()) if name == "BSR"
                             else (a.ccol_indices(), a.row_indices()))
    factory = ss.sparse_bsr_tensor if name == "BSR" else ss.sparse_bsc_tensor
    values = a.values().detach().clone().requires_grad_()
    xg = x.clone().requires_grad_()
    y = factory(compressed, plain_idx, values, a.shape) @ xg
    d = dense.clone().requires_grad_()
    yd = d @ xg
    gy = torch.randn(y.shape, generator=gen)
    bwd: dict[str, Callable[[], object]] = {
        "ss": lambda: torch.autograd.grad(y, (values, xg), gy, retain_graph=True),
        "dense": lambda: torch.autograd.grad(yd, (d, xg), gy, retain_graph=True),
    }
    tb = measure(bwd, cfg, f"blocks {name} {label} backward")
    _add(table, name, label, "backward", nnz, tb["ss"], "dense backward", tb["dense"],
         "blocks.backward_vs_dense", tb.max_spread())


def _add(table: Table, name: str, label: str, step: str, nnz: int, t_ss: Cell, baseline: str,
         t_base: Cell, key: str | None, spread: Cell) -> None:
    r = ratio(t_ss if not isinstance(t_ss, int) else float(t_ss),
              t_base if not isinstance(t_base, int) else float(t_base))
    target = "-" if key is None else target_text(key)
    met: Cell = None if key is None else judge(key, r)
    table.add(name, label, step, nnz, t_ss, baseline, t_base, r, target, met, spread)

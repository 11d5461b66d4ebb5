"""Group ``blocks``: BSR / BSC products with a dense operand, forward and backward.

Side by side in one process: safesparse's block route (safesparse/tensor/products.py: on CPU the
kernels of the safesparse operators, safesparse/kernels/blocks.py), torch's own BSR kernel
where it has one (square blocks on CPU, forward only), and the dense matmul of the same
matrix, on a 2048 x 2048 matrix with 5 % of its blocks stored, times a 2048 x 64 operand; and
issue 40's figure: ``A @ x`` of a checked BSR 16 x 32 / BSC 16 x 16 tensor, 1024 x 1024 at
5 %, x 1024 x 256, against the dense matmul and against the kernel called on the members.
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
    ("blocks.engine_forward", "`A @ x` of a checked BSR 16 x 32 / BSC 16 x 16 tensor, 1024 x "
     "1024 at 5 % of blocks, x 1024 x 256: safesparse / dense matmul (issue 40)", 0.12, "x"),
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
BLOCKS = [(2, 2), (4, 4), (2, 3), (3, 2), (1, 4), (16, 16)]
#: issue 40's figure: (layout, block), size, operand columns
ENGINE_CASES = [(torch.sparse_bsr, (16, 32)), (torch.sparse_bsc, (16, 16))]
ENGINE_SIZE, ENGINE_K = 1024, 256


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
    blocks = load_safesparse("tensor.products")
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        for block in BLOCKS:
            for layout in (torch.sparse_bsr, torch.sparse_bsc):
                _rows(table, cfg, ss, blocks, layout, block, n, gen)
                gc.collect()
        for layout, block in ENGINE_CASES:
            _engine_row(table, cfg, ss, layout, block, n // 2 if cfg.quick else ENGINE_SIZE,
                        gen)
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
        f"Rows `forward (issue 40)`: {ENGINE_SIZE} x {ENGINE_SIZE} at 5 % of blocks, x "
        + f"{ENGINE_SIZE} x {ENGINE_K}; row `kernel on members`: "
        + "safesparse.kernels.blocks.matmul called on the members (the route's own cost is "
        + "the difference).",
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


def _engine_row(table: Table, cfg: Config, ss: ModuleType, layout: torch.layout,
                block: tuple[int, int], n: int, gen: torch.Generator) -> None:
    kernels = load_safesparse("kernels.blocks")
    r, c = block
    mask = torch.rand(n // r, n // c, generator=gen) < DENSITY
    dense = torch.randn(n, n, generator=gen) * mask.repeat_interleave(r, 0).repeat_interleave(
        c, 1)
    bsr = layout == torch.sparse_bsr
    plain = dense.to_sparse_bsr(block) if bsr else dense.to_sparse_bsc(block)
    a = ss.validate(plain)
    x = torch.randn(n, ENGINE_K, generator=gen)
    members = ((plain.crow_indices(), plain.col_indices()) if bsr
               else (plain.ccol_indices(), plain.row_indices()))
    fns: dict[str, Callable[[], object]] = {"ss": lambda: a @ x, "dense": lambda: dense @ x}
    if kernels is not None:
        describe = getattr(load_safesparse("kernels.pattern"), "matrix", None)
        if describe is not None:  # (the matrix description; an older checkout: members)
            m = describe(layout, *members, plain.values(), n, n)
            fns["kernel"] = lambda: kernels.matmul(m, x)
        else:
            fns["kernel"] = lambda: kernels.matmul(layout, *members, plain.values(), n, n, x)
    tm = measure(fns, cfg, f"blocks engine {layout} {r}x{c}")
    name, label = ("BSR" if bsr else "BSC"), f"{r}x{c}"
    nnz = plain.values().numel()
    _add(table, name, label, "forward (issue 40)", nnz, tm["ss"], "dense matmul", tm["dense"],
         "blocks.engine_forward", tm.max_spread())
    if kernels is not None:
        _add(table, name, label, "kernel on members", nnz, tm["kernel"], "dense matmul",
             tm["dense"], None, tm.max_spread())


def _add(table: Table, name: str, label: str, step: str, nnz: int, t_ss: Cell, baseline: str,
         t_base: Cell, key: str | None, spread: Cell) -> None:
    r = ratio(t_ss if not isinstance(t_ss, int) else float(t_ss),
              t_base if not isinstance(t_base, int) else float(t_base))
    target = "-" if key is None else target_text(key)
    met: Cell = None if key is None else judge(key, r)
    table.add(name, label, step, nnz, t_ss, baseline, t_base, r, target, met, spread)

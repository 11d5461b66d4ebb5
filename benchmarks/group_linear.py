"""Group ``linear``: sparse weights in model code (SPEC 9 and 10; issues 25 and 35's figures).

Side by side in one process (interleaved rounds, the harness's statistic):

* ``SparseLinear`` (BSR, 16 x 16 blocks, pruned with ``SparseLinear.from_dense`` from a random
  ``nn.Linear``) against a dense ``nn.Linear`` of the same size, 1024 x 1024, batch 256, at
  5 %, 10 % and 25 % of the blocks stored: forward + backward (gradients to the input, the
  values and the bias), and forward alone under ``torch.no_grad()``; beside them (not judged)
  the same layer on the torch-op kernels (``native.disabled()``) and plain torch's own BSR
  forward (``torch.mm(W, x.mT).mT`` on the plain BSR tensor); at 10 % also the batch-1
  forward and bfloat16 forward + backward against bfloat16 ``nn.Linear`` (issue 40's figures;
  the notes say which kernel path ran);
* a model (Linear, ReLU, SparseLinear 10 %, ReLU, Linear; 1024 wide, batch 256) compiled with
  ``torch.compile(model, fullgraph=True)`` against the same model eager, forward + backward
  (compiled once, outside the timed region);
* on a 2048 x 2048 weight with 5 % of its 16 x 16 blocks stored and a dense operand of 64
  columns: ``F.linear(x, W)`` for a checked square-block BSR ``W`` against torch's own BSR
  kernel (``torch.mm(W, x.mT).mT``; torch's ``F.linear`` on the plain tensor is shown too),
  BSC ``W @ x`` against the dense matmul of the same matrix, and a training step with
  ``torch.optim.Adam`` of ``SparseLinear`` against the hand-written module docs/models.md used
  to show (:class:`HandWritten`).

``--quick`` runs every statement at small sizes (256 wide, batch 64; 512 for the products).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from common import DebugOff
from harness import (
    SEED,
    Cell,
    Column,
    Config,
    Table,
    fmt_ms,
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
from torch import nn

#: (key, description, limit, unit): this group's targets, merged into benchmarks/targets.py.
TARGETS = [
    ("linear.bsr_vs_torch", "`F.linear(x, W)`, square-block BSR `W`, no bias, no gradient: "
     "safesparse / torch's BSR kernel (`torch.mm(W, x.mT).mT`)", 1.10, "x"),
    ("linear.bsc_vs_dense", "BSC `W @ x` (16 x 16 blocks), forward: safesparse / dense matmul "
     "of the same matrix", 0.30, "x"),
    ("linear.fwd_bwd_five", "`SparseLinear` (BSR 16 x 16, 5 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward + backward", 0.15, "x"),
    ("linear.fwd_bwd_ten", "`SparseLinear` (BSR 16 x 16, 10 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward + backward", 0.22, "x"),
    ("linear.fwd_bwd_quarter", "`SparseLinear` (BSR 16 x 16, 25 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward + backward", 0.40, "x"),
    ("linear.forward_five", "`SparseLinear` (BSR 16 x 16, 5 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward under `no_grad`", 0.13, "x"),
    ("linear.forward_ten", "`SparseLinear` (BSR 16 x 16, 10 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward under `no_grad`", 0.20, "x"),
    ("linear.forward_quarter", "`SparseLinear` (BSR 16 x 16, 25 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 256, forward under `no_grad`", 0.36, "x"),
    ("linear.batch_one_ten", "`SparseLinear` (BSR 16 x 16, 10 % of blocks) / `nn.Linear`, "
     "1024 x 1024, batch 1, forward under `no_grad`", 0.40, "x"),
    ("linear.bfloat_ten", "`SparseLinear` / `nn.Linear`, both bfloat16 (BSR 16 x 16, 10 % of "
     "blocks), 1024 x 1024, batch 256, forward + backward", 0.50, "x"),
    ("linear.compiled_model", "model (Linear, ReLU, SparseLinear 10 %, ReLU, Linear; 1024 "
     "wide, batch 256) forward + backward: `torch.compile(model, fullgraph=True)` / eager",
     1.05, "x"),
    ("linear.adam_step", "`SparseLinear` training step with `torch.optim.Adam` / the "
     "hand-written module docs/models.md showed (BSR, 16 x 16 blocks)", 1.05, "x"),
]

COLUMNS = [
    Column("measurement"), Column("safesparse (ms)", fmt_ms), Column("baseline"),
    Column("baseline (ms)", fmt_ms), Column("ratio", fmt_ratio), Column("target", fmt_text),
    Column("met", fmt_verdict),
]
SIZE, QUICK_SIZE = 2048, 512
DENSITY = 0.05
BLOCK = (16, 16)
K = 64
#: The layer rows: width and batch (full, quick), and (density, fwd+bwd key, forward key).
LAYER, QUICK_LAYER = (1024, 256), (256, 64)
DENSITIES = [(0.05, "linear.fwd_bwd_five", "linear.forward_five"),
             (0.10, "linear.fwd_bwd_ten", "linear.forward_ten"),
             (0.25, "linear.fwd_bwd_quarter", "linear.forward_quarter")]
MODEL_DENSITY = 0.10


class HandWritten(nn.Module):
    """The block-sparse layer docs/models.md showed before ``SparseLinear``: the values a
    parameter, the checked pattern a buffer, the weight rebuilt on every call."""

    def __init__(self, weight: torch.Tensor, ss: ModuleType) -> None:
        super().__init__()
        self.ss = ss
        pattern = ss.validate(weight.detach())
        self.register_buffer("pattern", pattern)
        self.values = nn.Parameter(pattern.values().clone())
        self.bias = nn.Parameter(torch.zeros(weight.shape[0]))

    def weight(self) -> torch.Tensor:
        p = self.pattern
        w: torch.Tensor = self.ss.sparse_bsr_tensor(p.crow_indices(), p.col_indices(),
                                                    self.values, p.shape)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias.unsqueeze(1), self.weight(), x.mT).mT


@register("linear", "sparse weights in model code: SparseLinear vs nn.Linear at 5/10/25 % of "
          "16 x 16 blocks (1024 x 1024, batch 256), a compiled model vs eager, F.linear vs "
          "torch's BSR kernel, BSC @ x vs dense, the Adam step vs the hand-written module")
def bench_linear(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    width, rows = QUICK_LAYER if cfg.quick else LAYER
    layers = Table(f"linear layers: {width} x {width}, batch {rows}, {BLOCK[0]} x {BLOCK[1]} "
                   "blocks", COLUMNS)
    n = QUICK_SIZE if cfg.quick else SIZE
    table = Table(f"linear: {n} x {n} weight ({DENSITY:.0%} of {BLOCK[0]} x {BLOCK[1]} "
                  f"blocks), {K} columns", COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [layers, table]
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss):
        _densities(layers, cfg, ss, width, rows, gen)
        gc.collect()
        _compiled(layers, cfg, ss, width, rows, gen)
        gc.collect()
        r, c = BLOCK
        mask = torch.rand(n // r, n // c, generator=gen) < DENSITY
        full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
        dense = torch.randn(n, n, generator=gen) * full
        _products(table, cfg, ss, dense, gen)
        gc.collect()
        _layers(table, cfg, ss, dense, gen)
    layers.notes += [
        "float32, CPU. The pattern: `SparseLinear.from_dense(nn.Linear(...), (16, 16), "
        + "density)` of a randomly initialised layer (the blocks of largest norm). Forward + "
        + "backward: `torch.autograd.grad` of the output to the input and every parameter; "
        + "forward: under `torch.no_grad()`; both layers with a bias.",
        "Compiled: `torch.compile(model, fullgraph=True)` (inductor), compiled and warmed up "
        + "before the timed rounds; the baseline is the same module eager.",
    ]
    table.notes += [
        "float32, CPU. Forward rows without a gradient; the Adam rows with the values (and "
        + "the bias) requiring grad, the input not.",
        "`F.linear` on the plain BSR tensor is torch's own route for the same call (shown, "
        + "not judged).",
    ]
    return [layers, table]


def _densities(table: Table, cfg: Config, ss: ModuleType, width: int, rows: int,
               gen: torch.Generator) -> None:
    """``SparseLinear`` / ``nn.Linear`` at each density: forward + backward, forward alone."""
    torch.manual_seed(SEED)
    linear = nn.Linear(width, width)
    x = torch.randn(rows, width, generator=gen, requires_grad=True)
    gy = torch.randn(rows, width, generator=gen)
    native = load_safesparse("kernels.native")
    if native is not None:
        table.notes.append(f"Kernel path: {native.status().describe()}.")
    for density, key_train, key_forward in DENSITIES:
        layer = ss.nn.SparseLinear.from_dense(nn.Linear(width, width), BLOCK, density)
        label = f"{density:.0%} of blocks"
        train = _fwd_bwd(layer, x, gy, list(layer.parameters()))
        tm = measure({"sparse": train, "torch ops": _torch_ops(native, train),
                      "dense": _fwd_bwd(linear, x, gy, list(linear.parameters()))},
                     cfg, f"linear {label} fwd+bwd")
        _add(table, f"SparseLinear fwd+bwd, {label}", tm["sparse"], "nn.Linear fwd+bwd",
             tm["dense"], key_train)
        _add(table, f"SparseLinear fwd+bwd, {label}, torch-op kernels", tm["torch ops"],
             "nn.Linear fwd+bwd", tm["dense"], None)
        plain = _plain_bsr(layer)
        with torch.no_grad():
            fwd = lambda m=layer: m(x)  # noqa: E731
            tf = measure({"sparse": fwd, "torch ops": _torch_ops(native, fwd),
                          "torch bsr": lambda w=plain: torch.mm(w, x.mT).mT,
                          "dense": lambda: linear(x)}, cfg, f"linear {label} forward")
        _add(table, f"SparseLinear forward (no_grad), {label}", tf["sparse"],
             "nn.Linear forward", tf["dense"], key_forward)
        _add(table, f"SparseLinear forward (no_grad), {label}, torch-op kernels",
             tf["torch ops"], "nn.Linear forward", tf["dense"], None)
        _add(table, f"torch's own BSR forward (`torch.mm(W, x.mT).mT`), {label}",
             tf["torch bsr"], "nn.Linear forward", tf["dense"], None)
        if density == 0.10:
            _batch1_and_bf16(table, cfg, ss, native, layer, linear, width, rows, gen)


def _torch_ops(native: ModuleType | None, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` on the torch-op kernels (the native library off), where safesparse has both."""
    if native is None:
        return fn

    def run() -> None:
        with native.disabled():
            fn()
    return run


def _plain_bsr(layer: nn.Module) -> torch.Tensor:
    """The layer's weight as a plain torch BSR tensor (torch's own kernels)."""
    w = layer.weight
    return torch.sparse_bsr_tensor(w.crow_indices().clone(), w.col_indices().clone(),
                                   w.values().detach().clone(), w.shape)


def _batch1_and_bf16(table: Table, cfg: Config, ss: ModuleType, native: ModuleType | None,
                     layer: nn.Module, linear: nn.Linear, width: int, rows: int,
                     gen: torch.Generator) -> None:
    """Batch-1 inference, and bfloat16 training against bfloat16 ``nn.Linear`` (10 %)."""
    x1 = torch.randn(1, width, generator=gen)
    plain = _plain_bsr(layer)
    with torch.no_grad():
        tb = measure({"sparse": lambda: layer(x1), "torch bsr": lambda: torch.mm(plain, x1.mT).mT,
                      "dense": lambda: linear(x1)}, cfg, "linear batch 1 forward")
    _add(table, "SparseLinear forward (no_grad), batch 1, 10 %", tb["sparse"],
         "nn.Linear forward", tb["dense"], "linear.batch_one_ten")
    _add(table, "torch's own BSR forward, batch 1, 10 %", tb["torch bsr"],
         "nn.Linear forward", tb["dense"], None)
    half = ss.nn.SparseLinear.from_dense(nn.Linear(width, width), BLOCK, 0.10).bfloat16()
    dense = nn.Linear(width, width).bfloat16()
    xh = torch.randn(rows, width, generator=gen).bfloat16().requires_grad_(True)
    gh = torch.randn(rows, width, generator=gen).bfloat16()
    train = _fwd_bwd(half, xh, gh, list(half.parameters()))
    th = measure({"sparse": train, "torch ops": _torch_ops(native, train),
                  "dense": _fwd_bwd(dense, xh, gh, list(dense.parameters()))}, cfg,
                 "linear bfloat16 fwd+bwd")
    _add(table, "SparseLinear fwd+bwd, bfloat16, 10 %", th["sparse"],
         "nn.Linear fwd+bwd (bfloat16)", th["dense"], "linear.bfloat_ten")
    _add(table, "SparseLinear fwd+bwd, bfloat16, 10 %, torch-op kernels", th["torch ops"],
         "nn.Linear fwd+bwd (bfloat16)", th["dense"], None)


def _fwd_bwd(m: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, gy: torch.Tensor,
             params: list[nn.Parameter]) -> Callable[[], object]:
    """One forward and backward: gradients to ``x`` and to ``params``."""
    inputs = [x, *params]
    return lambda: torch.autograd.grad(m(x), inputs, gy)


def _compiled(table: Table, cfg: Config, ss: ModuleType, width: int, rows: int,
              gen: torch.Generator) -> None:
    """The model compiled with ``fullgraph=True`` against the same model eager."""
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(),
        ss.nn.SparseLinear.from_dense(nn.Linear(width, width), BLOCK, MODEL_DENSITY),
        nn.ReLU(), nn.Linear(width, width))
    params = list(model.parameters())
    x = torch.randn(rows, width, generator=gen, requires_grad=True)
    gy = torch.randn(rows, width, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    step = _fwd_bwd(compiled, x, gy, params)
    try:
        for _ in range(3):  # compile (forward and backward graphs), then warm up
            step()
    except Exception:  # measure() records the error cell and the problem
        pass
    tm = measure({"compiled": step, "eager": _fwd_bwd(model, x, gy, params)}, cfg,
                 "linear compiled model")
    _add(table, f"compiled model fwd+bwd ({MODEL_DENSITY:.0%} sparse layer)", tm["compiled"],
         "same model eager", tm["eager"], "linear.compiled_model")


def _products(table: Table, cfg: Config, ss: ModuleType, dense: torch.Tensor,
              gen: torch.Generator) -> None:
    n = dense.shape[0]
    plain_bsr = dense.to_sparse_bsr(BLOCK)
    w_bsr = ss.validate(plain_bsr)
    w_bsc = ss.validate(dense.to_sparse_bsc(BLOCK))
    xl = torch.randn(K, n, generator=gen)
    x = torch.randn(n, K, generator=gen)
    fns: dict[str, Callable[[], object]] = {
        "ss linear": lambda: F.linear(xl, w_bsr),
        "torch kernel": lambda: torch.mm(plain_bsr, xl.mT).mT,
        "torch linear": lambda: F.linear(xl, plain_bsr),
        "ss bsc": lambda: w_bsc @ x,
        "dense": lambda: dense @ x,
    }
    with torch.no_grad():
        tm = measure(fns, cfg, "linear products")
    _add(table, "F.linear(x, W), BSR", tm["ss linear"], "torch BSR kernel",
         tm["torch kernel"], "linear.bsr_vs_torch")
    _add(table, "F.linear(x, W), BSR", tm["ss linear"], "torch F.linear (plain BSR)",
         tm["torch linear"], None)
    _add(table, "W @ x, BSC", tm["ss bsc"], "dense matmul", tm["dense"],
         "linear.bsc_vs_dense")


def _layers(table: Table, cfg: Config, ss: ModuleType, dense: torch.Tensor,
            gen: torch.Generator) -> None:
    n = dense.shape[0]
    layer = ss.nn.SparseLinear(dense.to_sparse_bsr(BLOCK), True)
    hand = HandWritten(dense.to_sparse_bsr(BLOCK), ss)
    x = torch.randn(K, n, generator=gen)
    target = torch.randn(K, n, generator=gen)
    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-4)
            for name, m in (("layer", layer), ("hand", hand))}

    def step(name: str, m: nn.Module) -> Callable[[], object]:
        opt = opts[name]

        def run() -> None:
            opt.zero_grad()
            F.mse_loss(m(x), target).backward()
            opt.step()
        return run

    ts = measure({"layer": step("layer", layer), "hand": step("hand", hand)}, cfg,
                 "linear adam step")
    _add(table, "SparseLinear Adam step", ts["layer"], "hand-written module step",
         ts["hand"], "linear.adam_step")


def _add(table: Table, what: str, t_ss: Cell, baseline: str, t_base: Cell,
         key: str | None) -> None:
    r = ratio(t_ss if not isinstance(t_ss, int) else float(t_ss),
              t_base if not isinstance(t_base, int) else float(t_base))
    target = "-" if key is None else target_text(key)
    met: Cell = None if key is None else judge(key, r)
    table.add(what, t_ss, baseline, t_base, r, target, met)

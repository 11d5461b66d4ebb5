"""Group ``linear``: sparse weights in model code (SPEC 9; issue 25's figures).

Side by side in one process, on a 2048 x 2048 weight with 5 % of its 16 x 16 blocks stored and
a dense operand of 64 columns (``x`` of shape 64 x 2048 for ``F.linear``, 2048 x 64 for
``W @ x``):

* ``F.linear(x, W)`` for a checked square-block BSR ``W``, no bias, no gradient, against
  torch's own BSR kernel on the same data (``torch.mm(W, x.mT).mT``; torch's ``F.linear`` on
  the plain tensor is shown too);
* BSC ``W @ x`` against the dense matmul of the same matrix (the block route: the regrouped
  structure kept with the index proof, one gather of the values, one CSR product);
* ``SparseLinear`` forward + backward against a dense ``nn.Linear`` of the same size;
* a training step with ``torch.optim.Adam`` (zero_grad, forward, MSE loss, backward, step) of
  ``SparseLinear`` against the hand-written module docs/models.md used to show
  (:class:`HandWritten`).
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
    ("linear.layer_vs_dense", "`SparseLinear` forward + backward (BSR, 16 x 16 blocks) / dense "
     "`nn.Linear` forward + backward", 0.5, "x"),
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


@register("linear", "sparse weights in model code: F.linear vs torch's BSR kernel, BSC @ x vs "
          "dense, SparseLinear vs nn.Linear and vs the hand-written module (2048 x 2048, 5 % "
          "of 16 x 16 blocks, 64 columns)")
def bench_linear(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    n = QUICK_SIZE if cfg.quick else SIZE
    table = Table(f"linear: {n} x {n} weight ({DENSITY:.0%} of {BLOCK[0]} x {BLOCK[1]} "
                  f"blocks), {K} columns", COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    r, c = BLOCK
    mask = torch.rand(n // r, n // c, generator=gen) < DENSITY
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(n, n, generator=gen) * full
    with DebugOff(ss):
        _products(table, cfg, ss, dense, gen)
        gc.collect()
        _layers(table, cfg, ss, dense, gen)
    table.notes += [
        "float32, CPU. Forward rows without a gradient; the layer rows with the values (and "
        + "the bias) requiring grad, the input not.",
        "`F.linear` on the plain BSR tensor is torch's own route for the same call (shown, "
        + "not judged).",
    ]
    return [table]


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
    linear = nn.Linear(n, n)
    hand = HandWritten(dense.to_sparse_bsr(BLOCK), ss)
    x = torch.randn(K, n, generator=gen)
    target = torch.randn(K, n, generator=gen)
    gy = torch.randn(K, n, generator=gen)

    def fwd_bwd(m: nn.Module) -> Callable[[], object]:
        params = [p for p in m.parameters() if p.requires_grad]
        return lambda: torch.autograd.grad(m(x), params, gy)

    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-4)
            for name, m in (("layer", layer), ("hand", hand))}

    def step(name: str, m: nn.Module) -> Callable[[], object]:
        opt = opts[name]

        def run() -> None:
            opt.zero_grad()
            F.mse_loss(m(x), target).backward()
            opt.step()
        return run

    tm = measure({"layer": fwd_bwd(layer), "linear": fwd_bwd(linear)}, cfg,
                 "linear layer fwd+bwd")
    _add(table, "SparseLinear fwd+bwd", tm["layer"], "nn.Linear fwd+bwd", tm["linear"],
         "linear.layer_vs_dense")
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

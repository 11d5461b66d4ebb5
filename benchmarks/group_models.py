"""Group ``models``: where models run (issue 45): a transformer encoder layer and the layer
table from batch 1 to 16k rows, against dense, float32 and bfloat16.

* **Encoder layer** (plain torch, no new dependency): hidden 768, 12 heads, MLP 3072, pre-norm,
  ``F.scaled_dot_product_attention``; every projection (q, k, v, output) and both MLP linears
  are ``SparseLinear`` (``from_dense``, 16 x 16 blocks, 10 % of blocks kept) in the sparse
  model. A training step (forward, backward, ``torch.optim.AdamW(fused=True)``) at 8 x 128
  tokens and the inference of one 128-token sequence (``torch.no_grad()``), float32 and
  bfloat16 (the model converted with ``.bfloat16()``), each against the same layer dense.
* **Layer table**: ``SparseLinear`` (1024 x 1024, 16 x 16 blocks, 10 %, with a bias) /
  ``nn.Linear`` at batch 1, 8, 32, 256, 4096, 16384: forward under ``no_grad``, forward with
  the parameters requiring grad (batch 1: a layer call in a training loop), and forward +
  backward; float32, bfloat16, and the float32 layer under ``torch.autocast("cpu",
  torch.bfloat16)`` against the same layer in float32.

In ``run.py`` the harness times (wall clock, ``--threads``). For the figures of docs/models.md,
run this file itself: one thread, each statement timed by the process's CPU time (a loaded
machine), interleaved rounds, min::

    python benchmarks/group_models.py --threads 1 --clock cpu --rounds 7
    python benchmarks/group_models.py --only layers --batches 1 8 32 256

``--quick`` (CI's smoke test) runs a 64-wide encoder on 2 x 16 tokens and the layer table at
batch 1, 256 wide, float32 only, judging no target (they are for the full sizes).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DebugOff
from group_linear import COLUMNS, _add  # (the same table layout and verdicts)
from harness import (
    SEED,
    Cell,
    Config,
    Table,
    load_safesparse,
    measure,
    register,
)

#: (key, description, limit, unit): this group's targets, merged into benchmarks/targets.py.
TARGETS = [
    ("models.encoder_train", "transformer encoder layer (768 wide, 12 heads, MLP 3072; every "
     "projection and MLP linear `SparseLinear`, 10 % of 16 x 16 blocks), float32, training step "
     "(fwd + bwd + `AdamW(fused=True)`) at 8 x 128 tokens / the dense layer", 0.22, "x"),
    ("models.encoder_infer", "the same encoder layer, float32, inference of one 128-token "
     "sequence (`no_grad`) / the dense layer", 0.16, "x"),
]

DENSITY = 0.10
BLOCK = (16, 16)
#: encoder (hidden, heads, MLP, sequences, tokens) full and quick
ENCODER, QUICK_ENCODER = (768, 12, 3072, 8, 128), (64, 2, 256, 2, 16)
#: layer table width and batches, full and quick
WIDTH, QUICK_WIDTH = 1024, 256
BATCHES, QUICK_BATCHES = (1, 8, 32, 256, 4096, 16384), (1,)

Timed = Callable[[dict[str, Callable[[], object]], str], dict[str, Cell]]


class Encoder(nn.Module):
    """A pre-norm transformer encoder layer in plain torch (BERT-sized by default)."""

    def __init__(self, hidden: int = 768, heads: int = 12, mlp: int = 3072) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)))
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


LINEARS = ("q", "k", "v", "o", "fc1", "fc2")


def sparsified(dense: Encoder, ss: ModuleType, density: float = DENSITY) -> Encoder:
    """A copy of ``dense`` whose six linears are ``SparseLinear.from_dense`` of its own."""
    import copy

    model = copy.deepcopy(dense)
    for name in LINEARS:
        setattr(model, name, ss.nn.SparseLinear.from_dense(getattr(dense, name), BLOCK, density))
    return model


def fast_path_layers(model: nn.Module, ss: ModuleType) -> str:
    """How many of the model's ``SparseLinear`` layers hold an eager fast-path plan."""
    eager = load_safesparse("nn.eager")
    layers = [m for m in model.modules() if isinstance(m, ss.nn.SparseLinear)]
    if eager is None:
        return "-"
    held = sum(eager.plan_of(m) is not None for m in layers)
    return f"{held}/{len(layers)}"


def _train_step(model: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], object]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).backward(gy)
        opt.step()
    return step


def _state_bytes(model: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> int:
    """Bytes of the fused AdamW's state after one step (exp_avg, exp_avg_sq, step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    model(x).backward(gy)
    opt.step()
    total = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    model.zero_grad(set_to_none=True)
    return total


def encoder(table: Table, timed: Timed, ss: ModuleType, quick: bool) -> None:
    hidden, heads, mlp, seqs, tokens = QUICK_ENCODER if quick else ENCODER
    torch.manual_seed(SEED)
    dense32 = Encoder(hidden, heads, mlp)
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        name = "float32" if dtype == torch.float32 else "bfloat16"
        dense = dense32 if dtype == torch.float32 else Encoder(hidden, heads, mlp).to(dtype)
        if dtype != torch.float32:
            dense.load_state_dict({k: v.to(dtype) for k, v in dense32.state_dict().items()})
        sparse = sparsified(dense, ss)
        x = torch.randn(seqs, tokens, hidden, dtype=dtype)
        gy = torch.randn(seqs, tokens, hidden, dtype=dtype)
        t = timed({"sparse": _train_step(sparse, x, gy), "dense": _train_step(dense, x, gy)},
                  f"encoder {name} train")
        judged = dtype == torch.float32 and not quick  # (the targets are for the full size)
        _add(table, f"encoder training step, {name}, {seqs} x {tokens} tokens", t["sparse"],
             "dense layer", t["dense"], "models.encoder_train" if judged else None)
        one = x[:1].contiguous()
        with torch.no_grad():
            sparse(one)
            ti = timed({"sparse": lambda m=sparse, a=one: m(a),
                        "dense": lambda m=dense, a=one: m(a)},
                       f"encoder {name} inference")
        _add(table, f"encoder inference, {name}, 1 x {tokens} tokens (fast path: "
             f"{fast_path_layers(sparse, ss)} layers)", ti["sparse"], "dense layer",
             ti["dense"], "models.encoder_infer" if judged else None)
        if dtype == torch.float32:
            s_state, d_state = _state_bytes(sparse, x, gy), _state_bytes(dense, x, gy)
            table.notes.append(
                f"Optimizer memory: `AdamW(fused=True)` keeps {s_state / 2**20:.1f} MiB of "
                f"state for the sparse layer against {d_state / 2**20:.1f} MiB dense (two "
                "values-sized moments per parameter; the fused step makes no values-sized "
                "temporaries, torch's default `foreach` Adam adds its `sqrt` and `div`).")
        del sparse, dense
        gc.collect()


def layers(table: Table, timed: Timed, ss: ModuleType, quick: bool,
           batches: Sequence[int] | None, autocast_only: bool = False) -> None:
    width = QUICK_WIDTH if quick else WIDTH
    torch.manual_seed(SEED)
    linear = nn.Linear(width, width)
    sparse = ss.nn.SparseLinear.from_dense(linear, BLOCK, DENSITY)
    half = nn.Linear(width, width).bfloat16()
    half.load_state_dict({k: v.bfloat16() for k, v in linear.state_dict().items()})
    pairs = {} if autocast_only else {torch.float32: (sparse, linear)}
    if not quick and not autocast_only:
        pairs[torch.bfloat16] = (ss.nn.SparseLinear.from_dense(half, BLOCK, DENSITY), half)
    for n in batches or (QUICK_BATCHES if quick else BATCHES):
        for dtype, (s, d) in pairs.items():
            name = "float32" if dtype == torch.float32 else "bfloat16"
            x = torch.randn(n, width, dtype=dtype)
            gy = torch.randn(n, width, dtype=dtype)
            xg = x.clone().requires_grad_(True)
            with torch.no_grad():
                s(x)
                t = timed({"sparse": lambda m=s, a=x: m(a), "dense": lambda m=d, a=x: m(a)},
                          f"layer {name} {n} no_grad")
            _add(table, f"batch {n}, {name}, forward (no_grad)", t["sparse"], "nn.Linear",
                 t["dense"], None)
            if n <= 32:  # a layer call in a training loop (parameters requiring grad)
                t = timed({"sparse": lambda m=s, a=x: m(a), "dense": lambda m=d, a=x: m(a)},
                          f"layer {name} {n} grad")
                _add(table, f"batch {n}, {name}, forward (parameters require grad)",
                     t["sparse"], "nn.Linear", t["dense"], None)
            sp, dp = [xg, *s.parameters()], [xg, *d.parameters()]
            t = timed({"sparse": lambda m=s, p=sp, a=xg, g=gy: torch.autograd.grad(m(a), p, g),
                       "dense": lambda m=d, p=dp, a=xg, g=gy: torch.autograd.grad(m(a), p, g)},
                      f"layer {name} {n} fwd+bwd")
            _add(table, f"batch {n}, {name}, forward + backward", t["sparse"], "nn.Linear",
                 t["dense"], None)
        x = torch.randn(n, width)

        def autocast_fwd(m: nn.Module = sparse, a: torch.Tensor = x) -> object:
            # (autocast switched on and off around the call: a `with torch.autocast` block
            # would time its own entry and exit, about as long as a batch-1 product)
            torch.set_autocast_enabled("cpu", True)
            try:
                return m(a)
            finally:
                torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        with torch.no_grad():
            autocast_fwd()
            t = timed({"autocast": autocast_fwd, "float32": lambda a=x: sparse(a)},
                      f"layer autocast {n}")
        _add(table, f"batch {n}, float32 layer under bf16 autocast, forward (no_grad)",
             t["autocast"], "the same layer, float32", t["float32"], None)
        xa = x.clone().requires_grad_(True)
        ga = torch.randn(n, width)
        # (the output's gradient in the output's dtype, bfloat16, as the ops above a layer
        # under autocast hand it: no cast inside the timed step)
        ga16 = ga.to(torch.bfloat16)
        params = [xa, *sparse.parameters()]

        def autocast_step(m: nn.Module = sparse, a: torch.Tensor = xa,
                          g: torch.Tensor = ga16, ps: list[torch.Tensor] = params) -> object:
            torch.set_autocast_enabled("cpu", True)
            try:
                y = m(a)
            finally:
                torch.set_autocast_enabled("cpu", False)
            return torch.autograd.grad(y, ps, g)
        autocast_step()
        t = timed({"autocast": autocast_step,
                   "float32": lambda m=sparse, a=xa, g=ga, ps=params: torch.autograd.grad(
                       m(a), ps, g)},
                  f"layer autocast {n} fwd+bwd")
        _add(table, f"batch {n}, float32 layer under bf16 autocast, forward + backward",
             t["autocast"], "the same layer, float32", t["float32"], None)
        gc.collect()


def _notes(ss: ModuleType, tables: list[Table]) -> None:
    native = load_safesparse("kernels.native")
    path = native.status().describe() if native is not None else "unknown"
    for table in tables:
        bf16 = native.bf16_describe() if native is not None else "unknown"
        table.notes.append(f"Kernel path: {path}; bfloat16 products: {bf16}.")


def bench_models(cfg: Config) -> list[Table]:
    def timed(fns: dict[str, Callable[[], object]], label: str) -> dict[str, Cell]:
        t = measure(fns, cfg, label)
        return {k: t[k] for k in fns}
    return run_tables(timed, cfg.quick, None, ("encoder", "layers"))


def run_tables(timed: Timed, quick: bool, batches: Sequence[int] | None,
               only: Sequence[str]) -> list[Table]:
    ss = load_safesparse()
    enc = Table("models: transformer encoder layer (SparseLinear at 10 % of 16 x 16 blocks) / "
                "dense", COLUMNS)
    lay = Table(f"models: SparseLinear / nn.Linear, {QUICK_WIDTH if quick else WIDTH}^2, 10 % "
                "of 16 x 16 blocks, batch 1 to 16384", COLUMNS)
    if ss is None:
        enc.notes.append("safesparse could not be imported: nothing to measure.")
        return [enc, lay]
    with DebugOff(ss):
        if "encoder" in only:
            encoder(enc, timed, ss, quick)
        if "layers" in only or "autocast" in only:
            layers(lay, timed, ss, quick, batches, autocast_only="layers" not in only)
    out = [t for t, name in ((enc, "encoder"), (lay, "layers"), (lay, "autocast"))
           if name in only]
    _notes(ss, out)
    return out


def cpu_timed(rounds: int, min_time: float, clock: Callable[[], float]) -> Timed:
    """Interleaved rounds, each statement timed by ``clock`` over enough calls to last about
    ``min_time / rounds``; the min over the rounds, seconds per call."""

    def timed(fns: dict[str, Callable[[], object]], label: str) -> dict[str, Cell]:
        counts: dict[str, int] = {}
        for name, fn in fns.items():
            fn()
            t0 = clock()
            fn()
            one = max(clock() - t0, 1e-6)
            counts[name] = max(1, int(min_time / rounds / one))
        best = {name: float("inf") for name in fns}
        names = list(fns)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, n = fns[name], counts[name]
                t0 = clock()
                for _ in range(n):
                    fn()
                best[name] = min(best[name], (clock() - t0) / n)
        return dict(best)
    return timed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="seconds per statement, over all rounds")
    parser.add_argument("--only", action="append", choices=("encoder", "layers", "autocast"),
                        help="autocast: only the layer table's rows of a float32 layer under "
                        "bf16 autocast (forward, forward + backward) against it in float32")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    timed = cpu_timed(args.rounds, args.min_time, clock)
    for table in run_tables(timed, args.quick, args.batches,
                            args.only or ("encoder", "layers")):
        print("\n" + table.render(), flush=True)
    return 0


if __name__ == "__main__":  # (run.py imports this file as a group; run as a script, it is not one)
    sys.exit(main())
else:
    register("models", "where models run: a transformer encoder layer (768 wide, 12 heads, MLP "
             "3072, every linear SparseLinear at 10 %) training step and inference against "
             "dense, float32 and bfloat16; SparseLinear / nn.Linear at batch 1 to 16384"
             )(bench_models)

"""Group ``enforce``: what enforce mode costs code that does not build sparse data.

Enforce mode validates sparse data where torch builds it (factories, legacy and ``_unsafe``
constructors, ``Tensor.new``, ``torch.load``, index conversions), not on every call. Measured
side by side, interleaved, in one process: the same training step with enforce mode on and off
in this thread (the wrappers installed in both, as in an enforced program), and, for reference,
the same step under a torch function mode that only passes every call through (the cost of
intercepting every call, which enforce mode avoids).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from harness import (
    SEED,
    Cell,
    Column,
    Config,
    Table,
    fmt_n,
    fmt_pct,
    fmt_ratio,
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
from torch.overrides import TorchFunctionMode

#: (key, description, limit, unit): this group's targets, merged into benchmarks/targets.py.
TARGETS = [
    ("enforce.mlp", "dense MLP training step, enforced / not enforced", 1.05, "x"),
    ("enforce.gcn", "PyG GCN training step on a CSR adjacency, enforced / not enforced", 1.05,
     "x"),
]

COLUMNS = [
    Column("measurement"), Column("size", fmt_n), Column("enforced (µs)", fmt_us),
    Column("not enforced (µs)", fmt_us), Column("ratio", fmt_ratio), Column("target", fmt_text),
    Column("met", fmt_verdict), Column("spread", fmt_pct),
]


class _PassThrough(TorchFunctionMode):
    """Looks at every torch call and does nothing else: the floor of a per-call mode."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _mlp_step(gen: torch.Generator) -> Callable[[], object]:
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    def step() -> object:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _gcn_step(ss: ModuleType, gen: torch.Generator, nodes: int, edges: int,
              enforced: contextvars.Context) -> tuple[Callable[[], object], Callable[[], object]]:
    """The same two-layer GCN step on a plain CSR adjacency and on the one enforce mode builds
    (a checked SafeSparseTensor: its operations run through the wrapper)."""
    from torch_geometric.nn import GCNConv
    from torch_geometric.utils import coalesce, to_torch_csr_tensor

    ei = coalesce(torch.randint(0, nodes, (2, edges), generator=gen), num_nodes=nodes)
    plain_adj = to_torch_csr_tensor(ei, size=(nodes, nodes))
    safe_adj = enforced.run(to_torch_csr_tensor, ei, size=(nodes, nodes))
    assert ss.is_checked(safe_adj) and type(plain_adj) is torch.Tensor
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

    return make(safe_adj), make(plain_adj)


@register("enforce", "enforce mode's cost where no sparse data is built: a dense MLP step and "
          "a PyG GCN step on a CSR adjacency, enforced vs not (side by side)")
def bench_enforce(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    table = Table("enforce: dense code and a GCN step, enforced vs not", COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    mod = load_safesparse("enforcement.mode")
    assert mod is not None
    gen = torch.Generator().manual_seed(SEED)
    with ss.enforce(False):  # wrappers installed for the whole group; off in this context
        on, off = contextvars.copy_context(), contextvars.copy_context()
        on.run(mod._ENFORCE.set, True)
        off.run(mod._ENFORCE.set, False)
        assert on.run(ss.is_enforced) and not off.run(ss.is_enforced)
        step = _mlp_step(gen)
        mode = _PassThrough()

        def in_mode() -> object:
            with mode:
                return step()

        fns: dict[str, Callable[[], object]] = {
            "on": lambda: on.run(step), "off": lambda: off.run(step), "mode": in_mode}
        tm = measure(fns, cfg, "enforce mlp")
        r = ratio(tm["on"], tm["off"])
        _row(table, "MLP step 784-256-10, batch 64", 64, tm["on"], tm["off"], r,
             "enforce.mlp", tm.max_spread())
        table.add("  for reference: a pass-through torch function mode", 64, tm["mode"],
                  tm["off"], ratio(tm["mode"], tm["off"]), "(what enforce mode avoids)", None,
                  tm.max_spread())
        try:
            nodes, edges = (1000, 10_000) if cfg.quick else (5000, 50_000)
            safe_step, plain_step = _gcn_step(ss, gen, nodes, edges, on)
        except ImportError:
            table.notes.append("torch_geometric is not installed: no GCN row.")
        else:
            fns = {"on": lambda: on.run(safe_step), "off": lambda: off.run(plain_step)}
            tm = measure(fns, cfg, "enforce gcn")
            _row(table, f"GCN step, 2 layers, {nodes} nodes, CSR adjacency", edges, tm["on"],
                 tm["off"], ratio(tm["on"], tm["off"]), "enforce.gcn", tm.max_spread())
    table.notes += [
        "enforced: enforce mode on in this thread (the step's own context); not enforced: off, "
        "with the wrappers installed in both (as in an enforced program). The MLP step builds "
        "no sparse data and calls no wrapped function.",
        "GCN: torch_geometric GCNConv(normalize=False) x2 + cross entropy + SGD; enforced, the "
        "adjacency comes from to_torch_csr_tensor under enforce mode (a checked "
        "SafeSparseTensor: each product goes through its wrapper); not enforced, the same "
        "function's plain CSR tensor. size: edges (nnz).",
        "spread: largest IQR / median of the row's statements; on a loaded machine use "
        "--threads 1 --stat min (with 2 threads, other load makes every step far slower).",
    ]
    return [table]


def _row(table: Table, label: str, size: int, on: Cell | str, off: Cell | str,
         r: float | None, key: str, spread: float | None) -> None:
    table.add(label, size, num(on), num(off), r, target_text(key), judge(key, r), spread)

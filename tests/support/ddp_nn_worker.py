"""One rank of the 2-process gloo session behind tests/distributed/test_nn_distributed.py.

Run as ``python tests/support/ddp_nn_worker.py RANK WORLD INIT_FILE OUT_JSON``. Both ranks run every
scenario of :data:`SCENARIOS` in order: a model (Linear, ReLU, SparseLinear BSR 4 x 4, ReLU,
Linear) trained a few SGD steps under ``DistributedDataParallel``, eager and compiled, each rank
on its half of one batch. After every step each rank gathers both replicas' parameters and
index buffers and records how far apart they are, how far the parameters moved from their
start, and how far they are from a single-process run on the whole batch. Results go to
``OUT_JSON``; the test module asserts on them.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ranks import Result, serve  # this folder: the script's own, first on sys.path

import safesparse as ss
import safesparse.distributed as ssd
from safesparse.nn import SparseLinear

SCENARIOS: list[Callable[[int], Result]] = []
STEPS = 3
BATCH = 8  # the whole batch; each rank trains on half of it
BACKEND = "aot_eager"  # the graphs and autograd that inductor compiles, without code generation


def scenario(fn: Callable[[int], Result]) -> Callable[[int], Result]:
    SCENARIOS.append(fn)
    return fn


def make_model(pattern_seed: int) -> nn.Sequential:
    """The same dense weights on every rank; the sparse layer's pattern from ``pattern_seed``."""
    torch.manual_seed(0)
    first = nn.Linear(16, 32)
    torch.manual_seed(pattern_seed)
    sparse = SparseLinear.from_dense(nn.Linear(32, 32), (4, 4), 0.25)
    torch.manual_seed(1)
    return nn.Sequential(first, nn.ReLU(), sparse, nn.ReLU(), nn.Linear(32, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def synced_model(rank: int) -> nn.Sequential:
    """Rank 1 starts from another pattern; rank 0's is broadcast, validated on receipt, and set
    through the module (DDP's own broadcast of the parameters then makes the values equal)."""
    model = make_model(pattern_seed=3 if rank == 0 else 4)
    layer = model[2]
    assert isinstance(layer, SparseLinear)
    received = ssd.broadcast(layer.weight.detach() if rank == 0 else None, src=0)
    layer.weight = received
    return model


def wrap(model: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    with warnings.catch_warnings():  # torch 2.13 deprecates broadcast_buffers (docs/distributed.md)
        warnings.simplefilter("ignore", FutureWarning)
        return DistributedDataParallel(model, **kwargs)


def state(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """All parameters, flattened; all buffers (the index members), flattened."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buffers = torch.cat([b.detach().reshape(-1).to(torch.int64) for b in model.buffers()])
    return params, buffers


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def train(rank: int, run: Callable[[torch.Tensor], torch.Tensor], model: nn.Module) -> Result:
    """``STEPS`` SGD steps on this rank's half of the batch, next to a single-process reference
    (the same start, the whole batch); what the replicas look like after every step."""
    reference = make_model(pattern_seed=3)
    start, _ = state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = batch()
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    steps = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((run(x[half]) - y[half]) ** 2).mean()
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_opt.step()
        params, buffers = state(model)
        ref_params, ref_buffers = state(reference)
        p0, p1 = gathered(params)
        b0, b1 = gathered(buffers)
        steps.append({
            "loss": float(loss.detach()),
            "replica_diff": float((p0 - p1).abs().max()),
            "same_pattern": bool(torch.equal(b0, b1)),
            "moved": float((params - start).abs().max()),
            "reference_diff": float((params - ref_params).abs().max()),
            "reference_pattern": bool(torch.equal(buffers, ref_buffers)),
        })
    return {"steps": steps}


@scenario
def eager(rank: int) -> Result:
    model = synced_model(rank)
    return train(rank, wrap(model, broadcast_buffers=False), model)


@scenario
def compiled_then_wrapped(rank: int) -> Result:
    """``torch.compile(model, fullgraph=True)`` (one graph, no break), then DDP around it."""
    torch._dynamo.reset()
    model = synced_model(rank)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    return train(rank, wrap(compiled, broadcast_buffers=False), model)


@scenario
def wrapped_then_compiled(rank: int) -> Result:
    """``torch.compile(ddp)``: dynamo breaks the graph in DDP's own forward (not in the model),
    and compiles the model inside it; DDP's graph splitting (``optimize_ddp``) at its
    default."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = synced_model(rank)
    out = train(rank, torch.compile(wrap(model, broadcast_buffers=False), backend=BACKEND),
                model)
    out["unique_graphs"] = int(counters["stats"]["unique_graphs"])
    out["break_reasons"] = sorted(str(k).splitlines()[0] for k in counters["graph_break"])
    return out


@scenario
def default_buffers(rank: int) -> Result:
    """DDP's default ``broadcast_buffers=True`` writes every buffer in place before each
    forward, the index buffers included: the layer validates them again (O(nnz)) and trains."""
    model = synced_model(rank)
    ss.reset_stats()
    out = train(rank, wrap(model), model)
    out["validations"] = ss.stats().validations
    return out


@scenario
def default_buffers_compiled(rank: int) -> Result:
    """The same, compiled with ``fullgraph=True`` and then wrapped with DDP's defaults."""
    torch._dynamo.reset()
    model = synced_model(rank)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    return train(rank, wrap(compiled), model)


@scenario
def invalid_broadcast_refused(rank: int) -> Result:
    """Rank 0's index buffer holds invalid data after a first step: DDP's buffer broadcast
    hands it to rank 1, writing below autograd (no version counter moves there), and both
    refuse it before any kernel reads it, naming the key."""
    model = synced_model(rank)
    ddp = wrap(model)
    ddp(batch()[0])  # a first step: the buffers are validated, then trusted?
    if rank == 0:
        with torch.no_grad():
            model[2].plain_indices[0] = 1000
    try:
        ddp(batch()[0])
    except ss.InvariantError as err:
        return {"refused": str(err).splitlines()[0]}
    return {"refused": None}


if __name__ == "__main__":
    serve(SCENARIOS, timeout_s=60, barrier_each=True)

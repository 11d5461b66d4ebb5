"""One rank of the 2-process gloo session behind the FSDP2 tests of
tests/distributed/test_nn_distributed.py.

Run as ``python tests/support/fsdp_worker.py RANK WORLD INIT_FILE OUT_JSON``. Both ranks run every
scenario of :data:`SCENARIOS` in order: a model (Linear, ReLU, SparseLinear BSR 4 x 4, ReLU,
Linear) sharded with ``torch.distributed.fsdp.fully_shard`` (the sparse layer its own unit, then
the model) trained a few SGD steps, each rank on its half of one batch, next to a
single-process run on the whole batch; full and sharded state dicts saved and loaded (the
pattern validated there), a model built on the meta device, made sparse with ``sparsify_``,
sharded, ``to_empty`` and loaded; an invalid checkpoint refused on every rank; evaluations between
training steps at 64 rows per rank (16 x 16 blocks) equal to one process's. Results go to
``OUT_JSON``; the test module asserts on them.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ranks import Result, serve  # this folder: the script's own, first on sys.path

import safesparse as ss
from safesparse.nn import SparseLinear, sparsify_

SCENARIOS: list[Callable[[int], Result]] = []
STEPS = 3
BATCH = 8  # the whole batch; each rank trains on half of it
FULL = StateDictOptions(full_state_dict=True)


def scenario(fn: Callable[[int], Result]) -> Callable[[int], Result]:
    SCENARIOS.append(fn)
    return fn


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                         SparseLinear.from_dense(nn.Linear(32, 32), (4, 4), 0.25), nn.ReLU(),
                         nn.Linear(32, 4))


def sharded(model: nn.Sequential) -> nn.Sequential:
    with warnings.catch_warnings():  # (see docs/distributed.md: the layer's output is a view)
        warnings.simplefilter("ignore", UserWarning)
        fully_shard(model[2])
        fully_shard(model)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model.state_dict().items()}


def state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out: torch.Tensor = model(x)
    return out.detach()


@scenario
def trained(rank: int) -> Result:
    """Each rank trains its shard on its half of the batch; after every step the gathered
    model equals a single-process run on the whole batch, the pattern unchanged."""
    model, reference = sharded(make_model()), make_model()
    layer = model[2]
    assert isinstance(layer, SparseLinear)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = batch()
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    start = full_state(model)
    ss.reset_stats()
    steps = []
    for _ in range(STEPS):
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loss = ((model(x[half]) - y[half]) ** 2).mean()
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_opt.step()
        now = full_state(model)
        steps.append({"loss": float(loss.detach()),
                      "reference_diff": state_diff(now, full_state(reference)),
                      "moved": state_diff(now, start)})
    return {"steps": steps, "validations": ss.stats().validations,
            "values_sharded": isinstance(layer.values, DTensor),
            "local_blocks": int(layer.values.to_local().shape[0]),  # type: ignore[attr-defined]
            "same_pattern": bool(torch.equal(layer.block_mask(), reference[2].block_mask())),
            # the layer keeps no tensor over the full values FSDP2 sharded (freed)
            "keeps_full_values": layer.__dict__.get("_pattern") is not None}


@scenario
def evaluated_between_steps(rank: int) -> Result:
    """Training steps at 64 rows per rank (the eager plans' pre-packed values start at 16
    rows) with three ``no_grad`` evaluations after each: FSDP2 all-gathers the updated values
    into its unsharded parameters without moving their counters, so every evaluation must
    still compute what a single process computes with the current values (no stale copy)."""
    def blocks16() -> nn.Sequential:  # (blocks of 16 rows: the pre-packed copies' kind)
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                             SparseLinear.from_dense(nn.Linear(32, 32), (16, 16), 0.5),
                             nn.ReLU(), nn.Linear(32, 4))

    model, reference = sharded(blocks16()), blocks16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(128, 16, generator=g), torch.randn(128, 4, generator=g)
    half = slice(rank * 64, (rank + 1) * 64)
    diffs = []
    for _ in range(STEPS):
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ((model(x[half]) - y[half]) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        ref_opt.step()
        with torch.no_grad():
            want = reference(x[half])
            diffs.append(max(float((run(model, x[half]) - want).abs().max())
                             for _ in range(3)))
    return {"eval_diffs": diffs}


@scenario
def state_dicts(rank: int) -> Result:
    """A full state dict (``get_model_state_dict(full_state_dict=True)``) is the
    single-process model's; loaded into another sharded model (``set_model_state_dict``) and a
    sharded state dict loaded back with ``load_state_dict``, the pattern validated each time,
    the models compute the same."""
    model, reference = sharded(make_model()), make_model()
    x = batch()[0]
    full = get_model_state_dict(model, options=FULL)
    same = state_diff({k: v.detach() for k, v in full.items()}, reference.state_dict())
    torch.manual_seed(5)
    other = sharded(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                  SparseLinear.from_dense(nn.Linear(32, 32), (4, 4), 0.25),
                                  nn.ReLU(), nn.Linear(32, 4)))
    ss.reset_stats()
    set_model_state_dict(other, full, options=FULL)
    full_validations = ss.stats().validations
    loaded_diff = float((run(other, x) - reference(x).detach()).abs().max())
    ss.reset_stats()
    other.load_state_dict(model.state_dict())  # sharded (DTensor values)
    sharded_validations = ss.stats().validations
    return {"full_equals_reference": same, "loaded_diff": loaded_diff,
            "full_validations": full_validations, "sharded_validations": sharded_validations,
            "sharded_diff": float((run(other, x) - reference(x).detach()).abs().max())}


@scenario
def meta_init(rank: int) -> Result:
    """The big-model flow: built on the meta device, ``sparsify_`` (a skeleton), sharded,
    ``to_empty``, then the full checkpoint loaded: the file's pattern, validated."""
    reference = make_model()
    with torch.device("meta"):
        skeleton = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sparsify_(skeleton, density=0.25, block_size=4, filter_fn=lambda m, fqn: fqn == "2")
    model = sharded(skeleton)
    model.to_empty(device="cpu")
    ss.reset_stats()
    set_model_state_dict(model, reference.state_dict(), options=FULL)
    x = batch()[0]
    return {"validations": ss.stats().validations,
            "diff": float((run(model, x) - reference(x).detach()).abs().max()),
            "same_pattern": bool(torch.equal(model[2].block_mask(), reference[2].block_mask()))}


@scenario
def invalid_refused(rank: int) -> Result:
    model = sharded(make_model())
    full = {k: v.clone() for k, v in make_model().state_dict().items()}
    full["2.plain_indices"][0] = 1000
    try:
        set_model_state_dict(model, full, options=FULL)
    except ss.InvariantError as err:
        return {"refused": str(err).splitlines()[0]}
    return {"refused": None}


if __name__ == "__main__":
    serve(SCENARIOS, timeout_s=60, barrier_each=True)

"""DistributedDataParallel trains models holding ``SparseLinear`` (issue 35, item 7).

Two gloo processes on 127.0.0.1 (``tests/support/ddp_nn_worker.py``, one session per module, under a
timeout) train Linear, ReLU, SparseLinear (BSR 4 x 4), ReLU, Linear for a few SGD steps, each
rank on half of one batch: eager, compiled with ``fullgraph=True`` and then wrapped, and
wrapped and then compiled. After every step the replicas hold equal parameters and the same
pattern, the parameters moved, and they match a single-process run on the whole batch. Rank 1
starts from another pattern, replaced by rank 0's through ``safesparse.distributed.broadcast``
and ``layer.weight = ...``. DDP's default in-place buffer broadcast trains too (the layer
validates the written index buffers at each forward); invalid broadcast data is refused.

FSDP2 (``fully_shard``, ``tests/support/fsdp_worker.py``, a session of its own): the sparse
layer's values are sharded, its pattern replicated; two ranks train equal to one process on the
whole batch with no validation per step, full and sharded state dicts load (the pattern
validated), a meta-device model made sparse with ``sparsify_`` is sharded, ``to_empty``'d and
loaded, and an invalid checkpoint is refused on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from support.ranks import Results, run_two_ranks

WORKER = Path(__file__).resolve().parents[1] / "support" / "ddp_nn_worker.py"
FSDP_WORKER = WORKER.with_name("fsdp_worker.py")
SESSION_TIMEOUT = 240  # seconds: generous for a loaded 2-core machine; a run takes ~15 s

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TRAINED = ["eager", "compiled_then_wrapped", "wrapped_then_compiled", "default_buffers",
           "default_buffers_compiled"]
STEPS_RUN = 3  # ddp_nn_worker.STEPS


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return run_two_ranks(WORKER, tmp_path_factory.mktemp("ddp_nn"), SESSION_TIMEOUT)


def value(session: Results, rank: int, name: str) -> Any:
    record = session[rank][name]
    assert record["ok"], f"rank {rank}, scenario {name}:\n{record['error']}"
    return record["value"]


@pytest.mark.parametrize("name", TRAINED)
def test_replicas_stay_equal_and_train(session: Results, name: str) -> None:
    runs = [value(session, rank, name)["steps"] for rank in (0, 1)]
    assert len(runs[0]) == len(runs[1]) >= 3
    for rank, steps in enumerate(runs):
        for i, step in enumerate(steps):
            where = (name, rank, i)
            assert step["replica_diff"] <= 1e-6, where
            assert step["same_pattern"], where
            assert step["reference_pattern"], where
            assert step["reference_diff"] <= 1e-5, where
            assert step["moved"] > 1e-3, where
        moved = [s["moved"] for s in steps]
        assert moved == sorted(moved) and moved[-1] > moved[0], (name, rank)
    # each rank trains on its own half: different losses, one model
    assert [s["loss"] for s in runs[0]] != [s["loss"] for s in runs[1]]


def test_compiled_runs_compute_what_eager_computes(session: Results) -> None:
    eager = [s["loss"] for s in value(session, 0, "eager")["steps"]]
    for name in TRAINED[1:]:
        got = [s["loss"] for s in value(session, 0, name)["steps"]]
        assert got == pytest.approx(eager, rel=1e-5, abs=1e-6), name


def test_compiling_the_wrapper_breaks_only_in_ddp(session: Results) -> None:
    """``torch.compile(ddp)``: the model is one graph; the breaks are DDP's own code."""
    got = value(session, 0, "wrapped_then_compiled")
    assert got["unique_graphs"] == 1
    assert got["break_reasons"], "no break at all: fullgraph=True on the wrapper may work now"
    assert not any("safesparse" in reason for reason in got["break_reasons"])


def test_default_buffer_broadcast_validates_each_step(session: Results) -> None:
    """``broadcast_buffers=True`` (DDP's default) trains; the index buffers it writes in place
    without moving a version counter are validated at every forward and backward product
    (what it costs: one O(nnz) validation per product and step)."""
    for rank in (0, 1):
        assert value(session, rank, "default_buffers")["validations"] >= 2 * STEPS_RUN, rank


def test_invalid_broadcast_buffers_are_refused(session: Results) -> None:
    for rank in (0, 1):
        refused = value(session, rank, "invalid_broadcast_refused")["refused"]
        assert refused is not None and "[BSR 5.5]" in refused, rank
        assert "module.2.plain_indices" in refused, rank


# -- FSDP2 (fully_shard) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return run_two_ranks(FSDP_WORKER, tmp_path_factory.mktemp("fsdp"), SESSION_TIMEOUT)


def test_fsdp2_trains_equal_to_one_process(fsdp: Results) -> None:
    for rank in (0, 1):
        got = value(fsdp, rank, "trained")
        assert len(got["steps"]) == STEPS_RUN
        for i, step in enumerate(got["steps"]):
            assert step["reference_diff"] <= 1e-5, (rank, i)
            assert step["moved"] > 1e-3, (rank, i)
        assert got["values_sharded"] and got["local_blocks"] == 8  # 16 blocks, 2 ranks
        assert got["same_pattern"]
        assert got["validations"] == 0  # the replicated pattern stays proven
        assert not got["keeps_full_values"]  # what FSDP2 sharded is freed
    losses = [[s["loss"] for s in value(fsdp, rank, "trained")["steps"]] for rank in (0, 1)]
    assert losses[0] != losses[1]  # each rank its own half


def test_fsdp2_evaluations_between_steps_read_the_current_values(fsdp: Results) -> None:
    for rank in (0, 1):
        diffs = value(fsdp, rank, "evaluated_between_steps")["eval_diffs"]
        assert len(diffs) >= 3 and max(diffs) <= 1e-5, (rank, diffs)


def test_fsdp2_state_dicts_load_validated(fsdp: Results) -> None:
    for rank in (0, 1):
        got = value(fsdp, rank, "state_dicts")
        assert got["full_equals_reference"] == 0.0
        assert got["loaded_diff"] == 0.0 and got["sharded_diff"] == 0.0
        assert got["full_validations"] >= 1 and got["sharded_validations"] >= 1


def test_fsdp2_meta_skeleton_to_empty_and_load(fsdp: Results) -> None:
    for rank in (0, 1):
        got = value(fsdp, rank, "meta_init")
        assert got["diff"] == 0.0 and got["same_pattern"] and got["validations"] >= 1


def test_fsdp2_invalid_checkpoint_refused(fsdp: Results) -> None:
    for rank in (0, 1):
        refused = value(fsdp, rank, "invalid_refused")["refused"]
        assert refused is not None and "[BSR 5.5]" in refused and "2.plain_indices" in refused

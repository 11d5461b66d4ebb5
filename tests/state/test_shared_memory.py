"""Sparse tensors whose index storage is shared with other processes.

A write by another process bumps no version counter in this one, so a proof cached on shared
index storage could go stale unseen (SPEC section 4: such storage is never trusted from a
cache). The tests here make another process write the index storage of a checked tensor and
check that this process notices; and that DataLoader workers deliver sparse batches (validated
when they arrive in the main process).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader, Dataset

import safesparse as ss

JOIN_TIMEOUT = 60  # seconds; a child that hangs fails the test instead of the suite

needs_fork = pytest.mark.skipif("fork" not in mp.get_all_start_methods(),
                                reason="the fork start method is not available")


def _csr() -> ss.SafeSparseTensor:
    return ss.sparse_csr_tensor([0, 2, 3, 4], [0, 2, 1, 0], [1.0, 2.0, 3.0, 4.0], (3, 3))


def _coo() -> ss.SafeSparseTensor:
    return ss.sparse_coo_tensor([[0, 1, 2], [2, 0, 1]], [1.0, 2.0, 3.0], (3, 3),
                                is_coalesced=True)


def _share_indices(t: torch.Tensor) -> None:
    """Move ``t``'s index storage into shared memory, in place (torch has no share_memory_ for
    sparse tensors; the members' storages are the tensor's own)."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            t._indices().share_memory_()
        else:
            t.crow_indices().share_memory_()
            t.col_indices().share_memory_()


def _write_first_index(t: torch.Tensor, value: int) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        member = t._indices()[0] if t.layout == torch.sparse_coo else t.col_indices()
        member[0] = value


def _run_child(target: Callable[..., None], *args: Any) -> None:
    ctx = tmp.get_context("fork")
    child = ctx.Process(target=target, args=args)
    child.start()
    child.join(JOIN_TIMEOUT)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the child process hung")
    assert child.exitcode == 0


# ---------------------------------------------------------------------------------------------
# share_memory_(): another process writes the index storage


@needs_fork
@pytest.mark.parametrize("make", [_csr, _coo], ids=["csr", "coo"])
def test_shared_indices_really_are_shared(make: Callable[[], ss.SafeSparseTensor]) -> None:
    """The premise of the tests below: a child's write is visible here, and is valid data."""
    t = make()
    _share_indices(t)
    t = ss.validate(t)
    _run_child(_write_first_index, t, 1)
    with torch._C.DisableTorchFunctionSubclass():
        first = t._indices()[0, 0] if t.layout == torch.sparse_coo else t.col_indices()[0]
    assert int(first) == 1


@needs_fork
@pytest.mark.parametrize("make", [_csr, _coo], ids=["csr", "coo"])
def test_foreign_write_is_not_hidden_by_the_cache(make: Callable[[], ss.SafeSparseTensor]
                                                  ) -> None:
    t = make()
    _share_indices(t)
    t = ss.validate(t)
    _run_child(_write_first_index, t, 10**6)  # far out of bounds
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError, match="5"):
        ss.validate(t)


@needs_fork
def test_rebuild_on_foreign_written_indices_validates() -> None:
    """The training-loop path (new values on proven indices) must not skip validation."""
    t = _csr()
    _share_indices(t)
    t = ss.validate(t)
    crow, col = t.crow_indices(), t.col_indices()
    _run_child(_write_first_index, t, 10**6)
    with pytest.raises(ss.InvariantError, match=r"\[CSR 5.5\]"):
        ss.sparse_csr_tensor(crow, col, torch.ones(4), (3, 3))


def _send_then_corrupt(queue: Any, sent: Any, corrupt: Any, done: Any) -> None:
    t = _csr()
    queue.put(t)  # torch moves t's storages to shared memory to send them
    if not sent.wait(JOIN_TIMEOUT):
        return
    _write_first_index(t, 10**6)
    corrupt.set()
    done.wait(JOIN_TIMEOUT)


@needs_fork
def test_tensor_from_another_process_written_after_receipt() -> None:
    """A tensor received through a torch.multiprocessing queue (as DataLoader workers send
    batches) shares its index storage with the sender, who writes it afterwards."""
    ctx = tmp.get_context("fork")
    queue, sent, corrupt, done = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_send_then_corrupt, args=(queue, sent, corrupt, done))
    child.start()
    try:
        t = queue.get(timeout=JOIN_TIMEOUT)
        assert isinstance(t, ss.SafeSparseTensor)
        assert t.col_indices().is_shared()
        t = ss.validate(t)  # valid as received
        sent.set()
        assert corrupt.wait(JOIN_TIMEOUT)
        assert not ss.is_checked(t)
        with pytest.raises(ss.InvariantError, match=r"\[CSR 5.5\]"):
            ss.validate(t)
    finally:
        done.set()
        child.join(JOIN_TIMEOUT)
        if child.is_alive():
            child.kill()
            child.join()


# ---------------------------------------------------------------------------------------------
# DataLoader workers


LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
           torch.sparse_bsc)


def make_sample(i: int, layout: torch.layout) -> ss.SafeSparseTensor:
    g = torch.Generator().manual_seed(i)
    dense = torch.randn(4, 6, generator=g) * (torch.rand(4, 6, generator=g) > 0.5)
    if layout == torch.sparse_coo:
        return ss.validate(dense.to_sparse())
    blocksize = (2, 3) if layout in (torch.sparse_bsr, torch.sparse_bsc) else None
    return ss.validate(dense.to_sparse(layout=layout, blocksize=blocksize))


class SparseSamples(Dataset[dict[str, Any]]):
    """Each item: a sparse tensor of every layout, and a dense label."""

    def __init__(self, n: int, *, bad_item: int | None = None) -> None:
        self.n = n
        self.bad_item = bad_item

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        item: dict[str, Any] = {str(lay): make_sample(i, lay) for lay in LAYOUTS}
        item["label"] = torch.tensor(i)
        if i == self.bad_item:  # a buggy worker: index data out of bounds
            item["bad"] = ss.sparse_csr_tensor([0, 1], [10**9], [1.0], (1, 2),
                                               check_invariants=False)
        return item


def stack_coo(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate_fn batching the COO samples (torch.stack supports sparse COO)."""
    return {"coo": ss.validate(torch.stack([it[str(torch.sparse_coo)] for it in items])),
            "label": torch.stack([it["label"] for it in items])}


def _check_item(item: dict[str, Any], i: int) -> None:
    assert int(item["label"]) == i
    for lay in LAYOUTS:
        got = item[str(lay)]
        assert isinstance(got, ss.SafeSparseTensor) and got.layout == lay
        want = make_sample(i, lay)
        assert torch.equal(ss.validate(got).to_dense(), want.to_dense())


@pytest.mark.parametrize("context", [None, "spawn"], ids=["default", "spawn"])
def test_dataloader_workers_deliver_sparse_samples(context: str | None) -> None:
    # spawn: one worker is enough to prove the round trip, and each costs a fresh interpreter
    n, workers = (6, 2) if context is None else (2, 1)
    loader = DataLoader(SparseSamples(n), batch_size=None, num_workers=workers,
                        multiprocessing_context=context, timeout=JOIN_TIMEOUT)
    items = list(loader)
    assert len(items) == n
    for i, item in enumerate(items):
        _check_item(item, i)
    if context is None and mp.get_start_method() != "spawn":
        # the index storage came from a worker through shared memory
        assert items[0][str(torch.sparse_csr)].col_indices().is_shared()


def test_dataloader_workers_with_a_collate_fn() -> None:
    loader = DataLoader(SparseSamples(6), batch_size=3, num_workers=2, collate_fn=stack_coo,
                        timeout=JOIN_TIMEOUT)
    batches = list(loader)
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    for b in batches:
        coo = ss.validate(b["coo"])
        assert isinstance(coo, ss.SafeSparseTensor) and coo.shape == (3, 4, 6)
        for k, i in enumerate(b["label"].tolist()):
            want = make_sample(i, torch.sparse_coo).to_dense()
            assert torch.equal(coo.to_dense()[k], want)


def test_dataloader_refuses_invalid_data_from_a_worker() -> None:
    """A worker handing over broken index data: the main process refuses the batch with an
    InvariantError when it arrives, before anything is built from it (no crash)."""
    loader = DataLoader(SparseSamples(4, bad_item=2), batch_size=None, num_workers=2,
                        timeout=JOIN_TIMEOUT)
    got = []
    with pytest.raises(ss.InvariantError, match=r"\[CSR 5.5\]"):
        got.extend(loader)
    # items arrive from the two workers in any order; those before the bad one are intact
    assert [int(item["label"]) for item in got] == list(range(len(got)))[:2]

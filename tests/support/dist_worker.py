"""One rank of the 2-process gloo session behind tests/distributed/test_distributed.py.

Run as ``python tests/support/dist_worker.py RANK WORLD INIT_FILE OUT_JSON``. Both ranks run every
scenario of :data:`SCENARIOS` in order; each scenario returns a JSON-serialisable dict, and the
results of all scenarios are written to ``OUT_JSON`` (``OUT_JSON.partial`` while running). The
test module asserts on them. A scenario that raises records the error; the test then fails
with it. Rank 0 plays the hostile peer where a scenario needs one, by sending raw headers and
members or by skipping validation of what it sends.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ranks import Result, serve  # this folder: the script's own, first on sys.path

import safesparse as ss
import safesparse.distributed as ssd

SCENARIOS: list[Callable[[int], Result]] = []


def scenario(fn: Callable[[int], Result]) -> Callable[[int], Result]:
    SCENARIOS.append(fn)
    return fn


# ---------------------------------------------------------------------------------------------
# Example tensors, identical on every rank


def examples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    mask2 = rand(4, 6) > 0
    out: dict[str, torch.Tensor] = {
        "coo_uncoalesced": ss.sparse_coo_tensor([[0, 1, 1, 0], [2, 0, 0, 2]],
                                                [1.0, 2.0, 3.0, 4.0], (2, 3)),
        "coo_hybrid": ss.validate((rand(4, 5, 2) * (rand(4, 5, 1) > 0)).to_sparse(2)),
        "coo_3d_int64": ss.validate((torch.arange(24).reshape(2, 3, 4) % 3).to_sparse()),
        "csr": ss.validate((rand(4, 6) * mask2).to_sparse_csr()),
        "csr_batched": ss.validate((rand(2, 4, 6) * mask2).to_sparse_csr()),
        "csr_int32": ss.sparse_csr_tensor(torch.tensor([0, 1, 3], dtype=torch.int32),
                                          torch.tensor([2, 0, 1], dtype=torch.int32),
                                          [1.0, 2.0, 3.0], (2, 3)),
        "csc_hybrid": ss.validate((rand(4, 6, 2) * mask2.unsqueeze(-1)).to_sparse_csc(
            dense_dim=1)),
        "bsr_batched_hybrid": ss.validate(
            (rand(2, 4, 6, 3) * mask2[:, :, None]).to_sparse_bsr(
                (2, 3), dense_dim=1)),
        "bsc": ss.validate(rand(4, 6).to_sparse_bsc((2, 2))),
        "csr_complex": ss.validate((rand(3, 3) * (1 + 2j)).to_sparse_csr()),
        "csr_bool": ss.validate((rand(3, 4) > 0).to_sparse_csr()),
        "csr_empty": ss.sparse_csr_tensor(torch.zeros(4, dtype=torch.int64),
                                          torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                                          (3, 5)),
        "coo_empty": ss.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0),
                                          (3, 5)),
    }
    return out


def describe(t: torch.Tensor) -> Result:
    """What the tests compare: type, checked state, layout, dtypes, shape, dense contents."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo:
            index_dtype, coalesced = str(t._indices().dtype), t.is_coalesced()
        else:
            index_dtype = str((t.crow_indices() if t.layout in (torch.sparse_csr,
                               torch.sparse_bsr) else t.ccol_indices()).dtype)
            coalesced = None
        dense = t.to_dense()
    if dense.is_complex():
        dense = torch.view_as_real(dense)
    return {
        "safe": isinstance(t, ss.SafeSparseTensor),
        "checked": ss.is_checked(t),
        "layout": str(t.layout),
        "dtype": str(t.dtype),
        "index_dtype": index_dtype,
        "coalesced": coalesced,
        "shape": list(t.shape),
        "dense": dense.to(torch.float64).reshape(-1).tolist(),
    }


def refused(call: Callable[[], Any]) -> Result:
    """Run ``call``, which must raise; record the error."""
    try:
        got = call()
    except (ss.InvariantError, ssd.TransferError) as err:
        return {
            "type": type(err).__name__,
            "message": str(err),
            "invariant": getattr(err, "invariant", None),
            "source_rank": (err.location.get("source_rank")
                            if isinstance(err, ss.InvariantError) else err.source_rank),
        }
    return {"type": None, "message": f"accepted: {got!r}"}


# Hostile helpers (rank 0): raw protocol messages that skip the sender's validation


def bad_csr() -> torch.Tensor:
    """A CSR tensor whose column index 10**9 is far out of bounds (5.5)."""
    return ss.sparse_csr_tensor([0, 1, 2], [1, 10**9], [1.0, 2.0], (2, 3),
                                check_invariants=False)


def bad_coo_coalesced() -> torch.Tensor:
    """A COO tensor marked coalesced whose indices are not sorted (5.3)."""
    return ss.sparse_coo_tensor([[1, 0]], [1.0, 2.0], (3,), check_invariants=False,
                                is_coalesced=True)


def bad_bsr() -> torch.Tensor:
    """A BSR tensor whose crow_indices decrease (5.3)."""
    return ss.sparse_bsr_tensor([0, 2, 1], [0, 1], torch.ones(2, 2, 2), (4, 4),
                                check_invariants=False)


def raw_header(t: torch.Tensor, **fields: int) -> torch.Tensor:
    header = ssd._header(t, torch.device("cpu"))
    for name, value in fields.items():
        header[getattr(ssd, f"_F_{name.upper()}")] = value
    return header


def raw_members(t: torch.Tensor) -> list[torch.Tensor]:
    return [ssd._as_bytes(m, torch.device("cpu")) for m in ssd._members(t)]


@contextmanager
def hostile(active: bool) -> Iterator[None]:
    """On the hostile rank, the sending side of safesparse.distributed skips validation (and,
    working on plain tensors, the guard)."""
    original = ssd.validate
    if active:
        ssd.validate = ss.unwrap  # type: ignore[assignment]
    try:
        yield
    finally:
        ssd.validate = original


# ---------------------------------------------------------------------------------------------
# Scenarios


@scenario
def send_recv_every_layout(rank: int) -> Result:
    out: Result = {}
    for name, t in examples().items():
        if rank == 0:
            ssd.send(t, dst=1)
            out[name] = describe(t)  # the sender's tensor is untouched
        else:
            out[name] = describe(ssd.recv(src=0))
    return out


@scenario
def recv_any_source(rank: int) -> Result:
    t = examples()["csr"]
    if rank == 1:
        ssd.send(t, dst=0, tag=5)
        return {}
    return describe(ssd.recv(tag=5))


@scenario
def broadcast_every_layout(rank: int) -> Result:
    out: Result = {}
    for name, t in examples().items():
        got = ssd.broadcast(t if rank == 1 else None, src=1)
        out[name] = describe(got)
    return out


@scenario
def all_gather_mixed(rank: int) -> Result:
    ex = examples()
    mine = ex["bsr_batched_hybrid"] if rank == 0 else ex["coo_hybrid"]
    gathered = ssd.all_gather(mine)
    return {"gathered": [describe(t) for t in gathered], "own_is_input": gathered[rank] is mine,
            "input_after": describe(mine)}


@scenario
def all_gather_uneven_nnz(rank: int) -> Result:
    ex = examples()
    mine = ex["csr_empty"] if rank == 0 else ex["csr"]
    return {"gathered": [describe(t) for t in ssd.all_gather(mine)]}


@scenario
def all_gather_over_max_bytes(rank: int) -> Result:
    """Every rank refuses its peer's header before the member exchange; the group goes on."""
    ex = examples()
    mine = ex["csr"] if rank == 0 else ex["coo_uncoalesced"]
    out = {"refused": refused(lambda: ssd.all_gather(mine, max_bytes=64))}
    out["after"] = [describe(t) for t in ssd.all_gather(mine)]
    return out


@scenario
def all_reduce_coo(rank: int) -> Result:
    g = torch.Generator().manual_seed(10 + rank)
    dense = torch.randn(5, 4, 2, generator=g) * (torch.rand(5, 4, 1, generator=g) > 0.5)
    # duplicates on purpose: an uncoalesced input
    t = ss.validate(dense.to_sparse(2))
    part = ss.sparse_coo_tensor(torch.cat([t._indices(), t._indices()], 1),
                                torch.cat([t._values() * 0.5, t._values() * 0.5]), t.shape)
    total = ssd.all_reduce(part)
    parts = [describe(x) for x in ssd.all_gather(t)]
    return {"sum": describe(total), "parts": parts,
            "total_is_coalesced": total.is_coalesced()}


@scenario
def all_reduce_shape_mismatch(rank: int) -> Result:
    t = ss.sparse_coo_tensor([[0]], [1.0], (3 + rank,))
    try:
        ssd.all_reduce(t)
    except ValueError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


@scenario
def refuse_tampered_members(rank: int) -> Result:
    """Rank 0 sends broken members under a well-formed header; rank 1 refuses each, then a
    valid tensor still arrives (no crash, the protocol stays in step)."""
    out: Result = {}
    cases = {"csr_col_out_of_bounds": bad_csr(), "coo_unsorted_coalesced": bad_coo_coalesced(),
             "bsr_decreasing_crow": bad_bsr()}
    for name, t in cases.items():
        if rank == 0:
            dist.send(raw_header(t), 1)
            for m in raw_members(t):
                dist.send(m, 1)
        else:
            out[name] = refused(lambda: ssd.recv(src=0))
    if rank == 0:
        ssd.send(examples()["csr"], 1)
    else:
        out["after"] = describe(ssd.recv(src=0))
    return out


@scenario
def refuse_hostile_headers(rank: int) -> Result:
    """Headers refused before anything is allocated: the sender sends only the header."""
    t = examples()["csr"]
    headers = {
        "negative_nnz": raw_header(t, nnz=-5),
        "huge_nnz": raw_header(t, nnz=10**15),
        "huge_batch": raw_header(t, ndim=4, split=2, shape=10**9),
        "negative_size": raw_header(t, shape=-3),
        "unknown_layout": raw_header(t, layout=42),
        "unknown_dtype": raw_header(t, dtype=999),
        "index_dtype_float": raw_header(t, index_dtype=7),
        "bad_magic": raw_header(t, magic=1),
        "dims_inconsistent": raw_header(t, dense=3),
    }
    out: Result = {}
    for name, header in headers.items():
        if name == "huge_batch":
            header[ssd._F_SHAPE: ssd._F_SHAPE + 4] = torch.tensor([10**6, 10**6, 4, 6])
        if rank == 0:
            dist.send(header, 1)
        else:
            out[name] = refused(lambda: ssd.recv(src=0))
    # a header within the default limit, refused by an explicit max_bytes
    if rank == 0:
        dist.send(raw_header(t), 1)
    else:
        out["over_max_bytes"] = refused(lambda: ssd.recv(src=0, max_bytes=16))
    if rank == 0:
        ssd.send(t, 1)
    else:
        out["after"] = describe(ssd.recv(src=0))
    return out


@scenario
def refuse_tampered_broadcast(rank: int) -> Result:
    with hostile(rank == 0):
        if rank == 0:
            ssd.broadcast(bad_csr(), src=0)
            got: Result = {}
        else:
            got = refused(lambda: ssd.broadcast(None, src=0))
    after = describe(ssd.broadcast(examples()["bsc"] if rank == 0 else None, src=0))
    return {"refused": got, "after": after}


@scenario
def refuse_tampered_all_gather(rank: int) -> Result:
    mine = bad_bsr() if rank == 0 else examples()["csr"]
    with hostile(rank == 0):
        if rank == 0:
            got: Result = {"gathered": len(ssd.all_gather(mine))}
        else:
            got = refused(lambda: ssd.all_gather(mine))
    return got


@scenario
def refuse_tampered_all_reduce(rank: int) -> Result:
    mine = bad_coo_coalesced() if rank == 0 else ss.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))
    with hostile(rank == 0):
        if rank == 0:
            # the hostile rank may refuse its own data after the exchange: fine
            with contextlib.suppress(ss.InvariantError):
                ssd.all_reduce(mine)
            return {}
        return refused(lambda: ssd.all_reduce(mine))


@scenario
def sender_validates(rank: int) -> Result:
    """An honest sender refuses to send invalid data (before any message)."""
    return refused(lambda: ssd.send(bad_csr(), dst=1 - rank)) | {"rank": rank}


# Object collectives: pickling a SafeSparseTensor rebuilds it through validation


@scenario
def object_collectives(rank: int) -> Result:
    ex = examples()
    objs: list[Any] = ([ex["csr"], {"w": ex["bsr_batched_hybrid"], "n": 3}] if rank == 0
                       else [None, None])
    dist.broadcast_object_list(objs, src=0)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, ex["coo_hybrid"] if rank == 0 else ex["csc_hybrid"])
    p2p: list[Any] = [ex["csr_batched"]] if rank == 0 else [None]
    if rank == 0:
        dist.send_object_list(p2p, dst=1)
    else:
        dist.recv_object_list(p2p, src=0)
    return {"broadcast": [describe(objs[0]), describe(objs[1]["w"]), objs[1]["n"]],
            "all_gather": [describe(t) for t in gathered], "p2p": describe(p2p[0])}


@scenario
def object_collectives_tampered(rank: int) -> Result:
    out: Result = {}
    for name, bad in (("csr", bad_csr()), ("coo", bad_coo_coalesced()), ("bsr", bad_bsr())):
        objs: list[Any] = [{"layer.weight": bad}] if rank == 0 else [None]
        if rank == 0:
            dist.broadcast_object_list(objs, src=0)
        else:
            out[f"broadcast_{name}"] = refused(lambda o=objs: dist.broadcast_object_list(o, 0))
    # point to point, and a plain torch tensor for contrast: torch's own pickling does not
    # validate, so it arrives unchecked (and validate() then refuses it)
    with torch._C.DisableTorchFunctionSubclass():
        plain = torch.Tensor._make_subclass(torch.Tensor, bad_csr(), False)
    p2p: list[Any] = [bad_csr(), plain] if rank == 0 else [None, None]
    if rank == 0:
        dist.send_object_list(p2p[:1], dst=1)
        dist.send_object_list(p2p[1:], dst=1)
    else:
        out["p2p"] = refused(lambda: dist.recv_object_list(p2p[:1], src=0))
        got: list[Any] = [None]
        dist.recv_object_list(got, src=0)
        out["plain_type"] = type(got[0]).__name__
        out["plain_checked"] = ss.is_checked(got[0])
        out["plain_validate"] = refused(lambda: ss.validate(got[0]))
    gathered: list[Any] = [None, None]
    mine = bad_bsr() if rank == 0 else examples()["csr"]
    # every rank unpickles every entry, its own included: the hostile rank refuses its own too
    out["all_gather"] = refused(lambda: dist.all_gather_object(gathered, mine))
    # the group still works
    ok: list[Any] = [examples()["csr"] if rank == 0 else None]
    dist.broadcast_object_list(ok, 0)
    out["after"] = describe(ok[0])
    return out


# DDP


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.lin = nn.Linear(4, 3)
        adj = ss.sparse_csr_tensor([0, 2, 3, 4], [0, 2, 1, 0], [0.5, 2.0, -1.0, 1.5], (3, 3))
        self.register_buffer("adj", adj)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        y = self.lin(self.emb(idx))
        return (self.adj @ y.T).T


def train(model: nn.Module, idx: torch.Tensor, target: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(idx) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@scenario
def ddp_matches_single_process(rank: int) -> Result:
    from torch.nn.parallel import DistributedDataParallel

    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 12, (8,), generator=g)
    target = torch.randn(8, 3, generator=g)
    torch.manual_seed(0)
    model = Net()
    if rank == 1:  # a different buffer: the broadcast from rank 0 must replace it
        model.adj = ss.sparse_csr_tensor([0, 1, 1, 1], [2], [9.0], (3, 3))
    synced = ssd.broadcast_sparse_state(model, src=0)
    with warnings.catch_warnings():  # torch 2.13 deprecates the flag; its successor still syncs
        warnings.simplefilter("ignore", FutureWarning)  # buffers at init, which fails on sparse
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    half = slice(4 * rank, 4 * rank + 4)
    train(ddp, idx[half], target[half], steps=4)
    torch.manual_seed(0)
    reference = Net()
    ref_losses = train(reference, idx, target, steps=4)
    diffs = {name: float((p.detach() - q.detach()).abs().max())
             for (name, p), (_, q) in zip(model.named_parameters(),
                                          reference.named_parameters(), strict=True)}
    return {"synced": synced, "adj": describe(model.adj), "diffs": diffs,
            "ref_losses": ref_losses, "emb_grad_layout": str(model.emb.weight.grad.layout)}


# ---------------------------------------------------------------------------------------------


if __name__ == "__main__":
    serve(SCENARIOS, timeout_s=30, barrier_each=False)

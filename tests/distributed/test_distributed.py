"""safesparse.distributed: sparse tensors over torch.distributed, validated on receipt.

The 2-process tests run one gloo session of two subprocesses on 127.0.0.1
(``tests/support/dist_worker.py``: every scenario runs on both ranks, in order) and assert on
what each rank recorded. Rank 0 plays the hostile peer where a scenario needs one. The session
runs once per test module, under a timeout, so nothing can hang the suite; a crash of either
rank fails every test with its output.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from support.ranks import Results, run_two_ranks

import safesparse as ss
import safesparse.distributed as ssd

WORKER = Path(__file__).resolve().parents[1] / "support" / "dist_worker.py"
SESSION_TIMEOUT = 240  # seconds: generous for a loaded 2-core CI machine; a run takes ~20 s

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")



def _run_session(tmp: Path) -> Results:
    return run_two_ranks(WORKER, tmp, SESSION_TIMEOUT)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Results:
    return _run_session(tmp_path_factory.mktemp("dist"))


def value(session: Results, rank: int, name: str) -> Any:
    record = session[rank][name]
    assert record["ok"], f"rank {rank}, scenario {name}:\n{record['error']}"
    return record["value"]


def expected(t: torch.Tensor) -> dict[str, Any]:
    """What the worker's ``describe`` records, computed here for the same example."""
    sys.path.insert(0, str(WORKER.parent))
    from support import dist_worker as _dist_worker

    return _dist_worker.describe(t)


@pytest.fixture
def examples() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(WORKER.parent))
    from support import dist_worker as _dist_worker

    return _dist_worker.examples()


# ---------------------------------------------------------------------------------------------
# Every layout arrives checked and equal


def test_send_recv_every_layout(session: Results, examples: dict[str, torch.Tensor]) -> None:
    got = value(session, 1, "send_recv_every_layout")
    sent = value(session, 0, "send_recv_every_layout")
    assert set(got) == set(examples)
    for name, t in examples.items():
        assert got[name] == expected(t) | {"checked": True, "safe": True}, name
        assert sent[name] == got[name], name


def test_recv_from_any_source(session: Results, examples: dict[str, torch.Tensor]) -> None:
    assert value(session, 0, "recv_any_source") == expected(examples["csr"])


def test_broadcast_every_layout(session: Results, examples: dict[str, torch.Tensor]) -> None:
    for rank in (0, 1):
        got = value(session, rank, "broadcast_every_layout")
        for name, t in examples.items():
            assert got[name] == expected(t), (rank, name)


def test_all_gather_mixed_layouts(session: Results, examples: dict[str, torch.Tensor]) -> None:
    want = [expected(examples["bsr_batched_hybrid"]), expected(examples["coo_hybrid"])]
    for rank in (0, 1):
        got = value(session, rank, "all_gather_mixed")
        assert got["gathered"] == want
        assert got["own_is_input"] and got["input_after"] == want[rank]  # still checked


def test_all_gather_uneven_nnz(session: Results, examples: dict[str, torch.Tensor]) -> None:
    want = [expected(examples["csr_empty"]), expected(examples["csr"])]
    for rank in (0, 1):
        assert value(session, rank, "all_gather_uneven_nnz")["gathered"] == want


def test_all_gather_refuses_headers_over_max_bytes(session: Results,
                                                   examples: dict[str, torch.Tensor]) -> None:
    want = [expected(examples["csr"]), expected(examples["coo_uncoalesced"])]
    for rank in (0, 1):
        got = value(session, rank, "all_gather_over_max_bytes")
        _assert_refused(got["refused"], None, "TransferError", src=1 - rank)
        assert got["after"] == want


def test_all_reduce_sums_and_coalesces(session: Results) -> None:
    results = [value(session, rank, "all_reduce_coo") for rank in (0, 1)]
    assert results[0]["sum"] == results[1]["sum"]  # the same result on every rank
    total = results[0]["sum"]
    assert total["checked"] and total["coalesced"] and results[0]["total_is_coalesced"]
    parts = results[0]["parts"]  # the dense inputs of both ranks, gathered
    want = torch.tensor(parts[0]["dense"]) + torch.tensor(parts[1]["dense"])
    torch.testing.assert_close(torch.tensor(total["dense"]), want)
    assert total["shape"] == parts[0]["shape"] == [5, 4, 2]


def test_all_reduce_refuses_mismatched_shapes(session: Results) -> None:
    for rank in (0, 1):
        got = value(session, rank, "all_reduce_shape_mismatch")
        assert got["error"] == "ValueError"
        assert f"rank {1 - rank}" in got["message"]


# ---------------------------------------------------------------------------------------------
# A hostile peer is refused, without a crash


def _assert_refused(got: dict[str, Any], iid: str | None, kind: str = "InvariantError",
                    src: int = 0) -> None:
    assert got["type"] == kind, got["message"]
    assert got["source_rank"] == src
    assert f"rank {src}" in got["message"]
    if iid is not None:
        assert got["invariant"] == iid


def test_tampered_members_are_refused(session: Results, examples: dict[str, torch.Tensor]
                                      ) -> None:
    got = value(session, 1, "refuse_tampered_members")
    _assert_refused(got["csr_col_out_of_bounds"], "5.5")
    assert "[CSR 5.5]" in got["csr_col_out_of_bounds"]["message"]
    assert "1000000000" in got["csr_col_out_of_bounds"]["message"]
    _assert_refused(got["coo_unsorted_coalesced"], "5.3")
    _assert_refused(got["bsr_decreasing_crow"], "5.2")
    assert got["after"] == expected(examples["csr"])  # the next message still arrives


@pytest.mark.parametrize(("case", "kind", "iid"), [
    ("negative_nnz", "InvariantError", "3.9"),
    ("negative_size", "InvariantError", "3.1"),
    ("dims_inconsistent", "InvariantError", "3.1"),
    ("unknown_dtype", "InvariantError", "1.5"),
    ("index_dtype_float", "InvariantError", "1.3"),
    ("huge_nnz", "TransferError", None),
    ("huge_batch", "TransferError", None),
    ("over_max_bytes", "TransferError", None),
    ("unknown_layout", "TransferError", None),
    ("bad_magic", "TransferError", None),
])
def test_hostile_headers_are_refused_before_allocation(
    session: Results, case: str, kind: str, iid: str | None
) -> None:
    got = value(session, 1, "refuse_hostile_headers")
    _assert_refused(got[case], iid, kind)
    if case.startswith("huge"):
        assert "max_bytes" in got[case]["message"]


def test_receiver_survives_hostile_headers(session: Results,
                                           examples: dict[str, torch.Tensor]) -> None:
    assert value(session, 1, "refuse_hostile_headers")["after"] == expected(examples["csr"])


def test_tampered_broadcast_is_refused(session: Results, examples: dict[str, torch.Tensor]
                                       ) -> None:
    got = value(session, 1, "refuse_tampered_broadcast")
    _assert_refused(got["refused"], "5.5")
    assert "broadcast from rank 0" in got["refused"]["message"]
    for rank in (0, 1):
        assert value(session, rank, "refuse_tampered_broadcast")["after"] == expected(
            examples["bsc"])


def test_tampered_all_gather_is_refused(session: Results) -> None:
    got = value(session, 1, "refuse_tampered_all_gather")
    _assert_refused(got, "5.2")
    assert "[BSR 5.2]" in got["message"] and "all_gather from rank 0" in got["message"]


def test_tampered_all_reduce_is_refused(session: Results) -> None:
    _assert_refused(value(session, 1, "refuse_tampered_all_reduce"), "5.3")


def test_sender_validates_before_sending(session: Results) -> None:
    for rank in (0, 1):
        got = value(session, rank, "sender_validates")
        assert got["type"] == "InvariantError" and got["invariant"] == "5.5"
        assert got["source_rank"] is None  # a local refusal names no peer


# ---------------------------------------------------------------------------------------------
# Object collectives: pickled SafeSparseTensors are rebuilt through validation


def test_object_collectives_deliver_checked_tensors(session: Results,
                                                    examples: dict[str, torch.Tensor]) -> None:
    for rank in (0, 1):
        got = value(session, rank, "object_collectives")
        assert got["broadcast"] == [expected(examples["csr"]),
                                    expected(examples["bsr_batched_hybrid"]), 3]
        assert got["all_gather"] == [expected(examples["coo_hybrid"]),
                                     expected(examples["csc_hybrid"])]
    assert value(session, 1, "object_collectives")["p2p"] == expected(examples["csr_batched"])


@pytest.mark.parametrize(("case", "iid"), [("broadcast_csr", "5.5"), ("broadcast_coo", "5.3"),
                                           ("broadcast_bsr", "5.2"), ("p2p", "5.5"),
                                           ("all_gather", "5.2")])
def test_tampered_objects_are_refused(session: Results, case: str, iid: str) -> None:
    got = value(session, 1, "object_collectives_tampered")[case]
    assert got["type"] == "InvariantError" and got["invariant"] == iid, got["message"]


def test_plain_torch_tensors_arrive_unchecked(session: Results) -> None:
    """torch's own pickling of a plain sparse tensor does not validate: it arrives unchecked,
    and ss.validate refuses it before any kernel reads it."""
    got = value(session, 1, "object_collectives_tampered")
    assert got["plain_type"] == "Tensor" and got["plain_checked"] is False
    assert got["plain_validate"]["type"] == "InvariantError"
    assert got["plain_validate"]["invariant"] == "5.5"


def test_group_works_after_refused_objects(session: Results,
                                           examples: dict[str, torch.Tensor]) -> None:
    assert value(session, 1, "object_collectives_tampered")["after"] == expected(examples["csr"])
    assert value(session, 0, "object_collectives_tampered")["all_gather"]["invariant"] == "5.2"


# ---------------------------------------------------------------------------------------------
# DDP


def test_ddp_matches_single_process(session: Results) -> None:
    runs = [value(session, rank, "ddp_matches_single_process") for rank in (0, 1)]
    for got in runs:
        assert got["synced"] == ["adj"]
        assert got["adj"]["checked"] and got["adj"]["safe"]
        assert got["adj"]["dense"] == runs[0]["adj"]["dense"]  # rank 1's buffer was replaced
        assert got["emb_grad_layout"] == "torch.sparse_coo"
        assert got["ref_losses"][-1] < got["ref_losses"][0]  # it did train
        for name, diff in got["diffs"].items():
            assert diff < 1e-5, (name, diff)


# ---------------------------------------------------------------------------------------------
# In-process: the header, and a single-process group


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=ssd.HEADER_LEN,
                max_size=ssd.HEADER_LEN),
       st.booleans())
def test_any_header_is_planned_or_refused(header: list[int], keep_magic: bool) -> None:
    """A header of arbitrary int64s is refused with one of the two errors, or planned into
    member shapes that are all non-negative."""
    if keep_magic:
        header[0], header[1] = ssd._MAGIC, ssd._VERSION
        header[2] = abs(header[2]) % 6
        header[5] = abs(header[5]) % 6
    try:
        plan = ssd._plan(header, 3, "recv")
    except ss.InvariantError as err:
        assert err.location["source_rank"] == 3 and "rank 3" in str(err)
        return
    except ssd.TransferError as err:
        assert err.source_rank == 3 and "rank 3" in str(err)
        return
    assert all(s >= 0 for shape in plan.shapes for s in shape)
    assert all(n >= 0 for n in plan.nbytes)


@st.composite
def small_headers(draw: st.DrawFn) -> list[int]:
    """Headers of tensors small enough to receive: every field in a small range."""
    small = st.integers(-1, 4)
    h = [0] * ssd.HEADER_LEN
    h[ssd._F_MAGIC], h[ssd._F_VERSION] = ssd._MAGIC, ssd._VERSION
    h[ssd._F_LAYOUT] = draw(st.integers(0, 4))
    h[ssd._F_DTYPE] = draw(st.sampled_from([ssd._DTYPES.index(d) for d in (
        torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64)]))
    h[ssd._F_INDEX_DTYPE] = draw(st.integers(0, 1))
    ndim = h[ssd._F_NDIM] = draw(st.integers(0, 5))
    for f in (ssd._F_NNZ, ssd._F_SPLIT, ssd._F_DENSE, ssd._F_B0, ssd._F_B1):
        h[f] = draw(small)
    if draw(st.booleans()):  # mostly consistent dims, so that members get allocated
        coo = h[ssd._F_LAYOUT] == 0
        low = 1 if coo else 0
        split = h[ssd._F_SPLIT] = draw(st.integers(low, max(ndim - (0 if coo else 2), low)))
        h[ssd._F_DENSE] = ndim - split - (0 if coo else 2)
        h[ssd._F_NNZ] = abs(h[ssd._F_NNZ])
        h[ssd._F_B0], h[ssd._F_B1] = abs(h[ssd._F_B0]), abs(h[ssd._F_B1])
        h[ssd._F_INDEX_DTYPE] = 1 if coo else h[ssd._F_INDEX_DTYPE]
    h[ssd._F_COALESCED] = draw(st.integers(0, 1))
    h[ssd._F_SHAPE: ssd._F_SHAPE + ndim] = draw(st.lists(st.integers(0, 5), min_size=ndim,
                                                         max_size=ndim))
    return h


@given(small_headers(), st.integers(0, 2**32 - 1), st.booleans())
def test_any_received_members_are_built_checked_or_refused(header: list[int], seed: int,
                                                            tidy: bool) -> None:
    """Whatever a peer sends (a header, then member bytes), the receiver either builds a
    checked tensor that torch can use, or raises InvariantError / TransferError naming the
    peer: never another exception, never a crash."""
    g = torch.Generator().manual_seed(seed)
    try:
        plan = ssd._plan(header, 1, "recv")
    except (ss.InvariantError, ssd.TransferError):
        return
    members = []
    nnz = header[ssd._F_NNZ]
    for k, (shape, dtype, nbytes) in enumerate(zip(plan.shapes, plan.dtypes, plan.nbytes,
                                                    strict=True)):
        raw = torch.randint(0, 4, (nbytes,), generator=g, dtype=torch.uint8)
        if dtype in (torch.int32, torch.int64):  # index data: small values, some negative
            idx = torch.randint(-1 if not tidy else 0, 6, shape, generator=g, dtype=dtype)
            if tidy and plan.layout != torch.sparse_coo and k == 0 and idx.numel():
                # compressed indices that often hold: sorted, from 0 to nnz
                idx = idx.clamp(max=nnz).sort(dim=-1).values
                idx[..., 0], idx[..., -1] = 0, nnz
            raw = idx.reshape(-1).view(torch.uint8)
        members.append(ssd._from_bytes(raw, nbytes, shape, dtype))
    try:
        t = ssd._build(plan, members, 1, "recv")
    except ss.InvariantError as err:
        assert err.location["source_rank"] == 1 and "recv from rank 1" in str(err)
        return
    assert ss.is_checked(t) and t.layout == plan.layout and tuple(t.shape) == plan.size
    t.to_dense()  # torch can use it


def test_header_plans_the_members_of_every_example(examples: dict[str, torch.Tensor]) -> None:
    for name, t in examples.items():
        plan = ssd._plan(ssd._header(t, torch.device("cpu")).tolist(), 0, "recv")
        members = ssd._members(t)
        assert plan.layout == t.layout and plan.size == tuple(t.shape), name
        assert plan.shapes == tuple(tuple(m.shape) for m in members), name
        assert plan.dtypes == tuple(m.dtype for m in members), name


def test_header_with_an_overflowing_size_is_refused_after_a_tiny_allocation() -> None:
    """Huge sizes with few elements allocate almost nothing; the factories refuse them."""
    t = ss.sparse_coo_tensor([[0], [0]], [1.0], (2, 2))
    header = ssd._header(t, torch.device("cpu"))
    header[ssd._F_SHAPE: ssd._F_SHAPE + 2] = 2**62
    plan = ssd._plan(header.tolist(), 4, "recv")
    assert sum(plan.nbytes) == 20  # one int64 index pair and one float32 value
    members = [m.clone() for m in ssd._members(t)]
    with pytest.raises(ss.InvariantError, match=r"\[COO 3.2\].*recv from rank 4"):
        ssd._build(plan, members, 4, "recv")


def _header_of(layout: int, size: tuple[int, ...], split: int, nnz: int = 0) -> list[int]:
    h = [0] * ssd.HEADER_LEN
    h[ssd._F_MAGIC], h[ssd._F_VERSION] = ssd._MAGIC, ssd._VERSION
    h[ssd._F_LAYOUT], h[ssd._F_DTYPE] = layout, ssd._DTYPES.index(torch.float32)
    h[ssd._F_INDEX_DTYPE], h[ssd._F_NDIM], h[ssd._F_NNZ] = 1, len(size), nnz
    h[ssd._F_SPLIT] = split
    h[ssd._F_DENSE] = len(size) - split - (0 if layout == 0 else 2)
    h[ssd._F_B0] = h[ssd._F_B1] = 1
    h[ssd._F_SHAPE: ssd._F_SHAPE + len(size)] = size
    return h


BIG = 2**63 - 1


@pytest.mark.parametrize(("layout", "size", "split"), [
    (0, (1, 0, BIG, 2), 1),  # COO values (0, 0, BIG, 2): strides overflow, nothing to allocate
    (0, (2, 0, BIG, BIG), 1),
    (1, (2, 2, 0, BIG, 2), 0),  # CSR, hybrid
    (1, (0, BIG, BIG), 1),  # CSR, one batch dim: BIG + 1 compressed entries per batch
])
def test_header_with_a_zero_size_dim_next_to_a_huge_one_is_a_transfer_error(
        layout: int, size: tuple[int, ...], split: int) -> None:
    with pytest.raises(ssd.TransferError, match="cannot be laid out") as info:
        ssd._plan(_header_of(layout, size, split), 2, "recv")
    assert info.value.source_rank == 2


@given(st.sampled_from([0, 1, 3]), st.lists(st.sampled_from([0, 1, 2, BIG]), min_size=2,
                                             max_size=5), st.integers(0, 2))
def test_headers_with_extreme_sizes_are_built_or_refused(layout: int, size: list[int],
                                                         nnz: int) -> None:
    """Sizes at the int64 limit, with or without zero-size dims: the receiver allocates the
    members and builds a checked tensor, or refuses with InvariantError / TransferError."""
    split = 1 if layout == 0 else 0  # COO: one sparse dim; compressed: no batch dims
    if layout != 0 and len(size) < 2:
        return
    try:
        plan = ssd._plan(_header_of(layout, tuple(size), split, nnz), 1, "recv")
        if sum(plan.nbytes) > 2**20:
            return  # refused by max_bytes in a real transfer
        members = [ssd._from_bytes(torch.zeros(n, dtype=torch.uint8), n, shape, dtype)
                   for shape, dtype, n in zip(plan.shapes, plan.dtypes, plan.nbytes,
                                              strict=True)]
        ssd._build(plan, members, 1, "recv")
    except (ss.InvariantError, ssd.TransferError) as err:
        assert "rank 1" in str(err)


def test_received_bool_values_are_normalised() -> None:
    """Bytes other than 0 and 1 in bool values would be undefined behaviour in torch's
    kernels: the receiver maps them to True."""
    t = ss.sparse_coo_tensor([[0, 1, 2]], [True, False, True], (3,))
    plan = ssd._plan(ssd._header(t, torch.device("cpu")).tolist(), 1, "recv")
    indices = ssd._as_bytes(t._indices(), torch.device("cpu")).clone()
    values = torch.tensor([7, 0, 255], dtype=torch.uint8)  # a hostile peer's bool bytes
    members = [ssd._from_bytes(b, n, shape, dtype) for b, n, shape, dtype in
               zip((indices, values), plan.nbytes, plan.shapes, plan.dtypes, strict=True)]
    got = ssd._build(plan, members, 1, "recv")
    assert got._values().view(torch.uint8).tolist() == [1, 0, 1]
    assert got.to_dense().tolist() == [True, False, True]


def test_send_refuses_too_many_dims() -> None:
    t = ss.validate(torch.ones((1,) * (ssd.MAX_DIMS + 1)).to_sparse())
    with pytest.raises(ValueError, match="dims"):
        ssd._header(t, torch.device("cpu"))


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_single_process_group(examples: dict[str, torch.Tensor]) -> None:
    t = examples["bsr_batched_hybrid"]
    assert ssd.broadcast(t, src=0) is t
    (gathered,) = ssd.all_gather(examples["csc_hybrid"])
    assert gathered is examples["csc_hybrid"]
    coo = examples["coo_uncoalesced"]
    total = ssd.all_reduce(coo)
    assert ss.is_checked(total) and total.is_coalesced()
    assert torch.equal(total.to_dense(), coo.to_dense())
    # a plain torch tensor is validated before it is sent
    plain = torch.sparse_coo_tensor([[0, 5]], [1.0, 2.0], (3,), check_invariants=False)
    with pytest.raises(ss.InvariantError, match=r"\[COO 5.2\]"):
        ssd.broadcast(plain, src=0)
    with pytest.raises(TypeError):
        ssd.all_reduce(examples["csr"])
    leaf = ss.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (2,), requires_grad=True)
    assert not ssd.all_reduce(leaf).requires_grad


@pytest.mark.usefixtures("world_of_one")
def test_broadcast_sparse_state_replaces_sparse_buffers_and_parameters() -> None:
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(2, 2)
    model.lin.register_buffer("mask", ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 1.0], (2, 2)))
    model.weight = torch.nn.Parameter(ss.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)))
    dense_before = model.lin.weight.detach().clone()
    assert ssd.broadcast_sparse_state(model, src=0) == ["lin.mask", "weight"]
    assert ss.is_checked(model.lin.mask) and model.lin.mask.layout == torch.sparse_csr
    assert ss.is_checked(model.weight) and model.weight.requires_grad
    assert dict(model.named_parameters())["weight"] is model.weight
    assert torch.equal(model.lin.weight, dense_before)  # dense state is DDP's business

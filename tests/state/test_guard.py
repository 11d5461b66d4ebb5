"""The guard (SPEC 5) and one index state per storage (SPEC 4): the reproducers of issue 17.

Every reproducer that could crash torch on the old tree runs in a child process; the others run
here. Each asserts what the old tree got wrong: a kernel reading unchecked data, or a tensor
still counted as checked after a write through another view of its index memory.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from support.batch import Batch, child_env

import safesparse as ss
import safesparse.state.checked

ROOT = Path(__file__).resolve().parents[2]


#: The programs that could crash torch run in one child process (tests/support/batch.py).
CHILDREN = Batch("guard", env=child_env(ROOT, minimal=True))


def assert_refused(program: str, *expected: str) -> None:
    done = CHILDREN.run(program)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, done.stdout + done.stderr[-3000:]


def _csr(n: int = 6, seed: int = 0) -> ss.SafeSparseTensor:
    g = torch.Generator().manual_seed(seed)
    dense = (torch.rand(n, n, generator=g) < 0.4).float() * torch.rand(n, n, generator=g)
    dense[0, 0] = 1.0
    return ss.validate(dense.to_sparse_csr())


# ---------------------------------------------------------------------------------------------
# 1. The guard


WRITE_THROUGH_A_MEMBER = CHILDREN.add("write through a member", """
    import torch, safesparse as ss
    t = ss.validate((torch.rand(64, 64) < .1).float().to_sparse_csr())
    t.col_indices()[0] = 10**6
    assert not ss.is_checked(t)
    try:
        t @ torch.randn(64, 8)
    except ss.InvariantError as err:
        print("refused", err.invariant, str(err))
""")


@CHILDREN.mark
def test_a_write_through_a_member_is_caught_before_the_kernel_in_a_child() -> None:
    assert_refused(WRITE_THROUGH_A_MEMBER, "refused 5.5", "in op matmul, argument 0")


UNCHECKED_BUILD = CHILDREN.add("unchecked build", """
    import torch, safesparse as ss
    t = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]),
                             torch.ones(2), (2, 2), check_invariants=False)
    try:
        torch.mm(t, torch.ones(2, 3))
    except ss.InvariantError as err:
        print("refused", err.invariant, err.op)
""")


@CHILDREN.mark
def test_check_invariants_false_is_validated_by_its_first_operation_in_a_child() -> None:
    assert_refused(UNCHECKED_BUILD, "refused 5.5 mm, argument 0")


INVALID_PLAIN_OPERAND = CHILDREN.add("invalid plain operand", """
    import torch, safesparse as ss
    a = ss.sparse_csr_tensor([0, 1, 2], [0, 1], [1., 2.], (2, 2))
    bad = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]),
                                  torch.ones(2), (2, 2), check_invariants=False)
    for run in (lambda: a + bad, lambda: torch.add(bad, a), lambda: a.add(other=bad)):
        try:
            run()
        except ss.InvariantError as err:
            print("refused", err.invariant, err.op)
""")


@CHILDREN.mark
def test_invalid_plain_operand_is_refused_in_a_child() -> None:
    assert_refused(INVALID_PLAIN_OPERAND, "refused 5.5 add, argument 1",
                   "refused 5.5 add, argument 0", "refused 5.5 add, argument other")


LOAD_INVALID_STATE_DICT = CHILDREN.add("load invalid state dict", """
    import torch, safesparse as ss
    m = torch.nn.Module()
    w = ss.sparse_csr_tensor([0, 1, 2], [0, 1], [1., 2.], (2, 2))
    m.register_buffer("w", w)
    bad = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]),
                                  torch.ones(2), (2, 2), check_invariants=False)
    try:
        m.load_state_dict({"w": bad})
    except RuntimeError as err:
        print("refused", "5.5" in str(err))
    assert ss.is_checked(m.w), "the buffer stays checked"
    assert m.w.col_indices().tolist() == [0, 1], "nothing was written"
    print("unchanged", (m.w @ torch.ones(2, 1)).flatten().tolist())
""")


@CHILDREN.mark
def test_load_state_dict_from_an_invalid_source_writes_nothing_in_a_child() -> None:
    assert_refused(LOAD_INVALID_STATE_DICT, "refused True", "unchanged [1.0, 2.0]")


def test_copy_from_an_invalid_source_raises_before_writing() -> None:
    dst = ss.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2))
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 10**9]]), torch.tensor([5.0, 6.0]),
                                  (2, 2), check_invariants=False)
    with pytest.raises(ss.InvariantError, match="argument 1") as info:
        dst.copy_(bad)
    assert info.value.invariant == "5.2"
    assert ss.is_checked(dst)
    assert dst._values().tolist() == [1.0, 2.0]


def test_an_unvalidated_result_is_validated_on_first_use() -> None:
    t = _csr()
    out = torch.zeros_like(t)  # torch built its indices; nobody validated them
    assert not ss.is_checked(out)
    ss.reset_stats()
    out.to_dense()
    assert ss.stats().validations == 1
    assert ss.is_checked(out)
    out.to_dense()
    assert ss.stats().validations == 1  # remembered


def test_invalid_data_torch_leaves_after_resize_is_refused_by_the_next_op() -> None:
    """torch's ``resize_`` to fewer rows keeps nnz and merges rows: a row with duplicate
    columns (5.6). The result is not trusted, and the next op refuses it (PyTorch's own
    TestSparseCSR.test_resize resizes that data again: a difference the guard makes)."""
    a = ss.validate(torch.ones(2, 3).to_sparse_csr())
    a.resize_(4, 5)
    a.resize_(1, 5)
    assert not ss.is_checked(a)
    with pytest.raises(ss.InvariantError, match=r"\[CSR 5\.6\].*in op resize_"):
        a.resize_(1, 5)


def test_a_valid_plain_operand_is_validated_at_every_use() -> None:
    t = _csr()
    plain = ss.unwrap(_csr(seed=1)).clone()
    ss.reset_stats()
    for _ in range(3):
        t + plain
    # the plain operand at each use (nothing is remembered of a plain tensor: its members may be
    # tensors whose writes no counter here sees); each sum (torch built its indices) once
    assert ss.stats().validations == 6
    plain.col_indices()[0] = 10**6  # a write through it: validated again, and refused
    with pytest.raises(ss.InvariantError, match="argument 1"):
        t + plain


def test_metadata_and_members_of_an_invalid_tensor_can_be_read_and_repaired() -> None:
    t = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]), torch.ones(2),
                             (2, 2), check_invariants=False)
    ss.reset_stats()
    assert t.shape == (2, 2) and t.layout == torch.sparse_csr and t.dtype == torch.float32
    assert t._nnz() == 2 and t.dim() == 2 and t.sparse_dim() == 2 and t.dense_dim() == 0
    assert not t.requires_grad and t.device.type == "cpu" and len(t) == 2
    assert t.crow_indices().tolist() == [0, 1, 2] and t.values().tolist() == [1.0, 1.0]
    assert torch.ops.aten.col_indices(t).tolist() == [0, 10**9]
    assert ss.stats().validations == 0
    t.col_indices()[1] = 1  # repaired through the accessor
    assert (t @ torch.ones(2, 1)).flatten().tolist() == [1.0, 1.0]
    assert ss.is_checked(t)


def test_the_guard_names_a_keyword_argument_and_a_list_element() -> None:
    bad = ss.sparse_coo_tensor(torch.tensor([[0, 10**9]]), torch.ones(2), (3,),
                               check_invariants=False)
    good = ss.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))
    with pytest.raises(ss.InvariantError, match=r"cat, argument 0\[1\]"):
        torch.cat([good, bad])
    with pytest.raises(ss.InvariantError, match="add, argument other"):
        good.add(other=bad)


# ---------------------------------------------------------------------------------------------
# 2. One index state per storage


BATCH_AND_SAMPLE_VIEWS = CHILDREN.add("batch and sample views", """
    import torch, safesparse as ss
    crow = torch.tensor([[0, 1, 2], [0, 2, 2]]); col = torch.tensor([[0, 1], [0, 1]])
    batch = ss.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2))
    first = ss.sparse_csr_tensor(crow[0], col[0], torch.ones(2), (2, 2))
    batch.col_indices()[0, 1] = 10**9
    print("first", ss.is_checked(first))
    try:
        first @ torch.ones(2, 3)
    except ss.InvariantError as err:
        print("refused", err.invariant)
""")


@CHILDREN.mark
def test_batch_and_sample_views_share_one_state_in_a_child() -> None:
    assert_refused(BATCH_AND_SAMPLE_VIEWS, "first False", "refused 5.5")


def test_a_write_through_a_sample_unchecks_the_batch() -> None:
    crow = torch.tensor([[0, 1, 2], [0, 2, 2]])
    col = torch.tensor([[0, 1], [0, 1]])
    batch = ss.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2))
    first = ss.sparse_csr_tensor(crow[0], col[0], torch.ones(2), (2, 2))
    assert ss.is_checked(batch) and ss.is_checked(first)
    first.col_indices()[1] = 10**9
    assert not ss.is_checked(batch)
    with pytest.raises(ss.InvariantError):
        batch.to_dense()


@pytest.mark.parametrize("write_whole", [True, False])
def test_an_edge_list_and_a_coo_on_its_prefix_share_one_state(write_whole: bool) -> None:
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    whole = ss.sparse_coo_tensor(ei, torch.ones(4), (4, 4))
    prefix = ss.sparse_coo_tensor(ei[:, :2], torch.ones(2), (4, 4))
    assert ss.is_checked(whole) and ss.is_checked(prefix)
    writer, other = (whole, prefix) if write_whole else (prefix, whole)
    writer._indices()[1, 0] = 10**9
    assert not ss.is_checked(other)
    with pytest.raises(ss.InvariantError, match=r"5\.2"):
        other.to_dense()


@pytest.mark.parametrize("write_flat", [True, False])
def test_one_storage_viewed_with_two_shapes_shares_one_state(write_flat: bool) -> None:
    buf = torch.tensor([0, 1, 2, 0, 1])
    flat = ss.sparse_csr_tensor(buf[:3], buf[3:], torch.ones(2), (2, 2))
    batched = ss.sparse_csr_tensor(buf[:3].view(1, 3), buf[3:].view(1, 2), torch.ones(1, 2),
                                   (1, 2, 2))
    assert ss.is_checked(flat) and ss.is_checked(batched)
    writer, other = (flat, batched) if write_flat else (batched, flat)
    writer.col_indices().view(-1)[0] = 10**9
    assert not ss.is_checked(other)


def test_a_member_handed_out_by_an_aten_accessor_is_watched_after_its_owner_dies() -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [0, 1], torch.ones(2), (2, 2))
    sibling = ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(), torch.ones(2) * 2, (2, 2))
    member = torch.ops.aten.col_indices(t)
    del t
    gc.collect()
    for _ in range(40):  # enough joins to prune the watches of dead owners
        ss.sparse_csr_tensor(sibling.crow_indices(), sibling.col_indices(), torch.ones(2),
                             (2, 2), check_invariants=False)
    gc.collect()
    member[0] = 10**9
    assert not ss.is_checked(sibling)
    with pytest.raises(ss.InvariantError):
        sibling.to_dense()


@pytest.mark.parametrize("accessor", ["crow_indices", "indices", "_indices"])
def test_every_aten_index_accessor_hands_out_a_watched_member(accessor: str) -> None:
    t = _csr() if accessor == "crow_indices" else ss.sparse_coo_tensor(
        [[0, 1], [1, 0]], [1.0, 2.0], (2, 2)).coalesce()
    member = getattr(torch.ops.aten, accessor)(t)
    assert ss.is_checked(t)
    member.view(-1)[-1] = 10**9
    assert not ss.is_checked(t)


def test_a_state_forgets_dead_storages_and_their_proofs() -> None:
    # a persistent crow with a fresh col each step: the state does not keep the old cols
    crow = torch.tensor([0, 1, 2])
    # (freed by reference counting as the loop goes: one gc.collect at the end is enough)
    keep = ss.sparse_csr_tensor(crow, torch.tensor([0, 1]), torch.ones(2), (2, 2))
    rec = safesparse.state.checked.record(keep)
    assert rec is not None
    for _ in range(30):
        ss.sparse_csr_tensor(crow, torch.tensor([1, 0]), torch.ones(2), (2, 2))
        state = safesparse.state.checked.state_of(rec)
        assert state is not None and len(state.ranges) <= 4
    gc.collect()
    assert len(state.ranges) <= 4
    assert ss.is_checked(keep)


def test_data_assignment_of_another_dtype_takes_the_data_whole() -> None:
    """torch 2.13's ``t.data = new`` on a compressed tensor takes ``new``'s dtype and keeps the
    old members (float32 values read as float64). On a SafeSparseTensor the data is swapped in
    whole (``module.to(dtype)`` does this to checked sparse parameters): values and dtype agree,
    and the tensor stays checked without a validation."""
    t = ss.sparse_csr_tensor([0, 1, 2], [0, 1], [1.0, 2.0], (2, 2))
    ss.reset_stats()
    t.data = t.double()
    assert t.dtype == torch.float64 and t.values().dtype == torch.float64
    assert ss.is_checked(t) and ss.stats().validations == 0
    assert t.to_dense().tolist() == [[1.0, 0.0], [0.0, 2.0]]
    c = ss.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (2,))
    c.data = c.double()  # (COO swaps its members: consistent, and checked)
    assert ss.is_checked(c) and c._values().dtype == torch.float64


def test_mm_of_two_csc_tensors_keeps_torchs_layout() -> None:
    """``torch.mm`` / ``@`` of two CSC tensors is right in torch and returns CSR (the repair is
    for ``torch.sparse.mm``, whose CSC result torch breaks)."""
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0], [4.0, 0.0, 5.0]])
    a, b = ss.validate(dense.to_sparse_csc()), ss.validate(dense.T.to_sparse_csc())
    plain = torch.mm(ss.unwrap(a), ss.unwrap(b))
    for out in (torch.mm(a, b), a @ b):
        assert out.layout == plain.layout == torch.sparse_csr and ss.is_checked(out)
        assert torch.equal(out.to_dense(), dense @ dense.T)
    fixed = torch.sparse.mm(a, b)
    assert fixed.layout == torch.sparse_csc and torch.equal(fixed.to_dense(), dense @ dense.T)

"""``.data =`` on index tensors never leaves a checked tensor invalid (SPEC 4; issue 33).

``x.data = y`` keeps ``x``'s object and version counter and gives it ``y``'s shape, strides and
memory (``nn.Module._apply`` updates parameters this way). A proof names the member's object,
memory, shape, strides and counters, so: a rebuild on handed-out members changed this way is
refused (or validated), and a tensor built from the caller's index tensors does not change
when the caller's tensors do (it is built on detached aliases of them). Each case is run for
CSR and BSR, on the compressed and the plain member, shrunk, moved and replaced; a failure used
to be a checked tensor with ``crow_indices[-1] != nnz``, and a segfault in ``@``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import safesparse as ss
from safesparse.engine.validation import validate_tensor
from safesparse.state import checked

CHANGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "shrunk": lambda x: x[:1],  # same memory and counter, another shape
    "moved": lambda x: x.clone(),  # same values, other memory
    "replaced": lambda x: torch.full_like(x, 7),  # same shape, other memory, invalid values
}


def build(layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """crow, col, values and size of a valid 3 x 4 matrix (BSR: 1 x 2 blocks)."""
    crow, col = torch.tensor([0, 2, 3, 4]), torch.tensor([0, 1, 1, 0])
    if layout == "csr":
        return crow, col, torch.arange(1.0, 5.0), (3, 2)
    return crow, col, torch.arange(8.0).reshape(4, 1, 2), (3, 4)


def factory(layout: str) -> Callable[..., torch.Tensor]:
    return ss.sparse_csr_tensor if layout == "csr" else ss.sparse_bsr_tensor


def valid(t: torch.Tensor) -> bool:
    try:
        validate_tensor(ss.unwrap(t))  # reads the members only: no kernel
    except ss.InvariantError:
        return False
    return True


def assert_checked_means_valid(t: torch.Tensor) -> None:
    if ss.is_checked(t):
        assert valid(t), f"checked but invalid: {t!r}"
        dense = t.to_dense()  # a kernel reads it: only on valid data
        assert torch.equal((t @ torch.ones(t.shape[1], 1)), dense @ torch.ones(t.shape[1], 1))


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("member", [0, 1], ids=["compressed", "plain"])
@pytest.mark.parametrize("layout", ["csr", "bsr"])
def test_rebuild_on_handed_out_members_after_data_assignment(layout: str, member: int,
                                                             change: str) -> None:
    crow, col, values, size = build(layout)
    t = factory(layout)(crow, col, values, size)
    members = [t.crow_indices(), t.col_indices()]
    m = members[member]
    m.data = CHANGES[change](m)
    try:
        u = factory(layout)(*members, values.clone(), size)
    except ss.InvariantError:
        return  # refused: the members are not the proven ones, and this data is invalid
    assert_checked_means_valid(u)
    assert_checked_means_valid(t)


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("member", [0, 1], ids=["compressed", "plain"])
@pytest.mark.parametrize("layout", ["csr", "bsr"])
def test_callers_index_tensors_changed_by_data_assignment(layout: str, member: int,
                                                          change: str) -> None:
    crow, col, values, size = build(layout)
    t = factory(layout)(crow, col, values, size)
    before = t.to_dense()
    members = [crow, col]
    members[member].data = CHANGES[change](members[member])
    assert_checked_means_valid(t)
    assert torch.equal(t.to_dense(), before)  # the checked tensor did not change


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("layout", ["csr", "bsr"])
def test_rebuilt_tensor_survives_data_assignment_on_the_members_it_was_built_from(
        layout: str, change: str) -> None:
    """A tensor rebuilt on handed-out members is built on aliases of its own: ``.data =`` on
    the handed-out member later changes the member only."""
    crow, col, values, size = build(layout)
    t = factory(layout)(crow, col, values, size)
    c, p = t.crow_indices(), t.col_indices()
    ss.reset_stats()
    u = factory(layout)(c, p, values * 2, size)
    assert ss.stats().skipped == 1 and ss.stats().validations == 0  # (proven: a rebuild)
    before = u.to_dense()
    p.data = CHANGES[change](p)
    assert_checked_means_valid(u)
    assert torch.equal(u.to_dense(), before)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_coo_indices_changed_by_data_assignment(change: str) -> None:
    idx = torch.tensor([[0, 1, 2], [1, 0, 2]])
    t = ss.sparse_coo_tensor(idx, torch.ones(3), (3, 3))
    handed = t._indices()
    idx.data = CHANGES[change](idx)
    assert_checked_means_valid(t)
    handed.data = CHANGES[change](handed)
    try:
        u = ss.sparse_coo_tensor(handed, torch.ones(handed.shape[1]), (3, 3))
    except ss.InvariantError:
        return
    assert_checked_means_valid(u)


def test_values_changed_by_data_assignment_leave_the_tensor_whole() -> None:
    """Values shrunk through ``.data =`` would break 3.10 (values shape == (nnz,)): the
    tensor is built on its own alias of them."""
    crow, col, values, size = build("csr")
    t = ss.sparse_csr_tensor(crow, col, values, size)
    values.data = values[:1]
    assert t.values().shape == (4,)
    assert_checked_means_valid(t)


def test_freed_memory_reused_at_the_same_address_is_not_the_proven_memory() -> None:
    """The caller's tensor emptied (its old memory freed, as far as the caller knows), then
    refilled at possibly the same address with the same shape: the checked tensor still holds
    its own memory."""
    crow, col, values, size = build("csr")
    t = ss.sparse_csr_tensor(crow, col, values, size)
    col.data = col[:0].clone()
    col.data = torch.full((4,), 9)
    assert_checked_means_valid(t)
    assert t.col_indices().tolist() == [0, 1, 1, 0]


def test_the_proof_names_object_memory_view_counters_and_geometry() -> None:
    """``checked.proves``, the one question every module asks: the proven members at their
    views, unwritten, for the proven geometry; anything less is not the proof."""
    crow, col, values, size = build("csr")
    t = ss.sparse_csr_tensor(crow, col, values, size)
    rec = checked.record(t)
    assert rec is not None
    c, p = t.crow_indices(), t.col_indices()
    geom = checked.geometry_of(t)
    assert checked.proves(rec, c, p, (geom,))
    assert not checked.proves(rec, c, p[:3], (geom,))  # same pointer, shrunk
    assert not checked.proves(rec, c, p.clone(), (geom,))  # other memory
    assert not checked.proves(rec, c, p.view(torch.float64), (geom,))  # same bytes, other dtype
    assert not checked.proves(rec, c, p, (checked.compressed_geometry(3, 7),))
    assert checked.vouch(c, p, (geom,)) is rec and checked.confirm(c, p, geom)
    assert checked.vouch(c, p.clone(), (geom,)) is None  # a copy carries no claim
    p[0] = 0  # a write through a handed-out member moves the counter
    assert not checked.proves(rec, c, p, (geom,)) and not checked.confirm(c, p, geom)


@pytest.mark.parametrize("layout", ["csr", "bsr", "coo"])
def test_unchecked_build_validated_later_survives_data_assignment(layout: str) -> None:
    """``check_invariants=False`` builds on aliases of its own too: validated later (the guard,
    ``ss.validate``), the tensor is not reshaped by ``.data =`` on the caller's tensors."""
    if layout == "coo":
        idx = torch.tensor([[0, 1, 2], [1, 0, 2]])
        t = ss.sparse_coo_tensor(idx, torch.ones(3), (3, 3), check_invariants=False)
        ss.validate(t)
        idx.data = idx[:, :1]
        assert t._indices().shape == (2, 3)
    else:
        crow, col, values, size = build(layout)
        t = factory(layout)(crow, col, values, size, check_invariants=False)
        ss.validate(t)
        col.data = col[:1]
        values.data = values[:1]
        assert t.col_indices().shape == (4,) and t.values().shape[0] == 4
    assert_checked_means_valid(t)
    assert ss.is_checked(t)

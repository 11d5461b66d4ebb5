"""Index memory that something safesparse cannot watch can still write (issue 41, SPEC 4).

* a file mapping (``torch.load(mmap=True)``, safetensors), rewritten in place after loading,
  whatever slice of it a tensor holds: the factories and ``ss.validate`` work on their own copy
  of such index members, and a layer loaded with ``assign=True`` too;
* the index tensors torch kept as a plain tensor's members (the caller's ``col``, a PyG
  ``edge_index``): ``ss.validate`` works on its own copy; the guard remembers no plain operand;
* a storage resized at the same address: the proof names the storage's byte size.

A kernel reading the written indices can crash: those programs run in one child process.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from support.batch import Batch, child_env

import safesparse as ss

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = Batch("unwatched writers", env=child_env(ROOT))

# a helper every mapped-file program starts with: save, load mapped, rewrite in place
_REWRITE = """
    import struct, torch, safesparse as ss
    COL = [2, 0, 1]
    BAD = [2, 10**12, 1]
    def rewrite(path, old=COL, new=BAD):
        data = open(path, "rb").read()
        at = data.index(struct.pack(f"<{len(old)}q", *old))
        with open(path, "r+b") as f:           # same inode: the mapping sees the new bytes
            f.seek(at)
            f.write(struct.pack(f"<{len(new)}q", *new))
    crow, col, v = torch.tensor([0, 1, 2, 3]), torch.tensor(COL), torch.ones(3)
    expected = torch.sparse_csr_tensor(crow, col, v, (3, 3)).to_dense()
    def same(t):
        assert ss.is_checked(t)
        assert torch.equal(ss.unwrap(t).col_indices(), col), ss.unwrap(t).col_indices()
        return torch.equal((t @ torch.eye(3)), expected)
"""

MAPPED = {
    "factory on torch.load mmap": """
        torch.save({"crow": crow, "col": col, "v": v}, "m.pt")
        sd = torch.load("m.pt", mmap=True)
        t = ss.sparse_csr_tensor(sd["crow"], sd["col"], sd["v"], (3, 3))
        rewrite("m.pt")
        print(same(t))
        """,
    "factory on a slice of torch.load mmap": """
        torch.save({"both": torch.cat([crow, col])}, "m.pt")
        both = torch.load("m.pt", mmap=True)["both"]
        t = ss.sparse_csr_tensor(both[:4], both[4:], v, (3, 3))
        rewrite("m.pt")
        print(same(t))
        """,
    "coo factory on torch.load mmap": """
        idx = torch.tensor([[0, 1, 2], COL])
        torch.save({"idx": idx}, "m.pt")
        t = ss.sparse_coo_tensor(torch.load("m.pt", mmap=True)["idx"], v, (3, 3))
        rewrite("m.pt", [0, 1, 2, *COL], [0, 1, 2, *BAD])
        assert ss.is_checked(t) and int(ss.unwrap(t)._indices().max()) == 2
        print(torch.equal(t.to_dense(), expected))
        """,
    "factory on from_numpy of an np.memmap": """
        import numpy as np
        torch.save({"col": col}, "m.pt")            # (the rewrite finds the bytes in any file)
        np.save("col.npy", col.numpy())
        mapped = torch.from_numpy(np.load("col.npy", mmap_mode="r+"))
        t = ss.sparse_csr_tensor(crow, mapped, v, (3, 3))
        rewrite("col.npy")
        print(same(t))
        """,
    "validate of a plain tensor on torch.load mmap": """
        torch.save({"crow": crow, "col": col, "v": v}, "m.pt")
        sd = torch.load("m.pt", mmap=True)
        t = ss.validate(torch.sparse_csr_tensor(sd["crow"], sd["col"], sd["v"], (3, 3)))
        rewrite("m.pt")
        print(same(t))
        """,
    "validate of a mapped sparse tensor": """
        torch.save({"w": torch.sparse_csr_tensor(crow, col, v, (3, 3))}, "m.pt")
        t = ss.validate(torch.load("m.pt", mmap=True)["w"])
        rewrite("m.pt")
        print(same(t))
        """,
    "validate copy_indices=False of a mapped tensor": """
        torch.save({"w": torch.sparse_csr_tensor(crow, col, v, (3, 3))}, "m.pt")
        t = ss.validate(torch.load("m.pt", mmap=True)["w"], copy_indices=False)
        assert ss.is_checked(t)                  # validated when asked: never from a cache
        rewrite("m.pt")
        assert not ss.is_checked(t)
        try:
            t @ torch.eye(3)
        except ss.InvariantError as err:
            print(err.invariant == "5.5")
        """,
    "factory on safetensors load_file": """
        import safetensors.torch as st
        st.save_file({"crow": crow, "col": col, "v": v}, "m.st")
        sd = st.load_file("m.st")
        t = ss.sparse_csr_tensor(sd["crow"], sd["col"], sd["v"], (3, 3))
        rewrite("m.st")
        print(same(t))
        """,
    "SparseLinear assign=True from ss.load mmap": """
        from safesparse.nn import SparseLinear
        layer = SparseLinear(torch.sparse_csr_tensor(crow, col, v, (3, 3)))
        torch.save(layer.state_dict(), "m.pt")
        other = SparseLinear(torch.sparse_csr_tensor(crow, torch.tensor([0, 1, 2]), v, (3, 3)))
        other.load_state_dict(ss.load("m.pt", mmap=True), assign=True)
        rewrite("m.pt")
        x = torch.eye(3)
        print(torch.equal(other(x), layer(x)))
        """,
    "SparseLinear assign=True from torch.load mmap": """
        from safesparse.nn import SparseLinear
        layer = SparseLinear(torch.sparse_csr_tensor(crow, col, v, (3, 3)))
        torch.save(layer.state_dict(), "m.pt")
        other = SparseLinear(torch.sparse_csr_tensor(crow, torch.tensor([0, 1, 2]), v, (3, 3)))
        other.load_state_dict(torch.load("m.pt", mmap=True), assign=True)
        rewrite("m.pt")
        x = torch.eye(3)
        print(torch.equal(other(x), layer(x)))
        """,
}
for _key, _code in MAPPED.items():
    CHILDREN.add(_key, textwrap.dedent(_REWRITE) + textwrap.dedent(_code))


@CHILDREN.mark
@pytest.mark.parametrize("route", list(MAPPED))
def test_a_file_rewritten_after_loading_never_reaches_a_checked_tensor(route: str) -> None:
    """Fails on the starting commit: the tensor stayed checked over indices of 1e12."""
    pytest.importorskip("safetensors")
    done = CHILDREN.run(route)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


# ---------------------------------------------------------------------------------------------
# The validate-then-edit pattern of graph code


_GRAPH = """
    import torch, safesparse as ss
    n = 4
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    v = torch.ones(4)
    x = torch.arange(12.).reshape(4, 3)
    expected = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3, 4]), ei[1].clone(), v,
                                       (n, n)).to_dense() @ x
"""

GRAPH = {
    "direct": """
        A = ss.validate(torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3, 4]), ei[1], v, (n, n)))
        """,
    "to_torch_csr_tensor": """
        from torch_geometric.utils import to_torch_csr_tensor
        A = ss.validate(to_torch_csr_tensor(ei, v, size=(n, n), is_coalesced=True))
        """,
    "EdgeIndex.to_sparse_csr": """
        from torch_geometric import EdgeIndex
        ei = EdgeIndex(ei, sparse_size=(n, n), sort_order="row")
        A = ss.validate(ei.to_sparse_csr(v))
        """,
}
_EDIT = """
    assert ss.is_checked(A)
    ei[1, 2] = 10**6                              # edited in place after validation
    from torch_geometric.nn import GCNConv
    conv = GCNConv(3, 2, normalize=False, bias=False)
    try:
        ok = torch.allclose(A @ x, expected)
        ok = ok and torch.allclose(conv(x, A), expected @ conv.lin.weight.T, atol=1e-5)
        print("correct" if ok else "WRONG")
    except ss.InvariantError:
        print("refused")
"""
for _key, _code in GRAPH.items():
    CHILDREN.add(f"graph {_key}", "".join(textwrap.dedent(c) for c in (_GRAPH, _code, _EDIT)))


@CHILDREN.mark
@pytest.mark.parametrize("form", list(GRAPH))
def test_an_edge_index_edited_after_validate_never_reaches_a_checked_adjacency(form: str) -> None:
    """Fails on the starting commit (a plausible wrong result, or a crash)."""
    pytest.importorskip("torch_geometric")
    done = CHILDREN.run(f"graph {form}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] in ("correct", "refused")


GUARD = CHILDREN.add("guard plain operand edited", """
    import torch, safesparse as ss
    A = ss.sparse_csr_tensor([0, 1, 2, 3], [0, 1, 2], [1., 1., 1.], (3, 3))
    col = torch.tensor([2, 0, 1])
    P = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3]), col, torch.ones(3), (3, 3))
    A + P
    col[2] = 10**6
    try:
        A + P
        print("NOT REFUSED")
    except ss.InvariantError as err:
        print("refused", err.invariant)
""")


@CHILDREN.mark
def test_the_guard_validates_a_plain_operand_whose_index_tensor_was_written() -> None:
    """Fails on the starting commit (the guard remembered ``P``: a segfault)."""
    done = CHILDREN.run(GUARD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "refused 5.5"


def test_copy_indices_false_shares_the_index_storage_and_its_limit() -> None:
    """The documented opt-out: the adoption shares the caller's index tensors, whose writes
    it does not see (docs/ops.md, Limitations); the default adoption is not affected."""
    crow, col = torch.tensor([0, 1, 2, 3]), torch.tensor([2, 0, 1])
    plain = torch.sparse_csr_tensor(crow, col, torch.ones(3), (3, 3), check_invariants=False)
    shared = ss.validate(plain, copy_indices=False)
    owned = ss.validate(plain)
    assert shared.col_indices().data_ptr() == col.data_ptr()
    col[2] = 0  # valid data, through the caller's tensor
    assert torch.equal(owned.col_indices(), torch.tensor([2, 0, 1]))
    assert ss.is_checked(owned)


def test_adoption_keeps_the_autograd_graph_of_the_values() -> None:
    values = torch.ones(3, requires_grad=True)
    plain = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3]), torch.tensor([2, 0, 1]),
                                    values, (3, 3), check_invariants=False)
    t = ss.validate(plain)
    assert ss.is_checked(t) and t.requires_grad
    (t @ torch.ones(3, 1)).sum().backward()
    assert values.grad is not None and values.grad.tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# A storage resized at the same address


def test_a_storage_resized_to_another_size_at_the_same_address_is_unchecked() -> None:
    """``resize_(0)`` then ``resize_(m)`` often returns the same address (a large block goes back
    to the system and comes back): the proof names the byte size too. Fails on the starting
    commit, where an equal pointer was taken for the proven memory."""
    n = 1 << 16
    met = 0
    for _ in range(40):
        t = ss.sparse_csr_tensor(torch.arange(n + 1), torch.arange(n), torch.ones(n), (n, n))
        st = t.col_indices().untyped_storage()
        at, nbytes = st.data_ptr(), st.nbytes()
        st.resize_(0)
        st.resize_(nbytes + 4096)
        if st.data_ptr() != at:
            continue
        met += 1
        assert not ss.is_checked(t)
        if met >= 3:
            break
    if not met:
        pytest.skip("the allocator never gave the same address back")


def test_the_kept_storages_are_read_at_each_call() -> None:
    """``holds`` keeps its members' storage objects (no storage object made per call) and reads
    their byte size at each call: a resize through another storage object of the same memory,
    with the pointer the proof names (as when the allocator gives the address back: forced
    here by naming the new pointer), voids the proof; so does a member rebound to other
    memory (``settle`` rebinds a pending record's members)."""
    from safesparse.state import checked

    t = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2),
                             (2, 2))
    rec = checked.record(t)
    assert rec is not None and checked.holds(rec)  # (the storages kept)
    st = t.col_indices().untyped_storage()
    st.resize_(st.nbytes() + 4096)
    assert rec.m1 is not None
    rec.p1 = rec.m1.data_ptr()  # as if the allocator had given the same address back
    assert not checked.holds(rec)
    u = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2),
                             (2, 2))
    rec = checked.record(u)
    assert rec is not None and checked.holds(rec)
    other = torch.zeros(8, dtype=rec.m0.dtype)[:3]
    rec.m0, rec.p0 = other, other.data_ptr()  # (counter 0: the record's ver must match)
    rec.ver = other._version
    assert not checked.holds(rec)  # (another storage, of another size, read)


RESIZED_LAYER = CHILDREN.add("layer over a resized buffer", """
    import torch, safesparse as ss
    from safesparse.nn import SparseLinear
    n = 1 << 16
    layer = SparseLinear(ss.sparse_csr_tensor(torch.arange(n + 1), torch.arange(n),
                                              torch.ones(n), (n, n)))
    x = torch.ones(2, n)
    st = layer.plain_indices.untyped_storage()
    for _ in range(40):
        at, nbytes = st.data_ptr(), st.nbytes()
        st.resize_(0)
        st.resize_(nbytes // 2)              # the memory no longer covers the proven indices
        if st.data_ptr() == at:
            break
        st.resize_(nbytes)
        layer.plain_indices.copy_(torch.arange(n))
        layer = SparseLinear(ss.sparse_csr_tensor(torch.arange(n + 1), torch.arange(n),
                                                  torch.ones(n), (n, n)))
        st = layer.plain_indices.untyped_storage()
    else:
        print("never")
        raise SystemExit
    try:
        layer(x)
        print("COMPUTED")
    except (ss.InvariantError, RuntimeError, ValueError) as err:
        print("refused")
""")


@CHILDREN.mark
def test_a_module_operator_never_computes_on_a_buffer_its_proof_does_not_cover() -> None:
    done = CHILDREN.run(RESIZED_LAYER)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    if last == "never":
        pytest.skip("the allocator never gave the same address back")
    assert last == "refused"

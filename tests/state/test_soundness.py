"""Checked means valid, always: regression tests for the holes of issue [1/6].

Each test names the attack it pins. Steps that would crash the process on a lying checked
state (a torch kernel reading out-of-range indices) run in a subprocess.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from support.batch import Batch, child_env
from support.oracle import really_valid
from torch._C import DisableTorchFunctionSubclass

import safesparse as ss
from safesparse.base.layouts import SPARSE_LAYOUTS
from safesparse.state import checked
from safesparse.tensor import core as tensor

ROOT = Path(__file__).resolve().parents[2]
SIZE = (3, 3)


def members() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([0, 2, 3, 4]), torch.tensor([0, 2, 1, 2]), torch.tensor([1.0, 2, 3, 4])


#: The programs that would crash the process on a lying checked state run in one child process
#: (tests/support/batch.py); the environment variable's test starts its own.
CHILDREN = Batch("soundness", env=child_env(ROOT, minimal=True))


# ---------------------------------------------------------------------------------------------
# 1. A plain sparse operand is never ignored


def test_invalid_plain_operand_is_refused_by_the_guard() -> None:
    a = ss.sparse_coo_tensor([[0, 1], [1, 2]], [1.0, 2.0], SIZE)
    p = torch.sparse_coo_tensor(torch.tensor([[0, 2], [0, 10**9]]), torch.tensor([5.0, 6.0]),
                                SIZE, check_invariants=False)
    with pytest.raises(ss.InvariantError, match=r"in op add, argument 1") as info:
        a + p
    assert info.value.invariant == "5.2"
    with pytest.raises(ss.InvariantError, match=r"argument 0"):
        p.add(a)


def test_valid_plain_operand_gives_a_validated_or_unchecked_result() -> None:
    a = ss.sparse_coo_tensor([[0, 1], [1, 2]], [1.0, 2.0], SIZE)
    p = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([5.0]), SIZE,
                                check_invariants=True)
    ss.reset_stats()
    # torch built new indices: the result is validated (not trusted from the plain input)
    assert ss.is_checked(a + p) and ss.is_checked(p + a)
    # p at each use (the guard remembers no plain operand: docs/ops.md), then each sum
    assert ss.stats().validations == 4


PLAIN_OPERAND_CRASH = CHILDREN.add("plain operand crash", """
    import torch, safesparse as ss
    a = ss.sparse_csr_tensor([0, 1, 2, 2], [1, 2], [1., 2.], (3, 3))
    p = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 10**9]),
                                torch.tensor([5., 6.]), (3, 3), check_invariants=False)
    try:
        a + p
    except ss.InvariantError as err:
        print("refused", err.invariant)
""")


@CHILDREN.mark
def test_plain_operand_crash_is_impossible_in_a_subprocess() -> None:
    done = CHILDREN.run(PLAIN_OPERAND_CRASH)
    assert done.returncode == 0, done.stderr
    assert "refused 5.5" in done.stdout


# ---------------------------------------------------------------------------------------------
# 2. Results whose indices torch built are validated, repaired or refused


def _unsorted_product_input() -> torch.Tensor:
    torch.manual_seed(0)
    dense = (torch.rand(20, 20) < 0.3).float() * torch.rand(20, 20)
    return dense


def test_csr_matmul_result_is_valid_and_right() -> None:
    dense = _unsorted_product_input()
    plain = dense.to_sparse_csr()
    with DisableTorchFunctionSubclass():
        raw = plain @ plain
    assert not really_valid(raw)  # torch 2.13 leaves columns unsorted here (5.6)
    a = ss.validate(dense.to_sparse_csr())
    r = a @ a
    assert ss.is_checked(r)
    assert really_valid(r)
    torch.testing.assert_close(r.to_dense(), dense @ dense)


def test_csc_sparse_mm_is_computed_through_the_csr_kernel() -> None:
    dense = torch.tensor([[0.0, 1, 0], [2, 0, 3], [0, 4, 0]])
    with DisableTorchFunctionSubclass():
        raw = torch.sparse.mm(dense.to_sparse_csc(), dense.to_sparse_csc())
    assert not torch.equal(raw.to_dense(), dense @ dense)  # torch loses the values
    a = ss.validate(dense.to_sparse_csc())
    r = torch.sparse.mm(a, a)
    assert r.layout == torch.sparse_csc
    assert ss.is_checked(r) and really_valid(r)
    torch.testing.assert_close(r.to_dense(), dense @ dense)


def test_an_invalid_result_without_repair_is_refused() -> None:
    # What a kernel that builds an invalid result (5.5, no repair) leads to: refused, naming
    # the op, never returned.
    t = ss.sparse_csr_tensor(*members(), SIZE)
    crow, _, values = members()
    broken = torch.sparse_csr_tensor(crow, torch.tensor([0, 2, 1, 9]), values, SIZE,
                                     check_invariants=False)
    with pytest.raises(ss.InvariantError) as info:
        tensor.wrap_results(torch.Tensor.cumsum, ss.OpKind.NEW_INDICES, (t,), {}, broken)
    assert info.value.invariant == "5.5"
    assert "cumsum" in str(info.value)


# ---------------------------------------------------------------------------------------------
# 3. A write through a twin that died is not forgotten


def test_write_through_a_dead_twin_is_seen() -> None:
    crow, col, values = members()
    t = ss.sparse_csr_tensor(crow, col, values, SIZE)
    u = ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    u.col_indices()[1] = 7
    del u
    for _ in range(8):  # enough twins to reuse ids and trigger pruning
        ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    gc.collect()
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError):
        ss.validate(t)


def test_write_through_a_member_that_outlived_its_tensor_is_seen() -> None:
    crow, col, values = members()
    t = ss.sparse_csr_tensor(crow, col, values, SIZE)
    u = ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    handed = u.col_indices()
    del u
    gc.collect()
    for _ in range(40):
        ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    gc.collect()
    assert ss.is_checked(t)
    handed[1] = 7
    assert not ss.is_checked(t)


def test_a_view_of_a_handed_out_member_keeps_it_watched() -> None:
    crow, col, values = members()
    t = ss.sparse_csr_tensor(crow, col, values, SIZE)
    u = ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    view = u.col_indices()[1:]
    del u
    gc.collect()
    for _ in range(40):
        ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    gc.collect()
    view[0] = 7
    assert not ss.is_checked(t)


DEAD_TWIN_CRASH = CHILDREN.add("dead twin crash", """
    import gc, torch, safesparse as ss
    crow, col, vals = torch.tensor([0, 2, 3, 4]), torch.tensor([0, 2, 1, 2]), torch.ones(4)
    t = ss.sparse_csr_tensor(crow, col, vals, (3, 3))
    u = ss.sparse_csr_tensor(crow, col, vals, (3, 3), check_invariants=False)
    u.col_indices()[1] = 10**9
    del u
    for _ in range(8):
        ss.sparse_csr_tensor(crow, col, vals, (3, 3), check_invariants=False)
    gc.collect()
    print("checked", ss.is_checked(t))
    try:
        ss.validate(t) @ torch.eye(3)
    except ss.InvariantError as err:
        print("refused", err.invariant)
""")


@CHILDREN.mark
def test_dead_twin_crash_is_impossible_in_a_subprocess() -> None:
    done = CHILDREN.run(DEAD_TWIN_CRASH)
    assert done.returncode == 0, done.stderr
    assert "checked False" in done.stdout and "refused 5.5" in done.stdout


# ---------------------------------------------------------------------------------------------
# 4. A write landing during validation is never proven


def _write_during(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
                  write: Any) -> list[int]:
    """Make ``module.name`` (a validation step) perform ``write()`` once, as another thread
    would, after reading the data."""
    original = getattr(module, name)
    calls: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        out = original(*args, **kwargs)
        if len(calls) == 1:
            write()
        return out

    monkeypatch.setattr(module, name, racing)
    return calls


def test_write_during_validate_is_not_proven(monkeypatch: pytest.MonkeyPatch) -> None:
    crow, col, values = members()
    plain = torch.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    t = ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    handed = t.col_indices()
    calls = _write_during(monkeypatch, tensor, "validate_tensor",
                          lambda: handed.__setitem__(1, 7))
    with pytest.raises(ss.InvariantError) as info:
        ss.validate(t)  # the first pass read valid data; the write is caught on the second
    assert info.value.invariant == "5.5"
    assert len(calls) >= 2
    assert not ss.is_checked(t)
    del plain


def test_write_during_factory_validation_is_not_proven(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from safesparse.factories import build

    crow, col, values = members()
    # the fast path checks and builds in one call of torch's checked constructor; the write
    # lands right after it read the data
    original = build._BUILD[torch.sparse_csr]
    calls: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        out = original(*args, **kwargs)
        if len(calls) == 1:
            col[1] = 7
        return out

    monkeypatch.setitem(build._BUILD, torch.sparse_csr, racing)
    _write_during(monkeypatch, build, "check_compressed_indices",
                  lambda: col.__setitem__(1, 7))
    with pytest.raises(ss.InvariantError) as info:
        ss.sparse_csr_tensor(crow, col, values, SIZE)
    assert info.value.invariant == "5.5"


def test_valid_write_during_validation_still_ends_checked(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    crow, col, values = members()
    t = ss.sparse_csr_tensor(crow, col, values, SIZE, check_invariants=False)
    handed = t.col_indices()
    _write_during(monkeypatch, tensor, "validate_tensor", lambda: handed.__setitem__(1, 2))
    ss.reset_stats()
    assert ss.is_checked(ss.validate(t))
    assert ss.stats().validations == 2  # the proof of the first pass was refused


# ---------------------------------------------------------------------------------------------
# 5. Debug mode validates every input, whatever the cache says


DEBUG_MODE_UNSEEN_WRITE = CHILDREN.add("debug mode unseen write", """
    import torch, safesparse as ss
    t = ss.sparse_csr_tensor([0, 2, 3, 4], [0, 2, 1, 2], [1., 2., 3., 4.], (3, 3))
    t.col_indices().data[1] = 10**12  # .data: a write safesparse cannot see
    print("checked", ss.is_checked(t))  # the documented limit outside debug mode
    try:
        with ss.debug():
            t @ torch.eye(3)
    except ss.InvariantError as err:
        print("refused", err.invariant, err.op)
""")


@CHILDREN.mark
def test_debug_mode_catches_a_write_no_counter_saw() -> None:
    done = CHILDREN.run(DEBUG_MODE_UNSEEN_WRITE)
    assert done.returncode == 0, done.stderr
    assert "checked True" in done.stdout
    assert "refused 5.5 matmul" in done.stdout or "refused 5.5 __matmul__" in done.stdout


def test_debug_env_var_catches_it_in_a_subprocess() -> None:
    code = """
        import os, torch, safesparse as ss
        assert ss.is_debug()
        t = ss.sparse_csr_tensor([0, 2, 3, 4], [0, 2, 1, 2], [1., 2., 3., 4.], (3, 3))
        t.col_indices().data[1] = 10**12
        try:
            t @ torch.eye(3)
        except ss.InvariantError as err:
            print("refused", err.invariant)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "SAFESPARSE_DEBUG": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "refused 5.5" in done.stdout


def test_debug_mode_validates_plain_sparse_inputs() -> None:
    t = ss.sparse_coo_tensor([[0, 1], [1, 2]], [1.0, 2.0], SIZE)
    p = torch.sparse_coo_tensor(torch.tensor([[0, 2], [0, 10**9]]), torch.tensor([5.0, 6.0]),
                                SIZE, check_invariants=False)
    with ss.debug(), pytest.raises(ss.InvariantError) as info:
        t + p
    assert info.value.invariant == "5.2"


# ---------------------------------------------------------------------------------------------
# 6. Inference mode works, and nothing from it is cached


def test_inference_mode_factories_validate_and_ops() -> None:
    crow, col, values = members()
    with torch.inference_mode():
        t = ss.sparse_csr_tensor(crow, col, values, SIZE)
        assert ss.is_checked(t)
        r = t * 2
        assert ss.is_checked(r)
        torch.testing.assert_close(r.to_dense(), 2 * t.to_dense())
        v = ss.validate(torch.eye(3).to_sparse_csr())
        assert ss.is_checked(v)
        c = ss.sparse_coo_tensor([[0, 1], [1, 2]], [1.0, 2.0], SIZE)
        assert ss.is_checked(c.coalesce())
        with pytest.raises(ss.InvariantError):
            ss.sparse_csr_tensor(crow, torch.tensor([0, 2, 1, 9]), values, SIZE)


def test_inference_tensors_are_validated_each_time() -> None:
    crow, col, values = members()
    with torch.inference_mode():
        t = ss.sparse_csr_tensor(crow, col, values, SIZE)
    ss.reset_stats()
    assert ss.is_checked(t) and ss.is_checked(t)
    assert ss.stats().validations == 2  # no counter to watch: validated when asked
    with torch.inference_mode():
        t.col_indices()[1] = 7
    assert not ss.is_checked(t)


def test_inference_mode_load(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.eye(3).to_sparse_csr()}, path)
    with torch.inference_mode():
        loaded = ss.load(path)
    assert ss.is_checked(loaded["w"])


# ---------------------------------------------------------------------------------------------
# 7. Moves to devices that validation refuses


def test_to_meta_is_not_checked() -> None:
    t = ss.sparse_csr_tensor(*members(), SIZE)
    m = t.to("meta")
    assert m.device.type == "meta"
    assert not ss.is_checked(m)
    assert ss.is_checked(t.to(torch.float64))


# ---------------------------------------------------------------------------------------------
# More attacks on the same layer


def test_marking_uncoalesced_indices_coalesced_is_not_checked() -> None:
    c = ss.sparse_coo_tensor([[1, 0], [0, 0]], [1.0, 2.0], SIZE)  # unsorted
    assert ss.is_checked(c) and not c.is_coalesced()
    c._coalesced_(True)
    assert not ss.is_checked(c)
    with pytest.raises(ss.InvariantError) as info:
        ss.validate(c)
    assert info.value.invariant == "5.3"


def test_data_assignment_from_an_invalid_plain_tensor_is_refused() -> None:
    t = ss.sparse_coo_tensor([[0, 1], [1, 2]], [1.0, 2.0], SIZE)
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 2], [0, 10**9]]), torch.tensor([5.0, 6.0]),
                                  SIZE, check_invariants=False)
    with pytest.raises(ss.InvariantError):
        t.data = bad
    assert ss.is_checked(t) and t._nnz() == 2  # nothing was written
    good = ss.sparse_coo_tensor([[0], [0]], [3.0], SIZE)
    t.data = good
    assert ss.is_checked(t)
    assert torch.equal(t.to_dense(), good.to_dense())


def test_shared_memory_is_never_cached() -> None:
    crow, col, values = members()
    t = ss.sparse_csr_tensor(crow, col, values, SIZE)
    col.share_memory_()  # moves the storage: another process could write it now
    assert ss.is_checked(t) is False or ss.stats().validations >= 1
    s = ss.validate(t)
    ss.reset_stats()
    assert ss.is_checked(s)
    assert ss.stats().validations == 1  # validated when asked, not remembered
    assert checked.record(s) is not None and checked.record(s).ver == checked.VOLATILE  # type: ignore[union-attr]


@pytest.mark.parametrize("layout", sorted(SPARSE_LAYOUTS, key=str))
def test_inplace_unknown_op_drops_the_state(layout: torch.layout) -> None:
    dense = torch.tensor([[1.0, 0], [0, 2]])
    t = ss.validate(dense.to_sparse(layout=layout, blocksize=(1, 1))
                    if layout in (torch.sparse_bsr, torch.sparse_bsc)
                    else dense.to_sparse(layout=layout))
    assert ss.is_checked(t)
    t.zero_()  # not in the table: whatever it did, t is no longer trusted
    assert not ss.is_checked(t)


@pytest.mark.parametrize("member", ["compressed", "plain"])
@pytest.mark.parametrize("layout", ["csr", "bsr"])
def test_member_reshaped_in_place_gives_the_invariant_id(member: str, layout: str) -> None:
    """torch keeps the index tensors it is given as the members of its own tensor: reshaping
    one in place (``unsqueeze_``) changes the member dims of a plain tensor built on it, and
    of its adoption. The next op names the broken id; it used to fail with an IndexError while
    reading the tensor's geometry. A safe factory's tensor is built on detached aliases: the
    same reshape leaves it whole (validated again, still valid), and so does the default
    adoption, which works on its own copy of the index members."""
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    build = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_bsr_tensor
    values = torch.ones(2) if layout == "csr" else torch.ones(2, 1, 1)
    safe = (ss.sparse_csr_tensor if layout == "csr" else ss.sparse_bsr_tensor)(
        crow, col, values, (2, 2))
    owned = ss.validate(build(crow, col, values, (2, 2), check_invariants=False))
    t = ss.validate(build(crow, col, values, (2, 2), check_invariants=False),
                    copy_indices=False)
    (crow if member == "compressed" else col).unsqueeze_(0)
    assert ss.is_checked(owned) and torch.equal((owned * 2).to_dense(), 2 * torch.eye(2))
    assert not ss.is_checked(t)
    with pytest.raises(ss.InvariantError) as info:
        t * 2
    assert info.value.invariant == ("3.2" if member == "compressed" else "3.3")
    assert not ss.is_checked(safe)  # the caller's counter moved: validated again, and valid
    assert torch.equal((safe * 2).to_dense(), 2 * torch.eye(2))
    assert ss.is_checked(safe) and safe.crow_indices().dim() == 1

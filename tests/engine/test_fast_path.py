"""The fast paths of the validation engine agree with its reference paths.

* The one-pass metadata accept (``_accept_compressed_metadata``) accepts nothing the id-ordered
  stages reject, and returns the same meta.
* The index stage gives the same answer with torch's native checker allowed (CPU, small sizes)
  as with the vectorised path alone: same meta, or the same InvariantError (id and message). The
  corruptions aim at what could crash or fool the native checker: zero-size blocks, empty
  batches and dims, int32 offsets that could wrap, huge sizes, hostile index values, members
  that are contiguous per batch but strided across batches, COO with sparse_dim 0.

The fuzz runs in a child process (an input that crashed a native kernel would kill the process,
not just fail a test): ``test_fuzz_in_subprocess`` runs the ``fuzz_*`` properties below there,
with the suite's hypothesis profile; under pytest they only run inside such a child
(``SAFESPARSE_FUZZ_CHILD=1``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from support.batch import Batch, child_env
from support.strategies import (
    BLOCKED,
    COMPRESSED_LAYOUTS,
    ROW_COMPRESSED,
    Case,
    compressed_cases,
    coo_cases,
)

import safesparse as ss
from safesparse.engine import metadata as M
from safesparse.engine import validation as V

CHILD = os.environ.get("SAFESPARSE_FUZZ_CHILD") == "1"
child_only = pytest.mark.skipif(not CHILD, reason="runs inside test_fuzz_in_subprocess")

Outcome = tuple[str, object]


def _outcome(fn: Callable[[], object]) -> Outcome:
    """("ok", result) or ("err", (id, message)); torch's own exceptions propagate."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine must not warn
        try:
            return "ok", fn()
        except ss.InvariantError as err:
            return "err", (err.invariant, str(err))


@pytest.fixture
def native_off() -> Iterator[None]:
    previous = V.set_native(False)
    yield
    V.set_native(previous)


def _both_paths(fn: Callable[[], object]) -> tuple[Outcome, Outcome]:
    previous = V.set_native(True)
    try:
        fast = _outcome(fn)
        V.set_native(False)
        reference = _outcome(fn)
    finally:
        V.set_native(previous)
    return fast, reference


# ---------------------------------------------------------------------------------------------
# Hand-written cases (in process: every input here is known safe)


def _csr(crow: list[int], col: list[int], size: tuple[int, ...],
         dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    return (torch.tensor(crow, dtype=dtype), torch.tensor(col, dtype=dtype),
            torch.ones(len(col)))


def test_native_path_is_taken_for_small_cpu_inputs() -> None:
    c, p, v = _csr([0, 1, 2], [0, 1], (2, 2))
    meta = M.check_compressed_metadata(c, p, v, (2, 2), torch.sparse_csr)
    assert V.native_compressed_ok(meta, c, p, v)
    idx = torch.tensor([[0, 1], [0, 1]])
    cmeta = M.check_coo_metadata(idx, v, (2, 2))
    assert V.native_coo_ok(cmeta, idx, v, is_coalesced=True)


@pytest.mark.parametrize("blocks", [(0, 2), (2, 0)])
def test_zero_size_blocks_never_reach_the_native_checker(blocks: tuple[int, int]) -> None:
    c = torch.tensor([0, 1])
    p = torch.tensor([0])
    v = torch.ones(1, *blocks)
    size = (blocks[0], 2 * blocks[1] if blocks[1] else 0)
    meta = M.check_compressed_metadata(c, p, v, size, torch.sparse_bsr)
    assert not V.native_compressed_ok(meta, c, p, v)
    fast, reference = _both_paths(lambda: V.validate_compressed(c, p, v, size, torch.sparse_bsr))
    assert fast == reference


def test_int32_offsets_that_could_wrap_stay_on_the_vectorised_path() -> None:
    n_plain = 2**31 - 1
    c = torch.tensor([0, 2**31 - 1, -2, 0], dtype=torch.int32)
    p = torch.zeros(0, dtype=torch.int32)
    v = torch.ones(0)
    size = (3, n_plain)
    meta = M.check_compressed_metadata(c, p, v, size, torch.sparse_csr)
    assert not V.native_compressed_ok(meta, c, p, v)
    fast, reference = _both_paths(lambda: V.validate_compressed(c, p, v, size, torch.sparse_csr))
    assert fast == reference and fast[0] == "err"


def test_coo_with_sparse_dim_zero(native_off: None) -> None:
    """S = 0: every index tuple is the empty tuple, so nnz >= 2 is never coalesced (torch's
    checker says otherwise, so the native path is not used for S = 0)."""
    indices = torch.zeros(0, 3, dtype=torch.int64)
    values = torch.ones(3, 2)
    meta = M.CooMeta((2,), 0, 3)
    assert not V.native_coo_ok(meta, indices, values, is_coalesced=True)
    assert V.check_coo_indices(meta, indices, is_coalesced=False, values=values) == meta
    with pytest.raises(ss.InvariantError) as info:
        V.check_coo_indices(meta, indices, is_coalesced=True, values=values)
    assert info.value.invariant == "5.3"
    one = M.CooMeta((2,), 0, 1)
    assert V.check_coo_indices(one, indices[:, :1], is_coalesced=True, values=values[:1]) == one


def test_native_rejection_of_valid_data_falls_back() -> None:
    """Where torch's checker refuses something the catalog allows, the vectorised path
    decides: here a BSR with block-transposed values (3.7 allows them)."""
    c, p = torch.tensor([0, 1]), torch.tensor([0])
    v = torch.ones(1, 3, 2).transpose(1, 2)
    meta = V.validate_compressed(c, p, v, (2, 3), torch.sparse_bsr)
    assert meta.nnz == 1


def _strided_batch(t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous per batch (last stride 1) but strided across batches."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1] + 1), dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


@pytest.mark.parametrize("corrupt", [None, "order", "bound"])
def test_batch_strided_members_match_contiguous_ones(corrupt: str | None) -> None:
    crow = torch.tensor([[0, 1, 3], [0, 2, 3]])
    col = torch.tensor([[1, 0, 2], [0, 2, 1]])
    if corrupt == "order":
        col[0, 2] = 0
    elif corrupt == "bound":
        col[1, 1] = 7
    values = torch.ones(2, 3)
    size = (2, 2, 3)
    meta = M.check_compressed_metadata(crow, col, values, size, torch.sparse_csr)
    sc, sp = _strided_batch(crow), _strided_batch(col)
    assert sc.stride(-1) == 1 and not sc.is_contiguous()
    assert not V.native_compressed_ok(meta, sc, sp, values)
    want = _outcome(lambda: V.check_compressed_indices(meta, crow, col, values=values))
    got = _outcome(lambda: V.check_compressed_indices(meta, sc, sp, values=values))
    assert got == want
    assert (want[0] == "ok") == (corrupt is None)


# ---------------------------------------------------------------------------------------------
# Fuzz (child process)


_HOSTILE = [-(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**63 - 1]


@st.composite
def _index_value(draw: st.DrawFn, dtype: torch.dtype) -> int:
    info = torch.iinfo(dtype)
    value = draw(st.one_of(st.integers(-3, 8), st.sampled_from(_HOSTILE)))
    return min(max(value, info.min), info.max)


@st.composite
def compressed_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 tuple[int, ...], torch.layout, str]:
    """A valid compressed case, then zero or more corruptions aimed at the native checker."""
    case: Case = draw(compressed_cases(COMPRESSED_LAYOUTS, max_batch_dims=2, max_dense_dims=2))
    c, p, v = case.compressed.clone(), case.plain.clone(), case.values.clone()
    size = list(case.size)
    m = len(case.batch)
    kinds = draw(st.lists(st.sampled_from([
        "index", "index", "index", "swap", "size", "huge", "zero_dim", "int32_wide", "dtype",
        "zero_block", "transposed_values", "strided_batch", "values_shape",
    ]), max_size=3))
    for kind in kinds:
        if kind == "index":
            target = draw(st.sampled_from([c, p]))
            if target.numel():
                pos = draw(st.integers(0, target.numel() - 1))
                target.view(-1)[pos] = draw(_index_value(target.dtype))
        elif kind == "swap" and p.numel() > 1:
            i, j = draw(st.integers(0, p.numel() - 1)), draw(st.integers(0, p.numel() - 1))
            flat = p.view(-1)
            flat[[i, j]] = flat[[j, i]]
        elif kind == "size":
            d = draw(st.integers(0, len(size) - 1))
            size[d] = max(size[d] + draw(st.integers(-2, 2)), 0)
        elif kind == "huge":
            d = draw(st.sampled_from([m, m + 1]))
            size[d] = draw(st.sampled_from([2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**40]))
        elif kind == "zero_dim":
            d = draw(st.integers(0, len(size) - 1))
            size[d] = 0
        elif kind == "int32_wide":
            c, p = c.to(torch.int32), p.to(torch.int32)
            row = case.layout in ROW_COMPRESSED
            b = case.blocksize[1] if row else case.blocksize[0]
            size[m + 1 if row else m] = (2**31 - 1 - draw(st.integers(0, 2))) * b
        elif kind == "dtype":
            target = draw(st.sampled_from(["c", "p"]))
            new = draw(st.sampled_from([torch.int32, torch.int64, torch.int16]))
            c, p = (c.to(new), p) if target == "c" else (c, p.to(new))
        elif kind == "zero_block" and case.layout in BLOCKED:
            d = m + 1 + draw(st.integers(0, 1))
            shape = list(v.shape)
            shape[d] = 0
            v = torch.ones(shape, dtype=v.dtype)
        elif kind == "transposed_values" and case.layout in BLOCKED:
            v = v.transpose(m + 1, m + 2).contiguous().transpose(m + 1, m + 2)
        elif kind == "values_shape" and v.dim() > m + 1:
            v = v.narrow(-1, 0, max(v.shape[-1] - 1, 0)).contiguous()
    if "strided_batch" in kinds and m > 0:  # last: the corruptions above write through views
        c, p = _strided_batch(c), _strided_batch(p)
    note(f"{case.layout} kinds={kinds} size={size} c={c.tolist()} p={p.tolist()} "
         f"v={tuple(v.shape)}")
    return c, p, v, tuple(size), case.layout, ",".join(kinds)


@child_only
@given(inp=compressed_inputs())
def test_fuzz_compressed_native_matches_vectorised(
    inp: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], torch.layout, str],
) -> None:
    c, p, v, size, layout, _ = inp
    fast, reference = _both_paths(lambda: V.validate_compressed(c, p, v, size, layout))
    assert fast == reference


@child_only
@given(inp=compressed_inputs())
def test_fuzz_metadata_accept_matches_ordered_stages(
    inp: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], torch.layout, str],
) -> None:
    c, p, v, size, layout, _ = inp
    accepted = M._accept_compressed_metadata(c, p, v, size, layout, None, None)
    ordered = _outcome(lambda: M._ordered_compressed_metadata(c, p, v, size, layout))
    if accepted is not None:
        assert ordered == ("ok", accepted)
    assert _outcome(lambda: M.check_compressed_metadata(c, p, v, size, layout)) == ordered


@st.composite
def coo_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], bool]:
    case: Case = draw(coo_cases(max_dense_dims=2))
    idx, v, size = case.indices[0].clone(), case.values.clone(), list(case.size)
    s = idx.shape[0]
    for kind in draw(st.lists(st.sampled_from(
            ["index", "index", "swap", "dup", "size", "huge", "zero_dim"]), max_size=3)):
        if kind == "index" and idx.numel():
            pos = draw(st.integers(0, idx.numel() - 1))
            idx.view(-1)[pos] = draw(_index_value(torch.int64))
        elif kind == "swap" and idx.shape[1] > 1:
            i, j = draw(st.integers(0, idx.shape[1] - 1)), draw(st.integers(0, idx.shape[1] - 1))
            idx[:, [i, j]] = idx[:, [j, i]]
        elif kind == "dup" and idx.shape[1] > 1:
            idx[:, 1] = idx[:, 0]
        elif kind == "size":
            d = draw(st.integers(0, len(size) - 1))
            size[d] = max(size[d] + draw(st.integers(-2, 2)), 0)
        elif kind == "huge":
            size[draw(st.integers(0, s - 1))] = draw(st.sampled_from([2**31, 2**40, 2**62]))
        elif kind == "zero_dim":
            size[draw(st.integers(0, len(size) - 1))] = 0
    coalesced = draw(st.booleans())
    note(f"COO size={size} idx={idx.tolist()} v={tuple(v.shape)} coalesced={coalesced}")
    return idx, v, tuple(size), coalesced


@child_only
@given(inp=coo_inputs())
def test_fuzz_coo_native_matches_vectorised(
    inp: tuple[torch.Tensor, torch.Tensor, tuple[int, ...], bool],
) -> None:
    idx, v, size, coalesced = inp
    fast, reference = _both_paths(
        lambda: V.validate_coo(idx, v, size, is_coalesced=coalesced))
    assert fast == reference


@child_only
@given(nnz=st.integers(2, 6), coalesced=st.booleans(), dense=st.integers(1, 3))
def test_fuzz_coo_sparse_dim_zero(nnz: int, coalesced: bool, dense: int) -> None:
    indices = torch.zeros(0, nnz, dtype=torch.int64)
    values = torch.ones(nnz, dense)
    meta = M.CooMeta((dense,), 0, nnz)
    fast, reference = _both_paths(lambda: V.check_coo_indices(
        meta, indices, is_coalesced=coalesced, values=values))
    assert fast == reference
    assert fast[0] == ("err" if coalesced else "ok")


HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: The fuzz properties and the offsets reproducer run in one child process
#: (tests/support/batch.py).
CHILDREN = Batch("fast path", env={**child_env(ROOT), "SAFESPARSE_FUZZ_CHILD": "1"})
FUZZ_PROPERTIES = sorted(name for name in dir() if name.startswith("test_fuzz_"))
FUZZ = CHILDREN.add("fuzz", f"""
    import sys
    sys.path[:0] = [{str(HERE.parent)!r}, {str(HERE)!r}]
    import conftest  # noqa: F401  (the suite's hypothesis profiles: HYPOTHESIS_PROFILE)
    import test_fast_path as fuzz
    for name in {FUZZ_PROPERTIES!r}:
        getattr(fuzz, name)()  # each @given property runs all its examples
        print("passed", name, flush=True)
""")


@CHILDREN.mark
@pytest.mark.hypothesis  # it runs the fuzz properties: `-m hypothesis` selects it with them
def test_fuzz_in_subprocess() -> None:
    """Run the fuzz properties above in a child process: a native crash fails this test with
    the child's signal instead of killing the test run."""
    if CHILD:
        pytest.skip("already in the child")
    assert len(FUZZ_PROPERTIES) == 4, FUZZ_PROPERTIES
    proc = CHILDREN.run(FUZZ)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{tail}"
    assert proc.stdout.split() == [w for n in FUZZ_PROPERTIES for w in ("passed", n)], tail


OFFSETS = CHILDREN.add("offsets outside nnz", """
    import torch, safesparse as ss
    for _ in range(300):
        for crow in ([0, 3, -1, 2, 0], [0, 4, -4, 0], [0, 10**9, -10**9, 0]):
            n = len(crow) - 1
            long = [0] * 40 + crow[1:]
            for c, size in ((torch.tensor(crow), (n, 8)),
                            (torch.tensor([[0] * len(crow), crow]), (2, n, 8)),
                            (torch.tensor(long), (len(long) - 1, 8))):
                lead = tuple(c.shape[:-1])
                empty = torch.zeros(*lead, 0, dtype=torch.int64)
                try:
                    ss.sparse_bsr_tensor(c, empty, torch.ones(*lead, 0, 1, 2), size)
                except ss.InvariantError as err:
                    assert err.invariant == '5.3', err
                else:
                    raise AssertionError(c)
    print('refused')
""")


@CHILDREN.mark
def test_compressed_offsets_outside_nnz_never_reach_the_native_checker() -> None:
    """torch's checker reads each line's plain indices before it has checked the later lines'
    offsets: an offset outside [0, nnz] made it read outside the plain indices and segfault
    (found by fuzzing the factories). Run where a crash only fails this test."""
    # each offset list as one matrix, as the second of a batch of two (the batched short-list
    # check) and after 40 empty lines (the aminmax check of longer lists): OFFSETS above
    done = CHILDREN.run(OFFSETS)
    assert done.returncode == 0, done.stderr
    assert "refused" in done.stdout

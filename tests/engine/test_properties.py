"""Property tests: random valid tensors are accepted, random corruptions are refused cleanly.

(a) Every valid tensor from :mod:`strategies` is accepted by its safe factory, with and without
    the size, and densifies exactly like torch's (and like an independent Python reference).
(b) A single random corruption (an index entry set to a random or extreme integer, two entries
    swapped, the coalesced flag set, a shape, dtype or stride changed) is either still valid -
    then it is accepted and equals torch's checked build - or refused with an ``InvariantError``;
    never another exception. Index-data corruptions are judged by a Python reference checker
    that predicts the exact id; the others use torch's own validator as an oracle: whatever torch
    refuses, safesparse refuses, and whatever safesparse accepts, torch accepts.
(c) Corrupting the index data of a checked tensor in place is always noticed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import assume, event, given, note
from hypothesis import strategies as st
from support.strategies import (
    ALL_LAYOUTS,
    BLOCKED,
    COMPRESSED_LAYOUTS,
    OMIT,
    ROW_COMPRESSED,
    Case,
    _fill_compressed,
    _fill_coo,
    cases,
    estimated_plain_extent,
    expected_compressed_index_violation,
    expected_coo_index_violation,
    layout_id,
)

import safesparse as ss

I64 = torch.iinfo(torch.int64)
MAX_DENSE = 1 << 16  # elements; larger valid results are compared member by member


def _torch_estimate(case: Case) -> torch.Tensor:
    return case.torch_build(OMIT, check_invariants=True)


def _index_dtypes(t: torch.Tensor) -> tuple[torch.dtype, ...]:
    t = ss.unwrap(t)
    if t.layout == torch.sparse_coo:
        return (t._indices().dtype,)
    if t.layout in ROW_COMPRESSED:
        return t.crow_indices().dtype, t.col_indices().dtype
    return t.ccol_indices().dtype, t.row_indices().dtype


def _assert_matches(result: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(result, ss.SafeSparseTensor)
    assert ss.is_checked(result)
    assert result.layout == expected.layout
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype
    assert _index_dtypes(result) == _index_dtypes(expected)
    if 0 < math.prod(result.shape) <= MAX_DENSE:
        assert torch.equal(result.to_dense(), expected.to_dense())
    else:  # too large to densify, or empty (whose dense strides can still overflow: size
        # (0, 2**62, 2)): the members must agree
        for ours, theirs in zip(_members_of(result), _members_of(expected), strict=True):
            assert torch.equal(ours, theirs)


# --- (a) valid input is accepted ---------------------------------------------------------------


@given(case=cases())
def test_valid_input_is_accepted_with_size(case: Case) -> None:
    note(case.describe())
    event(f"{layout_id(case.layout)} batch dims={len(case.batch)} dense dims="
          f"{len(case.dense_size)} nnz={'0' if case.nnz == 0 else '>0'}")
    ss.reset_stats()
    result = case.ss_build()
    assert ss.stats().validations + ss.stats().skipped == 1
    expected = case.torch_build()
    _assert_matches(result, expected)
    assert torch.equal(result.to_dense(), case.dense)


@given(case=cases())
def test_valid_input_is_accepted_without_size(case: Case) -> None:
    note(case.describe())
    expected = _torch_estimate(case)
    result = case.ss_build(OMIT)
    _assert_matches(result, expected)
    # the seed rule, computed here with Python integers
    assert tuple(result.shape) == _resolved_size(Corruption(case, OMIT, "none", True))
    # the estimate never exceeds the real size
    assert all(e <= s for e, s in zip(result.shape, case.size, strict=True))


@given(case=cases(COMPRESSED_LAYOUTS))
def test_sparse_compressed_tensor_equals_the_layout_factory(case: Case) -> None:
    result = ss.sparse_compressed_tensor(*case.args(), layout=case.layout)
    _assert_matches(result, case.torch_build())


@given(case=cases())
def test_rebuild_from_validated_indices_skips_and_agrees(case: Case) -> None:
    first = case.ss_build()
    ss.reset_stats()
    second = case.ss_build()
    assert ss.stats().skipped == 1 and ss.stats().validations == 0
    _assert_matches(second, case.torch_build())
    assert ss.is_checked(first)


# --- (b) random single corruptions -------------------------------------------------------------


@dataclass
class Corruption:
    case: Case  # the corrupted inputs
    size: Any  # the size passed (OMIT: none)
    kind: str
    index_only: bool  # only index data changed: the reference checker knows the answer


def _extremes(dtype: torch.dtype) -> list[int]:
    info = torch.iinfo(dtype)
    return [info.min, info.min + 1, info.max, info.max - 1, -1, 2**31 - 1, -(2**31), 2**31]


@st.composite
def hostile_int(draw: st.DrawFn, dtype: torch.dtype, bound: int) -> int:
    info = torch.iinfo(dtype)
    value = draw(st.one_of(
        st.integers(-3, bound + 3),
        st.sampled_from(_extremes(dtype)),
        st.integers(info.min, info.max),
    ))
    return min(max(value, info.min), info.max)


@st.composite
def index_corruptions(draw: st.DrawFn, omit_size: bool = False) -> Corruption:
    case: Case = draw(cases())
    size = OMIT if omit_size else case.size
    bad = case.clone()
    members = list(bad.indices)
    kinds = ["set", "swap"] + (["coalesced"] if case.layout == torch.sparse_coo else [])
    kind = draw(st.sampled_from(kinds))
    which = draw(st.integers(0, len(members) - 1))
    flat = members[which].view(-1)
    if kind == "coalesced":
        bad.is_coalesced = True
    elif flat.numel() == 0:
        kind = "noop"
    elif kind == "set":
        pos = draw(st.integers(0, flat.numel() - 1))
        bound = max([*case.size, case.nnz, 1])
        flat[pos] = draw(hostile_int(members[which].dtype, bound))
    else:
        i = draw(st.integers(0, flat.numel() - 1))
        j = draw(st.integers(0, flat.numel() - 1))
        flat[[i, j]] = flat[[j, i]]
    bad.indices = tuple(members)
    bad.extra["valid"] = case
    return Corruption(bad, size, kind, index_only=True)


def _expected_index_violation(c: Corruption) -> str | None:
    case = c.case
    if case.layout == torch.sparse_coo:
        size = None if c.size is OMIT else case.size
        return expected_coo_index_violation(case.indices[0], size, bool(case.is_coalesced))
    n_plain = None if c.size is OMIT else case.n_plain
    return expected_compressed_index_violation(case.compressed, case.plain, n_plain)


def _resolved_size(c: Corruption) -> tuple[int, ...]:
    """The size of a valid corrupted case: given, or estimated with exact Python integers."""
    case = c.case
    if c.size is not OMIT:
        return tuple(case.size)
    if case.layout == torch.sparse_coo:
        idx = case.indices[0]
        sparse = [int(row.max()) + 1 if idx.shape[1] else 0 for row in idx]
        return (*sparse, *case.dense_size)
    m = len(case.batch)
    extent = estimated_plain_extent(case.compressed, case.plain)
    n_comp = case.compressed.shape[-1] - 1
    b0, b1 = case.blocksize
    sparse = (n_comp * b0, extent * b1) if case.layout in ROW_COMPRESSED else (
        extent * b0, n_comp * b1)
    return (*case.size[:m], *sparse, *case.dense_size)


def _reference_dense(case: Case, size: tuple[int, ...]) -> torch.Tensor:
    if case.layout == torch.sparse_coo:
        return _fill_coo(case.indices[0], case.values, size)
    return _fill_compressed(case.layout, case.compressed, case.plain, case.values, size,
                            case.batch, case.blocksize)


def _build(c: Corruption) -> torch.Tensor | ss.InvariantError:
    """The safe factory's answer: a tensor or an InvariantError (anything else propagates)."""
    try:
        return c.case.ss_build(c.size)
    except ss.InvariantError as err:
        assert err.layout == c.case.layout
        assert str(err).startswith(f"[{layout_id(c.case.layout)} {err.invariant}] ")
        return err


def _check_index_corruption(c: Corruption) -> None:
    note(f"{c.kind}: {c.case.describe()} size={'omitted' if c.size is OMIT else c.size}")
    expected = _expected_index_violation(c)
    event(f"{layout_id(c.case.layout)} {c.kind} -> {expected or 'valid'}")
    got = _build(c)
    if expected is not None:
        assert isinstance(got, ss.InvariantError), f"accepted, expected {expected}"
        assert got.invariant == expected, str(got)
        return
    assert not isinstance(got, ss.InvariantError), f"valid input refused: {got}"
    size = _resolved_size(c)
    assert tuple(got.shape) == size
    assert ss.is_checked(got)
    theirs = c.case.torch_build(size, check_invariants=True)
    if math.prod(size) <= MAX_DENSE:
        assert torch.equal(got.to_dense(), _reference_dense(c.case, size))
        assert torch.equal(got.to_dense(), theirs.to_dense())
    else:  # too large to densify (a huge index with the size omitted): compare the members
        for ours, want in zip(_members_of(got), c.case.indices, strict=True):
            assert torch.equal(ours, want.to(ours.dtype))


@given(c=index_corruptions())
def test_index_corruption_with_size(c: Corruption) -> None:
    _check_index_corruption(c)


def _estimate_representable(c: Corruption) -> bool:
    """Whether the exact estimated size is one torch can build (every dim, and the numel after
    each dim, within int64; for int32 indices, the two sparse extents counted in blocks within
    int32, as invariant 1.3 and torch's checker count them)."""
    size = _resolved_size(c)
    numel = 1
    for s in size:
        numel *= s
        if s > I64.max or numel > I64.max:
            return False
    if c.case.layout != torch.sparse_coo and c.case.indices[0].dtype == torch.int32:
        m = len(c.case.batch)
        b0, b1 = c.case.blocksize
        if size[m] // max(b0, 1) > 2**31 - 1 or size[m + 1] // max(b1, 1) > 2**31 - 1:
            return False
    return True


@given(c=index_corruptions(omit_size=True))
def test_index_corruption_without_size(c: Corruption) -> None:
    if _estimate_representable(c):
        _check_index_corruption(c)
        return
    # an unrepresentable estimate is refused; which id comes first may depend on the overflow
    got = _build(c)
    note(f"{c.kind}: {c.case.describe()} -> {got}")
    assert isinstance(got, ss.InvariantError), "unrepresentable estimated size accepted"


METADATA_KINDS = ("size", "member_shape", "dtype", "strides", "values_shape")


@st.composite
def metadata_corruptions(draw: st.DrawFn) -> Corruption:
    case: Case = draw(cases())
    bad = case.clone()
    kind = draw(st.sampled_from(METADATA_KINDS))
    size: Any = list(case.size)
    members = [*bad.indices, bad.values]
    which = draw(st.integers(0, len(members) - 1))
    target = members[which]
    if kind == "size":
        op = draw(st.sampled_from(["inc", "dec", "double", "drop", "append", "omit", "huge"]))
        dim = draw(st.integers(0, max(len(size) - 1, 0)))
        if op == "omit":
            size = OMIT
        elif op == "append":
            size.append(draw(st.integers(0, 3)))
        elif not size:
            size = [1]
        elif op == "drop":
            del size[dim]
        elif op == "inc":
            size[dim] += draw(st.integers(1, 3))
        elif op == "dec":
            size[dim] -= draw(st.integers(1, 3))
        elif op == "huge":
            size[dim] = draw(st.sampled_from([2**31 - 1, 2**31, 2**32 + 6, 2**62, I64.max]))
        else:
            size[dim] *= 2
    elif kind in ("member_shape", "values_shape"):
        if kind == "values_shape":
            which, target = len(members) - 1, members[-1]
        op = draw(st.sampled_from(["narrow", "grow", "unsqueeze", "flatten", "squeeze"]))
        dim = draw(st.integers(0, max(target.dim() - 1, 0)))
        if target.dim() == 0 or op == "unsqueeze":
            target = target.unsqueeze(draw(st.integers(0, target.dim())))
        elif op == "narrow" and target.shape[dim] > 0:
            target = target.narrow(dim, 0, target.shape[dim] - 1)
        elif op in ("grow", "narrow"):
            one = list(target.shape)
            one[dim] = 1
            extra = target.narrow(dim, 0, 1) if target.shape[dim] else torch.zeros(
                one, dtype=target.dtype)
            target = torch.cat([target, extra], dim)
        elif op == "flatten":
            target = target.flatten()
        else:
            target = target[(0,) * min(1, target.dim())] if target.shape[0] else target.flatten()
        members[which] = target.contiguous()
    elif kind == "dtype":
        index_targets = [torch.int16, torch.int32, torch.int64, torch.float32, torch.uint8,
                         torch.bool]
        value_targets = [torch.float16, torch.bool, torch.int8, torch.complex128, torch.float64]
        is_values = which == len(members) - 1
        dtype = draw(st.sampled_from(value_targets if is_values else index_targets))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # complex -> real drops the imaginary
            members[which] = target.to(dtype)
    else:  # strides
        members[which] = torch.stack([target, target], -1)[..., 0]
    bad.indices, bad.values = tuple(members[:-1]), members[-1]
    return Corruption(bad, size if size is OMIT else tuple(size), kind, index_only=False)


def _torch_answer(c: Corruption) -> torch.Tensor | Exception:
    try:
        return c.case.torch_build(c.size, check_invariants=True)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        return err


@given(c=metadata_corruptions())
def test_metadata_corruption_against_torch(c: Corruption) -> None:
    note(f"{c.kind}: {c.case.describe()} values={c.case.values.dtype} "
         f"size={'omitted' if c.size is OMIT else c.size}")
    ours = _build(c)
    theirs = _torch_answer(c)
    event(f"{layout_id(c.case.layout)} {c.kind}: ss "
          f"{'refused' if isinstance(ours, ss.InvariantError) else 'accepted'}, torch "
          f"{'refused' if isinstance(theirs, Exception) else 'accepted'}")
    if isinstance(theirs, Exception):
        if c.kind == "strides" and not isinstance(ours, ss.InvariantError):
            # the factories copy index members whose strides torch's checker refuses (SPEC 1:
            # any strides; copy where needed): the same, valid data
            assert ss.is_checked(ours)
            return
        assert isinstance(ours, ss.InvariantError), f"torch refused ({theirs}), ss accepted"
    if not isinstance(ours, ss.InvariantError):
        assert not isinstance(theirs, Exception)
        _assert_matches(ours, theirs)


# --- (c) in-place corruption of a checked tensor -----------------------------------------------


@given(c=index_corruptions())
def test_in_place_corruption_is_noticed(c: Corruption) -> None:
    """Build a checked tensor from the valid twin, then write the corruption into its members."""
    assume(c.kind in ("set", "swap"))
    note(f"{c.kind}: {c.case.describe()}")
    valid: Case = c.case.extra["valid"]
    t = valid.ss_build()
    assert ss.is_checked(t)
    members = _members_of(t)
    changed = False
    for member, corrupted in zip(members, c.case.indices, strict=True):
        if not torch.equal(member, corrupted):
            member.copy_(corrupted)
            changed = True
    if changed:
        assert not ss.is_checked(t)
    expected = _expected_index_violation(c)
    rebuild = ss.sparse_coo_tensor if t.layout == torch.sparse_coo else (
        lambda *args, **kw: ss.sparse_compressed_tensor(*args, layout=t.layout, **kw))
    values = ss.unwrap(t)._values() if t.layout == torch.sparse_coo else t.values()
    kwargs = valid.kwargs()
    if expected is None:
        assert ss.validate(t) is t
        assert ss.is_checked(t)
        again = rebuild(*members, values, valid.size, **kwargs)
        assert torch.equal(again.to_dense(), t.to_dense())
        return
    for attempt in (lambda: ss.validate(t), lambda: rebuild(*members, values, valid.size,
                                                            **kwargs)):
        with pytest.raises(ss.InvariantError) as excinfo:
            attempt()
        assert excinfo.value.invariant == expected


def _members_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout == torch.sparse_coo:
        return (t._indices(),)
    if t.layout in ROW_COMPRESSED:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def test_strategy_layouts_cover_everything() -> None:
    assert set(ALL_LAYOUTS) == {torch.sparse_coo, *COMPRESSED_LAYOUTS}
    assert set(BLOCKED) <= set(COMPRESSED_LAYOUTS)

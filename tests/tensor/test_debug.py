"""Debug mode (docs/debug.md).

Switched on by SAFESPARSE_DEBUG=1 at import, ``ss.set_debug``, or ``with ss.debug():`` (per
thread/context). In debug mode every sparse result is fully validated, the cache of checked
index structures is ignored, and errors name the operation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import safesparse as ss

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _debug_off() -> Iterator[None]:
    """Every test starts and ends with debug mode off in this thread."""
    ss.set_debug(False)
    yield
    ss.set_debug(False)


def build(**kwargs: object) -> ss.SafeSparseTensor:
    return ss.sparse_csr_tensor(
        torch.tensor([0, 2, 3, 4]), torch.tensor([0, 2, 1, 2]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]), (3, 3), **kwargs,  # type: ignore[arg-type]
    )


def validations() -> int:
    return ss.stats().validations


# ---------------------------------------------------------------------------------------------
# Switching it on and off


def _is_debug_in_subprocess(value: str | None) -> bool:
    env = dict(os.environ)
    env.pop("SAFESPARSE_DEBUG", None)
    if value is not None:
        env["SAFESPARSE_DEBUG"] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", "import safesparse as ss; print(ss.is_debug())"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()[-1]
    assert out in ("True", "False"), result.stdout
    return out == "True"


@pytest.mark.parametrize(("value", "expected"), [("1", True), (None, False)])
def test_environment_variable_is_read_at_import(value: str | None, expected: bool) -> None:
    assert _is_debug_in_subprocess(value) is expected


def test_environment_variable_is_read_only_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not ss.is_debug()
    monkeypatch.setenv("SAFESPARSE_DEBUG", "1")
    assert not ss.is_debug()


def test_set_debug_and_is_debug() -> None:
    assert ss.is_debug() is False
    ss.set_debug(True)
    assert ss.is_debug() is True
    ss.set_debug(False)
    assert ss.is_debug() is False


def test_context_manager_nests_and_restores() -> None:
    assert not ss.is_debug()
    with ss.debug():
        assert ss.is_debug()
        with ss.debug(False):
            assert not ss.is_debug()
            with ss.debug():
                assert ss.is_debug()
            assert not ss.is_debug()
        assert ss.is_debug()
    assert not ss.is_debug()


def test_context_manager_restores_on_error() -> None:
    with pytest.raises(KeyError), ss.debug():
        raise KeyError("boom")
    assert not ss.is_debug()


def test_context_manager_restores_an_outer_set_debug() -> None:
    ss.set_debug(True)
    with ss.debug(False):
        assert not ss.is_debug()
    assert ss.is_debug()


def test_debug_mode_is_per_thread() -> None:
    seen: dict[str, bool] = {}
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        inside.wait(10)
        seen["other, while main is in `with debug()`"] = ss.is_debug()
        release.set()

    def switcher() -> None:
        ss.set_debug(True)
        seen["switcher"] = ss.is_debug()

    with ss.debug():
        th = threading.Thread(target=other)
        th.start()  # started inside the block
        inside.set()
        release.wait(10)
        assert ss.is_debug()
        th.join()
    assert seen == {"other, while main is in `with debug()`": False}

    sw = threading.Thread(target=switcher)
    sw.start()
    sw.join()
    assert seen["switcher"] is True
    assert not ss.is_debug()  # set_debug in another thread does not leak here


# ---------------------------------------------------------------------------------------------
# What it does


def test_every_sparse_result_is_validated() -> None:
    # SPEC section 6: every sparse input before the op (cache ignored), every sparse result
    t = build()
    x = torch.ones(3, 2)
    ss.reset_stats()
    with ss.debug():
        a = t * 2
        assert validations() == 2  # t, then the result
        b = a.clone()
        assert validations() == 4
        c = b.mT
        assert validations() == 6
        d = t + t
        assert validations() == 9  # both operands, then the result
        e = torch.zeros_like(t)  # unknown outside debug mode; validated here
        assert validations() == 11
        y = t @ x  # strided: only the input to validate
        assert validations() == 12
    for r in (a, b, c, d, e):
        assert type(r) is ss.SafeSparseTensor
        assert ss.is_checked(r)
    assert type(y) is torch.Tensor
    ss.reset_stats()
    t * 2  # outside debug mode again: no validation
    assert validations() == 0


def test_validate_ignores_the_checked_state() -> None:
    t = build()
    ss.reset_stats()
    with ss.debug():
        assert ss.validate(t) is t
        assert ss.validate(t) is t
    assert ss.stats().validations == 2
    assert ss.stats().skipped == 0
    ss.validate(t)
    assert ss.stats().skipped == 1


def test_rebuild_on_checked_indices_validates_again() -> None:
    t = build()
    ss.reset_stats()
    ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(), torch.randn(4), t.shape)
    assert (ss.stats().validations, ss.stats().skipped) == (0, 1)
    with ss.debug():
        r = ss.sparse_csr_tensor(t.crow_indices(), t.col_indices(), torch.randn(4), t.shape)
    assert (ss.stats().validations, ss.stats().skipped) == (1, 1)
    assert ss.is_checked(r)


def test_check_invariants_false_still_validates() -> None:
    ss.reset_stats()
    with ss.debug():
        t = build(check_invariants=False)
        assert ss.is_checked(t)
        assert validations() == 1
        with pytest.raises(ss.InvariantError) as info:
            ss.sparse_csr_tensor([0, 2, 3, 4], [0, 2, 1, 7], [1.0, 2.0, 3.0, 4.0], (3, 3),
                                 check_invariants=False)
    assert info.value.invariant == "5.5"
    u = build(check_invariants=False)
    assert not ss.is_checked(u)


def test_corrupted_input_is_caught_before_the_op_and_names_it() -> None:
    t = build()
    t.col_indices()[1] = 7  # out of bounds: n_plain = 3
    assert not ss.is_checked(t)
    with ss.debug(), pytest.raises(ss.InvariantError) as info:
        t * 2
    err = info.value
    assert err.op == "mul"
    assert "mul" in str(err)
    assert err.invariant == "5.5"
    assert err.layout == torch.sparse_csr
    assert str(err).startswith("[CSR 5.5]")
    assert isinstance(err, RuntimeError) and isinstance(err, ValueError)


@pytest.mark.parametrize(("op", "fn"), [
    ("matmul", lambda t: t @ torch.ones(3, 2)),
    ("clone", lambda t: t.clone()),
    ("to_dense", lambda t: t.to_dense()),
])
def test_error_names_other_ops(op: str, fn: object) -> None:
    t = build()
    t.col_indices()[1] = 7
    with ss.debug(), pytest.raises(ss.InvariantError) as info:
        fn(t)  # type: ignore[operator]
    assert info.value.op is not None
    assert op in info.value.op
    assert op in str(info.value)


def test_outside_debug_mode_errors_name_no_op() -> None:
    t = build()
    t.col_indices()[1] = 7
    with pytest.raises(ss.InvariantError) as info:
        ss.validate(t)
    assert info.value.op is None


def test_valid_inputs_with_lost_state_are_revalidated_and_pass() -> None:
    t = build()
    t.values().mul_(2)  # drops the state conservatively (docs/ops.md, Limitations)
    assert not ss.is_checked(t)
    ss.reset_stats()
    with ss.debug():
        r = t * 2
    assert ss.is_checked(t)  # validated on the way in
    assert ss.is_checked(r)
    assert validations() == 2  # the input, then the result


def test_inplace_results_are_validated() -> None:
    t = build()
    ss.reset_stats()
    with ss.debug():
        t.mul_(2)
    assert validations() == 2  # the input before, the result after
    assert ss.is_checked(t)


def test_debug_mode_in_a_thread_validates_only_there() -> None:
    t = build()
    ss.reset_stats()
    counts: list[int] = []

    def worker() -> None:
        with ss.debug():
            t * 2
        counts.append(ss.stats().validations)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert counts == [2]  # the input and the result
    t * 2  # this thread: debug off
    assert validations() == 2


def test_error_names_property_ops() -> None:
    t = build()
    t.col_indices()[1] = 7
    with ss.debug(), pytest.raises(ss.InvariantError) as info:
        t.mT  # noqa: B018
    assert info.value.op is not None
    assert "mT" in info.value.op


def test_validate_in_debug_mode_validates_once_and_names_no_op() -> None:
    t = build(check_invariants=False)
    ss.reset_stats()
    with ss.debug():
        ss.validate(t)
    assert validations() == 1
    t.col_indices()[1] = 7
    with ss.debug(), pytest.raises(ss.InvariantError) as info:
        ss.validate(t)
    assert info.value.op is None

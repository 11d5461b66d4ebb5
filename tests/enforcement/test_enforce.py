"""Enforce mode (SPEC section 8): torch's own sparse factories and torch.load, validated.

Tests that switch enforce mode on for a whole context (``set_enforce``, ``SAFESPARSE_ENFORCE``)
run in a subprocess, so the wrappers they leave installed never touch the other tests.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import safesparse as ss
from safesparse.base import originals as _originals

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("sparse_coo_tensor", "sparse_compressed_tensor", "sparse_csr_tensor",
         "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor")
BUILTIN = {n: getattr(torch._C._VariableFunctions, n) for n in NAMES}

# (factory name, valid args, invalid args (5.6 / COO 5.2), kwargs)
CSR_OK = (torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.ones(2), (2, 2))
CSR_BAD = (torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2), (1, 2))
BSR_OK = (torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2, 2), (2, 2))
BSR_BAD = (torch.tensor([0, 1]), torch.tensor([1]), torch.ones(1, 2, 2), (2, 2))
CALLS: list[tuple[str, tuple[Any, ...], tuple[Any, ...], dict[str, Any]]] = [
    ("sparse_coo_tensor", (torch.tensor([[0, 1]]), torch.ones(2), (2,)),
     (torch.tensor([[0, 5]]), torch.ones(2), (2,)), {}),
    ("sparse_csr_tensor", CSR_OK, CSR_BAD, {}),
    ("sparse_csc_tensor", CSR_OK, CSR_BAD, {}),
    ("sparse_bsr_tensor", BSR_OK, BSR_BAD, {}),
    ("sparse_bsc_tensor", BSR_OK, BSR_BAD, {}),
    ("sparse_compressed_tensor", CSR_OK, CSR_BAD, {"layout": torch.sparse_csr}),
]


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _run(code: str, **env: str) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full_env.pop("SAFESPARSE_ENFORCE", None) if "SAFESPARSE_ENFORCE" not in env else None
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(autouse=True)
def _no_enforcement_leaks() -> Any:
    yield
    assert not ss.is_enforced()
    for name in NAMES:
        assert getattr(torch, name) is BUILTIN[name], f"torch.{name} left wrapped"


# --- the block ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "ok", "bad", "kwargs"), CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("check_invariants", [None, False, True])
def test_every_factory_is_validated_in_the_block(
        name: str, ok: tuple[Any, ...], bad: tuple[Any, ...], kwargs: dict[str, Any],
        check_invariants: bool | None) -> None:
    kw = dict(kwargs) if check_invariants is None else {**kwargs,
                                                         "check_invariants": check_invariants}
    theirs = _quiet(lambda: BUILTIN[name](*ok, **kw))
    with ss.enforce():
        assert ss.is_enforced()
        factory = getattr(torch, name)  # looked up in the block, as library code does
        out = factory(*ok, **kw)
        assert isinstance(out, ss.SafeSparseTensor) and ss.is_checked(out)
        assert out.layout == theirs.layout and torch.equal(out.to_dense(), theirs.to_dense())
        with pytest.raises(ss.InvariantError):
            factory(*bad, **kw)
    # outside: torch's own function again, invalid data accepted unchecked as torch does
    plain = _quiet(lambda: getattr(torch, name)(*bad, **{**kwargs, "check_invariants": False}))
    assert type(plain) is torch.Tensor


def test_third_party_code_is_protected() -> None:
    def library_function(n: int) -> torch.Tensor:  # stands for code you do not edit
        crow = torch.tensor([0, 1, n])
        return torch.sparse_csr_tensor(crow, torch.tensor([0, 1]), torch.ones(2), (2, 2),
                                       check_invariants=False)

    assert type(_quiet(lambda: library_function(5))) is torch.Tensor  # unchecked, silently
    with ss.enforce():
        assert ss.is_checked(library_function(2))
        with pytest.raises(ss.InvariantError) as excinfo:
            library_function(5)
    assert excinfo.value.invariant == "5.2"


def test_nested_blocks_and_switching_off() -> None:
    with ss.enforce():
        with ss.enforce(False):
            assert not ss.is_enforced()
            assert type(_quiet(lambda: torch.sparse_csr_tensor(*CSR_BAD))) is torch.Tensor
        assert ss.is_enforced()
        with ss.enforce():
            assert ss.is_enforced()
        assert ss.is_enforced()
    assert not ss.is_enforced()


def test_block_is_per_thread() -> None:
    seen: dict[str, Any] = {}
    started, release = threading.Event(), threading.Event()

    def other() -> None:
        seen["enforced"] = ss.is_enforced()
        seen["type"] = type(_quiet(lambda: torch.sparse_csr_tensor(*CSR_BAD)))
        started.set()
        release.wait(10)

    with ss.enforce():
        thread = threading.Thread(target=other)
        thread.start()
        started.wait(10)
        assert ss.is_enforced()
        with pytest.raises(ss.InvariantError):
            torch.sparse_csr_tensor(*CSR_BAD)
        release.set()
        thread.join()
    assert seen == {"enforced": False, "type": torch.Tensor}


def test_exception_in_block_restores_torch() -> None:
    with pytest.raises(ss.InvariantError), ss.enforce():
        torch.sparse_csr_tensor(*CSR_BAD)
    assert torch.sparse_csr_tensor is BUILTIN["sparse_csr_tensor"]


def test_safe_factories_keep_working_when_enforced() -> None:
    with ss.enforce():
        t = ss.sparse_csr_tensor(*CSR_OK)
        assert ss.is_checked(t) and ss.is_checked(t.t())
        unchecked = ss.sparse_csr_tensor(*CSR_BAD, check_invariants=False)  # the safe API's own
        assert not ss.is_checked(unchecked)


# --- torch.load -------------------------------------------------------------------------------


def _saved(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_torch_load_validates_in_the_block() -> None:
    bad = _quiet(lambda: BUILTIN["sparse_csr_tensor"](*CSR_BAD, check_invariants=False))
    good = _quiet(lambda: BUILTIN["sparse_csr_tensor"](*CSR_OK))
    assert type(torch.load(_saved({"w": bad}))["w"]) is torch.Tensor  # outside: torch's load
    with ss.enforce():
        with pytest.raises(ss.InvariantError) as excinfo:
            torch.load(_saved({"layer.w": bad}))
        assert excinfo.value.path is not None and "layer.w" in excinfo.value.path
        loaded = torch.load(_saved({"w": good}), map_location="cpu", weights_only=True)
        assert ss.is_checked(loaded["w"])
        # positional map_location, torch.serialization.load, ss.load: all once, no recursion
        assert ss.is_checked(torch.load(_saved([good]), "cpu")[0])
        assert ss.is_checked(torch.serialization.load(_saved([good]))[0])
        ss.reset_stats()
        assert ss.is_checked(ss.load(_saved([good]))[0])
        assert ss.stats().validations == 1
        with pytest.raises(ss.InvariantError):
            ss.load(_saved({"w": bad}))


class Custom:
    """A global the weights-only unpickler refuses."""


def test_torch_load_keeps_torch_s_weights_only_default() -> None:
    buf = _saved({"obj": Custom()})
    with ss.enforce(), pytest.raises(Exception, match=r"[Ww]eights"):
        torch.load(buf)
    buf.seek(0)
    with ss.enforce():
        assert isinstance(torch.load(buf, weights_only=False)["obj"], Custom)


# --- set_enforce, the environment, monkeypatches (subprocesses) ---------------------------------


def test_set_enforce_is_lasting_in_its_context_only() -> None:
    out = _run("""
        import threading, torch, safesparse as ss
        bad = (torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2), (1, 2))
        print(ss.is_enforced())
        ss.set_enforce(True)
        print(ss.is_enforced())
        try:
            torch.sparse_csr_tensor(*bad, check_invariants=False)
        except ss.InvariantError:
            print("refused")
        seen = []
        t = threading.Thread(target=lambda: seen.append(ss.is_enforced())); t.start(); t.join()
        print(seen[0])
        ss.set_enforce(False)
        print(type(torch.sparse_csr_tensor(*bad, check_invariants=False)).__name__)
    """)
    assert out.split() == ["False", "True", "refused", "False", "Tensor"]


def test_environment_variable_holds_in_every_thread() -> None:
    out = _run("""
        import threading, torch
        early = []
        def worker():
            import safesparse as ss
            bad = (torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2), (1, 2))
            try:
                torch.sparse_csr_tensor(*bad, check_invariants=False)
                early.append("built")
            except ss.InvariantError:
                early.append("refused")
        import safesparse as ss
        print(ss.is_enforced())
        t = threading.Thread(target=worker); t.start(); t.join()
        print(early[0])
        with ss.enforce(False):
            print(ss.is_enforced())
        out = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (2,))
        print(type(out).__name__, ss.is_checked(out))
    """, SAFESPARSE_ENFORCE="1")
    assert out.split() == ["True", "refused", "False", "SafeSparseTensor", "True"]


def test_user_monkeypatch_does_not_recurse() -> None:
    out = _run("""
        import io, torch, safesparse as ss
        for name in ("sparse_coo_tensor", "sparse_compressed_tensor", "sparse_csr_tensor",
                     "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor"):
            setattr(torch, name, getattr(ss, name))
        t = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]),
                                    torch.ones(2), (2, 2))
        print(type(t).__name__, ss.is_checked(t), ss.is_checked(t.t()), t.t().layout)
        c = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (2,))
        print(ss.is_checked(c.coalesce()) in (True, False))
        buf = io.BytesIO(); torch.save({"t": t}, buf); buf.seek(0)
        print(ss.is_checked(ss.load(buf)["t"]))
        with ss.enforce():
            t2 = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]),
                                         torch.ones(2), (2, 2), check_invariants=False)
            print(ss.is_checked(t2))
        print(torch.sparse_csr_tensor is ss.sparse_csr_tensor)
    """)
    assert out.split() == ["SafeSparseTensor", "True", "True", "torch.sparse_csc", "True",
                           "True", "True", "True"]


def test_originals_are_torch_s_builtins() -> None:
    for name in NAMES:
        assert _originals.FACTORIES[name] is BUILTIN[name]


def test_demo_runs_under_enforce_mode() -> None:
    """safesparse's own deliberate unchecked build (the demo's tampered file) uses torch's
    held factory, so enforce mode does not break it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SAFESPARSE_ENFORCE": "1"}
    proc = subprocess.run([sys.executable, "-m", "safesparse", "demo"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "5.5" in proc.stdout

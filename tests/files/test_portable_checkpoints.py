"""``ss.save`` / ``ss.unwrap_all``: checkpoints that plain torch loads where safesparse is not
installed, and that ``ss.load`` turns back into checked tensors."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import safesparse as ss

pytestmark = pytest.mark.filterwarnings("ignore:.*support is in beta state:UserWarning")

LAYOUTS = {
    "COO": lambda x: x.to_sparse(),
    "CSR": lambda x: x.to_sparse_csr(),
    "CSC": lambda x: x.to_sparse_csc(),
    "BSR": lambda x: x.to_sparse_bsr((2, 2)),
    "BSC": lambda x: x.to_sparse_bsc((2, 2)),
}
DENSE = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 4.0],
                      [0.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 7.0]])


class Pair(NamedTuple):
    first: Any
    second: Any


def safe_state() -> collections.OrderedDict[str, Any]:
    state: collections.OrderedDict[str, Any] = collections.OrderedDict(
        (f"{name}.weight", ss.validate(make(DENSE))) for name, make in LAYOUTS.items())
    state["bias"] = torch.zeros(4)
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return state


def test_unwrap_all_replaces_every_safe_tensor_and_leaves_the_input_alone() -> None:
    state = safe_state()
    leaf = ss.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (2,), requires_grad=True)
    obj = {"state": state, "list": [leaf], "pair": Pair(state["CSR.weight"], 1),
           "set": {state["COO.weight"]}, "deque": collections.deque([state["BSR.weight"]])}
    out = ss.unwrap_all(obj)
    leaves = [out["state"][k] for k in state] + [out["list"][0], out["pair"].first,
                                                 *out["set"], out["deque"][0]]
    assert not any(isinstance(t, ss.SafeSparseTensor) for t in leaves)
    assert out["state"]._metadata == {"": {"version": 1}}
    assert isinstance(out["pair"], Pair) and out["pair"].second == 1
    assert isinstance(out["list"][0], torch.nn.Parameter) and out["list"][0].requires_grad
    for key, t in list(state.items())[:-1]:  # the sparse ones: no copy of tensor data
        assert out["state"][key].layout == t.layout
        assert ss.unwrap(t).values().data_ptr() == out["state"][key].values().data_ptr()
    # the input is unchanged
    assert all(isinstance(state[f"{n}.weight"], ss.SafeSparseTensor) for n in LAYOUTS)
    assert isinstance(obj["list"][0], ss.SafeSparseTensor)
    assert ss.unwrap_all({"x": 1, "y": [torch.ones(1)]})["x"] == 1


def _run_without_safesparse(code: str, *args: str | Path,
                            cwd: Path) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter where ``import safesparse`` fails, whatever the environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    prelude = "import sys; sys.modules['safesparse'] = None\n"
    argv = [sys.executable, "-c", prelude + textwrap.dedent(code), *map(str, args)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_saved_checkpoint_loads_in_plain_torch_without_safesparse(tmp_path: Path) -> None:
    state = safe_state()
    portable, unportable = tmp_path / "portable.pt", tmp_path / "unportable.pt"
    ss.save({"state": state, "leaf": ss.sparse_csr_tensor(
        [0, 1], [0], [1.0], (1, 1), requires_grad=True)}, portable)
    torch.save({"state": state}, unportable)  # plain torch.save of SafeSparseTensors
    proc = _run_without_safesparse(
        """
        import json, sys, torch
        try:
            import safesparse
        except ImportError:
            pass
        else:
            raise AssertionError("safesparse is importable")
        out = {"unsafe_globals": torch.serialization.get_unsafe_globals_in_checkpoint(sys.argv[1])}
        obj = torch.load(sys.argv[1], weights_only=True)
        out["dense"] = {k: v.to_dense().tolist() for k, v in obj["state"].items()}
        out["types"] = {k: type(v).__name__ for k, v in obj["state"].items()}
        out["metadata"] = obj["state"]._metadata
        out["leaf"] = [type(obj["leaf"]).__name__, obj["leaf"].requires_grad]
        try:
            torch.load(sys.argv[2], weights_only=True)
        except Exception as exc:
            out["unportable"] = type(exc).__name__
        print(json.dumps(out))
        """,
        portable, unportable, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["unsafe_globals"] == []
    assert out["types"] == {**{f"{n}.weight": "Tensor" for n in LAYOUTS}, "bias": "Tensor"}
    for name in LAYOUTS:
        assert out["dense"][f"{name}.weight"] == DENSE.tolist()
    assert out["metadata"] == {"": {"version": 1}}
    assert out["leaf"] == ["Parameter", True]
    assert out["unportable"] == "UnpicklingError"  # what ss.save is for

    back = ss.load(portable)
    for name in LAYOUTS:
        t = back["state"][f"{name}.weight"]
        assert isinstance(t, ss.SafeSparseTensor) and ss.is_checked(t)
        assert torch.equal(t.to_dense(), DENSE)
    assert ss.is_checked(back["leaf"]) and back["leaf"].requires_grad and back["leaf"].is_leaf


def test_save_accepts_torch_save_keywords(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    ss.save({"w": ss.validate(DENSE.to_sparse_csr())}, path,
            _use_new_zipfile_serialization=False)
    assert not path.read_bytes().startswith(b"PK")
    assert ss.is_checked(ss.load(path)["w"])

"""Enforce mode and torch's aten constructors (SPEC section 8, issue 27 item 3).

``torch.ops.aten.sparse_csr_tensor`` (and its ``crow_col_value_size`` overload),
``aten.sparse_bsr_tensor.crow_col_value_size``, ``aten.sparse_compressed_tensor``,
``aten.sparse_coo_tensor.indices_size`` and ``aten._sparse_coo_tensor_with_dims_and_tensors``
returned plain, unvalidated tensors under enforce mode (FX graphs and decompositions call them by
name); the CSR/BSR ones segfaulted at the next product. Every aten sparse constructor packet and
overload is now validated, looked up at call time. The crash-prone reproducers run in a child
process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.batch import Batch, child_env

import safesparse as ss
from safesparse.enforcement import mode as _enforce_fn  # noqa: F401  (the package attribute is the function)
from safesparse_hooks import env

enforce_module = sys.modules["safesparse.enforcement.mode"]
ATEN_CONSTRUCTORS: tuple[str, ...] = enforce_module.ATEN_CONSTRUCTORS
ROOT = Path(__file__).resolve().parents[2]
ORIGINAL = {name: getattr(torch.ops.aten, name) for name in ATEN_CONSTRUCTORS}


@pytest.fixture(autouse=True)
def _no_enforcement_leaks() -> Iterator[None]:
    yield
    assert not ss.is_enforced()
    for name, packet in ORIGINAL.items():
        assert getattr(torch.ops.aten, name) is packet, f"torch.ops.aten.{name} left wrapped"


# ---------------------------------------------------------------------------------------------
# The issue's reproducers, with the product that used to crash (child processes)

REPRODUCERS = {
    "sparse_csr_tensor": "aten.sparse_csr_tensor(crow, col, vals, [2, 2])",
    "sparse_csr_tensor.crow_col_value_size":
        "aten.sparse_csr_tensor.crow_col_value_size(crow, col, vals, [2, 2])",
    "sparse_bsr_tensor.crow_col_value_size":
        "aten.sparse_bsr_tensor.crow_col_value_size(crow, col, blocks, [2, 2])",
    "sparse_compressed_tensor":
        "aten.sparse_compressed_tensor(crow, col, vals, [2, 2], layout=torch.sparse_csr)",
    "sparse_coo_tensor.indices_size": "aten.sparse_coo_tensor.indices_size(idx, vals, [2, 2])",
    "_sparse_coo_tensor_with_dims_and_tensors":
        "aten._sparse_coo_tensor_with_dims_and_tensors(2, 0, [2, 2], idx, vals, "
        "layout=torch.sparse_coo)",
}


# One child process runs every reproducer (tests/support/batch.py): a read out of bounds
# would crash it.
CHILDREN = Batch("aten reproducers", env=child_env(ROOT, drop=env.VARIABLES))
for _call, _build in REPRODUCERS.items():
    CHILDREN.add(_call, f"""
        import warnings; warnings.filterwarnings("ignore")
        import torch, safesparse as ss
        aten = torch.ops.aten
        x = torch.ones(2, 3)
        def build(bad):
            far = 10**7 if bad else 1
            crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, far])
            vals, blocks = torch.ones(2), torch.ones(2, 1, 1)
            idx = torch.tensor([[0, 1], [0, far]])
            return {_build}
        with ss.enforce():
            try:
                bad = build(True)
                print("BUILT", type(bad).__name__, flush=True)
                print((bad @ x).sum())  # torch 2.13: a read far out of bounds
            except ss.InvariantError as err:
                print("REFUSED", err.invariant, err.op)
            ok = build(False)
            print("OK", type(ok).__name__, ss.is_checked(ok), (ok @ x).sum().item())
    """)


@CHILDREN.mark
@pytest.mark.parametrize("call", sorted(REPRODUCERS))
def test_issue_reproducer_is_refused_and_valid_data_is_checked(call: str) -> None:
    proc = CHILDREN.run(call)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    layout_id = "5.2" if "coo" in call else "5.5"
    assert proc.stdout.splitlines() == [f"REFUSED {layout_id} torch.ops.aten.{call}",
                                        "OK SafeSparseTensor True 6.0"]


# ---------------------------------------------------------------------------------------------
# Every packet and every overload (in process: an invalid result is never read)


def _family(name: str) -> str:
    if "coo" in name:
        return "coo"
    return "csc" if ("csc" in name or "bsc" in name) else "csr"


def _args(name: str, overload: str | None, bad: bool) -> tuple[list[Any], dict[str, Any]] | None:
    """Arguments for ``aten.<name>[.<overload>]`` built from its schema, with data that breaks
    one index invariant (``bad``; COO 5.3 via ``is_coalesced=True``, compressed 5.6) or none;
    ``None`` when the overload takes no index data."""
    packet = ORIGINAL[name]
    schemas = [getattr(packet, o)._schema for o in ([overload] if overload else
                                                     packet.overloads())]
    # the packet: called with the arguments of its fullest overload with index data
    schema = max(schemas, key=lambda s: ("values" in [a.name for a in s.arguments],
                                         "out" not in [a.name for a in s.arguments],
                                         len(s.arguments)))
    names = [a.name for a in schema.arguments]
    if "values" not in names or "out" in names:
        return None  # builds from dims alone, or writes into an ``out`` tensor
    family = _family(name)
    blocked = "bsr" in name or "bsc" in name
    plain = torch.tensor([1, 0] if bad else [0, 1])
    given: dict[str, Any] = {
        "indices": torch.tensor([[1, 0]] if bad else [[0, 1]]),
        "values": torch.ones(2, 1, 1) if blocked else torch.ones(2),
        "size": [2] if family == "coo" else ([1, 2] if family == "csr" else [2, 1]),
        "sparse_dim": 1, "dense_dim": 0,
    }
    for compressed in ("crow_indices", "ccol_indices", "compressed_indices"):
        given[compressed] = torch.tensor([0, 2])
    for plain_name in ("col_indices", "row_indices", "plain_indices"):
        given[plain_name] = plain
    args, kwargs = [], {}
    for argument in schema.arguments:
        if argument.kwarg_only:
            break
        args.append(given[argument.name])
    if family == "coo":
        kwargs["is_coalesced"] = True
    if "layout" in names and ("compressed" in name or "with_dims" in name):
        kwargs["layout"] = torch.sparse_coo if family == "coo" else torch.sparse_csr
    return args, kwargs


def _calls() -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for name in ATEN_CONSTRUCTORS:
        for overload in [None, *ORIGINAL[name].overloads()]:
            if _args(name, overload, True) is not None:
                out.append((name, overload))
    return out


CALLS = _calls()


def test_the_calls_cover_the_issue_s_constructors() -> None:
    named = {f"{n}.{o}" if o else n for n, o in CALLS}
    assert {"sparse_csr_tensor", "sparse_csr_tensor.crow_col_value_size",
            "sparse_bsr_tensor.crow_col_value_size", "sparse_compressed_tensor",
            "sparse_coo_tensor.indices_size",
            "_sparse_coo_tensor_with_dims_and_tensors"} <= named
    assert len(CALLS) >= 30


@pytest.mark.parametrize(("name", "overload"), CALLS,
                         ids=[f"{n}.{o}" if o else n for n, o in CALLS])
def test_every_packet_and_overload_is_validated(name: str, overload: str | None) -> None:
    def call(bad: bool) -> Any:
        built = _args(name, overload, bad)
        assert built is not None
        args, kwargs = built
        packet = getattr(torch.ops.aten, name)  # looked up at call time, as FX code does
        return (getattr(packet, overload) if overload else packet)(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outside = call(True)  # torch's own: invalid data accepted, never read here
        assert type(outside) is torch.Tensor
        with ss.enforce():
            try:
                call(True)
            except ss.InvariantError as err:
                refused = err
            else:
                pytest.fail("invalid data built unchecked")  # (the result is not read)
            ok = call(False)
    assert refused.invariant == ("5.3" if _family(name) == "coo" else "5.6")
    op = f"torch.ops.aten.{name}" + (f".{overload}" if overload else "")
    assert refused.op == op and refused.built_by is not None
    assert refused.built_by.startswith(f"{op} at ")
    assert isinstance(ok, ss.SafeSparseTensor) and ss.is_checked(ok)
    assert torch.equal(ok.to_dense(), ss.unwrap(ok).to_dense())


def test_every_aten_sparse_constructor_is_wrapped() -> None:
    """Every aten operator named like a sparse constructor (``sparse_coo_tensor``,
    ``_sparse_bsr_tensor_unsafe``, ``_sparse_coo_tensor_with_dims_and_tensors`` ...) in torch's
    registry is on enforce mode's list."""
    pattern = re.compile(r"^aten::(_?sparse_(coo|csr|csc|bsr|bsc|compressed)_tensor\w*)$")
    names = {m.group(1) for s in torch._C._jit_get_all_schemas()
             if (m := pattern.match(s.name))}
    assert names, "no aten sparse constructors found"
    assert names <= set(ATEN_CONSTRUCTORS), sorted(names - set(ATEN_CONSTRUCTORS))


def test_out_overload_is_validated() -> None:
    out = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.ones(0), (2,),
                                  check_invariants=True)
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.out(
            1, 0, [2], torch.tensor([[0, 5]]), torch.ones(2), out=out)
    assert info.value.invariant == "5.2"


# ---------------------------------------------------------------------------------------------
# The stand-ins pass for torch's operators


def test_stand_ins_pass_for_the_packet_and_its_overloads() -> None:
    packet = ORIGINAL["sparse_csr_tensor"]
    overload = packet.crow_col_value_size
    with ss.enforce():
        ours = torch.ops.aten.sparse_csr_tensor
        assert ours is not packet
        assert isinstance(ours, torch._ops.OpOverloadPacket)
        assert ours == packet and packet == ours and hash(ours) == hash(packet)
        assert {ours: 1}[packet] == 1 and {packet: 1}[ours] == 1  # registries keyed either way
        assert (repr(ours), str(ours)) == (repr(packet), str(packet))
        assert ours.overloads() == packet.overloads() and ours.__name__ == packet.__name__
        theirs = ours.crow_col_value_size
        assert theirs is ours.crow_col_value_size  # made once, then kept
        assert theirs is not overload and theirs == overload and hash(theirs) == hash(overload)
        assert isinstance(theirs, torch._ops.OpOverload)
        assert theirs._schema == overload._schema and theirs.overloadpacket is packet
        from torch.jit import _builtins

        assert _builtins._find_builtin(ours) == "aten::sparse_csr_tensor"
    assert torch.ops.aten.sparse_csr_tensor is packet
    assert _builtins._find_builtin(ours) is None  # forgotten with the stand-in


def test_stand_ins_outlive_their_block() -> None:
    """torch's dispatcher caches a borrowed pointer to the Python operator it finds at
    ``torch.ops.aten.<name>.<overload>``; found during a block (a validating ``torch.load``
    does), a stand-in freed at the block's end left it dangling: the next load that dispatches
    to Python (``weights_only=False``) segfaulted. Stand-ins are made once and kept."""
    code = textwrap.dedent("""
        import gc, io, os, tempfile, warnings; warnings.filterwarnings("ignore")
        import torch, safesparse as ss
        good = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]),
                                       torch.ones(2), (2, 2))
        buf = io.BytesIO(); torch.save([good], buf); buf.seek(0)
        with ss.enforce():
            first = torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size
            print(ss.is_checked(torch.load(buf)[0]))
        gc.collect()
        path = os.path.join(tempfile.mkdtemp(), "w.pt")
        torch.save({"w": good}, path)
        print(ss.is_checked(ss.load(path, weights_only=False)["w"]), flush=True)
        with ss.enforce():
            print(torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size is first)
    """)
    environ = {k: v for k, v in os.environ.items() if k not in env.VARIABLES}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["True", "True", "True"]


def test_fx_graph_calls_the_constructor_by_name() -> None:
    """An FX graph's code names ``torch.ops.aten.<op>.<overload>``: run under enforce mode,
    it is validated whether the graph was made before or inside the block."""
    import torch.fx as fx

    graph = fx.Graph()
    crow, col, values = (graph.placeholder(n) for n in ("crow", "col", "values"))
    graph.output(graph.call_function(ORIGINAL["sparse_csr_tensor"].crow_col_value_size,
                                     (crow, col, values, [1, 3])))
    module = fx.GraphModule(torch.nn.Module(), graph)
    assert "torch.ops.aten.sparse_csr_tensor.crow_col_value_size(" in module.code
    with ss.enforce():
        with pytest.raises(ss.InvariantError) as info:
            module(torch.tensor([0, 2]), torch.tensor([0, 10**7]), torch.ones(2))
        ok = module(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.ones(2))
    assert info.value.invariant == "5.5"
    assert isinstance(ok, ss.SafeSparseTensor) and ss.is_checked(ok)


def test_below_autograd_the_validated_result_stays_plain() -> None:
    """Inside a dispatch mode (or a ``__torch_dispatch__`` handler) torch's plain tensor is
    handed back, validated; invalid data is refused there too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Logging(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with ss.enforce(), Logging():
        ok = torch.ops.aten.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), [2])
        with pytest.raises(ss.InvariantError):
            torch.ops.aten.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.ones(2), [2])
    assert type(ok) is torch.Tensor and ok.layout == torch.sparse_coo
    assert seen and all("sparse_coo_tensor" in s or "lift_fresh" in s or "_to_copy" in s
                        or "ones" in s for s in seen), seen  # validation is no part of it

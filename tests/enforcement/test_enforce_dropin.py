"""Enforce mode changes nothing but the refusal of invalid data (SPEC section 8, issue 26 item 7).

An enforced program prints what it prints without safesparse (byte for byte), TorchScript
compiles what it compiled (every wrapped torch function is usable from scripted code; PyG's
scripted ``GCNConv``), tensors without data (``meta``, ``FakeTensor``) and tensor subclasses
that dispatch in Python (torch's ``MaskedTensor``) are torch's business, and a refusal names the
call that built the tensor and where it was made.

Programs that switch enforce mode on for the whole process run in a child process.
"""

from __future__ import annotations

import functools
import linecache
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safesparse as ss
from safesparse.tensor import printing as _printing
from safesparse_hooks import env

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("sparse_coo_tensor", "sparse_compressed_tensor", "sparse_csr_tensor",
         "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor")
BUILTIN = {n: getattr(torch._C._VariableFunctions, n) for n in NAMES}


def _child(code: str, *, enforce: bool, cwd: Path | None = None,
           args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in env.VARIABLES}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    if enforce:
        environ[env.ENFORCE] = "1"
    argv = args if args is not None else ["-c", textwrap.dedent(code)]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=environ,
                          cwd=cwd, timeout=600)


@pytest.fixture(autouse=True)
def _no_enforcement_leaks() -> Iterator[None]:
    yield
    assert not ss.is_enforced()
    for name in NAMES:
        assert getattr(torch, name) is BUILTIN[name], f"torch.{name} left wrapped"


# ---------------------------------------------------------------------------------------------
# Printing


#: A program that prints sparse tensors the ways programs do. Run plain and enforced, its
#: stdout must be the same bytes; stderr gets the types it printed (to show it was enforced).
PRINTS = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch

i, v = torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0])
crow, col = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 2])
tensors = {
    "coo": torch.sparse_coo_tensor(i, v, (2, 3)),
    "coo_f64": torch.sparse_coo_tensor(i, v.double(), (2, 3)),
    "coo_int": torch.sparse_coo_tensor(i, v.int(), (2, 3)),
    "coo_hybrid": torch.sparse_coo_tensor(i, torch.arange(6.0).reshape(3, 2), (2, 3, 2)),
    "csr": torch.sparse_csr_tensor(crow, col, v, (2, 3)),
    "csr_wide": torch.sparse_csr_tensor(torch.arange(0, 121, 2), torch.arange(120) % 40,
                                        torch.arange(120.0) / 7, (60, 40)),
    "csc": torch.sparse_csc_tensor(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 0, 1]), v,
                                   (2, 3)),
    "bsr": torch.sparse_bsr_tensor(torch.tensor([0, 1]), torch.tensor([0]),
                                   torch.ones(1, 2, 2), (2, 2)),
    "bsc_f16": torch.sparse_bsc_tensor(torch.tensor([0, 1]), torch.tensor([0]),
                                       torch.ones(1, 2, 2, dtype=torch.float16), (2, 2)),
    "batched": torch.sparse_csr_tensor(torch.tensor([[0, 1, 2], [0, 2, 2]]),
                                       torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2),
                                       (2, 2, 2)),
    "compressed": torch.sparse_compressed_tensor(crow, col, v, (2, 3),
                                                 layout=torch.sparse_csr),
    "empty": torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0),
                                     (2, 3)),
    "leaf": torch.sparse_coo_tensor(i, v, (2, 3), requires_grad=True),
    "values_grad": torch.sparse_csr_tensor(crow, col, v.clone().requires_grad_(), (2, 3)),
    "legacy": torch.sparse.FloatTensor(i, v, torch.Size([2, 3])),
    "aten": torch.ops.aten.sparse_csr_tensor.crow_col_value_size(crow, col, v, [2, 3]),
}
tensors["op"] = tensors["values_grad"] * 2
tensors["transposed"] = tensors["csr"].t()
tensors["parameter"] = torch.nn.Parameter(torch.sparse_csr_tensor(crow, col, v, (2, 3)))
for name, t in tensors.items():
    sys.stderr.write(type(t).__name__ + "\\n")
    print(name)
    print(t)
    print(repr(t))
    print(f"{t}")
print([tensors["coo"], tensors["csr"]])
torch.set_printoptions(linewidth=40, precision=2)
print(tensors["csr_wide"])
print(tensors["op"])
print(tensors["leaf"])
torch.set_printoptions(profile="default")

def doctested():
    '''
    >>> a = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (2,))
    >>> a
    tensor(indices=tensor([[0, 1]]),
           values=tensor([1., 2.]),
           size=(2,), nnz=2, layout=torch.sparse_coo)
    '''

import doctest
print(doctest.run_docstring_examples(doctested, {"torch": torch}, name="doctested"))
"""


def test_an_enforced_program_prints_exactly_what_torch_prints() -> None:
    plain = _child(PRINTS, enforce=False)
    enforced = _child(PRINTS, enforce=True)
    assert plain.returncode == 0, plain.stderr
    assert enforced.returncode == 0, enforced.stderr
    assert "SafeSparseTensor" in enforced.stderr  # enforced: safesparse's tensors printed
    assert "SafeSparseTensor" not in plain.stderr
    assert "Failed example" not in enforced.stdout  # the doctest passes
    assert enforced.stdout == plain.stdout


CASES: dict[str, Callable[[Any], torch.Tensor]] = {
    "coo": lambda m: m.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]),
                                         torch.tensor([3.0, 4.0, 5.0]), (2, 3)),
    "csr_f64": lambda m: m.sparse_csr_tensor(torch.tensor([0, 1, 3]), torch.tensor([2, 0, 2]),
                                             torch.tensor([3.0, 4.0, 5.0]).double(), (2, 3)),
    "bsc": lambda m: m.sparse_bsc_tensor(torch.tensor([0, 1]), torch.tensor([0]),
                                         torch.arange(4.0).reshape(1, 2, 2), (2, 2)),
    "leaf": lambda m: m.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (2,),
                                          requires_grad=True),
    "grad_fn": lambda m: m.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]),
                                             torch.ones(1, requires_grad=True), (1, 1)) * 3,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_repr_is_torch_s_inside_enforce_and_names_the_state_outside(case: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = CASES[case](torch)
        ours = CASES[case](ss)
    assert isinstance(ours, ss.SafeSparseTensor) and type(theirs) is torch.Tensor
    with ss.enforce():
        assert repr(ours) == repr(theirs)
        assert str(ours) == str(theirs)
        p, q = torch.nn.Parameter(ours.detach()), torch.nn.Parameter(theirs.detach())
        assert repr(p) == repr(q) and repr(p).startswith("Parameter containing:\ntensor(")
    assert repr(ours).startswith("SafeSparseTensor(checked=True, ")
    assert repr(p).startswith("Parameter(SafeSparseTensor(checked=True, ")


def test_an_unchecked_invalid_tensor_prints_without_reading_its_data() -> None:
    """torch's printer reads the members only: bad data can be printed for diagnosis."""
    args = (torch.tensor([0, 2]), torch.tensor([1, 10**9]), torch.ones(2), (1, 3))
    bad = ss.sparse_csr_tensor(*args, check_invariants=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.sparse_csr_tensor(*args, check_invariants=False)
    with ss.enforce():
        assert repr(bad) == repr(theirs)
    assert "checked=False" in repr(bad) and "1000000000" in repr(bad)
    assert not ss.is_checked(bad)


def test_a_grad_suffix_is_placed_as_torch_places_it() -> None:
    """The autograd suffix goes on the last line or a new one by torch's own line-width rule."""
    values = torch.arange(12.0, requires_grad=True)
    make = {m: (lambda m=m: m.sparse_csr_tensor(torch.arange(13), torch.zeros(12, dtype=torch.long),
                                                values, (12, 1)) * 2) for m in (ss, torch)}
    for linewidth in (30, 45, 60, 80, 120):
        torch.set_printoptions(linewidth=linewidth)
        try:
            ours, theirs = make[ss](), make[torch]()
            with ss.enforce():
                assert repr(ours) == repr(theirs), linewidth
            assert _printing.torch_text(ours) == repr(theirs)
        finally:
            torch.set_printoptions(profile="default")


# ---------------------------------------------------------------------------------------------
# TorchScript


#: A call of every torch function enforce mode wraps that TorchScript can compile, with the
#: names TorchScript resolves them by (``torch.<name>``, ``torch.ops.aten.<name>``).
SCRIPTED = {
    "sparse_coo_tensor": "torch.sparse_coo_tensor(i, v, [3])",
    "sparse_csr_tensor": "torch.sparse_csr_tensor(c, p, v, [1, 3])",
    "sparse_csc_tensor": "torch.sparse_csc_tensor(c, p, v, [3, 1])",
    "sparse_bsr_tensor": "torch.sparse_bsr_tensor(c, p, b, [1, 3])",
    "sparse_bsc_tensor": "torch.sparse_bsc_tensor(c, p, b, [3, 1])",
    "sparse_compressed_tensor": "torch.sparse_compressed_tensor(c, p, v, [1, 3], "
                                "layout=torch.sparse_csr)",
    "coo_to_csr": "torch._convert_indices_from_coo_to_csr(r, 3)",
    "csr_to_coo": "torch._convert_indices_from_csr_to_coo(c, p, transpose=True)",
    "aten.sparse_coo_tensor": "torch.ops.aten.sparse_coo_tensor(i, v, [3])",
    "aten._sparse_coo_tensor_unsafe": "torch.ops.aten._sparse_coo_tensor_unsafe(i, v, [3])",
    "aten._sparse_coo_tensor_with_dims_and_tensors":
        "torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(1, 0, [3], i, v, "
        "layout=torch.sparse_coo)",
    "aten._sparse_coo_tensor_with_dims":
        "torch.ops.aten._sparse_coo_tensor_with_dims(1, 0, [3], layout=torch.sparse_coo)",
    "aten.sparse_csr_tensor": "torch.ops.aten.sparse_csr_tensor(c, p, v, [1, 3])",
    "aten.sparse_bsr_tensor": "torch.ops.aten.sparse_bsr_tensor(c, p, b, [1, 3])",
    "aten.sparse_compressed_tensor": "torch.ops.aten.sparse_compressed_tensor(c, p, v, [1, 3], "
                                     "layout=torch.sparse_csr)",
    "aten._sparse_csr_tensor_unsafe": "torch.ops.aten._sparse_csr_tensor_unsafe(c, p, v, [1, 3])",
    "aten._sparse_compressed_tensor_unsafe":
        "torch.ops.aten._sparse_compressed_tensor_unsafe(c, p, v, [1, 3], layout=torch.sparse_csr)",
}


def _script(call: str) -> str:
    """The graph TorchScript compiles for a fresh function making ``call`` (a new code object
    each time: ``torch.jit.script`` caches by function), or the error's type name."""
    source = ("def f(i: torch.Tensor, v: torch.Tensor, c: torch.Tensor, p: torch.Tensor,\n"
              "      b: torch.Tensor, r: torch.Tensor):\n"
              f"    return {call}\n")
    filename = "<scripted>"  # TorchScript reads the source back through linecache
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope: dict[str, Any] = {"torch": torch, "__name__": "scripted"}
    exec(compile(source, filename, "exec"), scope)  # our own source
    try:
        return str(torch.jit.script(scope["f"]).graph)
    except Exception as err:  # compared with what TorchScript did outside enforce mode
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_every_wrapped_torch_function_scripts_as_before(name: str) -> None:
    """Issue 26: torch.jit.script of code reaching torch._convert_indices_from_coo_to_csr
    failed under enforce ("module, class, method, function ... expected, got
    builtin_function_or_method"); so would every aten packet's stand-in."""
    before = _script(SCRIPTED[name])
    with ss.enforce():
        assert ss.is_enforced()
        during = _script(SCRIPTED[name])
    assert before.startswith("graph("), before  # TorchScript compiles each of these calls
    assert during == before
    assert _script(SCRIPTED[name]) == before  # and again once the wrappers are gone


def test_scripted_pyg_gcnconv_runs_under_enforce() -> None:
    pytest.importorskip("torch_geometric")
    code = """
        import warnings; warnings.filterwarnings("ignore")
        import torch
        import safesparse as ss
        from torch_geometric.nn import GCNConv
        from torch_geometric.utils import to_torch_csr_tensor
        assert ss.is_enforced()
        torch.manual_seed(0)
        conv = GCNConv(4, 3)
        scripted = torch.jit.script(conv)
        x = torch.randn(5, 4)
        edge_index = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
        print("SCRIPTED", torch.allclose(scripted(x, edge_index), conv(x, edge_index)))
        adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(5, 5))  # PyG's adj_t
        print("ADJ", type(adj_t).__name__, ss.is_checked(adj_t))
        print("EAGER", torch.allclose(conv(x, adj_t), conv(x, edge_index), atol=1e-6))
        try:
            to_torch_csr_tensor(torch.tensor([[0, 1, 10**7], [1, 0, 2]]), size=(3, 3))
            print("NOT REFUSED")
        except ss.InvariantError as err:
            print("REFUSED", err.invariant)
    """
    proc = _child(code, enforce=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:4] == ["SCRIPTED True", "ADJ SafeSparseTensor True",
                                           "EAGER True", "REFUSED 5.2"]


# ---------------------------------------------------------------------------------------------
# Tensors without data, and subclasses that dispatch in Python


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        out = fn()
    except Exception as err:  # compared with what torch does outside enforce mode
        return f"raises {type(err).__name__}"
    return f"{type(out).__name__} {getattr(out, 'layout', None)} {tuple(out.shape)}"


def _fake_cases() -> dict[str, Callable[[], Any]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    crow, col, v = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2)
    mode = FakeTensorMode()

    def in_fake(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with FakeTensorMode():
                return fn()
        return run

    return {
        "fake coo factory": in_fake(lambda: torch.sparse_coo_tensor(
            torch.tensor([[0, 1]]), torch.ones(2), (3,))),
        "fake aten overload": in_fake(lambda: torch.ops.aten._sparse_coo_tensor_unsafe.default(
            torch.tensor([[0, 1]]), torch.ones(2), [3])),
        "from_tensor coo": lambda: mode.from_tensor(
            torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (3,))),
        "from_tensor csr": lambda: mode.from_tensor(torch.sparse_csr_tensor(crow, col, v, (2, 2))),
        "from_tensor bsc": lambda: mode.from_tensor(torch.sparse_bsc_tensor(
            torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2, 2), (2, 2))),
        "meta factory": lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2),
                                                        (3,), device="meta"),
        "meta members": lambda: torch.sparse_csr_tensor(crow.to("meta"), col.to("meta"),
                                                        v.to("meta"), (2, 2)),
        "meta with dims": lambda: torch.ops.aten._sparse_compressed_tensor_with_dims(
            2, 0, [2, 2], [], torch.int64, layout=torch.sparse_csr, device="meta"),
    }


@pytest.mark.parametrize("case", sorted(_fake_cases()))
def test_tensors_without_data_are_torch_s_business(case: str) -> None:
    """Before: enforce mode refused meta factories ([COO 4.1]) and fake tensors
    (DataDependentOutputException); wrapping the aten overloads would have broken
    ``FakeTensorMode.from_tensor``, which calls them on meta tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = _outcome(_fake_cases()[case])
        with ss.enforce():
            during = _outcome(_fake_cases()[case])
    assert not before.startswith("raises"), before
    assert during == before


MASKED = """
import functools, sys, warnings
warnings.filterwarnings("ignore")
print = functools.partial(print, flush=True)
import torch
mode = sys.argv[1]
if mode != "plain":
    import safesparse as ss
    if mode == "before":  # MaskedTensor's dispatch table filled with torch's own packets
        import torch.masked.maskedtensor._ops_refs
    ss.set_enforce(True)
from torch.masked import masked_tensor

i = torch.tensor([[0, 1, 1], [2, 0, 2]])
bad_i = torch.tensor([[0, 1, 9], [2, 0, 2]])
v, m = torch.tensor([3.0, 4.0, 5.0]), torch.tensor([True, False, True])
mv = masked_tensor(v, m)
aten = torch.ops.aten

def show(name, fn, bad=False):
    if bad and mode == "plain":
        return  # plain torch builds it and corrupts the heap when it is read
    try:
        r = fn()
    except Exception as err:
        print(name, "raises", type(err).__name__, str(err)[:9])
        return
    data = r.get_data() if hasattr(r, "get_data") else r
    mask = r.get_mask().to_dense().tolist() if hasattr(r, "get_mask") else None
    print(name, type(r).__name__, data.to_dense().tolist(), mask)

show("factory", lambda: torch.sparse_coo_tensor(i, mv, (2, 3)))
show("factory_bad", lambda: torch.sparse_coo_tensor(bad_i, mv, (2, 3)), bad=True)
show("with_dims", lambda: aten._sparse_coo_tensor_with_dims_and_tensors(
    2, 0, [2, 3], i, mv, layout=torch.sparse_coo))
show("with_dims_bad", lambda: aten._sparse_coo_tensor_with_dims_and_tensors(
    2, 0, [2, 3], bad_i, mv, layout=torch.sparse_coo), bad=True)
show("unsafe", lambda: aten._sparse_coo_tensor_unsafe(i, mv, [2, 3]))
sparse = masked_tensor(torch.sparse_coo_tensor(i, v, (2, 3)),
                       torch.sparse_coo_tensor(i, m, (2, 3)))
show("add", lambda: sparse + sparse)
show("sin", lambda: torch.sin(sparse))
dense = masked_tensor(torch.tensor([[0.0, 0, 3], [4, 0, 5]]),
                      torch.tensor([[False, False, True], [True, False, True]]))
show("to_sparse_coo", lambda: dense.to_sparse_coo())
show("to_sparse_csr", lambda: dense.to_sparse_csr())
csr = dense.to_sparse_csr()
show("csr_add", lambda: csr + csr)
"""


@functools.cache
def _masked(mode: str) -> subprocess.CompletedProcess[str]:
    """MASKED run in a child of its own (``plain``: torch alone, run once for both orders)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "masked.py"
        script.write_text(MASKED)
        return _child("", enforce=False, args=[str(script), mode])


@pytest.mark.xdist_group("masked tensor")  # one worker: the plain run is shared
@pytest.mark.parametrize("order", ["before", "after"])
def test_masked_tensor_works_as_in_torch_and_its_bad_indices_are_refused(order: str) -> None:
    """Last round's finding: replacing ``aten._sparse_coo_tensor_with_dims_and_tensors``
    broke torch's MaskedTensor (its dispatch table is keyed by the packet); before that,
    enforce mode already broke ``torch.sparse_coo_tensor(indices, masked_values, size)``."""
    plain = _masked("plain")
    enforced = _masked(order)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert enforced.returncode == 0, enforced.stderr[-2000:]
    lines = enforced.stdout.splitlines()
    refusals = [line for line in lines if "_bad" in line.split()[0]]
    assert refusals == ["factory_bad raises InvariantError [COO 5.2]",
                        "with_dims_bad raises InvariantError [COO 5.2]"]
    assert [line for line in lines if line not in refusals] == plain.stdout.splitlines()
    assert "with_dims MaskedTensor" in plain.stdout  # the table's route ran


def test_inductor_imports_under_enforce() -> None:
    """inductor registers a fallback for ``aten._sparse_coo_tensor_with_dims_and_tensors``
    when first imported; ``make_fallback`` raises for anything that is not an operator."""
    code = """
        import torch, safesparse as ss
        assert ss.is_enforced()
        assert type(torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors).__name__ == "AtenOp"
        import torch._inductor.lowering as lowering
        print(torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default
              in lowering.lowerings)
    """
    proc = _child(code, enforce=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True"]


# ---------------------------------------------------------------------------------------------
# Refusals name the building call and its place


def test_refusal_names_the_building_call_and_its_place(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(textwrap.dedent("""
        import torch
        crow, col = torch.tensor([0, 1]), torch.tensor([10**7])
        adj = torch.sparse_csr_tensor(crow, col, torch.ones(1), (1, 2))
    """))
    for argv in (["user.py"], ["-m", "safesparse", "run", "user.py"]):
        proc = _child("", enforce=argv[0] == "user.py", cwd=tmp_path, args=argv)
        assert proc.returncode == 1, proc.stderr
        assert "(built by torch.sparse_csr_tensor at user.py:4)" in proc.stderr, proc.stderr


def _empty_coo() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.ones(0), (2,))


ROUTES: dict[str, tuple[str, Callable[[], Any]]] = {  # each call on its lambda's first line
    "factory": ("torch.sparse_coo_tensor",
                lambda: torch.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1), (2,))),
    "legacy": ("torch.sparse.FloatTensor",
               lambda: torch.sparse.FloatTensor(torch.tensor([[5]]), torch.ones(1),
                                                torch.Size([2]))),
    "aten packet": ("torch.ops.aten.sparse_coo_tensor",
                    lambda: torch.ops.aten.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1),
                                                             [2])),
    "aten overload": ("torch.ops.aten._sparse_coo_tensor_unsafe.default",
                      lambda: torch.ops.aten._sparse_coo_tensor_unsafe.default(
                          torch.tensor([[5]]), torch.ones(1), [2])),
    "Tensor.new": ("Tensor.new",
                   lambda: _empty_coo().new(torch.tensor([[5]]), torch.ones(1), torch.Size([2]))),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_names_its_call_and_place(route: str) -> None:
    """The factory route named nothing (the legacy route named the op, not the place)."""
    op, build = ROUTES[route]
    with warnings.catch_warnings(), ss.enforce(), pytest.raises(ss.InvariantError) as info:
        warnings.simplefilter("ignore")
        build()
    err = info.value
    assert (err.layout, err.invariant, err.op) == (torch.sparse_coo, "5.2", op)
    here = os.path.basename(__file__)  # the base name: the traceback has the path
    assert err.built_by == f"{op} at {here}:{build.__code__.co_firstlineno}"
    assert f"(built by {err.built_by})" in str(err)


def test_built_by_survives_pickling() -> None:
    import pickle

    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        torch.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1), (2,))
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.built_by == info.value.built_by and str(copy) == str(info.value)

"""Files that hide sparse tensors from validation or alias their index storage (issue 11).

Two kinds of crafted checkpoint, for every layout:

* **hidden constructors**: an invalid sparse tensor built while the file is read somewhere a
  key-path walk of dicts, lists and tuples does not look (a set, a dict key, a ``Counter``, an
  object attribute, ...), by torch's rebuild function, by a legacy typed constructor
  (``torch.sparse.FloatTensor``) or by an unsafe constructor. ``ss.load`` must refuse the file
  and ``check`` must exit 1.
* **aliasing**: a dense tensor (or another tensor's values, or a bare storage) on the same bytes
  as a valid sparse tensor's index members. ``ss.load`` gives the sparse tensor its own copy of
  its index members, so that writing through the other tensor cannot leave a checked tensor
  invalid; ``check`` reports it and exits 1.

Anything that would run a torch kernel on a bad tensor runs in a subprocess.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import safesparse as ss
from safesparse import cli
from safesparse.serialization import load_and_validate

ROOT = Path(__file__).resolve().parents[2]
COO, CSR, CSC, BSR, BSC = (
    torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc,
)
LAYOUTS = {"COO": COO, "CSR": CSR, "CSC": CSC, "BSR": BSR, "BSC": BSC}
BAD_INVARIANT = {"COO": "5.2", "CSR": "5.5", "CSC": "5.5", "BSR": "5.5", "BSC": "5.5"}

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning",
                                        "ignore:TypedStorage is deprecated:UserWarning",
                                        "ignore:.*support is in beta state:UserWarning")


# --- crafted objects -------------------------------------------------------------------------


class Reduce:
    """Pickles to ``func(*args)``: any callable the unpickler will call, any arguments."""

    def __init__(self, func: Any, *args: Any, **kwargs: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def __reduce__(self) -> tuple[Any, ...]:
        if self.kwargs:
            return (functools.partial(self.func, **self.kwargs), self.args)
        return (self.func, self.args)


def bad_members(name: str) -> tuple[Any, ...]:
    """Members of a tensor of layout ``name`` whose second stored element has index 10**9."""
    if name == "COO":
        return (torch.tensor([[0, 1], [0, 10**9]]), torch.tensor([1.0, 2.0]), (2, 3))
    values = torch.ones(2) if name in ("CSR", "CSC") else torch.ones(2, 2, 2)
    size = {"CSR": (2, 3), "CSC": (3, 2), "BSR": (4, 6), "BSC": (6, 4)}[name]
    return (torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]), values, size)


def rebuilt(name: str) -> Reduce:
    """What torch.save writes for a sparse tensor: ``torch._utils._rebuild_sparse_tensor``."""
    members = bad_members(name)
    if name == "COO":
        return Reduce(torch._utils._rebuild_sparse_tensor, COO, (*members, None))
    return Reduce(torch._utils._rebuild_sparse_tensor, LAYOUTS[name], members)


def build_unchecked(layout: torch.layout, *members: Any) -> torch.Tensor:
    """torch's unchecked aten constructors, which no Python factory stands in front of."""
    if layout == COO:
        indices, values, size = members
        return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            2, 0, list(size), indices, values, dtype=values.dtype, layout=COO)
    *tensors, size = members
    return torch.ops.aten._sparse_compressed_tensor_unsafe(
        *tensors, list(size), dtype=tensors[-1].dtype, layout=layout)


def unsafe(name: str) -> Reduce:
    """A function of the file's own calling torch's unchecked constructors (``weights_only=False``
    only: such a global is refused otherwise)."""
    return Reduce(build_unchecked, LAYOUTS[name], *bad_members(name))


def legacy(dtype_class: Any = None) -> Reduce:
    """A legacy typed constructor, ``torch.sparse.FloatTensor(indices, values, size)``."""
    indices, values, size = bad_members("COO")
    cls = dtype_class if dtype_class is not None else torch.sparse.FloatTensor
    return Reduce(cls, indices, values.to(torch.float64) if "Double" in cls.__name__ else values,
                  torch.Size(size))


class Holder:
    def __init__(self, item: Any) -> None:
        self.item = item


class Slotted:
    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item

    def __getstate__(self) -> Any:
        return (None, {"item": self.item})


def hide(place: str, item: Any) -> Any:
    """``item`` put in a hiding place of the loaded object."""
    return {
        "set": lambda: {"s": {item}},
        "dict key": lambda: {"w": {item: 1}},
        "Counter": lambda: {"c": collections.Counter({"x": item})},
        "frozenset": lambda: {"f": frozenset([item])},
        "deque": lambda: {"d": collections.deque([item])},
        "defaultdict": lambda: {"d": collections.defaultdict(int, {"x": item})},
        "attribute": lambda: {"o": Holder(item)},
        "slots": lambda: {"o": Slotted(item)},
        "partial": lambda: {"p": functools.partial(print, item)},  # unreachable for the walk
    }[place]()


PATHS = {"set": "['s']{0}", "dict key": "['w'].keys()[0]", "Counter": "['c']['x']",
         "frozenset": "['f']{0}", "deque": "['d'][0]", "defaultdict": "['d']['x']",
         "attribute": "['o'].item", "slots": "['o'].item", "partial": None}
WEIGHTS_ONLY_PLACES = ("set", "dict key", "Counter")


def write(tmp_path: Path, obj: Any, name: str = "f.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


# --- hidden constructors ---------------------------------------------------------------------

CASES = [
    pytest.param(name, how, place, weights_only,
                 id=f"{name}-{how}-{place.replace(' ', '_')}-wo{int(weights_only)}")
    for name in LAYOUTS
    for how in ("rebuild", "unsafe", "legacy")
    if not (how == "legacy" and name != "COO")
    for weights_only in (True, False)
    if not (how == "unsafe" and weights_only)  # not an allowed global
    for place in (WEIGHTS_ONLY_PLACES if weights_only else tuple(PATHS))
]


def crafted(name: str, how: str) -> Reduce:
    return {"rebuild": rebuilt, "unsafe": unsafe, "legacy": lambda _: legacy()}[how](name)


@pytest.mark.parametrize(("name", "how", "place", "weights_only"), CASES)
def test_hidden_invalid_tensor_is_refused(name: str, how: str, place: str, weights_only: bool,
                                          tmp_path: Path) -> None:
    path = write(tmp_path, hide(place, crafted(name, how)))
    with pytest.raises(ss.InvariantError) as info:
        ss.load(path, weights_only=weights_only)
    err = info.value
    assert (err.layout, err.invariant) == (LAYOUTS[name], BAD_INVARIANT[name]), str(err)
    assert err.path == PATHS[place]
    assert "1000000000" in str(err)


@pytest.mark.parametrize("cls", ["FloatTensor", "DoubleTensor"])
@pytest.mark.parametrize("place", WEIGHTS_ONLY_PLACES)
def test_every_legacy_typed_constructor_is_seen(cls: str, place: str, tmp_path: Path) -> None:
    path = write(tmp_path, hide(place, legacy(getattr(torch.sparse, cls))))
    with pytest.raises(ss.InvariantError, match=r"^\[COO 5\.2\]") as info:
        ss.load(path)
    assert info.value.path == PATHS[place]


@pytest.mark.parametrize("place", ["set", "dict key", "Counter", "attribute", "slots"])
def test_valid_tensors_in_hiding_places_come_back_checked(place: str, tmp_path: Path) -> None:
    good = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr()
    legacy_good = Reduce(torch.sparse.FloatTensor, torch.tensor([[0, 1]]), torch.ones(2),
                         torch.Size([2]))
    path = write(tmp_path, {"a": hide(place, good), "b": hide(place, legacy_good)})
    out = ss.load(path, weights_only=place in WEIGHTS_ONLY_PLACES)
    result = load_and_validate(path, weights_only=place in WEIGHTS_ONLY_PLACES)
    assert sorted(f.path for f in result.found) == sorted(
        f"['{k}']{PATHS[place]}" for k in "ab")
    for f in result.found:
        assert isinstance(f.item, ss.SafeSparseTensor) and ss.is_checked(f.item)
    # the checked tensors are in place of the plain ones, in every kind of container
    reach = {"set": lambda n: next(iter(n["s"])), "dict key": lambda n: next(iter(n["w"])),
             "Counter": lambda n: n["c"]["x"], "attribute": lambda n: n["o"].item,
             "slots": lambda n: n["o"].item}[place]
    for key in "ab":
        t = reach(out[key])
        assert isinstance(t, ss.SafeSparseTensor) and ss.is_checked(t)


def test_state_dict_metadata_and_counter_counts_survive(tmp_path: Path) -> None:
    state = collections.OrderedDict(w=torch.eye(2).to_sparse())
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    obj = {"state": state, "c": collections.Counter(a=3), "k": {torch.eye(2).to_sparse(): 1}}
    out = ss.load(write(tmp_path, obj))
    assert out["state"]._metadata == {"": {"version": 1}}
    assert out["c"] == collections.Counter(a=3)
    (key,) = out["k"]
    assert ss.is_checked(key) and out["k"][key] == 1


def test_unreachable_invalid_tensor_is_refused_without_a_path(tmp_path: Path) -> None:
    path = write(tmp_path, hide("partial", legacy()))
    with pytest.raises(ss.InvariantError, match=r"^\[COO 5\.2\]") as info:
        ss.load(path, weights_only=False)
    assert info.value.path is None
    assert "while loading" in str(info.value)  # names the op that built it
    result = load_and_validate(path, weights_only=False)
    assert [(f.path, f.error is not None) for f in result.found] == [(None, True)]


def test_check_reports_hidden_tensors_with_their_key_paths(tmp_path: Path) -> None:
    paths = [write(tmp_path, hide(place, legacy()), f"{i}.pt")
             for i, place in enumerate(WEIGHTS_ONLY_PLACES)]
    reports = cli.check_files(paths)
    assert cli.exit_code(reports) == cli.EXIT_INVALID
    keys = [[t.key for t in r.tensors] for r in reports]
    assert keys == [[PATHS[p]] for p in WEIGHTS_ONLY_PLACES]
    key_paths = [r.tensors[0].key_path for r in reports]
    assert key_paths == [["s", {"set_item": 0}], ["w", {"dict_key": 0}], ["c", "x"]]


# --- aliasing ----------------------------------------------------------------------------------


def valid(name: str) -> torch.Tensor:
    x = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 4.0],
                      [0.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 7.0]])
    return {"COO": lambda: x.to_sparse(), "CSR": x.to_sparse_csr, "CSC": x.to_sparse_csc,
            "BSR": lambda: x.to_sparse_bsr((2, 2)), "BSC": lambda: x.to_sparse_bsc((2, 2))}[name]()


def plain_indices(t: torch.Tensor) -> torch.Tensor:
    t = ss.unwrap(t)
    if t.layout == COO:
        return t._indices()
    return t.col_indices() if t.layout in (CSR, BSR) else t.row_indices()


ALIASES = ["dense", "dense in a set", "values", "storage"]


def aliased_file(tmp_path: Path, name: str, how: str) -> Path:
    w = valid(name)
    idx = plain_indices(w)
    other: Any = {
        "dense": lambda: idx[:],
        "dense in a set": lambda: {idx.view(-1)[:]},
        "values": lambda: torch.sparse_coo_tensor(torch.zeros(1, idx.numel(), dtype=torch.int64),
                                                  idx.reshape(-1), (1,), check_invariants=True),
        "storage": lambda: idx.storage(),  # a TypedStorage: torch.save keeps one dtype
    }[how]()
    return write(tmp_path, {"weight": w, "step_counter": other}, f"{name}-{how}.pt")


@pytest.mark.parametrize("how", ALIASES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_aliased_index_storage_is_copied_on_load(name: str, how: str, tmp_path: Path) -> None:
    path = aliased_file(tmp_path, name, how)
    out = ss.load(path)
    w = out["weight"]
    assert isinstance(w, ss.SafeSparseTensor) and ss.is_checked(w)
    assert torch.equal(w.to_dense(), valid(name).to_dense())
    mine = plain_indices(w)
    other = out["step_counter"]
    if how == "dense in a set":
        (other,) = other
    if how == "values":
        other = ss.unwrap(other)._values()
    shared = other.data_ptr()  # a tensor or a storage
    storage = mine.untyped_storage()
    assert not (storage.data_ptr() <= shared < storage.data_ptr() + storage.nbytes())
    result = load_and_validate(path, weights_only=True)
    (weight,) = [f for f in result.found if f.path == "['weight']"]
    assert weight.aliased_with and weight.aliased_with[0].startswith("['step_counter']")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_check_flags_aliasing_and_exits_1(name: str, tmp_path: Path) -> None:
    code, out = _check_json(aliased_file(tmp_path, name, "dense"))
    assert code == 1
    (t,) = out["files"][0]["tensors"]
    assert (t["key"], t["valid"], t["ok"]) == ("['weight']", True, False)
    assert t["aliased_with"] == ["['step_counter']"]
    assert out["summary"]["aliased"] == 1 and out["summary"]["invalid"] == 0
    assert out["files"][0]["dense"] == 1


def _check_json(*paths: Path) -> tuple[int, Any]:
    import io

    buf = io.StringIO()
    code = cli.run_check([str(p) for p in paths], as_json=True, out=buf)
    return code, json.loads(buf.getvalue())


def test_tensors_on_the_same_index_members_stay_shared(tmp_path: Path) -> None:
    """Two tensors built on the same index tensors share one checked state: not aliasing."""
    a = ss.validate(valid("CSR"))
    b = ss.sparse_csr_tensor(a.crow_indices(), a.col_indices(), a.values() * 2, a.shape)
    result = load_and_validate(write(tmp_path, {"a": a, "b": b}), weights_only=True)
    assert [f.aliased_with for f in result.found] == [(), ()]
    out = result.obj
    assert out["a"].col_indices().data_ptr() == out["b"].col_indices().data_ptr()
    out["b"].col_indices()[0] = 1  # a write through either is seen by both
    assert not ss.is_checked(out["a"]) and not ss.is_checked(out["b"])


def test_a_tensor_whose_values_alias_its_own_indices_gets_its_own_indices(
    tmp_path: Path,
) -> None:
    idx = torch.tensor([[0, 1]])
    t = torch.sparse_coo_tensor(idx, idx[0], (2,), check_invariants=True)  # values on idx bytes
    out = ss.load(write(tmp_path, {"t": t}))["t"]
    assert ss.is_checked(out)
    out.mul_(10**9)  # a write through the values
    assert out._indices().tolist() == [[0, 1]]  # the index members are a copy of their own
    assert ss.is_checked(ss.validate(out))


# --- the crash, and its absence, in subprocesses -----------------------------------------------


def _python(code: str, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_writes_through_loaded_aliases_never_break_a_checked_tensor(tmp_path: Path) -> None:
    files = [aliased_file(tmp_path, name, "dense") for name in LAYOUTS]
    proc = _python(
        """
        import sys, warnings, torch, safesparse as ss
        warnings.simplefilter("ignore")
        for path in sys.argv[1:]:
            obj = ss.load(path)
            w = obj["weight"]
            before = w.to_dense()
            obj["step_counter"].add_(10**9)  # plain torch: the weight's indices move too
            assert ss.is_checked(w), path
            assert torch.equal(w.to_dense(), before), path  # reads every index
            if w.layout != torch.sparse_bsc:  # no BSC @ dense kernel on CPU
                x = torch.ones(w.shape[1], 2)
                assert torch.equal(w @ x, before @ x), path
            print("ok", w.layout, flush=True)
        """,
        *files, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok") == 5


def test_hidden_tensors_check_exits_1_in_a_subprocess(tmp_path: Path) -> None:
    files = [write(tmp_path, hide(place, rebuilt(name)), f"{name}-{i}.pt")
             for name in LAYOUTS for i, place in enumerate(WEIGHTS_ONLY_PLACES)]
    files.append(write(tmp_path, hide("set", legacy()), "legacy.pt"))
    proc = subprocess.run(
        [sys.executable, "-m", "safesparse", "check", "--json", *map(str, files)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["summary"]["invalid"] == len(files) and doc["summary"]["unreadable"] == 0
    for entry in doc["files"]:
        (t,) = entry["tensors"]
        assert t["valid"] is False and t["invariant"] in ("5.2", "5.5")
        assert t["key"] in (PATHS[p] for p in WEIGHTS_ONLY_PLACES)


def test_a_kernel_called_by_the_file_on_a_tainted_tensor_is_refused(tmp_path: Path) -> None:
    """A pickle (weights_only=False) that runs a kernel on the invalid tensor it built: the
    watch raises before the kernel runs. Plain torch would run it."""
    path = write(tmp_path, {"x": Reduce(torch.Tensor.coalesce, legacy())})
    proc = _python(
        """
        import sys, warnings, safesparse as ss
        warnings.simplefilter("ignore")
        try:
            ss.load(sys.argv[1], weights_only=False)
        except ss.InvariantError as err:
            print("refused", err.invariant, err.__cause__.op)
        """,
        path, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.match(r"refused 5\.2 _?coalesce, while loading", proc.stdout), proc.stdout


def test_plain_torch_loads_the_hidden_tensor(tmp_path: Path) -> None:
    """The hole is real: plain torch.load(weights_only=True) hands the tensor back."""
    obj = torch.load(write(tmp_path, hide("set", legacy())), weights_only=True)
    (t,) = obj["s"]
    assert t.layout == COO and int(t._indices().max()) == 10**9  # no kernel on the data


# --- property: wherever the containers put them, every tensor comes back checked ------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEAVES = st.one_of(st.integers(0, 3), st.sampled_from(list(LAYOUTS)))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    hashable = st.one_of(st.integers(0, 3), st.sampled_from(list(LAYOUTS)))
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("ab", max_size=2), children, max_size=3),
        st.dictionaries(st.text("ab", max_size=2), children, max_size=3).map(
            collections.OrderedDict),
        st.lists(hashable, max_size=3).map(lambda xs: ("set", xs)),
        st.lists(st.tuples(hashable, children), max_size=3).map(lambda xs: ("keys", xs)),
        st.lists(children, max_size=2).map(lambda xs: ("counter", xs)),
    )


class _Maker:
    """Turns a drawn skeleton into an object: each layout name becomes a new valid sparse
    tensor whose values identify it (its number)."""

    def __init__(self) -> None:
        self.made: list[float] = []

    def tensor(self, name: str) -> torch.Tensor:
        number = float(len(self.made) + 1)
        self.made.append(number)
        return {"COO": lambda x: x.to_sparse(), "CSR": lambda x: x.to_sparse_csr(),
                "CSC": lambda x: x.to_sparse_csc(), "BSR": lambda x: x.to_sparse_bsr((1, 1)),
                "BSC": lambda x: x.to_sparse_bsc((1, 1))}[name](torch.tensor([[number, 0.0]]))

    def make(self, node: Any) -> Any:
        if isinstance(node, str):
            return self.tensor(node)
        if isinstance(node, int):
            return node
        if isinstance(node, tuple) and len(node) == 2 and node[0] == "set":
            return {self.make(x) for x in node[1]}
        if isinstance(node, tuple) and len(node) == 2 and node[0] == "keys":
            return {self.make(k): self.make(v) for k, v in node[1]}
        if isinstance(node, tuple) and len(node) == 2 and node[0] == "counter":
            return collections.Counter({i: self.make(v) for i, v in enumerate(node[1])})
        if isinstance(node, dict):
            return type(node)((k, self.make(v)) for k, v in node.items())
        return type(node)(self.make(x) for x in node)


def _tensors_in(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for k, v in node.items() for t in (*_tensors_in(k), *_tensors_in(v))]
    if isinstance(node, (list, tuple, set, frozenset)):
        return [t for x in node for t in _tensors_in(x)]
    return []


@given(st.recursive(_LEAVES, _containers, max_leaves=8))
def test_every_sparse_tensor_anywhere_comes_back_checked(skeleton: Any) -> None:
    import io

    maker = _Maker()
    obj = maker.make(skeleton)
    buf = io.BytesIO()
    torch.save({"root": obj}, buf)
    buf.seek(0)
    result = load_and_validate(buf, weights_only=True)
    placed = sorted(float(t.to_dense().sum()) for t in _tensors_in(obj))  # not overwritten
    back = _tensors_in(result.obj)
    assert all(isinstance(t, ss.SafeSparseTensor) and ss.is_checked(t) for t in back)
    assert sorted(float(ss.unwrap(t).to_dense().sum()) for t in back) == placed
    assert sorted(float(ss.unwrap(f.item).to_dense().sum()) for f in result.found) == placed
    assert all(f.keys is not None and f.error is None for f in result.found)


def test_overlapping_index_members_of_two_tensors_are_both_copied(tmp_path: Path) -> None:
    a = torch.eye(3).to_sparse_csr()
    col = a.col_indices()
    b = torch.sparse_csr_tensor(torch.tensor([0, 2]), col[1:], torch.ones(2), (1, 3),
                                check_invariants=True)
    result = load_and_validate(write(tmp_path, {"a": a, "b": b}), weights_only=True)
    assert [f.aliased_with for f in result.found] == [("['b'] (index members)",),
                                                     ("['a'] (index members)",)]
    out = result.obj
    assert ss.is_checked(out["a"]) and ss.is_checked(out["b"])
    out["b"].col_indices()[0] = 0  # b's own copy: a is unaffected
    assert out["a"].col_indices().tolist() == [0, 1, 2] and ss.is_checked(out["a"])


def test_a_function_of_the_unpickler_on_a_legacy_tensor_is_refused(tmp_path: Path) -> None:
    """weights_only=True: ``bytearray`` (an allowed global) asks the tensor for ``__index__``;
    the function mode validates the legacy-built tensor first and refuses to run it."""
    path = write(tmp_path, {"x": Reduce(bytearray, legacy())})
    with pytest.raises(ss.InvariantError, match=r"^\[COO 5\.2\]") as info:
        ss.load(path)
    cause = info.value.__cause__
    assert isinstance(cause, ss.InvariantError) and "while loading" in str(cause.op)


def test_legacy_tensor_with_torch_global_checks_enabled(tmp_path: Path) -> None:
    """Refused with torch's checks enabled globally too (torch's legacy constructor may then
    refuse it first, with its own RuntimeError)."""
    path = write(tmp_path, hide("set", legacy()))
    with torch.sparse.check_sparse_tensor_invariants(enable=True), \
            pytest.raises(RuntimeError, match=r"size is inconsistent with indices|5\.2"):
        ss.load(path)
    good = write(tmp_path, hide("set", Reduce(torch.sparse.FloatTensor, torch.tensor([[0, 1]]),
                                              torch.ones(2), torch.Size([2]))), "good.pt")
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        (t,) = ss.load(good)["s"]
    assert ss.is_checked(t)


def test_an_aborted_load_does_not_leak_into_the_next(tmp_path: Path) -> None:
    """torch keeps the sparse tensors of an aborted load in a global list that its post-load
    pass (global checks enabled) goes through next time: they are not this file's tensors."""
    with pytest.raises(ss.InvariantError):
        ss.load(write(tmp_path, {"x": Reduce(bytearray, legacy())}, "aborted.pt"))
    good = write(tmp_path, {"w": torch.eye(2).to_sparse()}, "good.pt")
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        assert ss.is_checked(ss.load(good)["w"])
    assert cli.check_file(good).ok


@pytest.mark.parametrize("place", WEIGHTS_ONLY_PLACES)
def test_legacy_file_format_hidden_and_aliased(place: str, tmp_path: Path) -> None:
    """torch's pre-1.6 format reads the data after the pickle: the same outcome."""
    bad = tmp_path / "bad.pt"
    torch.save(hide(place, legacy()), bad, _use_new_zipfile_serialization=False)
    with pytest.raises(ss.InvariantError) as info:
        ss.load(bad)
    assert (info.value.invariant, info.value.path) == ("5.2", PATHS[place])
    w = valid("CSR")
    aliased = tmp_path / "aliased.pt"
    torch.save({"w": w, "c": hide(place, plain_indices(w)[:])}, aliased,
               _use_new_zipfile_serialization=False)
    result = load_and_validate(aliased, weights_only=True)
    (found,) = result.found
    assert found.aliased_with == (f"['c']{PATHS[place]}",)
    assert ss.is_checked(result.obj["w"])

"""An error's first line is short in every mode, and the class prints by its public name
(issue 41, item 5).

Under enforce mode the building call's place named the script by its path (relative to the
working directory, else absolute) and the loaders named the file by its path: first lines of
200-340 characters. The place is now the base name and line (the traceback has the path), a
file the base name; a part that is still too long is shortened in its middle. The class
printed as ``safesparse.catalog.errors.InvariantError``.
"""

from __future__ import annotations

import copy
import pickle
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safesparse as ss
import safesparse.distributed as ssd
import safesparse.nn as ssnn
import safesparse.safetensors as sst

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 200  # SPEC 2: the first line is at most 200 characters, in every mode
SCRIPT = """\
import torch
crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 10**9])
adj = torch.sparse_csr_tensor(crow, col, torch.ones(2), (2, 3))
"""


def _deep(tmp_path: Path, depth: int = 10) -> Path:
    """A directory whose path alone is longer than the first line may be."""
    deep = tmp_path.joinpath(*(["a-directory-of-an-experiment-series-run"] * depth))
    deep.mkdir(parents=True)
    assert len(str(deep)) > LIMIT
    return deep


def _first(err: BaseException) -> str:
    return str(err).splitlines()[0]


def test_the_limit_is_the_specs() -> None:
    from safesparse.catalog.errors import FIRST_LINE_MAX

    assert FIRST_LINE_MAX == LIMIT


def test_a_script_in_a_long_path_is_named_by_base_name_and_line(tmp_path: Path) -> None:
    script = _deep(tmp_path) / "build_adjacency.py"
    script.write_text(SCRIPT)
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        runpy.run_path(str(script))
    err = info.value
    assert (err.invariant, err.built_by) == (
        "5.5", "torch.sparse_csr_tensor at build_adjacency.py:3")
    first = _first(err)
    assert len(first) <= LIMIT, first
    assert first.endswith("(built by torch.sparse_csr_tensor at build_adjacency.py:3)"), first
    assert str(script.parent) not in str(err)


def test_a_refused_script_in_a_long_path_prints_short_under_run(tmp_path: Path) -> None:
    """A fresh interpreter: ``python -m safesparse run`` shows the uncaught error (the
    traceback names the path; the error's first line the base name)."""
    script = _deep(tmp_path) / "build_adjacency.py"
    script.write_text(SCRIPT)
    environ = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "safesparse", "run", str(script)],
                          capture_output=True, text=True, env=environ, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert f'  File "{script}", line 3, in <module>' in lines, proc.stderr
    errors = [line for line in lines if line.startswith("safesparse.InvariantError: ")]
    assert len(errors) == 1, proc.stderr
    first = errors[0].removeprefix("safesparse.InvariantError: ")
    assert first.startswith("[CSR 5.5] ") and len(first) <= LIMIT, first
    assert first.endswith("(built by torch.sparse_csr_tensor at build_adjacency.py:3)")


def test_a_base_name_near_the_file_systems_limit_is_left_out_of_the_first_line(
    tmp_path: Path,
) -> None:
    name = "x" * 120 + "_and_so_on_" + "y" * 110 + ".py"  # 246 characters
    script = tmp_path / name
    script.write_text(SCRIPT)
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        runpy.run_path(str(script))
    err = info.value
    assert err.built_by == f"torch.sparse_csr_tensor at {name}:3"  # the attribute is whole
    first = _first(err)
    assert len(first) <= LIMIT, first
    # what and where whole; the provenance shortened at a word boundary (no word is cut)
    assert first == ("[CSR 5.5] column 1000000000 is out of range for 3 columns (row 1, "
                     "position 1: col_indices[1] = 1000000000, n_plain = 3) (built by ...)")
    assert str(err).splitlines()[1:] == [
        f"in full: column 1000000000 is out of range for 3 columns (row 1, position 1: "
        f"col_indices[1] = 1000000000, n_plain = 3) (built by {err.built_by})",
        f"invariant: {err.statement}", f"to repair: {err.hint}"]


def _tampered(path: Path) -> Path:
    bad = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 10**9]),
                                  torch.ones(2), (2, 3), check_invariants=False)
    torch.save({"model": {"encoder.layers.11.attention.adjacency": bad}}, path)
    return path


def test_loaders_name_the_file_by_its_base_name(tmp_path: Path) -> None:
    path = _tampered(_deep(tmp_path) / "checkpoint-epoch-0042.pt")
    with pytest.raises(ss.InvariantError) as info:
        ss.load(path)
    first = _first(info.value)
    assert len(first) <= LIMIT, first
    assert first.endswith("(loaded by ss.load from 'checkpoint-epoch-0042.pt')"), first
    assert info.value.path == "['model']['encoder.layers.11.attention.adjacency']"
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        torch.load(path)
    first = _first(info.value)
    assert len(first) <= LIMIT and "from 'checkpoint-epoch-0042.pt')" in first, first
    with open(path, "rb") as f, pytest.raises(ss.InvariantError) as info:
        ss.load(f)  # a file object: by its name's base name
    assert _first(info.value).endswith("(loaded by ss.load from 'checkpoint-epoch-0042.pt')")


def test_safetensors_load_file_names_the_file_by_its_base_name(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    path = _deep(tmp_path) / "model.safetensors"
    good = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 2]), torch.ones(2),
                                (2, 3))
    sst.save_file({"adjacency": good}, path)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    flat = st.load_file(path)
    flat["adjacency.__ss_col_indices"] = torch.tensor([0, 10**9])
    st.save_file(flat, path, metadata=metadata)
    with pytest.raises(ss.InvariantError) as info:
        sst.load_file(path)
    first = _first(info.value)
    assert len(first) <= LIMIT, first
    # the file kept, the loader's name left out (whole words), all of it on the next line
    assert first.endswith("(loaded by ... from 'model.safetensors')"), first
    assert str(info.value).splitlines()[1].endswith(
        "(loaded by safesparse.safetensors.load_file from 'model.safetensors')")


def test_a_key_path_of_hundreds_of_characters_is_shortened() -> None:
    err = ss.InvariantError(torch.sparse_csr, "5.5", "row 1, position 1: col_indices[1] = 9",
                            explanation="column 9 is out of range for 3 columns",
                            path="['" + "k" * 500 + "']",
                            loaded_by="ss.load from '" + "f" * 240 + ".pt'")
    first = _first(err)
    assert len(first) <= LIMIT, first
    assert first.startswith("[CSR 5.5] column 9 is out of range for 3 columns (row 1, ")
    assert err.path == "['" + "k" * 500 + "']"  # the attributes keep every part whole
    assert pickle.loads(pickle.dumps(err)).path == err.path


# --- what and where first, the provenance shortens (issue 46) -----------------------------------


def _whole_words(first: str, full: str) -> None:
    """Every word of ``first`` is a word of ``full``, or stands beside ``...`` for what was
    left out (no word is cut in its middle)."""
    words = set(full.split())
    for word in first.split():
        assert word in words or "..." in word, (word, first)


def test_a_tampered_block_checkpoint_keeps_position_and_value(tmp_path: Path) -> None:
    """The issue's example: a BSR layer's state dict with one block column out of range, in
    a file of a long name, under a deep key. The first line read ``[BSR 5.5] block column
    99..., n_plain = 64) (at [...]) (loaded by ... from '...')``."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        ssnn.SparseLinear.from_dense(torch.nn.Linear(256, 256), 16, 0.25) for _ in range(12))
    model = torch.nn.ModuleDict({"encoder": torch.nn.ModuleDict({"layer": layers})})
    state = model.state_dict()
    key = "encoder.layer.11.plain_indices"
    state[key] = state[key].clone()
    state[key][5] = 99
    name = "bert-base-uncased-pruned-25pct-block16-epoch-0042-step-0012345-final.pt"
    path = _deep(tmp_path) / name
    torch.save(state, path)
    with pytest.raises(ss.InvariantError) as info:
        ss.load(path)
    err = info.value
    first, second, *_ = str(err).splitlines()
    assert len(first) <= LIMIT, first
    assert first.startswith(
        "[BSR 5.5] block column 99 is out of range for 16 block columns (block row "), first
    assert f"position 5: col_indices[5] = 99, n_plain = 16) (at ['{key}'])" in first, first
    _whole_words(first, "[BSR 5.5] " + second)
    assert second.startswith("in full: ") and second.endswith(f"(loaded by ss.load from "
                                                              f"{name!r})"), second
    assert err.location["position"] == 5 and err.location["value"] == 99
    assert err.path == f"['{key}']" and err.loaded_by == f"ss.load from {name!r}"
    # load_state_dict of the same names the key and the loader whole (it fits)
    with pytest.raises(ss.InvariantError) as info:
        model.load_state_dict(state)
    first = _first(info.value)
    assert first.endswith(f"= 99, n_plain = 16) (at {key}) (loaded by "
                          "SparseLinear.load_state_dict)"), first


def _refusals() -> list[ss.InvariantError]:
    """One real refusal for every reachable invariant id of every layout (the corruption
    table of tests/engine/test_corruptions.py)."""
    import warnings

    from engine.test_corruptions import TABLE, base

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layout, _, _, corrupt in TABLE:
            try:
                corrupt(base(layout))()
            except ss.InvariantError as err:
                out.append(err)
    return out


REFUSALS = _refusals()
_SEGMENT = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=40)


@st.composite
def _provenance(draw: st.DrawFn) -> dict[str, str]:
    """A key path (state-dict keys or nested containers), a loader and a file base name, and
    a building call or op, each possibly long (hundreds of characters) or absent."""
    out: dict[str, str] = {}
    if draw(st.booleans()):
        keys = draw(st.lists(_SEGMENT, min_size=1, max_size=12))
        out["path"] = (".".join(keys) if draw(st.booleans())
                       else "".join(f"[{k!r}]" for k in keys))
    if draw(st.booleans()):
        loader = draw(st.sampled_from(["ss.load", "safesparse.safetensors.load_file",
                                       "torch.load (enforce)", "SparseLinear.load_state_dict"]))
        base_name = draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1,
                                 max_size=250))
        out["loaded_by"] = f"{loader} from {base_name!r}"
    if draw(st.booleans()):
        place = f"{draw(_SEGMENT)}.py:{draw(st.integers(1, 9999))}"
        out["built_by"] = f"torch.sparse_csr_tensor at {place}"
    elif draw(st.booleans()):
        out["op"] = draw(st.sampled_from(["safesparse::linear", "aten::mm", "F.linear"]))
    return out


def _check_first_line(err: ss.InvariantError, context: dict[str, str]) -> None:
    alone = _first(err)
    loaded = err.with_context(**context)
    lines = str(loaded).splitlines()
    first = lines[0]
    assert len(first) <= LIMIT, first
    assert first.startswith(f"[{first[1:4]} {err.invariant}] "), first
    # what and where whole: the explanation and the location (member, position, value)
    assert first.startswith(alone), (alone, first)
    if "value" in err.location:
        assert str(err.location["value"]) in first and str(err.location["position"]) in first
    full = alone[alone.index("] ") + 2:] + "".join(
        f" ({label} {context[k]})" for k, label in (
            ("path", "at"), ("loaded_by", "loaded by"), ("built_by", "built by"))
        if k in context)
    if "op" in context and "built_by" not in context:
        full += f" (in op {context['op']})"
    if first[first.index("] ") + 2:] == full:
        assert not lines[1].startswith("in full: ")
    else:  # shortened: whole words only, and all of it on the next line
        assert lines[1] == f"in full: {full}"
        _whole_words(first, first[:first.index("] ") + 2] + full)
    for k, v in context.items():  # the attributes keep every part whole
        assert getattr(loaded, k) == v


@pytest.mark.parametrize("err", REFUSALS, ids=lambda e: f"{e.layout}-{e.invariant}")
def test_every_invariant_keeps_what_and_where_with_long_provenance(
        err: ss.InvariantError) -> None:
    context = {"path": "['model']['" + ".".join(["encoder", "layers", "11", "attention"] * 6)
                       + ".adjacency']",
               "loaded_by": "ss.load from '" + "checkpoint-epoch-0042-" * 8 + ".pt'",
               "built_by": "torch.sparse_csr_tensor at train_graph_attention.py:12"}
    _check_first_line(err, context)


@given(index=st.integers(0, len(REFUSALS) - 1), context=_provenance())
def test_first_line_property(index: int, context: dict[str, str]) -> None:
    _check_first_line(REFUSALS[index], context)


# --- the class's name ----------------------------------------------------------------------------


def _refusal() -> ss.InvariantError:
    with ss.enforce(), pytest.raises(ss.InvariantError) as info:
        torch.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1), (2,))
    return info.value


def test_the_class_prints_as_safesparse_invariant_error() -> None:
    err = _refusal()
    assert str(type(err)) == "<class 'safesparse.InvariantError'>"
    assert f"{type(err).__module__}.{type(err).__qualname__}" == "safesparse.InvariantError"
    shown = traceback.format_exception_only(err)
    assert shown[0].startswith("safesparse.InvariantError: [COO 5.2] "), shown
    assert repr(err).startswith('InvariantError("[COO 5.2] ')


def test_the_error_pickles_and_copies_by_its_public_name() -> None:
    err = _refusal()
    err.path = "['w']"  # every field travels
    err = err.with_context(loaded_by="ss.load from 'x.pt'")
    assert b"safesparse.catalog.errors" in pickle.dumps(err)  # its rebuild function
    for copied in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
        assert type(copied) is ss.InvariantError
        assert (copied.layout, copied.invariant, copied.detail, copied.location, copied.op,
                copied.path, copied.built_by, copied.loaded_by, copied.explanation) == (
            err.layout, err.invariant, err.detail, err.location, err.op, err.path,
            err.built_by, err.loaded_by, err.explanation)
        assert str(copied) == str(err)
    assert pickle.loads(pickle.dumps(ss.InvariantError)) is ss.InvariantError
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)


@pytest.mark.parametrize(("cls", "name"), [
    (ssnn.SparseParameterError, "safesparse.nn.SparseParameterError"),
    (ssnn.UnprovenMembersError, "safesparse.nn.UnprovenMembersError"),
    (sst.FormatError, "safesparse.safetensors.FormatError"),
    (ssd.TransferError, "safesparse.distributed.TransferError"),
])
def test_other_public_errors_print_by_their_public_names(cls: type[Exception],
                                                         name: str) -> None:
    assert f"{cls.__module__}.{cls.__qualname__}" == name
    err = cls("what", source_rank=1) if cls is ssd.TransferError else cls("what")
    assert traceback.format_exception_only(err)[0].startswith(f"{name}: what")
    copied = pickle.loads(pickle.dumps(err))
    assert type(copied) is cls and str(copied) == str(err)
    assert pickle.loads(pickle.dumps(cls)) is cls

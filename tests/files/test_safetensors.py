"""``safesparse.safetensors``: sparse tensors in safetensors files, round trips for every layout,
hostile files refused (loading them runs in a child process), saving that refuses invalid data,
and ``check`` on safetensors files."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, note
from support.cli import run_cli
from support.strategies import Case, cases

import safesparse as ss
from safesparse import cli
from safesparse.safetensors import FormatError, load, load_file, save, save_file

st = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _dense(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(*shape, generator=g)
    return d * (torch.rand(*shape, generator=g) < 0.5)


def _compressed(layout: torch.layout, kind: str, index_dtype: torch.dtype) -> torch.Tensor:
    blocked = layout in (torch.sparse_bsr, torch.sparse_bsc)
    block = {"blocksize": (2, 3)} if blocked else {}
    if kind == "plain":
        d = _dense(4, 6)
        t = d.to_sparse(layout=layout, **block)
    elif kind == "batched":
        mask = _dense(4, 6) != 0  # one pattern: the same nnz in every batch
        d = (torch.arange(3 * 4 * 6.0).reshape(3, 4, 6) + 1) * mask
        t = d.to_sparse(layout=layout, **block)
    elif kind == "hybrid":
        d = _dense(4, 6, 2)
        t = d.to_sparse(layout=layout, dense_dim=1, **block)
    else:  # empty
        t = torch.zeros(4, 6).to_sparse(layout=layout, **block)
    plain = ss.unwrap(ss.validate(t))
    compressed, plain_idx = (
        (plain.crow_indices(), plain.col_indices())
        if layout in (torch.sparse_csr, torch.sparse_bsr)
        else (plain.ccol_indices(), plain.row_indices()))
    return ss.sparse_compressed_tensor(compressed.to(index_dtype), plain_idx.to(index_dtype),
                                       plain.values(), plain.shape, layout=layout)


def _coo(kind: str) -> torch.Tensor:
    if kind == "plain":
        return ss.validate(_dense(4, 6).to_sparse())
    if kind == "hybrid":
        return ss.validate(_dense(4, 6, 2).to_sparse(2))
    if kind == "uncoalesced":
        return ss.sparse_coo_tensor([[0, 0, 3], [1, 1, 5]], [1.0, 2.0, 3.0], (4, 6))
    return ss.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (4, 6))


SAMPLES: dict[str, Callable[[], torch.Tensor]] = {
    **{f"{str(lay)[13:]}-{kind}-{str(dt)[6:]}":
       (lambda lay=lay, kind=kind, dt=dt: _compressed(lay, kind, dt))
       for lay in COMPRESSED for kind in ("plain", "batched", "hybrid", "empty")
       for dt in (torch.int32, torch.int64)},
    **{f"coo-{kind}": (lambda kind=kind: _coo(kind))
       for kind in ("plain", "hybrid", "uncoalesced", "empty")},
}


def _members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    p = ss.unwrap(t)
    if p.layout == torch.sparse_coo:
        return p._indices(), p._values()
    if p.layout in (torch.sparse_csr, torch.sparse_bsr):
        return p.crow_indices(), p.col_indices(), p.values()
    return p.ccol_indices(), p.row_indices(), p.values()


def _assert_same(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, ss.SafeSparseTensor) and ss.is_checked(got)
    assert got.layout == want.layout and got.shape == want.shape and got.dtype == want.dtype
    for a, b in zip(_members(got), _members(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if want.layout == torch.sparse_coo:
        assert ss.unwrap(got).is_coalesced() == ss.unwrap(want).is_coalesced()


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_through_save_file_and_load_file(tmp_path: Path, name: str) -> None:
    t = SAMPLES[name]()
    path = tmp_path / "m.safetensors"
    save_file({"w": t, "bias": torch.arange(3.0)}, path, metadata={"author": "me"})
    out = load_file(path)
    assert sorted(out) == ["bias", "w"]
    _assert_same(out["w"], t)
    assert torch.equal(out["bias"], torch.arange(3.0))
    _assert_same(load(save({"w": t}))["w"], t)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_plain_safetensors_reads_the_members_under_their_documented_names(
    tmp_path: Path, name: str
) -> None:
    t = SAMPLES[name]()
    path = tmp_path / "m.safetensors"
    save_file({"layer.weight": t}, path, metadata={"author": "me"})
    flat = st.load_file(path)
    accessors = {torch.sparse_coo: ("indices", "values"),
                 torch.sparse_csr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
                 torch.sparse_bsc: ("ccol_indices", "row_indices", "values")}[t.layout]
    assert sorted(flat) == sorted(f"layer.weight.__ss_{m}" for m in accessors)
    for m, want in zip(accessors, _members(t), strict=True):
        assert torch.equal(flat[f"layer.weight.__ss_{m}"], want)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    spec = json.loads(meta["__ss_sparse__:layer.weight"])
    assert spec["format"] == 1 and spec["layout"] == str(t.layout)[6:]
    assert spec["size"] == list(t.shape) and meta["author"] == "me"
    assert ("coalesced" in spec) == (t.layout == torch.sparse_coo)
    # and plain torch rebuilds the tensor from them, as the docs show
    parts = [flat[f"layer.weight.__ss_{m}"] for m in accessors]
    if t.layout == torch.sparse_coo:
        rebuilt = torch.sparse_coo_tensor(*parts, spec["size"], is_coalesced=spec["coalesced"],
                                          check_invariants=True)
    else:
        rebuilt = torch.sparse_compressed_tensor(*parts, spec["size"], layout=t.layout,
                                                 check_invariants=True)
    assert torch.equal(rebuilt.to_dense(), t.to_dense())


def test_a_transposed_bsr_view_and_noncontiguous_members_are_saved(tmp_path: Path) -> None:
    t = ss.validate(_dense(4, 6).to_sparse_bsr((2, 3)))
    view = t.mT  # a BSC view: block-transposed values, not contiguous
    path = tmp_path / "v.safetensors"
    save_file({"v": view}, path)
    out = load_file(path)["v"]
    assert out.layout == torch.sparse_bsc and torch.equal(out.to_dense(), view.to_dense())


def test_load_file_returns_what_safetensors_returns_for_dense_files(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    st.save_file({"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int32)}, path)
    out = load_file(path)
    want = st.load_file(path)
    assert sorted(out) == sorted(want)
    assert all(torch.equal(out[k], want[k]) and type(out[k]) is torch.Tensor for k in out)


# --- saving refuses invalid data ---------------------------------------------------------------


def _unchecked_csr(col: list[int], n: int = 3) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.arange(len(col) + 1), torch.tensor(col),
                                   torch.ones(len(col)), (n, n), check_invariants=False)


def test_save_file_refuses_an_invalid_tensor_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(ss.InvariantError) as info:
        save_file({"ok": torch.eye(3).to_sparse_csr(), "dec.w": _unchecked_csr([0, 10**9, 1])},
                  path)
    assert (info.value.invariant, info.value.path) == ("5.5", "['dec.w']")
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"the previous version")
    with pytest.raises(ss.InvariantError):
        save_file({"w": ss.sparse_csr_tensor([0, 1, 2, 3], [0, 5, 1], [1.0, 2, 3], (3, 3),
                                             check_invariants=False)}, path)
    assert path.read_bytes() == b"the previous version"
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(ss.InvariantError, match=r"\['w'\]"):
        save({"w": _unchecked_csr([7])})


def test_an_unchecked_valid_tensor_is_validated_and_saved(tmp_path: Path) -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2), check_invariants=False)
    assert not ss.is_checked(t)
    save_file({"w": t}, tmp_path / "m.safetensors")
    assert ss.is_checked(t)
    _assert_same(load_file(tmp_path / "m.safetensors")["w"], t)


def test_ss_save_refuses_invalid_data_naming_the_key_path(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    with pytest.raises(ss.InvariantError) as info:
        ss.save({"enc": [torch.eye(2).to_sparse(), {"w": _unchecked_csr([0, 3, 1])}]}, path)
    assert (info.value.invariant, info.value.path) == ("5.5", "['enc'][1]['w']")
    assert list(tmp_path.iterdir()) == []
    buf = io.BytesIO()
    with pytest.raises(ss.InvariantError):
        ss.save({"w": _unchecked_csr([9])}, buf)
    assert buf.getvalue() == b""


def test_ss_save_that_fails_midway_leaves_neither_a_partial_file_nor_a_damaged_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.pt"
    ss.save({"w": torch.eye(2).to_sparse_csr()}, path)
    before = path.read_bytes()
    with pytest.raises(Exception, match=r"(?i)pickle"):
        ss.save({"w": torch.eye(2).to_sparse_csr(), "f": lambda: 0}, path)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    assert ss.is_checked(ss.load(path)["w"])


def test_reserved_names_are_refused_when_saving(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save_file({"w.__ss_values": torch.ones(2)}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="reserved"):
        save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors",
                  metadata={"__ss_sparse__:w": "{}"})
    assert list(tmp_path.iterdir()) == []


def test_safetensors_own_refusals_pass_through(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non contiguous"):
        save_file({"x": torch.ones(3, 2).t()}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match=r"expected torch\.Tensor"):
        save_file({"x": [1, 2]}, tmp_path / "b.safetensors")  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_a_clear_import_error_without_the_safetensors_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for call in (lambda: save_file({}, tmp_path / "a"), lambda: load_file(tmp_path / "a"),
                 lambda: load(b""), lambda: save({})):
        with pytest.raises(ImportError, match=r'pip install "safesparse\[safetensors\]"'):
            call()


# --- hostile files -----------------------------------------------------------------------------


def _valid_parts() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    t = ss.unwrap(ss.validate(torch.eye(3).to_sparse_csr()))
    flat = {"w.__ss_crow_indices": t.crow_indices().clone(),
            "w.__ss_col_indices": t.col_indices().clone(), "w.__ss_values": t.values().clone()}
    return flat, {"__ss_sparse__:w": json.dumps({"format": 1, "layout": "sparse_csr",
                                                   "size": [3, 3]})}


def _spec(**changes: Any) -> dict[str, str]:
    spec: dict[str, Any] = {"format": 1, "layout": "sparse_csr", "size": [3, 3], **changes}
    return {"__ss_sparse__:w": json.dumps({k: v for k, v in spec.items() if v is not ...})}


def _coo_parts(indices: list[list[int]], size: list[int], coalesced: bool,
               dtype: torch.dtype = torch.int64) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    idx = torch.tensor(indices, dtype=dtype)
    return ({"e.__ss_indices": idx, "e.__ss_values": torch.ones(idx.shape[1])},
            {"__ss_sparse__:e": json.dumps({"format": 1, "layout": "sparse_coo", "size": size,
                                            "coalesced": coalesced})})


def _hostile() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    flat, meta = _valid_parts()
    f = dict(flat)

    def with_(**tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(f)
        out.update({k.replace("__", ".__ss_", 1) if "__" in k else k: v
                    for k, v in tensors.items()})
        return out

    missing = dict(f)
    del missing["w.__ss_values"]
    return {
        "unknown layout": (f, _spec(layout="sparse_foo")),
        "strided layout": (f, _spec(layout="strided")),
        "malformed json": (f, {"__ss_sparse__:w": "{\"format\": 1, "}),
        "not an object": (f, {"__ss_sparse__:w": "[1, 2]"}),
        "deep json": (f, {"__ss_sparse__:w": "[" * 100000}),
        "newer format": (f, _spec(format=2)),
        "no format": (f, _spec(format=...)),
        "unknown field": (f, _spec(blocksize=[1, 1])),
        "negative size": (f, _spec(size=[3, -3])),
        "float size": (f, _spec(size=[3, 3.0])),
        "size too large": (f, _spec(size=[3, 2**64])),
        "size not a list": (f, _spec(size="3x3")),
        "coalesced on csr": (f, _spec(coalesced=True)),
        "missing member": (missing, meta),
        "extra member": (with_(w__indices=torch.zeros(2, 3, dtype=torch.long)), meta),
        "unclaimed member": (with_(v__values=torch.ones(2)), meta),
        "dense collision": (with_(w=torch.ones(3)), meta),
        "entry on a member name": (f, {**meta, "__ss_sparse__:w.__ss_values": "{}"}),
        "float indices": (with_(w__col_indices=torch.tensor([0.0, 1.0, 2.0])), meta),
        "int16 indices": (with_(w__crow_indices=torch.tensor([0, 1, 2, 3], dtype=torch.int16)),
                          meta),
        "coo int32 indices": _coo_parts([[0], [1]], [2, 2], True, torch.int32),
        "coo no coalesced flag": ({"e.__ss_indices": torch.zeros(2, 0, dtype=torch.long),
                                   "e.__ss_values": torch.zeros(0)},
                                  {"__ss_sparse__:e": json.dumps(
                                      {"format": 1, "layout": "sparse_coo", "size": [2, 2]})}),
        # data the factories refuse: InvariantError naming the key
        "tampered column": (with_(w__col_indices=torch.tensor([0, 10**9, 2])), meta),
        "tampered crow": (with_(w__crow_indices=torch.tensor([0, 2, 1, 3])), meta),
        "size too small": (f, _spec(size=[2, 2])),
        "size too big for members": (f, _spec(size=[2**62, 2**62])),
        "size of three dims": (f, _spec(size=[3, 3, 1])),
        "values shape": (with_(w__values=torch.ones(3, 2, 2)), meta),
        "mixed index dtypes": (with_(w__col_indices=torch.tensor([0, 1, 2], dtype=torch.int32)),
                               meta),
        "coo out of bounds": _coo_parts([[0, 5], [1, 1]], [2, 2], False),
        "coo duplicates marked coalesced": _coo_parts([[0, 0], [1, 1]], [2, 2], True),
        "coo sparse dims vs size": _coo_parts([[0], [1]], [2], False),
    }


EXPECTED: dict[str, tuple[str, str]] = {  # case -> (error class, text in the message)
    "unknown layout": ("FormatError", "unknown layout 'sparse_foo'"),
    "strided layout": ("FormatError", "unknown layout 'strided'"),
    "malformed json": ("FormatError", "not valid JSON"),
    "not an object": ("FormatError", "not a JSON object"),
    "deep json": ("FormatError", "not valid JSON"),
    "newer format": ("FormatError", "unknown format version 2"),
    "no format": ("FormatError", "unknown format version None"),
    "unknown field": ("FormatError", "unknown metadata field(s) blocksize"),
    "negative size": ("FormatError", "size must be a list of non-negative integers"),
    "float size": ("FormatError", "size must be a list of non-negative integers"),
    "size too large": ("FormatError", "size must be a list of non-negative integers"),
    "size not a list": ("FormatError", "size must be a list of non-negative integers"),
    "coalesced on csr": ("FormatError", "unknown metadata field(s) coalesced"),
    "missing member": ("FormatError", "missing member(s) 'w.__ss_values'"),
    "extra member": ("FormatError", "'w.__ss_indices' is not a member of sparse tensor 'w': "
                                    "a sparse_csr tensor has crow_indices, col_indices, values"),
    "unclaimed member": ("FormatError", "no entry of the file's metadata describes 'v'"),
    "dense collision": ("FormatError", "also stores a dense tensor named 'w'"),
    "entry on a member name": ("FormatError", "reserved for members"),
    "float indices": ("FormatError", "member col_indices has dtype float32, expected int32 or "
                                     "int64"),
    "int16 indices": ("FormatError", "member crow_indices has dtype int16"),
    "coo int32 indices": ("FormatError", "member indices has dtype int32, expected int64"),
    "coo no coalesced flag": ("FormatError", "coalesced must be true or false"),
    "tampered column": ("InvariantError", "[CSR 5.5]"),
    "tampered crow": ("InvariantError", "[CSR 5.3]"),
    "size too small": ("InvariantError", "[CSR 3."),
    "size too big for members": ("InvariantError", "[CSR 3."),
    "size of three dims": ("InvariantError", "[CSR 3."),
    "values shape": ("InvariantError", "[CSR 3."),
    "mixed index dtypes": ("InvariantError", "[CSR 1."),
    "coo out of bounds": ("InvariantError", "[COO 5.2]"),
    "coo duplicates marked coalesced": ("InvariantError", "[COO 5.3]"),
    "coo sparse dims vs size": ("InvariantError", "[COO 3."),
}

_CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import safesparse as ss
from safesparse.safetensors import load, load_file
out = {}
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1]
    try:
        got = load_file(path)
        out[name] = ["ok", repr(sorted(got))]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc), getattr(exc, "path", None)]
    try:
        load(open(path, "rb").read())
        out[name].append("bytes ok")
    except Exception as exc:
        out[name].append(type(exc).__name__)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every hostile file, written with plain safetensors and loaded in one child process."""
    root = tmp_path_factory.mktemp("hostile")
    paths = []
    for i, (flat, meta) in enumerate(_hostile().values()):
        path = root / f"{i}.safetensors"
        st.save_file(flat, path, metadata=meta)
        paths.append(str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _CHILD, *paths], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    return {case: results[f"{i}.safetensors"] for i, case in enumerate(_hostile())}


def test_every_hostile_case_has_an_expectation() -> None:
    assert sorted(_hostile()) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_hostile_file_is_refused_with_a_clear_error(
    hostile_results: dict[str, list[Any]], case: str
) -> None:
    kind, text = EXPECTED[case]
    got = hostile_results[case]
    assert got[0] == kind, got
    assert text in got[1], got
    assert got[-1] == kind  # load(bytes) refuses it the same way
    if kind == "InvariantError":
        assert got[2] in ("['w']", "['e']")
        assert got[2] in got[1]
    else:
        assert "tensor '" in got[1]  # names the key


def test_the_valid_parts_load(tmp_path: Path) -> None:
    flat, meta = _valid_parts()
    st.save_file(flat, tmp_path / "ok.safetensors", metadata=meta)
    assert torch.equal(load_file(tmp_path / "ok.safetensors")["w"].to_dense(), torch.eye(3))
    flat2, meta2 = _coo_parts([[0, 1], [1, 0]], [2, 2], True)
    st.save_file(flat2, tmp_path / "coo.safetensors", metadata=meta2)
    assert ss.is_checked(load_file(tmp_path / "coo.safetensors")["e"])


def test_a_file_that_is_not_safetensors_at_all(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{junk")
    with pytest.raises(Exception) as info:
        load_file(path)
    assert not isinstance(info.value, ss.InvariantError)
    with pytest.raises(FormatError):
        from safesparse.files.safetensors import _rebuild

        _rebuild({}, {"__ss_sparse__:x": "{"})


# --- ss.load of a safetensors path -------------------------------------------------------------


def test_ss_load_reads_a_safetensors_path_through_safesparse(tmp_path: Path) -> None:
    """torch.load hands a path ending in .safetensors to plain safetensors, which would return
    the loose members; ss.load rebuilds and validates them instead."""
    path = tmp_path / "m.safetensors"
    t = ss.validate(_dense(4, 6).to_sparse_csc())
    save_file({"w": t, "b": torch.ones(2)}, path)
    assert sorted(torch.load(path, weights_only=True)) == [
        "b", "w.__ss_ccol_indices", "w.__ss_row_indices", "w.__ss_values"]
    for kwargs in ({}, {"map_location": "cpu"}, {"map_location": torch.device("cpu")}):
        out = ss.load(str(path), **kwargs)
        assert sorted(out) == ["b", "w"]
        _assert_same(out["w"], t)
    found = ss.serialization.load_and_validate(path)
    assert [f.path for f in found.found] == ["['w']"] and found.dense == 1
    with pytest.raises(RuntimeError, match="map_location"):
        ss.load(path, map_location={"cuda:0": "cpu"})
    flat, meta = _valid_parts()
    bad = tmp_path / "bad.safetensors"
    st.save_file({**flat, "w.__ss_col_indices": torch.tensor([0, 10**9, 2])}, bad,
                 metadata=meta)
    with pytest.raises(ss.InvariantError) as info:
        ss.load(bad)
    assert (info.value.invariant, info.value.path) == ("5.5", "['w']")


# --- plain safetensors where safesparse is absent ------------------------------------------------


def test_plain_safetensors_reads_the_file_where_safesparse_cannot_be_imported(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": ss.validate(_dense(4, 6).to_sparse_bsr((2, 3))), "b": torch.ones(2)}, path)
    code = textwrap.dedent("""
        import json, sys
        sys.modules["safesparse"] = None  # import safesparse fails here
        try:
            import safesparse
        except ImportError:
            pass
        else:
            raise SystemExit("safesparse importable")
        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file
        flat = load_file(sys.argv[1])
        with safe_open(sys.argv[1], framework="pt") as f:
            spec = json.loads(f.metadata()["__ss_sparse__:w"])
        w = torch.sparse_bsr_tensor(flat["w.__ss_crow_indices"], flat["w.__ss_col_indices"],
                                    flat["w.__ss_values"], spec["size"], check_invariants=True)
        print(json.dumps(w.to_dense().tolist()))
    """)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.tensor(json.loads(done.stdout)), load_file(path)["w"].to_dense())


# --- check on safetensors files ------------------------------------------------------------------


def test_check_reports_safetensors_files_like_torch_files(tmp_path: Path) -> None:
    good, bad, hostile = (tmp_path / f"{n}.safetensors" for n in ("good", "bad", "hostile"))
    save_file({"enc.w": ss.validate(torch.eye(4).to_sparse_bsr((2, 2))), "b": torch.ones(2)},
              good)
    flat, meta = _valid_parts()
    st.save_file({**flat, "w.__ss_col_indices": torch.tensor([0, 10**9, 2])}, bad,
                 metadata=meta)
    st.save_file(flat, hostile, metadata=_spec(layout="sparse_foo"))
    code, out = run_cli("check", good)
    assert code == 0
    assert out.splitlines()[:2] == [f"{good}: 1 sparse tensor, 1 dense tensor",
                                    "  ['enc.w']  BSR  (4, 4)  nnz 2  OK"]
    code, out = run_cli("check", good, bad)
    assert code == 1
    line = next(x for x in out.splitlines() if "['w']" in x)
    assert "INVALID [CSR 5.5]" in line and "col_indices[1] = 1000000000" in line
    code, out = run_cli("check", "--json", bad, hostile)
    assert code == 2
    doc = json.loads(out)
    assert doc["files"][0]["tensors"][0]["invariant"] == "5.5"
    assert doc["files"][0]["tensors"][0]["key_path"] == ["w"]
    assert doc["files"][1]["error"].startswith("FormatError: sparse tensor 'w': unknown layout")
    renamed = tmp_path / "weights.bin"  # found by its content
    renamed.write_bytes(bad.read_bytes())
    assert run_cli("check", renamed)[0] == 1
    assert cli.find_checkpoints(tmp_path) == sorted([bad, good, hostile])


def test_check_quiet_prints_only_failures_and_the_summary(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"a": torch.eye(2).to_sparse()}, good)
    torch.save({"a": torch.eye(2).to_sparse(), "z": _unchecked_csr([0, 9, 1])}, bad)
    code, out = run_cli("check", "--quiet", good, bad)
    assert code == 1
    assert out.splitlines() == [
        f"{bad}: 2 sparse tensors, 0 dense tensors",
        out.splitlines()[1],
        "summary: 2 files, 3 sparse tensors checked (2 valid, 1 invalid), 0 dense tensors, "
        "0 unreadable",
    ]
    assert out.splitlines()[1].startswith("  ['z']") and "INVALID [CSR 5.5]" in out
    code, out = run_cli("check", "-q", good)
    assert (code, len(out.splitlines())) == (0, 1)


class Marker:
    """A class a checkpoint names as a global (importable as tests.test_safetensors.Marker)."""


def test_check_allow_global_admits_a_named_global(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"f": io.StringIO, "w": torch.eye(2).to_sparse_csr()}, path)
    code, out = run_cli("check", path)
    assert code == 2 and "admit it with --allow-global _io.StringIO" in out
    code, out = run_cli("check", "--allow-global", "_io.StringIO", "--allow-global",
                     "collections.OrderedDict", path)
    assert code == 0 and "['w']  CSR  (2, 2)  nnz 2  OK" in out
    assert cli.resolve_global("collections.OrderedDict.fromkeys") is not None
    with pytest.raises(SystemExit) as info:
        run_cli("check", "--allow-global", "no_such_module_x.Thing", path)
    assert info.value.code == 2


# --- property: every valid tensor round-trips ----------------------------------------------------


@given(case=cases())
def test_every_valid_tensor_round_trips_through_bytes(case: Case) -> None:
    note(case.describe())
    t = case.ss_build()
    out = load(save({"t": t, "d": torch.ones(1)}))
    _assert_same(out["t"], t)
    assert torch.equal(out["t"].to_dense(), case.dense)

"""Loads that vet pruned checkpoints (issue 39, SPEC 7 and 9).

A ``safesparse.nn`` state dict holds dense tensors only: the index members and values of each
module beside its geometry (``_extra_state``). ``ss.load``, ``safesparse.safetensors.load_file``
and ``torch.load`` under enforce mode find each such triple by its geometry and validate it,
naming the key on the first line; ``python -m safesparse check`` reports it (exit 1 when
invalid, a damaged geometry included: never "0 sparse tensors checked"); the geometry and the
values must agree; for data read from a file the repair hint speaks of a corrupt file, not of
a larger size. No test here runs a kernel on the tampered data: every load refuses it.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli import run_cli
from torch import nn

import safesparse as ss
from safesparse import safetensors as sst
from safesparse.nn import SparseLinear

pytestmark = pytest.mark.filterwarnings("ignore:.*support is in beta state:UserWarning")

FILE_HINT = "the file's index data is corrupt or belongs to another model"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = SparseLinear.from_dense(nn.Linear(8, 8), (2, 2), 0.5)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.fc1(x).relu())
        return out


def state(**changes: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fresh copy of ``Net()``'s state dict with ``changes[key]`` applied to its keys
    (``fc1__plain_indices`` stands for ``fc1.plain_indices``)."""
    sd = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    for name, change in changes.items():
        key = name.replace("__", ".")
        sd[key] = change(sd[key])
    return sd


def out_of_range(t: torch.Tensor) -> torch.Tensor:
    t[0] = 1000
    return t


def geometry(**fields: int) -> Callable[[torch.Tensor], torch.Tensor]:
    where = {"tag": 0, "layout": 2, "rows": 3, "cols": 4, "block_rows": 5, "block_cols": 6}

    def change(t: torch.Tensor) -> torch.Tensor:
        for name, value in fields.items():
            t[where[name]] = value
        return t
    return change


def save_as(fmt: str, sd: Any, path: Path) -> Path:
    if fmt == "safetensors":
        sst.save_file(sd, path.with_suffix(".safetensors"))
        return path.with_suffix(".safetensors")
    torch.save(sd, path.with_suffix(".pt"))
    return path.with_suffix(".pt")


def load_with(loader: str, path: Path) -> Any:
    if loader == "ss.load":
        return ss.load(path)
    if loader == "load_file":
        return sst.load_file(path)
    with ss.enforce():
        return torch.load(path, weights_only=True)


LOADERS = [("ss.load", "pt"), ("load_file", "safetensors"), ("torch.load-enforced", "pt")]


@pytest.mark.parametrize(("loader", "fmt"), LOADERS, ids=[ld for ld, _ in LOADERS])
def test_loads_refuse_tampered_module_indices_naming_the_key(loader: str, fmt: str,
                                                             tmp_path: Path) -> None:
    path = save_as(fmt, state(fc1__plain_indices=out_of_range), tmp_path / "bad")
    with pytest.raises(ss.InvariantError) as info:
        load_with(loader, path)
    first = str(info.value).splitlines()[0]
    assert info.value.invariant == "5.5"
    assert "fc1.plain_indices" in first and path.name in first, first
    # the data came from a file: corrupt or another model's, not "pass a larger size"
    assert FILE_HINT in str(info.value) and "pass a larger size" not in str(info.value)
    good = save_as(fmt, state(), tmp_path / "good")
    loaded = load_with(loader, good)
    assert set(loaded) == set(Net().state_dict())


def test_ss_load_vets_a_state_dict_nested_in_a_checkpoint(tmp_path: Path) -> None:
    bad = state(fc1__compressed_indices=lambda t: t.flip(0))
    torch.save({"epoch": 3, "model": bad, "opt": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(ss.InvariantError) as info:
        ss.load(tmp_path / "ckpt.pt")
    first = str(info.value).splitlines()[0]
    assert "['model']['fc1.compressed_indices']" in first, first
    code, out = run_cli("check", tmp_path / "ckpt.pt")
    assert code == 1 and "fc1.compressed_indices" in out, out


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_geometry_and_values_must_agree(fmt: str, tmp_path: Path) -> None:
    """A 2x2-block checkpoint whose geometry says 4x4 (or CSR) is refused by the loads and by
    ``check``, naming the values' key."""
    for change, iid in ((geometry(block_rows=4, block_cols=4), "3.10"),
                        (geometry(layout=0, block_rows=1, block_cols=1), "3.4")):
        path = save_as(fmt, state(fc1___extra_state=change), tmp_path / f"g{iid}")
        with pytest.raises(ss.InvariantError) as info:
            ss.load(path) if fmt == "pt" else sst.load_file(path)
        assert info.value.invariant == iid
        assert "fc1.values" in str(info.value).splitlines()[0]
        code, out = run_cli("check", path)
        assert code == 1 and "fc1.values" in out and "INVALID" in out, out


DAMAGED = {
    "tag": lambda t: geometry(tag=7)(t),
    "layout-code": lambda t: geometry(layout=9)(t),
    "negative-rows": lambda t: geometry(rows=-8)(t),
    "float": lambda t: t.double(),
    "truncated": lambda t: t[:5].clone(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_damaged_geometry_is_invalid_never_dense(damage: str, fmt: str,
                                                   tmp_path: Path) -> None:
    """``check`` exits 1 naming the geometry's key (it said "0 sparse tensors checked", exit
    0, even with invalid indices beside it); the loads refuse the file."""
    for extra, name in (({}, "geom"), ({"fc1__plain_indices": out_of_range}, "both")):
        sd = state(fc1___extra_state=DAMAGED[damage], **extra)
        path = save_as(fmt, sd, tmp_path / f"{name}")
        code, out = run_cli("check", path)
        assert code == 1, out
        assert "fc1._extra_state" in out and "1 invalid" in out, out
        with pytest.raises(ValueError, match=r"fc1\._extra_state") as info:
            ss.load(path) if fmt == "pt" else sst.load_file(path)
        assert "damaged" in str(info.value).splitlines()[0]
        assert isinstance(info.value, RuntimeError)  # (as InvariantError: torch's type too)
        assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


@pytest.mark.parametrize("rows", [2**40, 2**62 - 2, 2**63 - 1])
def test_a_geometry_with_huge_sizes_is_invalid(rows: int, tmp_path: Path) -> None:
    """Sizes that do not fit the members (or overflow) are refused by the factory's checks,
    with no allocation of the stated size."""
    path = save_as("pt", state(fc1___extra_state=geometry(rows=rows, cols=rows)), tmp_path / "h")
    code, out = run_cli("check", path)
    assert code == 1 and "INVALID" in out, out
    with pytest.raises(ss.InvariantError, match=r"fc1\."):
        ss.load(path)


def test_check_reports_a_valid_module_matrix_ok(tmp_path: Path) -> None:
    path = save_as("pt", state(), tmp_path / "good")
    code, out = run_cli("check", path)
    assert code == 0 and "fc1.{compressed_indices,plain_indices,values}" in out, out
    assert "1 sparse tensor checked (1 valid" in out, out


# ---------------------------------------------------------------------------------------------
# torch.export archives


def _export(tmp_path: Path, tamper: bool = False) -> Path:
    ep = torch.export.export(Net(), (torch.randn(3, 8),))
    path = tmp_path / "net.pt2"
    torch.export.save(ep, path)
    if tamper:  # the plain indices' bytes in the archive, rewritten
        with zipfile.ZipFile(path) as z:
            entries = {n: z.read(n) for n in z.namelist()}
        name = next(n for n in entries if n.endswith("model_weights_config.json"))
        config = json.loads(entries[name])["config"]
        weight = name.rsplit("/", 1)[0] + "/" + config["fc1.plain_indices"]["path_name"]
        data = bytearray(entries[weight])
        data[0:8] = (1000).to_bytes(8, "little")
        entries[weight] = bytes(data)
        with zipfile.ZipFile(path, "w") as z:
            for n, b in entries.items():
                z.writestr(n, b)
    return path


def test_check_says_a_pt2_file_is_a_torch_export_archive_and_vets_it(tmp_path: Path) -> None:
    path = _export(tmp_path)
    code, out = run_cli("check", path)
    assert "probably corrupted" not in out and "torch.export" in out, out
    assert code == 0 and "fc1.{compressed_indices,plain_indices,values}" in out, out
    assert "BSR" in out, out


def test_check_finds_tampered_indices_in_a_pt2_archive(tmp_path: Path) -> None:
    path = _export(tmp_path, tamper=True)
    code, out = run_cli("check", path)
    assert code == 1, out
    assert "fc1.plain_indices" in out and "5.5" in out, out
    code, out = run_cli("check", "--json", path)
    assert code == 1 and '"invariant": "5.5"' in out, out


def _rewrite_config(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in entries if n.endswith("model_weights_config.json"))
    config = json.loads(entries[name])
    change(config["config"])
    entries[name] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, b in entries.items():
            z.writestr(n, b)


@pytest.mark.parametrize("attack", ["strides-past-the-bytes", "pickled", "symbolic-size",
                                    "not-json", "duplicate-entry"])
def test_a_crafted_pt2_archive_is_unreadable_never_read_past_its_bytes(
        attack: str, tmp_path: Path) -> None:
    """A member whose strides reach past its bytes, one stored pickled (check unpickles
    nothing), a symbolic size, a config that is not JSON: exit 2, naming the archive."""
    path = _export(tmp_path)

    def change(config: dict[str, Any]) -> None:
        meta = config["fc1.plain_indices"]
        if attack == "strides-past-the-bytes":
            meta["tensor_meta"]["strides"] = [{"as_int": 10**6}]
        elif attack == "pickled":
            meta["use_pickle"] = True
        else:
            meta["tensor_meta"]["sizes"] = [{"as_expr": {"expr_str": "s0"}}]

    if attack == "duplicate-entry":  # a second, tampered, plain_indices under the same name
        with zipfile.ZipFile(path) as z:
            entries = {n: z.read(n) for n in z.namelist()}
        config = json.loads(next(b for n, b in entries.items()
                                 if n.endswith("model_weights_config.json")))["config"]
        weight = next(n for n in entries
                      if n.endswith("/" + config["fc1.plain_indices"]["path_name"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (zipfile warns of the duplicate name)
            with zipfile.ZipFile(path, "a") as z:
                z.writestr(weight, (1000).to_bytes(8, "little") + entries[weight][8:])
    elif attack == "not-json":
        with zipfile.ZipFile(path) as z:
            entries = {n: z.read(n) for n in z.namelist()}
        name = next(n for n in entries if n.endswith("model_weights_config.json"))
        entries[name] = b"{not json"
        with zipfile.ZipFile(path, "w") as z:
            for n, b in entries.items():
                z.writestr(n, b)
    else:
        _rewrite_config(path, change)
    code, out = run_cli("check", path)
    assert code == 2, out
    assert "torch.export archive" in out and "cannot read" in out, out


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = Net().fc1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.cond(x.sum() > 0, lambda x: self.fc(x), lambda x: x * 2, (x,))
        return out


def test_safesparse_operators_in_nested_graphs_are_named_not_skipped(tmp_path: Path) -> None:
    """An operator inside a ``torch.cond`` branch is not vetted: check says so (exit 2)
    rather than reporting "0 sparse tensors" as if there were none."""
    torch.export.save(torch.export.export(Branching(), (torch.randn(3, 8),)),
                      tmp_path / "cond.pt2")
    code, out = run_cli("check", tmp_path / "cond.pt2")
    assert code == 2 and "nested graphs" in out, out


def test_hint_for_data_built_in_the_program_is_unchanged() -> None:
    with pytest.raises(ss.InvariantError) as info:
        ss.sparse_csr_tensor([0, 1], [5], [1.0], (1, 3))
    assert "pass a larger size" in str(info.value) and FILE_HINT not in str(info.value)


def test_hint_for_a_tampered_sparse_tensor_in_a_file(tmp_path: Path) -> None:
    bad = torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([5]), torch.tensor([1.0]),
                                  (1, 3), check_invariants=False)
    buf = io.BytesIO()
    torch.save({"w": bad}, buf)
    buf.seek(0)
    with pytest.raises(ss.InvariantError) as info:
        ss.load(buf)
    assert FILE_HINT in str(info.value) and "pass a larger size" not in str(info.value)

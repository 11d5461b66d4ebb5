"""Saving refuses invalid data (SPEC 7): ``ss.save`` and ``safesparse.safetensors.save_file``
name the key path of an invalid sparse tensor and leave no file behind, temporary file included;
what they write is what ``torch.save`` / ``safetensors`` would write to that name."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import safesparse as ss
from safesparse.safetensors import load_file, save_file


def _bad(requires_grad: bool = False) -> ss.SafeSparseTensor:
    """An unchecked SafeSparseTensor whose column index is far past its 3 columns."""
    return ss.sparse_csr_tensor([0, 1, 2], [0, 10**9], [1.0, 2.0], (2, 3),
                                check_invariants=False, requires_grad=requires_grad)


def test_ss_save_names_the_key_path_of_an_unchecked_safe_tensor(tmp_path: Path) -> None:
    bad = _bad()
    assert isinstance(bad, ss.SafeSparseTensor) and not ss.is_checked(bad)
    with pytest.raises(ss.InvariantError) as info:
        ss.save({"enc": {"w": bad}}, tmp_path / "model.pt")
    err = info.value
    assert (err.invariant, err.path) == ("5.5", "['enc']['w']")
    assert "['enc']['w']" in str(err)
    assert err.op is None and "in op" not in str(err)  # no operation ran: a save is no op
    assert list(tmp_path.iterdir()) == []


def test_ss_save_of_an_invalid_leaf_that_requires_grad(tmp_path: Path) -> None:
    bad = _bad(requires_grad=True)
    assert bad.is_leaf and bad.requires_grad
    with pytest.raises(ss.InvariantError) as info:
        ss.save({"layer": {"weight": bad}}, tmp_path / "model.pt")
    assert info.value.path == "['layer']['weight']"
    assert list(tmp_path.iterdir()) == []


def test_safetensors_save_file_names_the_key_of_an_unchecked_safe_tensor(
    tmp_path: Path,
) -> None:
    with pytest.raises(ss.InvariantError) as info:
        save_file({"enc.w": _bad(), "ok": torch.ones(2)}, tmp_path / "m.safetensors")
    assert (info.value.invariant, info.value.path) == ("5.5", "['enc.w']")
    assert "['enc.w']" in str(info.value) and "in op" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_valid_unchecked_tensor_is_saved_and_checked(tmp_path: Path) -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [0, 2], [1.0, 2.0], (2, 3), check_invariants=False)
    ss.save({"enc": {"w": t}}, tmp_path / "model.pt")
    assert ss.is_checked(t)
    assert ss.is_checked(ss.load(tmp_path / "model.pt")["enc"]["w"])


def test_ss_save_archive_is_named_after_the_file_not_a_temporary_one(tmp_path: Path) -> None:
    """torch.save names the archive's inner folder after the file; ss.save writes through a
    temporary file, which must not show (``.model.pt.<hex>/`` instead of ``model/``)."""
    obj = {"w": ss.validate(torch.eye(3).to_sparse_csr()), "d": torch.ones(2)}
    ss.save(obj, tmp_path / "model.pt")
    torch.save(ss.unwrap_all(obj), tmp_path / "torch.pt")
    ours = zipfile.ZipFile(tmp_path / "model.pt").namelist()
    theirs = zipfile.ZipFile(tmp_path / "torch.pt").namelist()
    assert {n.split("/", 1)[0] for n in ours} == {"model"}
    assert [n.split("/", 1)[1] for n in ours] == [n.split("/", 1)[1] for n in theirs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "torch.pt"]


def test_safetensors_save_file_leaves_only_the_file(tmp_path: Path) -> None:
    save_file({"w": ss.validate(torch.eye(3).to_sparse_csr())}, tmp_path / "m.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    assert ss.is_checked(load_file(tmp_path / "m.safetensors")["w"])


def test_a_relative_file_name_is_written_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    ss.save({"d": torch.ones(2)}, "model.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert zipfile.ZipFile("model.pt").namelist()[0].startswith("model/")

"""Files from elsewhere: pickling SafeSparseTensor, and ``ss.load`` of untrusted checkpoints.

Tampered files are written the way a corrupted or malicious checkpoint would carry them: either
by ``torch.save`` of a tensor built with torch's unchecked factory, or by :class:`Forged`, an
object that pickles to exactly what ``torch.save`` writes for a sparse tensor
(``torch._utils._rebuild_sparse_tensor(layout, members)``) but with arbitrary members.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import safesparse as ss
from safesparse.pickling import reduce_safe_sparse
from safesparse.serialization import SparseRecord, _rebuild_safe_sparse

COO, CSR, CSC, BSR, BSC = (
    torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc,
)
LAYOUTS = (COO, CSR, CSC, BSR, BSC)
NAMES = {COO: "COO", CSR: "CSR", CSC: "CSC", BSR: "BSR", BSC: "BSC"}


# --- helpers -----------------------------------------------------------------------------------


def sample(layout: torch.layout, batch: tuple[int, ...] = (), dense: tuple[int, ...] = ()
           ) -> torch.Tensor:
    """A plain torch sparse tensor of ``layout``: batch + (4, 6) + dense, 2 x 2 block pattern
    (the same number of specified elements in every batch)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.float64)
    mask = blocks.repeat_interleave(2, 0).repeat_interleave(2, 1)  # (4, 6)
    mask = mask.reshape((1,) * len(batch) + (4, 6) + (1,) * len(dense))
    x = (torch.rand(*batch, 4, 6, *dense, generator=gen, dtype=torch.float64) + 1) * mask
    if layout == COO:
        return x.to_sparse(len(batch) + 2)
    if layout == BSR:
        return x.to_sparse_bsr((2, 2), dense_dim=len(dense))
    if layout == BSC:
        return x.to_sparse_bsc((2, 2), dense_dim=len(dense))
    if layout == CSR:
        return x.to_sparse_csr(dense_dim=len(dense))
    return x.to_sparse_csc(dense_dim=len(dense))


def members(t: torch.Tensor) -> list[torch.Tensor]:
    p = ss.unwrap(t)
    if p.layout == COO:
        return [p._indices(), p._values()]
    if p.layout in (CSR, BSR):
        return [p.crow_indices(), p.col_indices(), p.values()]
    return [p.ccol_indices(), p.row_indices(), p.values()]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.layout == b.layout and a.shape == b.shape and a.dtype == b.dtype
    for x, y in zip(members(a), members(b), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(ss.unwrap(a).to_dense(), ss.unwrap(b).to_dense())


class Forged:
    """Pickles to ``torch._utils._rebuild_sparse_tensor(layout, data)``, any data."""

    def __init__(self, layout: torch.layout, *data: Any) -> None:
        self.layout, self.data = layout, data

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_sparse_tensor, (self.layout, self.data))


def unchecked_csr(col: list[int], crow: list[int] | None = None, n: int = 3) -> torch.Tensor:
    crow_t = torch.tensor(crow if crow is not None else list(range(len(col) + 1)))
    return torch.sparse_csr_tensor(crow_t, torch.tensor(col), torch.ones(len(col)), (n, n),
                                   check_invariants=False)


def saved(tmp_path: Path, obj: Any, name: str = "ckpt.pt", *, legacy: bool = False) -> Path:
    """``torch.save`` to a file; ``legacy=True``: the pre-1.6 format, whose storages follow the
    pickle (torch rebuilds the sparse tensors before it has read their data)."""
    path = tmp_path / name
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path


CASES = [
    pytest.param(layout, batch, dense, id=f"{NAMES[layout]}-b{len(batch)}-d{len(dense)}")
    for layout in LAYOUTS
    for batch, dense in (((), ()), ((2,), ()), ((), (3,)), ((2,), (3,)))
    if not (layout == COO and batch)  # COO has no batch dims (they are sparse dims)
]


# --- pickling SafeSparseTensor -----------------------------------------------------------------


@pytest.mark.parametrize(("layout", "batch", "dense"), CASES)
def test_round_trips(layout: torch.layout, batch: tuple[int, ...], dense: tuple[int, ...],
                     tmp_path: Path) -> None:
    t = ss.validate(sample(layout, batch, dense))

    loaded = [pickle.loads(pickle.dumps(t))]
    path = saved(tmp_path, {"w": t})
    loaded.append(torch.load(path, weights_only=False)["w"])
    loaded.append(torch.load(path, weights_only=True)["w"])  # safesparse is imported
    loaded.append(ss.load(path)["w"])
    plain_path = saved(tmp_path, {"w": ss.unwrap(t)}, "plain.pt")
    loaded.append(ss.load(plain_path)["w"])  # a plain torch checkpoint
    for obj in (t, ss.unwrap(t)):
        loaded.append(ss.load(saved(tmp_path, {"w": obj}, "legacy.pt", legacy=True))["w"])
    for u in loaded:
        assert isinstance(u, ss.SafeSparseTensor) and ss.is_checked(u)
        assert_same(u, t)


def test_coo_coalesced_flag_round_trips(tmp_path: Path) -> None:
    coalesced = ss.validate(sample(COO))
    uncoalesced = ss.sparse_coo_tensor([[1, 0, 1]], [1.0, 2.0, 3.0], (2,))
    assert coalesced.is_coalesced() and not uncoalesced.is_coalesced()
    back = ss.load(saved(tmp_path, [coalesced, uncoalesced]))
    assert back[0].is_coalesced() and not back[1].is_coalesced()
    assert torch.equal(back[1].to_dense(), torch.tensor([2.0, 4.0]))


def test_requires_grad_round_trips(tmp_path: Path) -> None:
    t = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2), requires_grad=True)
    for u in (pickle.loads(pickle.dumps(t)), ss.load(saved(tmp_path, t))):
        assert u.requires_grad and u.is_leaf and ss.is_checked(u)
        (u @ torch.ones(2, 1)).sum().backward()
        assert u.grad is not None


def test_pickle_carries_no_checked_flag() -> None:
    t = ss.validate(sample(CSR))
    func, args = reduce_safe_sparse(t)
    assert func is _rebuild_safe_sparse
    layout, data, requires_grad = args
    assert layout == CSR and requires_grad is False
    assert all(isinstance(x, torch.Tensor) for x in data[:3]) and data[3] == (4, 6)
    assert not any(isinstance(x, ss.SafeSparseTensor) for x in data)


def test_unpickling_always_validates_again() -> None:
    blob = pickle.dumps(ss.validate(sample(BSR)))
    ss.reset_stats()
    ss.clear_cache()
    pickle.loads(blob)
    assert ss.stats().validations == 1


@pytest.mark.parametrize("how", ["pickle", "torch.load", "torch.load weights_only"])
def test_pickled_unchecked_invalid_tensor_raises_on_load(how: str, tmp_path: Path) -> None:
    bad = ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], (2, 3),
                               check_invariants=False)
    assert not ss.is_checked(bad)
    with pytest.raises(ss.InvariantError, match=r"^\[CSR 5\.6\]"):
        if how == "pickle":
            pickle.loads(pickle.dumps(bad))
        else:
            torch.load(saved(tmp_path, bad), weights_only=how.endswith("weights_only"))


def test_forged_safe_pickle_is_validated() -> None:
    """A pickle calling the rebuild function directly with bad members is refused too."""

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (_rebuild_safe_sparse, (CSR, (torch.tensor([0, 1]), torch.tensor([7]),
                                                 torch.ones(1), (1, 3)), False))

    with pytest.raises(ss.InvariantError, match=r"^\[CSR 5\.5\]"):
        pickle.loads(pickle.dumps(Evil()))


def test_rebuild_function_is_a_registered_safe_global() -> None:
    assert _rebuild_safe_sparse in torch.serialization.get_safe_globals()


# --- ss.load -----------------------------------------------------------------------------------


def test_load_wraps_every_sparse_tensor_in_nested_containers(tmp_path: Path) -> None:
    csr, coo, bsc = sample(CSR), sample(COO, dense=(3,)), sample(BSC, (2,))
    dense = torch.randn(3)
    state = collections.OrderedDict([("layer.weight", csr), ("layer.bias", dense)])
    state._metadata = {"layer": {"version": 2}}  # type: ignore[attr-defined]
    obj = {"model": state, "extra": [coo, (1, {"deep": bsc})], "step": 7}
    out = ss.load(saved(tmp_path, obj))
    assert isinstance(out["model"], collections.OrderedDict)
    assert out["model"]._metadata == {"layer": {"version": 2}}  # state-dict metadata survives
    assert torch.equal(out["model"]["layer.bias"], dense)
    assert type(out["model"]["layer.bias"]) is torch.Tensor and out["step"] == 7
    for got, want in ((out["model"]["layer.weight"], csr), (out["extra"][0], coo),
                      (out["extra"][1][1]["deep"], bsc)):
        assert isinstance(got, ss.SafeSparseTensor) and ss.is_checked(got)
        assert_same(got, want)


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"layer.weight": "BAD"}, "['layer.weight']"),
        (["ok", "BAD"], "[1]"),
        ({"a": [{"b": "BAD"}]}, "['a'][0]['b']"),
        ({"a": ("ok", {"b": ("x", "BAD")})}, "['a'][1]['b'][1]"),
        (collections.OrderedDict(w=collections.OrderedDict(v="BAD")), "['w']['v']"),
        ({3: "BAD"}, "[3]"),
    ],
)
def test_load_error_names_the_key_path(obj: Any, path: str, tmp_path: Path) -> None:
    bad, ok = unchecked_csr([0, 10**9, 1]), sample(CSR)

    def fill(x: Any) -> Any:
        if x == "BAD":
            return bad
        if x == "ok":
            return ok
        if isinstance(x, dict):
            return type(x)((k, fill(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    file = saved(tmp_path, fill(obj))
    with pytest.raises(ss.InvariantError) as info:
        ss.load(file)
    err = info.value
    assert err.invariant == "5.5" and err.layout == CSR and err.path == path
    assert str(err).startswith("[CSR 5.5]")
    assert str(err).splitlines()[0].endswith(f"(at {path}) (loaded by ss.load from "
                                             f"{file.name!r})")  # base name: issue 41
    assert str(err).endswith(f"\nto repair: {err.hint}")
    assert "col_indices[1] = 1000000000" in str(err)


def test_load_reports_the_first_invalid_tensor_in_order(tmp_path: Path) -> None:
    obj = {"a": sample(CSR), "b": unchecked_csr([1, 0], [0, 2, 2], n=2), "c": unchecked_csr([9])}
    with pytest.raises(ss.InvariantError) as info:
        ss.load(saved(tmp_path, obj))
    assert info.value.path == "['b']" and info.value.invariant == "5.6"


def test_load_of_a_bare_tensor(tmp_path: Path) -> None:
    assert ss.is_checked(ss.load(saved(tmp_path, sample(BSR, (2,), (3,)))))
    with pytest.raises(ss.InvariantError) as info:
        ss.load(saved(tmp_path, unchecked_csr([0, 3, 1]), "bad.pt"))
    assert info.value.path in (None, "") and "(at" not in str(info.value)


def test_load_accepts_file_objects_and_torch_load_kwargs(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": sample(CSC)}, buf)
    buf.seek(0)
    out = ss.load(buf, map_location="cpu")
    assert ss.is_checked(out["w"])


def test_load_defaults_to_weights_only(tmp_path: Path) -> None:
    path = saved(tmp_path, {"f": collections.deque, "w": sample(CSR)})
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ss.load(path)
    out = ss.load(path, weights_only=False)  # the caller's explicit choice
    assert out["f"] is collections.deque and ss.is_checked(out["w"])


def test_load_adopts_sparse_parameters(tmp_path: Path) -> None:
    param = torch.nn.Parameter(sample(COO))
    out = ss.load(saved(tmp_path, {"p": param}))
    assert isinstance(out["p"], ss.SafeSparseTensor) and ss.is_checked(out["p"])
    assert out["p"].requires_grad and out["p"].is_leaf
    assert_same(out["p"], param.detach())


def test_invalid_tensor_wrapped_by_torch_during_load_is_still_refused(tmp_path: Path) -> None:
    # torch wraps the refused record in a Parameter, which fails: the invariant is what counts.
    path = saved(tmp_path, {"p": torch.nn.Parameter(unchecked_csr([0, 10**9, 1]))})
    with pytest.raises(ss.InvariantError, match=r"^\[CSR 5\.5\]") as info:
        ss.load(path)
    assert info.value.path is None and info.value.__cause__ is not None


def test_invalid_tensor_the_walk_cannot_reach_is_still_refused(tmp_path: Path) -> None:
    path = saved(tmp_path, {"s": {unchecked_csr([0, 10**9, 1])}})  # a set: not a pytree node
    with pytest.raises(ss.InvariantError, match=r"^\[CSR 5\.5\]"):
        ss.load(path)


@pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning")
def test_legacy_sparse_constructor_is_validated(tmp_path: Path) -> None:
    class Legacy:
        def __init__(self, index: int) -> None:
            self.index = index

        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.sparse.FloatTensor,
                    (torch.tensor([[0, self.index]]), torch.ones(2), torch.Size([2])))

    out = ss.load(saved(tmp_path, {"w": Legacy(1)}))
    assert ss.is_checked(out["w"])
    with pytest.raises(ss.InvariantError) as info:
        ss.load(saved(tmp_path, {"w": Legacy(5)}, "bad.pt"))
    assert info.value.invariant == "5.2" and info.value.path == "['w']"


def test_global_torch_invariant_checks_do_not_change_the_outcome(tmp_path: Path) -> None:
    good = saved(tmp_path, {"w": sample(CSR)}, "good.pt")
    bad = saved(tmp_path, {"w": unchecked_csr([0, 10**9, 1])}, "bad.pt")
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        assert ss.is_checked(ss.load(good)["w"])
        with pytest.raises(ss.InvariantError) as info:
            ss.load(bad)
    assert info.value.path == "['w']" and info.value.invariant == "5.5"


# --- the legacy file format: data read after the tensors are rebuilt ----------------------------


def test_legacy_format_is_validated_after_its_data_is_read(tmp_path: Path) -> None:
    state = collections.OrderedDict(a=sample(CSR, (2,), (3,)), b=[(ss.validate(sample(BSC)),)])
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    out = ss.load(saved(tmp_path, state, legacy=True))
    assert out._metadata == {"": {"version": 1}}
    for got, want in ((out["a"], state["a"]), (out["b"][0][0], state["b"][0][0])):
        assert ss.is_checked(got)
        assert_same(got, want)
    bad = saved(tmp_path, {"x": [unchecked_csr([0, 10**9, 1])]}, "bad.pt", legacy=True)
    with pytest.raises(ss.InvariantError) as info:
        ss.load(bad)
    assert (info.value.invariant, info.value.path) == ("5.5", "['x'][0]")


def test_legacy_loader_is_recognised() -> None:
    """safesparse recognises torch's legacy loader by its code object; a torch release that
    renames it must fail here, not silently validate storages before they are read."""
    from safesparse import serialization

    assert serialization._LEGACY_LOAD_CODE is torch.serialization._legacy_load.__code__


def test_plain_torch_load_of_a_legacy_file_never_yields_an_unvalidated_safe_tensor(
    tmp_path: Path,
) -> None:
    path = saved(tmp_path, {"w": ss.validate(sample(CSR))}, legacy=True)
    with pytest.raises(RuntimeError, match=r"legacy-format.*safesparse\.load\(\)"):
        torch.load(path, weights_only=True)
    assert ss.is_checked(ss.load(path)["w"])


def test_legacy_file_with_a_sparse_parameter_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path, {"p": torch.nn.Parameter(sample(CSR))}, legacy=True)
    with pytest.raises(RuntimeError, match="legacy-format checkpoint"):
        ss.load(path)


# --- tampered files, one per invariant family --------------------------------------------------

I64 = torch.int64


def _meta(*shape: int, dtype: torch.dtype = I64) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


TAMPERED = [
    # family 1: dtypes
    pytest.param(Forged(CSR, torch.tensor([0.0, 1.0]), torch.tensor([0.0]), torch.ones(1),
                        (1, 2)), "CSR", "1.3", id="CSR-1.3-float-indices"),
    pytest.param(Forged(CSR, torch.tensor([0.0, 1.0]), torch.tensor([0]), torch.ones(1),
                        (1, 2)), "CSR", "1.1", id="CSR-1.1-float-compressed"),
    pytest.param(Forged(CSR, torch.tensor([0, 1]), torch.tensor([0], dtype=torch.int32),
                        torch.ones(1), (1, 2)), "CSR", "1.2", id="CSR-1.2-mixed-index-dtypes"),
    # COO float indices are converted to int64 as torch converts them (SPEC 3, COO 1.1): a file
    # holding them loads like torch loads it, so no COO 1.1 row here
    # family 2: member layouts
    pytest.param(Forged(CSR, torch.tensor([0, 1]), torch.tensor([0]).to_sparse(),
                        torch.ones(1), (1, 2)), "CSR", "2.2", id="CSR-2.2-sparse-member"),
    pytest.param(Forged(COO, torch.tensor([[0]]), torch.ones(1).to_sparse(), (2,), None),
                 "COO", "2.2", id="COO-2.2-sparse-values"),
    # family 3: shapes
    pytest.param(Forged(BSR, torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2, 2),
                        (2, 3)), "BSR", "3.1", id="BSR-3.1-size-not-divisible"),
    pytest.param(Forged(CSC, torch.tensor([0, 1, 1]), torch.tensor([0]), torch.ones(1),
                        (2, 3)), "CSC", "3.8", id="CSC-3.8-compressed-shape"),
    pytest.param(Forged(CSR, torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(3),
                        (2, 2)), "CSR", "3.10", id="CSR-3.10-values-shape"),
    pytest.param(Forged(COO, torch.zeros(1, 1, 1, dtype=I64), torch.ones(1), (2,), None), "COO",
                 "3.1", id="COO-3.1-indices-dims"),
    pytest.param(Forged(COO, torch.tensor([[0, 1]]), torch.ones(3), (2,), None), "COO", "3.3",
                 id="COO-3.3-nnz-mismatch"),
    # family 4: devices (only meta is reachable on a CPU-only machine)
    pytest.param(Forged(CSR, _meta(3), _meta(2), _meta(2, dtype=torch.float32), (2, 2)), "CSR",
                 "4.1", id="CSR-4.1-meta"),
    pytest.param(Forged(COO, _meta(1, 2), _meta(2, dtype=torch.float32), (2,), None), "COO",
                 "4.1", id="COO-4.1-meta"),
    # family 5: index data
    pytest.param(Forged(CSR, torch.tensor([1, 1, 2]), torch.tensor([0, 1]), torch.ones(2),
                        (2, 2)), "CSR", "5.1", id="CSR-5.1"),
    pytest.param(Forged(CSC, torch.tensor([0, 1, 3]), torch.tensor([0, 1]), torch.ones(2),
                        (2, 2)), "CSC", "5.2", id="CSC-5.2"),
    pytest.param(Forged(BSR, torch.tensor([[0, 2, 1, 2]]), torch.tensor([[0, 1]]),
                        torch.ones(1, 2, 1, 1), (1, 3, 2)), "BSR", "5.3", id="BSR-5.3-batched"),
    pytest.param(Forged(BSC, torch.tensor([0, 1]), torch.tensor([-1]), torch.ones(1, 2, 2),
                        (4, 2)), "BSC", "5.4", id="BSC-5.4"),
    pytest.param(Forged(CSR, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 10**9, 1]),
                        torch.ones(3), (3, 3)), "CSR", "5.5", id="CSR-5.5"),
    pytest.param(Forged(CSR, torch.tensor([0, 2], dtype=torch.int32),
                        torch.tensor([1, 1], dtype=torch.int32), torch.ones(2, 3), (1, 2, 3)),
                 "CSR", "5.6", id="CSR-5.6-hybrid-int32"),
    pytest.param(Forged(COO, torch.tensor([[0, -1]]), torch.ones(2), (2,), None), "COO", "5.1",
                 id="COO-5.1"),
    pytest.param(Forged(COO, torch.tensor([[0, 1], [0, 7]]), torch.ones(2), (2, 3), False),
                 "COO", "5.2", id="COO-5.2"),
    pytest.param(Forged(COO, torch.tensor([[1, 0]]), torch.ones(2), (2,), True), "COO", "5.3",
                 id="COO-5.3-marked-coalesced"),
]


@pytest.mark.parametrize(("forged", "layout", "invariant"), TAMPERED)
def test_tampered_file_is_refused_with_its_invariant(
    forged: Forged, layout: str, invariant: str, tmp_path: Path
) -> None:
    path = saved(tmp_path, {"model": {"w": forged}})
    with pytest.raises(ss.InvariantError) as info:
        ss.load(path)
    err = info.value
    assert (NAMES[err.layout], err.invariant) == (layout, invariant), str(err)
    assert err.path == "['model']['w']"
    assert str(err).startswith(f"[{layout} {invariant}]")


def test_tampered_index_data_error_names_the_location(tmp_path: Path) -> None:
    forged = Forged(BSR, torch.tensor([[0, 1, 2], [0, 2, 2]]), torch.tensor([[0, 1], [1, 0]]),
                    torch.ones(2, 2, 2, 2), (2, 4, 4))
    with pytest.raises(ss.InvariantError) as info:
        ss.load(saved(tmp_path, {"w": forged}))
    err = info.value
    assert err.invariant == "5.6"
    assert err.location["batch"] == (1,) and err.location["position"] == 1
    assert "batch (1,)" in str(err) and "block row 0" in str(err)


# --- the crash torch does not prevent, and the proof that nothing ran on the bad data ------------


class SparseOpSpy(TorchDispatchMode):
    """Records every aten op that receives or returns a tensor with a sparse layout."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse_ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs, out))
        if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in leaves):
            self.sparse_ops.append(str(func))
        return out


def test_tampered_tensor_never_reaches_a_sparse_kernel(tmp_path: Path) -> None:
    path = saved(tmp_path, {"w": unchecked_csr([0, 10**9, 1])})
    with SparseOpSpy() as spy, pytest.raises(ss.InvariantError):
        ss.load(path)
    assert spy.sparse_ops == []  # no sparse tensor was built, none was read
    good = saved(tmp_path, {"w": sample(CSR)}, "good.pt")
    with SparseOpSpy() as spy:
        ss.load(good)
    assert any("sparse_compressed_tensor" in op for op in spy.sparse_ops)  # the spy works


def test_refused_records_are_not_tensors() -> None:
    record = SparseRecord(CSR, (torch.tensor([0]), torch.tensor([]), torch.ones(0)), (0, 0),
                          None, ss.InvariantError(CSR, "5.5", "x"))
    assert not isinstance(record, torch.Tensor)
    assert record.shape == (0, 0) and record.nnz == 0
    assert "[CSR 5.5]" in repr(record)


def test_pickles_name_the_rebuild_function_where_files_have_always_found_it() -> None:
    """The code moved to safesparse.files; files written before and after the move name
    ``safesparse.serialization._rebuild_safe_sparse`` and load under weights_only=True."""
    from safesparse import serialization
    from safesparse.files import pickling

    data = pickle.dumps(ss.validate(sample(CSR)))
    assert b"safesparse.serialization" in data and b"safesparse.files" not in data
    assert serialization._rebuild_safe_sparse is pickling._rebuild_safe_sparse
    buf = io.BytesIO()
    torch.save({"w": ss.validate(sample(CSR))}, buf)
    buf.seek(0)
    assert ss.is_checked(torch.load(buf, weights_only=True)["w"])

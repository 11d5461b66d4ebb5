"""``load_state_dict`` of ``safesparse.nn`` modules (issue 39, SPEC 9): errors name the key
(the layer's prefix and the member), a state dict saved by 0.2.0 (no geometry) loads into a
layer of the same layout, the geometry and the values must agree, a damaged geometry is an
error naming its key, and a load that torch refuses for another key of the module (a bias of
another shape) leaves the module as it was. No test runs a kernel on invalid data: every load
here refuses it before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.batch import Batch, child_env
from torch import nn

import safesparse as ss
from safesparse.nn import SparseLinear, SparseMatmul

pytestmark = pytest.mark.filterwarnings("ignore:.*support is in beta state:UserWarning")

STATE_DICT_HINT = "the state dict's index data is corrupt or belongs to another model"


class Net(nn.Module):
    def __init__(self, density: float = 0.5, blocks: tuple[int, int] = (2, 2),
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = SparseLinear.from_dense(nn.Linear(8, 8), blocks, density)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.fc1(x).relu())
        return out


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_unchanged(m: nn.Module, before: dict[str, torch.Tensor], prefix: str = "") -> None:
    """``m``'s state (the keys under ``prefix``) is ``before``'s."""
    after = m.state_dict()
    assert set(after) == set(before)
    for k, v in after.items():
        if k.startswith(prefix):
            assert v.shape == before[k].shape and torch.equal(v, before[k]), k


def test_an_invalid_pattern_names_the_layers_key_on_the_first_line() -> None:
    net = Net()
    sd = snapshot(net)
    sd["fc1.plain_indices"][0] = 1000
    before = snapshot(net)
    with pytest.raises(ss.InvariantError) as info:
        net.load_state_dict(sd)
    first = str(info.value).splitlines()[0]
    assert "fc1.plain_indices" in first and "load_state_dict" in first, first
    assert STATE_DICT_HINT in str(info.value)
    assert "pass a larger size" not in str(info.value)
    assert_unchanged(net, before)
    sd = snapshot(net)
    sd["fc1.compressed_indices"] = sd["fc1.compressed_indices"].flip(0)
    with pytest.raises(ss.InvariantError, match=r"fc1\.compressed_indices"):
        net.load_state_dict(sd)
    assert_unchanged(net, before)


def test_a_state_dict_saved_by_0_2_0_loads_with_the_layers_geometry() -> None:
    """0.2.0 saved the index members, the values and the bias, no ``_extra_state``."""
    src = Net(density=0.25, seed=1)
    old = {k: v for k, v in snapshot(src).items() if not k.endswith("_extra_state")}
    net = Net()
    result = net.load_state_dict(old)  # strict: no missing key
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(3, 8)
    torch.testing.assert_close(net(x), src(x))
    assert ss.is_checked(net.fc1.weight) and net.fc1.values.shape == src.fc1.values.shape
    # still validated, naming the key
    old["fc1.plain_indices"] = old["fc1.plain_indices"].clone()
    old["fc1.plain_indices"][-1] = 99
    with pytest.raises(ss.InvariantError, match=r"fc1\.plain_indices"):
        Net().load_state_dict(old)


def test_a_state_dict_without_geometry_must_fit_the_layers_blocks() -> None:
    old = {k: v for k, v in snapshot(Net(blocks=(4, 4))).items()
           if not k.endswith("_extra_state")}
    net = Net(blocks=(2, 2))
    before = snapshot(net)
    with pytest.raises(ss.InvariantError, match=r"fc1\.values") as info:
        net.load_state_dict(old)
    assert info.value.invariant == "3.10"
    assert_unchanged(net, before)


def test_a_state_dict_without_geometry_still_needs_the_pattern() -> None:
    sd = {k: v for k, v in snapshot(Net()).items() if not k.startswith("fc1.")}
    result = Net().load_state_dict(sd, strict=False)
    assert "fc1._extra_state" in result.missing_keys
    assert "fc1.plain_indices" in result.missing_keys


@pytest.mark.parametrize(("change", "iid"), [((5, 4), "3.10"), ((6, 4), "3.10"),
                                             ((2, 0), "3.4")], ids=["4x4", "2x4", "csr"])
def test_geometry_and_values_must_agree(change: tuple[int, int], iid: str) -> None:
    """A 2x2-block checkpoint whose geometry says 4x4 (or 2x4, or CSR) is refused."""
    net = Net()
    sd = snapshot(net)
    where, value = change
    sd["fc1._extra_state"][where] = value
    if iid == "3.10":
        sd["fc1._extra_state"][5:] = torch.tensor([4, 4]) if where == 5 else torch.tensor([2, 4])
    else:
        sd["fc1._extra_state"][5:] = 1
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"fc1\.") as info:
        net.load_state_dict(sd)
    if iid == "3.10":
        assert isinstance(info.value, ss.InvariantError) and info.value.invariant == iid
        assert "fc1.values" in str(info.value).splitlines()[0]
    assert_unchanged(net, before)


@pytest.mark.parametrize("damage", ["tag", "layout", "dtype", "shape", "list"])
def test_a_damaged_geometry_is_an_error_naming_its_key(damage: str) -> None:
    net = Net()
    sd: dict[str, object] = dict(snapshot(net))
    g = sd["fc1._extra_state"]
    assert isinstance(g, torch.Tensor)
    if damage == "tag":
        g[0] = 1
    elif damage == "layout":
        g[2] = 17
    elif damage == "dtype":
        sd["fc1._extra_state"] = g.float()
    elif damage == "shape":
        sd["fc1._extra_state"] = g[:6]
    else:
        sd["fc1._extra_state"] = g.tolist()
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"fc1\._extra_state") as info:
        net.load_state_dict(sd)
    assert "damaged" in str(info.value).splitlines()[0]
    assert_unchanged(net, before)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_a_load_torch_refuses_for_the_bias_leaves_the_layer_as_it_was(assign: bool) -> None:
    """A re-pruned checkpoint (another number of blocks) with a bias of another shape: torch
    refuses the bias, and the pattern and values were not replaced before it did."""
    net = Net(density=0.75)
    sd = snapshot(Net(density=0.25, seed=3))
    sd["fc1.bias"] = torch.zeros(9)
    before = snapshot(net)
    with pytest.raises(RuntimeError, match=r"fc1\.bias"):
        net.load_state_dict(sd, assign=assign)
    assert_unchanged(net, before, "fc1.")  # (torch loads the other modules, as it does)
    net(torch.randn(2, 8))  # still proven, still runs
    sd["fc1.bias"] = "not a tensor"  # type: ignore[assignment]
    with pytest.raises((RuntimeError, TypeError)):
        net.load_state_dict(sd, assign=assign)
    assert_unchanged(net, before, "fc1.")


def test_strict_false_with_a_refused_bias_still_reports_it() -> None:
    net = Net(density=0.75)
    sd = snapshot(Net(density=0.25, seed=3))
    sd["fc1.bias"] = torch.zeros(9)
    before = snapshot(net)
    with pytest.raises(RuntimeError, match="size mismatch"):
        net.load_state_dict(sd, strict=False)
    assert_unchanged(net, before, "fc1.")


def test_sparse_matmul_names_its_key_too() -> None:
    a = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]]).to_sparse_csr()
    model = nn.ModuleDict({"adj": SparseMatmul(a)})
    sd = snapshot(model)
    sd["adj.plain_indices"][0] = -1
    with pytest.raises(ss.InvariantError, match=r"adj\.plain_indices"):
        model.load_state_dict(sd)
    old = {k: v for k, v in snapshot(model).items() if not k.endswith("_extra_state")}
    model.load_state_dict(old)  # 0.2.0-shaped: the module's own geometry


def test_a_bias_torch_fails_to_copy_leaves_the_layer_as_it_was() -> None:
    """A refusal the shape check cannot foresee (torch cannot copy out of a meta tensor):
    torch records it while loading, and the pattern is not replaced after it."""
    net = Net(density=0.75)
    sd = snapshot(Net(density=0.25, seed=3))
    sd["fc1.bias"] = torch.empty(8, device="meta")
    before = snapshot(net)
    with pytest.raises(RuntimeError, match=r"fc1\.bias"):
        net.load_state_dict(sd)
    assert_unchanged(net, before, "fc1.")


@pytest.mark.parametrize("rows", [2**40, 2**62 - 2])
def test_a_geometry_with_huge_sizes_is_refused_without_allocating(rows: int) -> None:
    """A geometry naming a huge matrix of the layer's own (tampered layer, same sizes in the
    state dict) cannot load: the layer's shape differs, named by key."""
    net = Net()
    sd = snapshot(net)
    sd["fc1._extra_state"][3] = rows
    with pytest.raises(ValueError, match=r"fc1\._extra_state"):
        net.load_state_dict(sd)


# ---------------------------------------------------------------------------------------------
# A file that puts another tensor on the index bytes (in a child: at the starting commit the
# kernel read the written, unchecked index)

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = Batch("checkpoints", env=child_env(ROOT, minimal=True))
ALIAS = CHILDREN.add("alias", """
    import io, warnings
    import torch
    from torch import nn
    import safesparse as ss
    from safesparse.nn import SparseLinear
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    src = nn.Sequential(SparseLinear.from_dense(nn.Linear(8, 8), (2, 2), 0.5))
    sd = src.state_dict()
    sd["step"] = sd["0.plain_indices"][1:]  # another tensor of the file on the index bytes
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = ss.load(buf)
    for assign in (True, False):
        model = nn.Sequential(SparseLinear.from_dense(nn.Linear(8, 8), (2, 2), 0.5))
        model.load_state_dict({k: v for k, v in loaded.items() if k != "step"}, assign=assign)
        loaded["step"][0] = 10**6  # a write through the alias (its own version counter)
        x = torch.randn(2, 8)
        torch.testing.assert_close(model(x), src(x))  # the layer's own, valid, pattern
        loaded["step"][0] = int(src[0].plain_indices[1])
    print("ok")
""")


@CHILDREN.mark
def test_a_file_alias_of_the_index_bytes_never_reaches_the_layer() -> None:
    """``load_state_dict`` (``assign=True`` too) gives the layer its own copies of the index
    members: a tensor of the same file on the same bytes, with a version counter of its own,
    writes nothing the layer reads."""
    done = CHILDREN.run(ALIAS)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr

"""Whole models made block-sparse (SPEC 9, issue 46): ``safesparse.nn.sparsify_``,
``block_mask``, meta-device skeletons, ``to_empty``, state dicts of another density.

An MLP of ``nn.Linear`` layers and a GPT-2-style ``Conv1D`` (duck-typed: ``nf``, a weight of
shape ``(in, out)``) is converted in place; a layer the block does not divide stays dense and
is reported by a ``SparsifyWarning``; ``filter_fn`` gets ``(module, fqn)``; a model built on the
meta device and sparsified is a skeleton that ``load_state_dict(sd, assign=True)`` completes
with the checkpoint's pattern (validated there); ``block_mask`` comes from the pattern (a kept
all-zero block is True); training after ``sparsify_`` equals training the masked dense model.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import safesparse as ss
from safesparse.nn import SparseLinear, SparseMatmul, SparsifyWarning, sparsify_


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D`` (transformers.pytorch_utils), written out: ``y = x @ W + b`` with
    ``W`` of shape ``(in, out)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.reshape(*x.shape[:-1], self.nf)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.proj = Conv1D(48, 64)  # (in 64, out 48)
        self.blocks = nn.ModuleList([nn.Linear(48, 48, bias=False)])
        self.head = nn.Linear(48, 10)  # 10: the block does not divide it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.proj(x))
        x = torch.relu(self.blocks[0](x))
        out: torch.Tensor = self.head(x)
        return out


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


X = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))


def sparsified(model: nn.Module, **kwargs: object) -> tuple[nn.Module, list[SparsifyWarning]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sparsify_(model, **kwargs)  # type: ignore[arg-type]
    return out, [w.message for w in caught if isinstance(w.message, SparsifyWarning)]


def masked_dense(model: MLP, sparse: nn.Module) -> MLP:
    """``model`` with every converted weight multiplied by its layer's block mask."""
    out = copy.deepcopy(model)
    for name in ("fc1", "proj", "blocks.0"):
        layer = sparse.get_submodule(name)
        assert isinstance(layer, SparseLinear)
        r, c = layer.blocksize or (1, 1)
        full = layer.block_mask().repeat_interleave(r, 0).repeat_interleave(c, 1)
        target = out.get_submodule(name)
        with torch.no_grad():
            if isinstance(target, Conv1D):
                target.weight.mul_(full.t())
            else:
                target.weight.mul_(full)
    return out


def test_linear_and_conv1d_become_sparse_and_the_rest_is_reported() -> None:
    dense = mlp()
    model, caught = sparsified(mlp(), density=0.5, block_size=16)
    assert isinstance(model, MLP)
    for name in ("fc1", "proj", "blocks.0"):
        layer = model.get_submodule(name)
        assert isinstance(layer, SparseLinear), name
        assert layer.blocksize == (16, 16) and layer.layout == torch.sparse_bsr
    assert model.proj.in_features == 64 and model.proj.out_features == 48  # type: ignore[union-attr]
    assert model.blocks[0].bias is None  # type: ignore[union-attr]
    assert type(model.head) is nn.Linear
    [warning] = caught
    assert list(warning.skipped) == ["head"] and "(16, 16)" in warning.skipped["head"]
    assert warning.converted == 3 and "head" in str(warning)
    # the kept blocks are the dense weight's (Conv1D's transposed), the bias copied
    proj = model.proj
    assert isinstance(proj, SparseLinear)
    want = dense.proj.weight.detach().t() * proj.block_mask().repeat_interleave(
        16, 0).repeat_interleave(16, 1)
    torch.testing.assert_close(proj.weight.to_dense(), want)
    torch.testing.assert_close(proj.bias, dense.proj.bias)
    torch.testing.assert_close(model(X), masked_dense(dense, model)(X))


def test_the_kept_blocks_are_from_dense_s() -> None:
    model, _ = sparsified(mlp(), density=0.25, block_size=(8, 16))
    want = SparseLinear.from_dense(mlp().fc1, (8, 16), 0.25)
    got = model.fc1
    assert isinstance(got, SparseLinear)
    assert torch.equal(got.block_mask(), want.block_mask())
    assert got.block_mask().sum() == round(0.25 * 8 * 2)
    torch.testing.assert_close(got.values, want.values)


def test_block_one_gives_csr_layers() -> None:
    model, caught = sparsified(mlp(), density=0.1, block_size=1)
    assert caught == []  # block 1 divides every layer
    assert all(isinstance(m, SparseLinear) and m.layout == torch.sparse_csr
               for m in (model.fc1, model.proj, model.head))
    assert model.head.block_mask().shape == (10, 48)  # type: ignore[operator]


def test_filter_fn_gets_module_and_fqn() -> None:
    seen: list[tuple[str, str]] = []

    def only_fc1(module: nn.Module, fqn: str) -> bool:
        seen.append((type(module).__name__, fqn))
        return fqn == "fc1"

    model, caught = sparsified(mlp(), density=0.5, block_size=16, filter_fn=only_fc1)
    assert isinstance(model.fc1, SparseLinear)
    assert type(model.proj) is Conv1D and type(model.blocks[0]) is nn.Linear
    assert caught == []  # what filter_fn refused is not reported
    assert ("Linear", "fc1") in seen and ("Conv1D", "proj") in seen
    assert ("Linear", "blocks.0") in seen and ("Linear", "head") in seen
    assert ("MLP", "") not in seen  # only the layers sparsify_ would convert are asked


def test_a_linear_root_is_returned_converted() -> None:
    torch.manual_seed(0)
    out, _ = sparsified(nn.Linear(32, 32), density=0.5, block_size=8)
    assert isinstance(out, SparseLinear)


def test_nothing_converted_is_reported() -> None:
    _, caught = sparsified(nn.Sequential(nn.ReLU()), density=0.5)
    assert [w.converted for w in caught] == [0]


def test_shared_layers_stay_shared() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model, _ = sparsified(nn.Sequential(shared, nn.ReLU(), shared), density=0.5,
                         block_size=8)
    assert isinstance(model[0], SparseLinear) and model[0] is model[2]


def test_multihead_attention_projections_stay_dense() -> None:
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` rather than calling it: a
    ``SparseLinear`` there would not compute; reported, the encoder layer's MLP converted."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model, caught = sparsified(layer, density=0.5, block_size=16)
    assert isinstance(model.linear1, SparseLinear) and isinstance(model.linear2, SparseLinear)
    assert type(model.self_attn.out_proj) is not SparseLinear
    assert list(caught[0].skipped) == ["self_attn.out_proj"]
    model(torch.randn(2, 5, 32)).sum().backward()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="density"):
        sparsify_(mlp(), density=1.5)
    with pytest.raises(ValueError, match="block_size"):
        sparsify_(mlp(), density=0.5, block_size=(0, 4))


# -- block_mask -------------------------------------------------------------------------------


def test_block_mask_keeps_a_kept_block_of_zeros() -> None:
    linear = nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[:4, :4] = 1.0  # one block of ones, three of zeros
    layer = SparseLinear.from_dense(linear, 4, 0.5)  # keeps two: the ones, then a zero block
    mask = layer.block_mask()
    assert mask.dtype == torch.bool and mask.shape == (2, 2)
    assert mask.tolist() == [[True, True], [False, False]]  # ties: row-major order
    assert layer.weight.to_dense()[:4, 4:].abs().sum() == 0  # the kept block is all zeros
    with torch.no_grad():
        layer.values.zero_()  # values never decide the mask
    assert torch.equal(layer.block_mask(), mask)


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                                    torch.sparse_bsc])
def test_block_mask_of_every_layout(layout: torch.layout) -> None:
    g = torch.Generator().manual_seed(3)
    blocks = (torch.rand(3, 4, generator=g) < 0.5)
    blocks[0, 0] = True
    block = (2, 3) if layout in (torch.sparse_bsr, torch.sparse_bsc) else (1, 1)
    full = blocks.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    dense = (torch.rand(full.shape, generator=g) + 0.5) * full
    w = dense.to_sparse(layout=layout, blocksize=block if block != (1, 1) else None)
    w.values()[0].zero_()  # a stored block of zeros
    w = ss.validate(w)
    assert (w.to_dense() != 0).sum() < full.sum()
    assert torch.equal(SparseLinear(w).block_mask(), blocks)
    assert torch.equal(SparseMatmul(w).block_mask(), blocks)


def test_block_mask_validates_written_buffers() -> None:
    layer = SparseLinear.from_dense(nn.Linear(8, 8), 4, 0.5)
    with torch.no_grad():
        layer.plain_indices[0] = 7  # out of range, in place
    with pytest.raises(ss.InvariantError) as info:
        layer.block_mask()
    assert info.value.invariant == "5.5"


# -- meta-device skeletons ----------------------------------------------------------------------


def test_meta_skeleton_loaded_with_assign() -> None:
    trained, _ = sparsified(mlp(), density=0.5, block_size=16)
    sd = trained.state_dict()
    with torch.device("meta"):
        skeleton = MLP()
    skeleton, caught = sparsified(skeleton, density=0.25, block_size=16)  # another density
    assert list(caught[0].skipped) == ["head"]
    fc1 = skeleton.fc1
    assert isinstance(fc1, SparseLinear) and fc1.values.is_meta
    assert fc1.values.shape == (round(0.25 * 8), 16, 16)  # as many as from_dense would keep
    assert fc1.block_mask().is_meta and fc1.block_mask().shape == (4, 2)
    assert skeleton(X.to("meta")).shape == (6, 10)  # shapes flow through the meta skeleton
    weight = fc1.weight  # no data to check: an unchecked matrix of the same metadata
    assert weight.is_meta and weight.layout == fc1.layout and not ss.is_checked(weight)
    assert weight.shape == (fc1.out_features, fc1.in_features)
    ss.reset_stats()
    skeleton.load_state_dict(sd, assign=True)
    assert ss.stats().validations >= 3  # the file's patterns are validated
    assert not any(t.is_meta for t in skeleton.state_dict().values())
    for name in ("fc1", "proj", "blocks.0"):
        assert torch.equal(skeleton.get_submodule(name).block_mask(),  # type: ignore[operator]
                           trained.get_submodule(name).block_mask()), name
    torch.testing.assert_close(skeleton(X), trained(X))
    ss.reset_stats()
    skeleton(X)
    assert ss.stats().validations == 0  # proven at load: O(1) per call
    skeleton(X).sum().backward()
    assert skeleton.fc1.values.grad is not None


def test_meta_skeleton_refuses_an_invalid_checkpoint() -> None:
    trained, _ = sparsified(mlp(), density=0.5, block_size=16)
    sd = trained.state_dict()
    sd["fc1.plain_indices"] = sd["fc1.plain_indices"].clone()
    sd["fc1.plain_indices"][0] = 99
    with torch.device("meta"):
        skeleton = MLP()
    sparsify_(skeleton, density=0.5, block_size=16, filter_fn=lambda m, n: n != "head")
    with pytest.raises(ss.InvariantError) as info:
        skeleton.load_state_dict(sd, assign=True)
    assert info.value.invariant == "5.5" and "fc1.plain_indices" in str(info.value)
    assert skeleton.fc1.values.is_meta  # nothing written


def test_meta_skeleton_to_empty_then_load() -> None:
    trained, _ = sparsified(mlp(), density=0.5, block_size=16)
    with torch.device("meta"):
        skeleton = MLP()
    sparsify_(skeleton, density=0.5, block_size=16, filter_fn=lambda m, n: n != "head")
    skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(trained.state_dict())
    torch.testing.assert_close(skeleton(X), trained(X))


def test_meta_skeleton_without_assign_is_a_no_op_as_torch_s() -> None:
    trained, _ = sparsified(mlp(), density=0.5, block_size=16)
    with torch.device("meta"):
        skeleton = MLP()
    sparsify_(skeleton, density=0.5, block_size=16, filter_fn=lambda m, n: n != "head")
    with pytest.warns(UserWarning, match="fc1.values: copying from a non-meta"):
        skeleton.load_state_dict(trained.state_dict())
    assert skeleton.fc1.values.is_meta and skeleton.fc1.plain_indices.is_meta


def test_from_dense_on_meta_builds_a_skeleton() -> None:
    with torch.device("meta"):
        linear = nn.Linear(64, 32, dtype=torch.bfloat16)
    layer = SparseLinear.from_dense(linear, (8, 16), 0.5)
    assert layer.values.is_meta and layer.values.dtype == torch.bfloat16
    assert layer.values.shape == (8, 8, 16) and layer.compressed_indices.shape == (5,)
    assert layer.bias is not None and layer.bias.is_meta
    assert "nnz=8" in repr(layer)


# -- to_empty and state dicts of another density --------------------------------------------------


def test_to_empty_then_forward_says_load_a_state_dict_first() -> None:
    model, _ = sparsified(mlp(), density=0.5, block_size=16)
    sd = model.state_dict()
    want = model(X).detach()
    model.to_empty(device="cpu")
    with torch.no_grad():  # (uninitialised memory may hold anything: make it invalid)
        for layer in (model.fc1, model.proj, model.blocks[0]):
            layer.compressed_indices.fill_(-1)  # type: ignore[operator]
    with pytest.raises(ss.InvariantError) as info:
        model(X)
    first = str(info.value).splitlines()[0]
    assert "uninitialised memory (to_empty)" in first and "load a state dict first" in first
    assert "'fc1'" in first
    assert "fc1.compressed_indices" in str(info.value)  # the refusal follows
    with pytest.raises(ss.InvariantError, match="uninitialised memory \\(to_empty\\)"):
        model.fc1.block_mask()  # type: ignore[operator]
    model.load_state_dict(sd)
    torch.testing.assert_close(model(X), want)


def test_other_errors_do_not_mention_to_empty() -> None:
    model, _ = sparsified(mlp(), density=0.5, block_size=16)
    with torch.no_grad():
        model.fc1.plain_indices[0] = 99  # type: ignore[index]
    with pytest.raises(ss.InvariantError) as info:
        model(X)
    assert "to_empty" not in str(info.value)


def test_a_state_dict_of_another_density_is_noted(caplog: pytest.LogCaptureFixture) -> None:
    dense_sd = sparsified(mlp(), density=0.5, block_size=16)[0].state_dict()
    model, _ = sparsified(mlp(), density=0.25, block_size=16)
    old_values = model.fc1.values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(dense_sd)
    said = [str(w.message) for w in caught]
    assert any("fc1: the state dict's pattern stores 4 blocks, the layer stored 2" in m
               and "optimizer" in m for m in said), said
    assert model.fc1.values is not old_values and model.fc1.values.shape[0] == 4
    # the same density: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(dense_sd)
    # assign=True replaces the parameters anyway: an info-level record
    other, _ = sparsified(mlp(), density=0.25, block_size=16)
    with caplog.at_level(logging.INFO, logger="safesparse.nn"), warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(dense_sd, assign=True)
    assert any("fc1: the state dict's pattern stores 4 blocks" in r.getMessage()
               for r in caplog.records)


# -- training -------------------------------------------------------------------------------------


def test_training_after_sparsify_matches_the_masked_dense_model() -> None:
    model, _ = sparsified(mlp(), density=0.5, block_size=16)
    reference = masked_dense(mlp(), model)
    masks = {name: model.get_submodule(name).block_mask()  # type: ignore[operator]
             for name in ("fc1", "proj", "blocks.0")}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    y = torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            ((m(X) - y) ** 2).mean().backward()
            o.step()
        # the dense reference's gradient outside the kept blocks is masked away
        with torch.no_grad():
            masked_dense_weights(reference, masks)
        torch.testing.assert_close(model(X), reference(X))
    for name, mask in masks.items():  # the pattern never changes
        assert torch.equal(model.get_submodule(name).block_mask(), mask)  # type: ignore[operator]
    torch.testing.assert_close(model.head.weight, reference.head.weight)


def masked_dense_weights(reference: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    for name, mask in masks.items():
        full = mask.repeat_interleave(16, 0).repeat_interleave(16, 1)
        target = reference.get_submodule(name)
        target.weight.mul_(full.t() if isinstance(target, Conv1D) else full)


def test_a_frozen_layer_stays_frozen() -> None:
    model = mlp()
    model.fc1.requires_grad_(False)
    sparsify_(model, density=0.5, block_size=16, filter_fn=lambda m, n: n != "head")
    assert not model.fc1.values.requires_grad and not model.fc1.bias.requires_grad
    assert model.proj.values.requires_grad  # type: ignore[union-attr]

"""``sparsify_``: a whole model's linear layers made block-sparse in one call.

Every ``nn.Linear`` and every GPT-2-style ``Conv1D`` (duck-typed: an ``nf`` attribute and a
``weight`` of shape ``(in, out)``, ``y = x @ weight + bias``; nothing of ``transformers`` is
imported) whose sides the block divides, and that ``filter_fn`` accepts, becomes a
:class:`~safesparse.nn.SparseLinear` as :meth:`SparseLinear.from_dense` builds it (the blocks
of largest norm, the bias copied; on the meta device a skeleton that ``load_state_dict(sd,
assign=True)`` completes with the checkpoint's pattern). The layers it leaves dense are
reported by one :class:`SparsifyWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .linear import SparseLinear
from .pattern import block_shape

__all__ = ["SparsifyWarning", "sparsify_"]


class SparsifyWarning(UserWarning):
    """Layers :func:`sparsify_` left dense, and why.

    Attributes:
        skipped: ``{fully qualified name: reason}`` of every ``nn.Linear`` or ``Conv1D`` that
            ``filter_fn`` accepted and that stayed dense (the block does not divide its
            sides; a projection ``nn.MultiheadAttention`` reads as a weight rather than
            calling it).
    """

    __module__ = "safesparse.nn"

    def __init__(self, skipped: dict[str, str], converted: int) -> None:
        self.skipped = dict(skipped)
        self.converted = converted
        listed = "; ".join(f"{name or '(the module)'}: {why}" for name, why in skipped.items())
        super().__init__(f"sparsify_: {len(skipped)} layer(s) left dense, {converted} "
                         f"converted: {listed}")


def _is_conv1d(module: nn.Module) -> bool:
    """A GPT-2-style ``Conv1D``: ``nf`` output features, ``weight`` of shape ``(in, nf)``."""
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    return (not isinstance(module, nn.Linear) and isinstance(nf, int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and int(weight.shape[1]) == nf)


def _candidate(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _dense(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight as ``nn.Linear`` holds it, ``(out, in)``, and the bias."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    bias = getattr(module, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    w = weight.detach()
    return (w if isinstance(module, nn.Linear) else w.t()), bias


def sparsify_(module: nn.Module, *, density: float,
              block_size: int | tuple[int, int] = 16,
              filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Make a model's linear layers block-sparse, in place.

    Args:
        module: the model. Its submodules are replaced in place.
        density: the fraction of blocks each layer keeps, in ``[0, 1]``
            (:meth:`SparseLinear.from_dense`'s rule: the blocks of largest norm).
        block_size: ``(rows, cols)`` of a block, or an int for square blocks (1: single
            elements, a CSR weight).
        filter_fn: ``filter_fn(module, fully_qualified_name) -> bool``, as torchao's
            ``sparsify_`` takes it: only the layers for which it is true are converted
            (None: every layer). The root module's name is ``""``.

    Returns:
        ``module`` (a new :class:`SparseLinear` when ``module`` itself is a converted
        layer: use the returned module).

    Every ``nn.Linear`` and GPT-2-style ``Conv1D`` (``nf`` and a ``weight`` of shape
    ``(in, out)``) that ``filter_fn`` accepts becomes a :class:`SparseLinear` holding the
    same ``y = x @ W.T + b`` on its kept blocks, the bias copied, with the weight's dtype,
    device and ``requires_grad``. On the meta device the new layers are skeletons (no
    pattern yet) that ``load_state_dict(sd, assign=True)`` completes with the checkpoint's
    pattern, validated there. Layers whose sides the block does not divide, and the projections
    ``nn.MultiheadAttention`` reads as weights rather than calling them, stay dense: one
    :class:`SparsifyWarning` lists them (its ``skipped`` attribute maps their names to the
    reason); so does a call that converts nothing. Layers ``filter_fn`` refused are not
    listed.
    """
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"sparsify_: density must be in [0, 1], got {density}")
    r, c = block_shape(block_size)
    if r < 1 or c < 1:
        raise ValueError(f"sparsify_: block_size must be positive, got {block_size}")
    skipped: dict[str, str] = {}
    converted = 0
    done: dict[int, nn.Module] = {}  # a module held twice is converted once (tied stays tied)

    def convert(parent: nn.Module | None, name: str, fqn: str, child: nn.Module) -> nn.Module:
        if id(child) not in done:
            done[id(child)] = visit(parent, fqn, child)
        return done[id(child)]

    def visit(parent: nn.Module | None, fqn: str, child: nn.Module) -> nn.Module:
        nonlocal converted
        if not _candidate(child) or (filter_fn is not None and not filter_fn(child, fqn)):
            for sub_name, sub in list(child._modules.items()):  # (duplicates too)
                if sub is None:
                    continue
                new = convert(child, sub_name, f"{fqn}.{sub_name}" if fqn else sub_name, sub)
                if new is not sub:
                    setattr(child, sub_name, new)
            return child
        if isinstance(parent, nn.MultiheadAttention):
            skipped[fqn] = ("nn.MultiheadAttention reads its weight rather than calling it "
                            "(convert the attention's projections as nn.Linear modules)")
            return child
        w, bias = _dense(child)
        out_f, in_f = int(w.shape[0]), int(w.shape[1])
        if out_f % r or in_f % c:
            skipped[fqn] = (f"the block ({r}, {c}) does not divide its weight "
                            f"(out {out_f}, in {in_f})")
            return child
        converted += 1
        layer = SparseLinear._pruned(w, bias, (r, c), density, "sparsify_")
        was_bias = getattr(child, "bias", None)
        for param, was in ((layer.values, child.weight), (layer.bias, was_bias)):
            if param is not None and isinstance(was, torch.Tensor):
                param.requires_grad_(was.requires_grad)  # (a frozen layer stays frozen)
        return layer

    out = convert(None, "", "", module)
    if skipped or not converted:
        warnings.warn(SparsifyWarning(skipped, converted), stacklevel=2)
    return out

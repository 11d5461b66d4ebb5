"""Errors of ``safesparse.nn``'s layers: an operator's refusal named by the layer's key.

The ``safesparse`` operators (:mod:`safesparse.operators`) name the operator and the member in
an ``InvariantError``; a layer's forward adds the member's key in the model (:func:`keyed`),
and a refusal of index buffers moved with ``to_empty()`` says so first
(:class:`UninitialisedMemoryError`).
"""

from __future__ import annotations

import sys

import torch

from ..catalog.errors import InvariantError
from ..operators.library import member_of

__all__ = ["UninitialisedMemoryError", "keyed"]


def keyed(module: torch.nn.Module, err: InvariantError) -> InvariantError:
    """``err`` (raised by an operator over ``module``'s members) naming the member by its key
    in the outermost module whose code called ``module`` (``fc1.plain_indices``; under DDP
    ``module.fc1.plain_indices``), found from the calling frames: an error path only."""
    key = ""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and owner is not module:
            for name, sub in owner.named_modules(remove_duplicate=False):
                if sub is module:
                    key = name
                    break
        frame = frame.f_back  # type: ignore[assignment]
    member = err.path or member_of(err)
    if key:
        member = ", ".join(f"{key}.{m}" for m in member.split(", "))
    keyed_err = err.with_context(path=member)
    if module.__dict__.get("_emptied"):  # (set by to_empty, dropped once a pattern is proven)
        return UninitialisedMemoryError.of(
            keyed_err, f"{type(module).__name__} {key!r}" if key else type(module).__name__)
    return keyed_err


class UninitialisedMemoryError(InvariantError):
    """The index buffers of a layer moved with ``to_empty()`` (uninitialised memory) and not
    loaded since were refused: an :class:`~safesparse.InvariantError` whose first line says
    so and names the way that works (load a state dict first); the refusal follows."""

    __module__ = "safesparse.nn"
    layer: str = ""

    @classmethod
    def of(cls, err: InvariantError, layer: str) -> UninitialisedMemoryError:
        """``err`` (a refusal of ``layer``'s index buffers, keyed) saying first that they are
        uninitialised memory from ``to_empty``."""
        out = cls(err.layout, err.invariant, err.detail, location=err.location, op=err.op,
                  path=err.path, built_by=err.built_by, explanation=err.explanation,
                  loaded_by=err.loaded_by)
        out.layer = layer
        out.args = (str(out),)
        return out

    def _message(self) -> str:
        return (f"{self.layer or 'the layer'}: uninitialised memory (to_empty) in its index "
                "buffers: load a state dict first (model.load_state_dict(sd))\n"
                + super()._message())

"""Debug mode for plain torch sparse tensors: a torch function mode on the debugging thread.

A ``SafeSparseTensor`` validates its operations' inputs itself (its ``__torch_function__``);
a plain torch sparse tensor used where no ``SafeSparseTensor`` takes part reaches torch's
kernels without passing through safesparse at all. While debug mode is on, :class:`DebugMode`
sees every torch function called on the thread and validates each plain sparse input before the
function runs (cache ignored), raising :class:`~safesparse.InvariantError` naming the operation.
Metadata and member accessors are passed through, so bad data can still be inspected.

The mode is pushed on a thread's torch function mode stack when debug mode is switched on
there (``set_debug(True)``, ``with debug():``, the process default on the importing thread), at
the bottom of the stack so that other modes entered and exited meanwhile never pop it, and
removed when debug mode is switched off there. A torch function mode costs every torch call some
Python work, which is why enforce mode does without one; debug mode is allowed to cost more.
Threads that never switch debug mode on themselves (the environment variable makes it their
default) see plain tensors only in operations with a ``SafeSparseTensor``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..base import debug_flag as debug
from .core import SafeSparseTensor, _validate_inputs, sparse_inputs
from .optable import INSPECTION

__all__ = ["DebugMode"]


class DebugMode(TorchFunctionMode):
    """Validates the plain sparse inputs of every torch function while debug mode is on."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in INSPECTION and debug.is_debug():
            inputs = sparse_inputs(tuple(args), kwargs)
            if inputs and not any(isinstance(x, SafeSparseTensor) for x in inputs):
                _validate_inputs(func, tuple(args), kwargs)  # (a SafeSparseTensor does it)
        return func(*args, **kwargs)


def _stack() -> list[Any]:
    return torch.overrides._get_current_function_mode_stack()  # type: ignore[no-any-return,no-untyped-call]


def _rebuild(modes: list[Any]) -> None:
    """Make ``modes`` this thread's torch function mode stack (bottom first)."""
    for _ in range(len(_stack())):
        torch.overrides._pop_mode()  # type: ignore[no-untyped-call]
    for mode in modes:
        torch.overrides._push_mode(mode)  # type: ignore[no-untyped-call]


def _switched(enabled: bool) -> None:
    """Keep one :class:`DebugMode` at the *bottom* of this thread's stack while debug mode is on
    (so that a mode entered earlier and exited later, which pops whatever is on top, never pops
    ours), none while it is off."""
    stack = _stack()
    ours = any(isinstance(m, DebugMode) for m in stack)
    if enabled and not ours:
        _rebuild([DebugMode(), *stack])
    elif not enabled and ours:
        _rebuild([m for m in stack if not isinstance(m, DebugMode)])


debug.LISTENERS.append(_switched)
if debug.is_debug():
    _switched(True)

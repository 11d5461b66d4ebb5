"""The torch.compile boundary: validation and checked-state bookkeeping are never traced.

Functions marked :func:`not_traced` run through ``torch.compiler.disable``, so dynamo
graph-breaks at them and they always run eagerly. Applying ``torch.compiler.disable`` imports
``torch._dynamo`` (about two seconds), which a program that never compiles should not pay. So
each marked function calls through a one-element cell holding its implementation; the cells are
switched to the disabled versions the moment ``torch._dynamo`` is imported (a meta-path hook
watches for it), which happens before dynamo can trace anything.

Dynamo also calls marked functions itself while it converts a frame: wrapping a
``SafeSparseTensor`` argument reads attributes such as ``is_nested`` through
``__torch_function__``, which in debug mode validates the tensor. An error raised there would
reach the caller as dynamo's ``InternalTorchDynamoError`` (with no ``__cause__``). So while a
frame is being converted, an error from a marked function becomes dynamo's ``Unsupported``
(skip this frame): dynamo runs the frame eagerly, where the same call raises the same error,
``InvariantError`` included, straight to the caller.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])

_cells: list[list[Callable[..., Any]]] = []
_armed = False
_lock = threading.Lock()


def not_traced(fn: F) -> F:
    """Mark ``fn`` as a graph break for torch.compile (see the module docstring)."""
    cell: list[Callable[..., Any]] = [fn]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return cell[0](*args, **kwargs)

    with _lock:
        _cells.append(cell)
        if _armed:
            cell[0] = _disable(fn)
    return cast(F, call)


#: ``(owner, name, fn, kind)``: attributes bound to ``fn`` itself until dynamo is imported,
#: then to its disabled version (see :func:`bind`).
_bindings: list[tuple[Any, str, Callable[..., Any], str]] = []


def _as(kind: str, f: Callable[..., Any]) -> Any:
    if kind == "classmethod":
        return classmethod(f)
    if kind == "property":
        return property(f)
    return f


def bind(owner: Any, name: str, fn: Callable[..., Any], *, kind: str = "function") -> None:
    """:func:`not_traced` without the indirection, for the hottest entry points (one call
    level less per operation): ``owner.name`` is ``fn`` (as a ``classmethod`` or ``property``
    of a class, by ``kind``) until ``torch._dynamo`` is imported, then the disabled version.
    Only for attributes that callers look up at call time (a class's ``__torch_function__``
    and properties, ``module.function``)."""
    with _lock:
        _bindings.append((owner, name, fn, kind))
        setattr(owner, name, _as(kind, _disable(fn) if _armed else fn))


def _disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def surfaced(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if _converting_frame() and not isinstance(err, _dynamo_errors()):
                raise _skip_frame(err) from err
            raise

    return cast(Callable[..., Any], torch.compiler.disable(surfaced))  # type: ignore[no-untyped-call]


def _converting_frame() -> bool:
    """Whether dynamo is converting a frame right now (not running compiled code)."""
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def _dynamo_errors() -> type[Exception]:
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def _skip_frame(err: Exception) -> Exception:
    """Dynamo's "run this frame eagerly" for an error raised while it probed an argument."""
    from torch._dynamo.exc import Unsupported

    return Unsupported(
        f"safesparse raised {type(err).__name__} while dynamo inspected an argument; the frame "
        "runs eagerly, which raises it to the caller",
        gb_type="safesparse error while tracing", skip_frame=True,
    )


def _arm() -> None:
    global _armed
    with _lock:
        if _armed:
            return
        _armed = True
        for cell in _cells:
            cell[0] = _disable(cell[0])
        for owner, name, fn, kind in _bindings:
            setattr(owner, name, _as(kind, _disable(fn)))


class _DynamoWatcher(importlib.abc.MetaPathFinder):
    """Arms the cells right after ``torch._dynamo`` has been imported."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _arm()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch._dynamo" in sys.modules:
    _arm()
else:
    sys.meta_path.insert(0, _DynamoWatcher())

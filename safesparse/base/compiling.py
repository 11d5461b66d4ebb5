"""The torch.compile boundary: validation and checked-state bookkeeping are never traced.

Dynamo is told to skip safesparse, as it skips third-party libraries: the package's files join
its trace rules' skipped paths, and every function marked :func:`not_traced` (or bound with
:func:`bind`) is marked skipped (``torch._dynamo.decorators.skip``). A call into a skipped
function is a graph break: it runs eagerly, never traced. The one file traced is
``nn/forward.py``: the forward passes of the ``safesparse.nn`` modules, which read strided
tensors only and call the ``safesparse`` operators (one graph node each; their real
implementations run eagerly, never traced). Nothing wraps the functions, so this costs nothing
at run time, also once dynamo is imported (as PyTorch Geometric imports it). Importing dynamo
takes about two seconds, which a program that never compiles should not pay: the marks are made
the moment ``torch._dynamo`` is imported (a meta-path hook watches for it), before dynamo can
trace anything.

Dynamo also calls into safesparse itself while it converts a frame: wrapping a
``SafeSparseTensor`` argument reads attributes such as ``is_nested`` through
``__torch_function__``, which in debug mode validates the tensor. An error raised there would
reach the caller as dynamo's ``InternalTorchDynamoError`` (with no ``__cause__``). So while a
frame is being converted, an error from ``__torch_function__`` becomes dynamo's ``Unsupported``
(skip this frame, :func:`surface`): dynamo runs the frame eagerly, where the same call raises the
same error, ``InvariantError`` included, straight to the caller.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: functions to mark skipped for dynamo once it is imported
_marked: list[Callable[..., Any]] = []
#: ``torch.compiler.config.dynamic_sources`` entries added once dynamo is imported
_dynamic: list[str] = []
_armed = False
_lock = threading.Lock()


def not_traced(fn: F) -> F:
    """Mark ``fn`` as a graph break for torch.compile (see the module docstring); ``fn``
    itself is returned (no wrapper)."""
    with _lock:
        _marked.append(fn)
        if _armed:
            _skip(fn)
    return fn


def dynamic_length(container: str, name: str) -> None:
    """Make dim 0 of every module's ``container[name]`` (``"_buffers"`` or ``"_parameters"``)
    dynamic under ``torch.compile`` from the first compile.

    ``nn.Module`` buffers and parameters get static shapes (dynamo's
    ``force_parameter_static_shapes``, which ``mark_dynamic`` on the tensor does not override),
    so a layer's index members and values of another stored length recompiled the graph, per
    density, up to the recompile limit. An entry of ``torch.compiler.config.dynamic_sources``
    (``.*\\._buffers\\['plain_indices'\\]$:0``) is the one switch torch gives that overrides
    it; it is appended to the user's own entries when dynamo is imported (a program that
    assigns the config afterwards replaces it: one compile per length again)."""
    entry = rf".*\.{container}\['{name}'\]$:0"
    with _lock:
        _dynamic.append(entry)
        if _armed:
            _add_dynamic_sources([entry])


def _add_dynamic_sources(entries: list[str]) -> None:
    import torch.compiler.config as config

    have = [e for e in config.dynamic_sources.replace(" ", "").split(",") if e]
    config.dynamic_sources = ",".join([*have, *(e for e in entries if e not in have)])


def _as(kind: str, f: Callable[..., Any]) -> Any:
    if kind == "classmethod":
        return classmethod(f)
    if kind == "property":
        return property(f)
    return f


def bind(owner: Any, name: str, fn: Callable[..., Any], *, kind: str = "function") -> None:
    """``owner.name = fn`` (as a ``classmethod`` or ``property`` of a class, by ``kind``),
    marked :func:`not_traced`: for entry points defined outside their class body."""
    setattr(owner, name, _as(kind, not_traced(fn)))


def _skip(fn: Callable[..., Any]) -> None:
    from torch._dynamo.decorators import skip

    skip(fn)


#: the package's one file dynamo traces: the forward passes of ``safesparse.nn``'s modules,
#: which hold only strided tensors and call the ``safesparse`` operators (SPEC 10)
TRACED = Path(__file__).resolve().parents[1] / "nn" / "forward.py"
#: and the routing of ``safesparse.SparseOperand`` (a traceable wrapper over strided members
#: whose ``__torch_function__`` calls the same operators; SPEC 10, sparse inputs)
TRACED_OPERAND = Path(__file__).resolve().parents[1] / "compiled" / "operand.py"


def _skip_package() -> None:
    """Every file of the package joins dynamo's skipped paths, except :data:`TRACED` and
    :data:`TRACED_OPERAND`."""
    from torch._dynamo import trace_rules

    root = Path(__file__).resolve().parents[1]  # (the package: this file is in base/)
    traced = (TRACED, TRACED_OPERAND)
    skipped = [f"{p.as_posix()}" for p in sorted(root.rglob("*.py")) if p not in traced]
    trace_rules.SKIP_DIRS.extend(skipped)
    trace_rules._recompile_re()


def surface(err: Exception) -> Exception:
    """What ``__torch_function__`` raises for ``err``: ``err`` itself, or, while dynamo is
    converting a frame, dynamo's "skip this frame" (see the module docstring)."""
    if _armed and _converting_frame() and not isinstance(err, _dynamo_errors()):
        return _skip_frame(err)
    return err


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
        _skip_package()
        for fn in _marked:
            _skip(fn)
        _add_dynamic_sources(_dynamic)


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

"""The wrappers enforce mode puts on torch's routes to sparse data (see
:mod:`safesparse.enforcement.mode`).

One maker per kind of route; each takes what the attribute held before (torch's function or a
user's monkeypatch) and returns the stand-in that :mod:`safesparse.enforcement.mode` installs:

* :func:`factory` - ``torch.sparse_*_tensor``: runs the safe factory instead;
* :func:`load` - ``torch.load``: a validating load;
* :class:`Builder` - the legacy typed constructors: builds, then adopts the result;
* :class:`AtenOp` - an aten constructor packet (``torch.ops.aten.sparse_csr_tensor``) and,
  looked up through it, each of its overloads (``.crow_col_value_size``);
* :func:`new` / :func:`type_` - ``Tensor.new`` / ``Tensor.type``.

torch's index conversions are in :mod:`safesparse.enforcement.conversions`.

Outside enforce mode every stand-in calls what was there before, unchanged.

What is validated, and what is handed back
------------------------------------------
A sparse result with real data (a plain ``torch.Tensor`` not on the ``meta`` device) is
validated before it is handed back; refused, the :class:`~safesparse.InvariantError` names the
call that built it and where it was made (``built_by``: ``"torch.sparse_csr_tensor at
train.py:12"``). Called from Python code (above autograd), the result comes back as a checked
``SafeSparseTensor``. Called below autograd, from inside a ``__torch_dispatch__`` handler or a
dispatch mode (a tensor subclass such as torch's ``MaskedTensor`` building its members, a
decomposition), the validated result comes back as the plain tensor torch returned: handlers
expect plain tensors there.

Tensors that carry no data safesparse could read (``meta`` tensors, ``FakeTensor`` s) and
tensor subclasses that dispatch in Python (``MaskedTensor``, ``FunctionalTensor``) are their
own business: a call with such an argument goes to torch's function, with the plain index data
among its arguments checked first where there is any (a ``MaskedTensor`` of values on plain
COO indices), and what comes back is handed back as torch returned it.

The aten stand-ins look like what they stand for: ``isinstance(op, torch._ops.OpOverloadPacket)``
holds, they hash and compare equal to it (registries keyed by the packet, such as
``MaskedTensor``'s dispatch table or inductor's lowerings, find them and find it through them),
and every attribute but the overloads is the packet's. TorchScript compiles every stand-in of
a torch function to the same builtin operator as before (:func:`register_builtin`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.serialization
from torch.utils._python_dispatch import _disable_current_modes

from .. import files
from ..base import enforce_flag as _enforcing
from ..base import originals as _originals
from ..base.layouts import (
    BLOCK_LAYOUTS,
    BY_SHORT_NAME,
    COMPRESSED_LAYOUTS,
    INDEX_MEMBERS,
    SHORT_NAMES,
    SPARSE_LAYOUTS,
    index_members,
)
from ..catalog.errors import InvariantError
from ..engine.indices import check_compressed_indices, check_coo_indices
from ..factories import core as factories
from ..files.session import _LoadMode
from ..tensor.core import SafeSparseTensor, validate

__all__ = ["AtenOp", "Builder", "active", "adopt", "builtins_seen", "call_site", "factory",
           "load", "new", "register_builtin", "stand_in", "type_", "unregister_builtin"]

SAFE: dict[str, Callable[..., Any]] = {
    "sparse_coo_tensor": factories.sparse_coo_tensor,
    "sparse_compressed_tensor": factories.sparse_compressed_tensor,
    "sparse_csr_tensor": factories.sparse_csr_tensor,
    "sparse_csc_tensor": factories.sparse_csc_tensor,
    "sparse_bsr_tensor": factories.sparse_bsr_tensor,
    "sparse_bsc_tensor": factories.sparse_bsc_tensor,
}

_local = threading.local()  # depth of validating loads run by the torch.load wrapper
_PYTHON_KEY = torch._C.DispatchKey.Python
_BELOW_AUTOGRAD = torch._C.DispatchKey.ADInplaceOrView
#: Frames in these directories are not "where the call was made": safesparse's and torch's own.
_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                  for f in (os.path.dirname(__file__), torch.__file__))
_INDEX_DTYPES = (torch.int32, torch.int64)
#: What an operator that reads index data runs in its stand-in's place while enforced:
#: ``gate(operator, op name, args, kwargs)`` checks the arguments, then calls the operator.
Gate = Callable[[Callable[..., Any], str, tuple[Any, ...], dict[str, Any]], Any]


def _loading() -> bool:
    """Whether :func:`safesparse.load` is reading a file here (its torch function mode is
    active): it validates what the file builds and names the key path itself."""
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(isinstance(mode, _LoadMode) for mode in stack)


def active() -> bool:
    """Enforce mode is on here and no :func:`safesparse.load` is reading a file."""
    return _enforcing.is_enforced() and not _loading()


# ---------------------------------------------------------------------------------------------
# Helpers: foreign tensors, the call site, adopting a result


def _foreign(t: torch.Tensor) -> bool:
    """No data safesparse could read (``meta``, fake), or a subclass dispatching in Python."""
    if t.is_meta:
        return True
    return (type(t) is not torch.Tensor and not isinstance(t, SafeSparseTensor)
            and torch._C._dispatch_keys(t).has(_PYTHON_KEY))


def _any_foreign(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A foreign tensor among the arguments, or a factory call asking for ``meta``."""
    device = kwargs.get("device")
    if device is not None:
        try:
            if torch.device(device).type == "meta":
                return True
        except (RuntimeError, TypeError):
            pass  # not a device: the factory raises as torch does
    return any(isinstance(x, torch.Tensor) and _foreign(x)
               for x in (*args, *kwargs.values()))


def _plain_context() -> bool:
    """Called below autograd (from inside a ``__torch_dispatch__`` handler or a dispatch
    mode's) or while a dispatch mode is active (``FakeTensorMode``, ``make_fx`` tracing, a
    user's ``TorchDispatchMode``): torch's plain tensors are expected back there."""
    return (torch._C._len_torch_dispatch_stack() > 0
            or bool(torch._C._dispatch_tls_is_dispatch_key_excluded(_BELOW_AUTOGRAD)))


def _caller(frame: FrameType | None) -> FrameType | None:
    """``frame`` or, when that is safesparse's or torch's own, the first frame above it that
    is neither (the code that called torch)."""
    while (frame is not None
           and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL)):
        frame = frame.f_back
    return frame


def call_site(frame: FrameType | None) -> str:
    """``file:line`` of :func:`_caller` of ``frame``; the file by its base name (the
    traceback has its path; an error's first line stays short)."""
    frame = _caller(frame)
    if frame is None:
        return "<unknown>"
    filename = frame.f_code.co_filename
    return f"{os.path.basename(filename) or filename}:{frame.f_lineno}"


def _refused(err: InvariantError, op: str, frame: FrameType | None) -> InvariantError:
    """``err`` naming the call ``op``, where it was made and the module that made it (a
    library's own repair hint, e.g. PyG's ``torch_geometric.edge_index``)."""
    caller = _caller(frame)
    module = caller.f_globals.get("__name__") if caller is not None else None
    return err.with_context(op=op, built_by=f"{op} at {call_site(frame)}",
                            built_in=module if isinstance(module, str) else None)


def adopt(out: Any, op: str, frame: FrameType | None) -> Any:
    """A sparse tensor torch built without reading its index data, validated now: handed back
    as a checked SafeSparseTensor sharing its storage (plain, below autograd), or refused
    naming ``op`` and the call site. Anything else is handed back as it is."""
    if not isinstance(out, torch.Tensor) or out.layout not in SPARSE_LAYOUTS:
        return out
    if type(out) is not torch.Tensor and not isinstance(out, SafeSparseTensor):
        return out  # a subclass's own business (FakeTensor, MaskedTensor...)
    if out.is_meta:
        return out  # no data: nothing to read, nothing a kernel could read
    try:
        if type(out) is torch.Tensor and _plain_context():
            with _disable_current_modes():  # validation is no part of what a mode sees
                if _foreign(index_members(out)[0]):
                    return out  # fake members (FakeTensorMode's fallback): no data
                validate(out)
            return out
        return validate(out)
    except InvariantError as err:
        raise _refused(err, op, frame) from None


# ---------------------------------------------------------------------------------------------
# The six factories


def factory(name: str, previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.<name>``: the safe factory, whatever ``check_invariants`` says."""
    safe = SAFE[name]
    builtin = _originals.FACTORIES[name]
    op = f"torch.{name}"

    @functools.wraps(previous)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _enforcing.is_enforced():
            return previous(*args, **kwargs)
        if _loading():
            return builtin(*args, **kwargs)  # the load validates and names the key path
        if _any_foreign(args, kwargs) or _plain_context():
            frame = sys._getframe(1)
            _check_plain_indices(name, args, kwargs, op, frame)
            return adopt(builtin(*args, **kwargs), op, frame)
        kwargs["check_invariants"] = True  # enforce mode ignores check_invariants=False
        try:
            return safe(*args, **kwargs)
        except InvariantError as err:
            raise _refused(err, op, sys._getframe(1)) from None

    wrapper.__ss_original__ = builtin  # type: ignore[attr-defined]
    return wrapper


#: Where a constructor takes its index data: COO (indices, size) argument positions.
_COO_ARGS = {"sparse_coo_tensor": (0, 2), "_sparse_coo_tensor_unsafe": (0, 2),
             "_sparse_coo_tensor_with_dims_and_tensors": (3, 2)}
_COMPRESSED_NAMES = {
    "compressed": ("compressed_indices", "plain_indices"),
    **{SHORT_NAMES[layout]: INDEX_MEMBERS[layout] for layout in COMPRESSED_LAYOUTS}}


def _check_plain_indices(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], op: str,
                         frame: FrameType | None) -> None:
    """Before torch's constructor ``name`` (``sparse_coo_tensor``, ``_sparse_csr_tensor_unsafe``
    ...) builds from foreign members: the index members that are plain tensors with data,
    checked as the safe factory would check them (the values are the foreign part, e.g. a
    ``MaskedTensor``, whose own dispatch builds the plain tensors behind it)."""
    try:
        with _disable_current_modes():  # the check is no part of what a mode sees
            _check_index_args(name, args, kwargs)
    except InvariantError as err:
        raise _refused(err, op, frame) from None


def _check_index_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if name in _COO_ARGS:
        at, size_at = _COO_ARGS[name]
        indices = _arg(args, kwargs, at, "indices")
        if _plain_index(indices) and indices.dim() == 2:
            check_coo_indices(indices, _arg(args, kwargs, size_at, "size"),
                              is_coalesced=bool(kwargs.get("is_coalesced")))
        return
    short = name.strip("_").removeprefix("sparse_").removesuffix("_tensor_unsafe")
    short = short.removesuffix("_tensor")
    if short not in _COMPRESSED_NAMES:
        return  # builds from dims only: no index data
    cname, pname = _COMPRESSED_NAMES[short]
    compressed = _arg(args, kwargs, 0, cname)
    plain = _arg(args, kwargs, 1, pname)
    values = _arg(args, kwargs, 2, "values")
    layout = BY_SHORT_NAME.get(short, kwargs.get("layout"))  # ("compressed": the argument)
    if (_plain_index(compressed) and _plain_index(plain) and layout in SPARSE_LAYOUTS
            and isinstance(values, torch.Tensor)):
        m = compressed.dim() - 1
        blocked = layout in BLOCK_LAYOUTS
        blocksize = tuple(values.shape[m + 1:m + 3]) if blocked else None
        check_compressed_indices(compressed, plain, _arg(args, kwargs, 3, "size"),
                                 layout=layout, blocksize=blocksize)


def _plain_index(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and not _foreign(x) and x.dim() >= 1
            and not x.dtype.is_floating_point and not x.dtype.is_complex)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


# ---------------------------------------------------------------------------------------------
# torch.load


_LOAD_SIGNATURE = inspect.signature(_originals.load)


def load(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.load`` / ``torch.serialization.load``: :func:`safesparse.load` with the
    caller's ``weights_only`` (torch's default for it)."""

    @functools.wraps(previous)
    def load(*args: Any, **kwargs: Any) -> Any:
        if (not _enforcing.is_enforced() or _local.__dict__.get("loading", 0)
                or _loading()):
            return previous(*args, **kwargs)
        bound = _LOAD_SIGNATURE.bind(*args, **kwargs)
        bound.arguments.setdefault("weights_only", None)  # torch's own default, not ours
        f = bound.arguments.pop("f")
        extra = bound.arguments.pop("pickle_load_args", {})
        _local.loading = getattr(_local, "loading", 0) + 1
        try:
            return files.load_as("torch.load", f, **bound.arguments, **extra)
        finally:
            _local.loading -= 1

    load.__ss_original__ = _originals.load  # type: ignore[attr-defined]
    return load


# ---------------------------------------------------------------------------------------------
# Constructors that build without reading the index data


class Builder:
    """Stands in for a legacy typed constructor (``torch.sparse.FloatTensor``): calls it,
    then :func:`adopt` s the result. ``isinstance`` checks and every attribute are the
    wrapped type's."""

    def __init__(self, previous: Any, op: str) -> None:
        self.__ss_original__ = previous
        self._op = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.__ss_original__(*args, **kwargs)
        return adopt(out, self._op, sys._getframe(1)) if active() else out

    def __getattr__(self, name: str) -> Any:
        if name == "__ss_original__":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.__ss_original__, name)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.__ss_original__)

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self.__ss_original__)

    def __repr__(self) -> str:
        return repr(self.__ss_original__)


class AtenOp:
    """Stands in for an aten constructor packet (``torch.ops.aten.sparse_csr_tensor``) or one
    of its overloads (``torch.ops.aten.sparse_csr_tensor.crow_col_value_size``): calls it,
    then :func:`adopt` s the result.

    It passes for what it stands for: ``isinstance(op, OpOverloadPacket)`` (or
    ``OpOverload``) holds, it hashes and compares equal to it, and every attribute is the
    original's, except that an overload looked up through a stand-in packet is a stand-in
    too (made on first use, then kept)."""

    def __init__(self, original: Any, op: str, name: str | None = None,
                 gate: Gate | None = None) -> None:
        d = self.__dict__
        d["__ss_original__"] = original
        d["_ss_op"] = op
        d["_ss_gate"] = gate
        d["_ss_name"] = op.split(".")[3] if name is None else name  # torch.ops.aten.<name>
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(original, name):
                d[name] = getattr(original, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(op, OpOverloadPacket) holds
        return type(self.__ss_original__)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:  # an aten ``self=`` keyword
        if self._ss_gate is not None:  # an index conversion: checks its input, then runs
            if not _enforcing.is_enforced():
                return self.__ss_original__(*args, **kwargs)
            return self._ss_gate(self.__ss_original__, self._ss_op, args, kwargs)
        if not active():
            return self.__ss_original__(*args, **kwargs)
        if _any_foreign(args, kwargs) or _plain_context():
            _check_plain_indices(self._ss_name, args, kwargs, self._ss_op, sys._getframe(1))
        out = self.__ss_original__(*args, **kwargs)
        return adopt(out, self._ss_op, sys._getframe(1))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__ss") or name.startswith("_ss_"):
            raise AttributeError(name)
        value = getattr(self.__ss_original__, name)
        if isinstance(value, torch._ops.OpOverload) and not name.startswith("_"):
            value = stand_in(value, f"{self._ss_op}.{name}", self._ss_name, self._ss_gate)
            self.__dict__[name] = value  # next time found without __getattr__
        return value

    def __eq__(self, other: object) -> bool:
        return self.__ss_original__ is getattr(other, "__ss_original__", other)

    def __hash__(self) -> int:
        return hash(self.__ss_original__)

    def __repr__(self) -> str:
        return repr(self.__ss_original__)

    def __str__(self) -> str:
        return str(self.__ss_original__)

    def __reduce__(self) -> Any:  # pickles (an FX graph's target) as the original
        return self.__ss_original__.__reduce__()


#: Every stand-in ever made, by the ``id`` of what it stands for (which it keeps alive): made
#: once, kept for the life of the process. torch's C++ dispatcher caches, per operator, a
#: *borrowed* pointer to the Python object it finds at ``torch.ops.aten.<name>.<overload>`` the
#: first time it needs one (``getTorchApiFunction``); when that happens while a stand-in is
#: installed, the stand-in must outlive the block, or the pointer dangles (a segfault at the next
#: Python dispatch of that operator). Being the same object in every block keeps it valid; it
#: calls torch's operator unchanged outside enforce mode.
_STAND_INS: dict[int, AtenOp] = {}
_stand_ins_lock = threading.Lock()


def stand_in(original: Any, op: str, name: str | None = None,
             gate: Gate | None = None) -> AtenOp:
    """The one :class:`AtenOp` standing in for ``original`` (an aten packet or overload);
    ``gate`` for an operator that reads index data (torch's index conversions)."""
    with _stand_ins_lock:
        ours = _STAND_INS.get(id(original))
        if ours is None:
            ours = _STAND_INS[id(original)] = AtenOp(original, op, name, gate)
        return ours


def new(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.new``: ``t.new(indices, values, size)`` on a sparse tensor, adopted."""

    @functools.wraps(previous)
    def new(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = previous(self, *args, **kwargs)
        if out.layout is torch.strided or not active():
            return out
        return adopt(out, "Tensor.new", sys._getframe(1))

    new.__ss_original__ = previous  # type: ignore[attr-defined]
    return new


def type_(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.type(torch.sparse.DoubleTensor)`` while the legacy types are replaced:
    torch's parser wants its own type object, not the stand-in."""

    @functools.wraps(previous)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_originals._original(a) for a in args)
        kwargs = {k: _originals._original(v) for k, v in kwargs.items()}
        return previous(self, *args, **kwargs)

    type_.__ss_original__ = previous  # type: ignore[attr-defined]
    return type_


# ---------------------------------------------------------------------------------------------
# TorchScript


def builtins_seen() -> None:
    """Have ``torch.jit`` build its table of builtins now, if it has not yet: it scans torch's
    attributes once, and must see torch's own functions there, not the stand-ins."""
    try:
        from torch.jit import _builtins

        _builtins._get_builtin_table()  # type: ignore[no-untyped-call]
    except Exception:  # pragma: no cover - private API of torch.jit
        pass


def register_builtin(fn: Any, op: str) -> None:
    """TorchScript compiles a call of ``fn`` to aten operator ``op``, as it compiled a call of
    the torch function ``fn`` stands in for (``torch.jit`` keeps its builtins by ``id``)."""
    try:
        from torch.jit import _builtins

        _builtins._register_builtin(fn, op)
    except Exception:  # pragma: no cover - private API of torch.jit
        pass


def unregister_builtin(fn: Any) -> None:
    """Forget ``fn`` as a builtin (before it is dropped: its ``id`` may be reused)."""
    try:
        from torch.jit import _builtins

        table = _builtins._builtin_table
        if table is not None:
            table.pop(id(fn), None)
    except Exception:  # pragma: no cover - private API of torch.jit
        pass

"""Enforce mode: validate sparse tensors where torch builds them, from code you do not edit.

``with ss.enforce():`` (a block), ``ss.set_enforce(True)`` (until switched off) and
``SAFESPARSE_ENFORCE=1`` in the environment switch it on (``python -m safesparse run`` and
``pytest --safesparse=enforce`` set the variable and switch it on for the whole process; see
docs/protecting.md). While it is on, every sparse tensor born through one of torch's Python
routes is validated before anything uses it:

* the six factories (``torch.sparse_coo_tensor``, ``torch.sparse_csr_tensor``,
  ``torch.sparse_csc_tensor``, ``torch.sparse_bsr_tensor``, ``torch.sparse_bsc_tensor``,
  ``torch.sparse_compressed_tensor``) run the safe factory of the same name instead: the data is
  validated before torch sees it, whatever ``check_invariants`` says;
* the legacy typed constructors (``torch.sparse.FloatTensor(indices, values, size)`` and the
  other ``torch.sparse.*Tensor`` / ``torch.cuda.sparse.*Tensor``), ``Tensor.new(indices,
  values, size)`` on a sparse tensor and the ``_unsafe`` constructors
  (``torch.ops.aten._sparse_coo_tensor_unsafe``, ``_sparse_compressed_tensor_unsafe``,
  ``_sparse_csr/csc/bsr/bsc_tensor_unsafe``) build without reading the index data; what they
  build is validated before it is handed back;
* ``torch.load`` validates every sparse tensor it loads, as :func:`safesparse.load` does (with
  the caller's ``weights_only`` and torch's default for it);
* torch's index conversions ``torch._convert_indices_from_coo_to_csr`` (PyTorch Geometric's
  ``index2ptr``) and ``torch._convert_indices_from_csr_to_coo`` write out of bounds for indices
  outside the target size: their inputs are checked first (``[COO 5.1]`` / ``[COO 5.2]`` for
  the row indices against ``size``, ``[CSR 5.x]`` / ``[CSC 5.x]`` for the compressed indices
  against the nnz), with the position.

Each result is a checked :class:`~safesparse.SafeSparseTensor` (or an
:class:`~safesparse.InvariantError` is raised), so kernels only ever read validated data and
the guard of :class:`~safesparse.SafeSparseTensor` covers everything computed from it. Dense
code never meets a wrapper on its hot path: only these functions are replaced (a torch function
mode looking at every call would cost dense code a quarter of its speed).

Mechanism
---------
The switch is a :class:`contextvars.ContextVar`, like debug mode's: ``enforce()`` and
``set_enforce()`` act on the current thread (or asyncio task) only; the process default
(``SAFESPARSE_ENFORCE``, read once at import, or :func:`set_process_default`, used by
``safesparse run`` and the pytest option) is what every context starts from, so it holds in
every thread, including threads started before or after.

The routes are intercepted by replacing their attributes (``torch.<factory>``,
``torch.load`` / ``torch.serialization.load``, ``torch.sparse.<Type>Tensor``, ``Tensor.new``,
``torch.ops.aten.<op>``, ``torch._convert_indices_*``) with thin wrappers. They are installed
the first time enforce mode is switched on, and removed again when the last
``with enforce():`` block ends unless ``set_enforce(True)`` or the process default made
enforcement lasting. Until then ``torch`` is untouched; while they are installed, a call
outside enforce mode goes straight to the function that was there before (torch's own, or a
user's monkeypatch), unchanged.

While :func:`safesparse.load` reads a file (its torch function mode is active), the wrappers
hand the call to torch's function, so that the load validates the data and reports its key
path; ``torch.load`` inside :func:`safesparse.load` is torch's own, never a second validating
load.

Limits
------
* Code that took a reference before the wrappers were installed (``from torch import
  sparse_coo_tensor`` at import time, ``torch._C._VariableFunctions.sparse_coo_tensor``, an
  overload such as ``torch.ops.aten._sparse_coo_tensor_unsafe.default``) calls torch's function
  directly; enforcement does not see those calls. ``python -m safesparse run`` and the
  environment variable switch enforce mode on before the program imports anything.
* Sparse tensors built by C++ code from data that is already checked (``Tensor.to_sparse()``,
  kernels) are not births from unchecked data: the guard of ``SafeSparseTensor`` validates
  what its operations build.
* ``torch.jit.script`` resolves the factory wrappers to torch's builtins (they are registered
  as such); ``torch.compile`` traces through them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.serialization

from safesparse_hooks import env

# files first: it records torch's functions before any wrapper is installed
from . import _originals, factories, files
from .errors import InvariantError
from .files.session import _LoadMode
from .indices import check_compressed_indices, check_coo_indices
from .invariants import SPARSE_LAYOUTS
from .tensor import validate

__all__ = ["enforce", "is_enforced", "set_enforce"]

_ENV_VAR = env.ENFORCE
_ENV_DEFAULT = env.flag(_ENV_VAR)  # read once, at import; a bad value raises, naming it
_default = _ENV_DEFAULT  # what a context that never switched starts from
_ENFORCE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "safesparse_enforce", default=None
)

_SAFE: dict[str, Callable[..., Any]] = {
    "sparse_coo_tensor": factories.sparse_coo_tensor,
    "sparse_compressed_tensor": factories.sparse_compressed_tensor,
    "sparse_csr_tensor": factories.sparse_csr_tensor,
    "sparse_csc_tensor": factories.sparse_csc_tensor,
    "sparse_bsr_tensor": factories.sparse_bsr_tensor,
    "sparse_bsc_tensor": factories.sparse_bsc_tensor,
}

_local = threading.local()  # depth of validating loads run by the torch.load wrapper


def is_enforced() -> bool:
    """Whether enforce mode is on in the current thread/context.

    Returns:
        ``True`` inside ``with enforce():``, after ``set_enforce(True)`` in this
        thread/context, or with ``SAFESPARSE_ENFORCE=1`` (unless switched off here).
    """
    value = _ENFORCE.get()
    return _default if value is None else value


def _loading() -> bool:
    """Whether :func:`safesparse.load` is reading a file here (its torch function mode is
    active): it validates what the file builds and names the key path itself."""
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(isinstance(mode, _LoadMode) for mode in stack)


def _active() -> bool:
    return is_enforced() and not _loading()


# ---------------------------------------------------------------------------------------------
# The wrappers, one per kind of route


def _factory_wrapper(name: str, previous: Callable[..., Any]) -> Callable[..., Any]:
    safe = _SAFE[name]
    builtin = _originals.FACTORIES[name]

    @functools.wraps(previous)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not is_enforced():
            return previous(*args, **kwargs)
        if _loading():
            return builtin(*args, **kwargs)  # the load validates and names the key path
        kwargs["check_invariants"] = True  # enforce mode ignores check_invariants=False
        return safe(*args, **kwargs)

    wrapper.__ss_original__ = builtin  # type: ignore[attr-defined]
    return wrapper


_LOAD_SIGNATURE = inspect.signature(_originals.load)


def _load_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def load(*args: Any, **kwargs: Any) -> Any:
        if not is_enforced() or _local.__dict__.get("loading", 0) or _loading():
            return previous(*args, **kwargs)
        bound = _LOAD_SIGNATURE.bind(*args, **kwargs)
        bound.arguments.setdefault("weights_only", None)  # torch's own default, not ours
        f = bound.arguments.pop("f")
        extra = bound.arguments.pop("pickle_load_args", {})
        _local.loading = getattr(_local, "loading", 0) + 1
        try:
            return files.load(f, **bound.arguments, **extra)
        finally:
            _local.loading -= 1

    load.__ss_original__ = _originals.load  # type: ignore[attr-defined]
    return load


def _adopt(out: Any, op: str) -> Any:
    """A sparse tensor torch built without reading its index data: validated now, handed back
    as a checked SafeSparseTensor sharing its storage, or refused naming ``op``."""
    if isinstance(out, torch.Tensor) and out.layout in SPARSE_LAYOUTS:
        try:
            return validate(out)
        except InvariantError as err:
            raise err.with_context(op=op) from None
    return out


class _Builder:
    """Stands in for a callable that builds sparse tensors without validating them (a legacy
    typed constructor, an aten operator packet): calls it, then :func:`_adopt` s the result.
    Everything else (``isinstance`` checks, attributes such as ``.default`` or ``.dtype``)
    is the wrapped object's."""

    def __init__(self, previous: Any, op: str) -> None:
        self.__ss_original__ = previous
        self._op = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.__ss_original__(*args, **kwargs)
        return _adopt(out, self._op) if _active() else out

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


def _new_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def new(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = previous(self, *args, **kwargs)
        if out.layout is torch.strided or not _active():
            return out
        return _adopt(out, "Tensor.new")

    new.__ss_original__ = previous  # type: ignore[attr-defined]
    return new


def _type_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.type(torch.sparse.DoubleTensor)`` while the legacy types are replaced: torch's
    parser wants its own type object, not the stand-in."""

    @functools.wraps(previous)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_originals._original(a) for a in args)
        kwargs = {k: _originals._original(v) for k, v in kwargs.items()}
        return previous(self, *args, **kwargs)

    type_.__ss_original__ = previous  # type: ignore[attr-defined]
    return type_


_INDEX_DTYPES = (torch.int32, torch.int64)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _coo_to_csr_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def convert(*args: Any, **kwargs: Any) -> Any:
        if is_enforced():
            rows, size = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "size")
            if (isinstance(rows, torch.Tensor) and rows.dtype in _INDEX_DTYPES
                    and rows.dim() <= 1 and not isinstance(size, torch.Tensor)):
                try:
                    check_coo_indices(rows.reshape(1, -1), (operator.index(size),))
                except InvariantError as err:
                    raise err.with_context(op="torch._convert_indices_from_coo_to_csr") from None
        return previous(*args, **kwargs)

    convert.__ss_original__ = previous  # type: ignore[attr-defined]
    return convert


def _csr_to_coo_wrapper(previous: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(previous)
    def convert(*args: Any, **kwargs: Any) -> Any:
        if is_enforced():
            crow, col = _arg(args, kwargs, 0, "crow_indices"), _arg(args, kwargs, 1, "col_indices")
            if (isinstance(crow, torch.Tensor) and isinstance(col, torch.Tensor)
                    and crow.dtype in _INDEX_DTYPES and crow.dim() >= 1 and col.dim() >= 1):
                _check_offsets(crow, col.shape[-1], bool(kwargs.get("transpose", False)))
        return previous(*args, **kwargs)

    convert.__ss_original__ = previous  # type: ignore[attr-defined]
    return convert


def _check_offsets(compressed: torch.Tensor, nnz: int, transpose: bool) -> None:
    """The compressed offsets against ``nnz`` (CSR 5.1-5.3; CSC with ``transpose``), the
    only index data the conversion reads: checked with a plain index that is valid by
    construction (``0 .. nnz-1``, sorted) against a plain extent of ``nnz``."""
    batch = tuple(compressed.shape[:-1])
    plain = torch.arange(nnz, dtype=compressed.dtype, device=compressed.device)
    plain = plain.expand(*batch, nnz)
    n = max(compressed.shape[-1] - 1, 0)
    size = (*batch, nnz, n) if transpose else (*batch, n, nnz)
    try:
        check_compressed_indices(compressed, plain, size,
                                 layout=torch.sparse_csc if transpose else torch.sparse_csr)
    except InvariantError as err:
        raise err.with_context(op="torch._convert_indices_from_csr_to_coo") from None


# ---------------------------------------------------------------------------------------------
# Installing and removing the wrappers

_install_lock = threading.Lock()
_MISSING = object()
# (owner, attr) -> (what owner.__dict__ held before, or _MISSING; ours)
_installed: dict[tuple[Any, str], tuple[Any, Any]] = {}
_blocks = 0  # live ``with enforce():`` blocks, all threads
_lasting = _ENV_DEFAULT  # set_enforce(True) or the process default: never removed

#: torch's ``_unsafe`` constructors (aten operator packets under ``torch.ops.aten``).
UNSAFE_OPS = ("_sparse_coo_tensor_unsafe", "_sparse_compressed_tensor_unsafe",
              "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe",
              "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe")
#: The legacy typed constructors' names in ``torch.sparse`` (and ``torch.cuda.sparse``).
LEGACY_TYPES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor",
                "CharTensor", "ShortTensor", "IntTensor", "LongTensor")


def _routes() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Every (owner, attribute, make-wrapper-from-previous) that enforce mode replaces."""
    routes: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (torch, name, functools.partial(_factory_wrapper, name))
        for name in _originals.FACTORY_NAMES]
    routes += [(torch, "load", _load_wrapper), (torch.serialization, "load", _load_wrapper)]
    for module in (torch.sparse, getattr(getattr(torch, "cuda", None), "sparse", None)):
        for name in LEGACY_TYPES:
            if module is not None and hasattr(module, name):
                routes.append((module, name, functools.partial(
                    _Builder, op=f"{module.__name__}.{name}")))
    routes += [(torch.Tensor, "new", _new_wrapper), (torch.Tensor, "type", _type_wrapper)]
    for name in UNSAFE_OPS:
        if hasattr(torch.ops.aten, name):
            routes.append((torch.ops.aten, name,
                           functools.partial(_Builder, op=f"torch.ops.aten.{name}")))
    routes += [(torch, "_convert_indices_from_coo_to_csr", _coo_to_csr_wrapper),
               (torch, "_convert_indices_from_csr_to_coo", _csr_to_coo_wrapper)]
    return routes


def _install() -> None:
    with _install_lock:
        if _installed:
            return
        for owner, attr, make in _routes():
            previous = getattr(owner, attr)
            ours = make(previous)
            own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else previous
            _installed[(owner, attr)] = (own, ours)
            setattr(owner, attr, ours)
            _register_jit_builtin(ours, attr)


def _uninstall() -> None:
    with _install_lock:
        if _blocks or _lasting:
            return
        for (owner, attr), (previous, ours) in list(_installed.items()):
            if getattr(owner, attr) is not ours:
                continue  # leave a later monkeypatch alone
            if previous is _MISSING:
                delattr(owner, attr)  # Tensor.new: TensorBase's shows through again
            else:
                setattr(owner, attr, previous)
        _installed.clear()


def _register_jit_builtin(fn: Callable[..., Any], attr: str) -> None:
    """TorchScript compiles calls of ``torch.<factory>`` to the aten op; keep that working."""
    if attr not in _SAFE:
        return
    try:
        from torch.jit import _builtins

        _builtins._register_builtin(fn, f"aten::{attr}")
    except Exception:  # pragma: no cover - private API of torch.jit
        pass


def set_enforce(enabled: bool) -> None:
    """Switch enforce mode on or off for the current thread/context (until switched again).

    Args:
        enabled: ``True``: every sparse tensor torch builds through its Python routes (the
            factories whatever ``check_invariants`` says, legacy and ``_unsafe``
            constructors, ``Tensor.new``, ``torch.load``) is validated and returned as a
            checked ``SafeSparseTensor``, and torch's index conversions check their input
            first; ``False``: torch behaves as without safesparse.
    """
    global _lasting
    if enabled:
        with _install_lock:
            _lasting = True
        _install()
    _ENFORCE.set(bool(enabled))


def set_process_default(enabled: bool) -> None:
    """Make enforce mode on (or off) the default of every thread/context of the process, as
    ``SAFESPARSE_ENFORCE`` does at import; contexts that switched it themselves keep their
    setting. Used by ``python -m safesparse run`` and the pytest option."""
    global _default, _lasting
    if enabled:
        with _install_lock:
            _lasting = True
        _install()
    _default = bool(enabled)


@contextlib.contextmanager
def enforce(enabled: bool = True) -> Iterator[None]:
    """``with enforce():`` validates every sparse tensor torch builds (factories, legacy and
    ``_unsafe`` constructors, ``Tensor.new``, ``torch.load``) and checks torch's index
    conversions, in this thread/context for the block (nestable; ``enforce(False)`` switches
    it off for a block).

    Args:
        enabled: switch enforce mode on (default) or off for the block.

    Yields:
        None; the previous setting is restored on exit, also on an exception.
    """
    global _blocks
    with _install_lock:
        _blocks += 1
    _install()
    token = _ENFORCE.set(bool(enabled))
    try:
        yield
    finally:
        _ENFORCE.reset(token)
        with _install_lock:
            _blocks -= 1
        _uninstall()


if _ENV_DEFAULT:
    _install()

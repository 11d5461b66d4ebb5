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
  values, size)`` on a sparse tensor and every aten constructor of sparse tensors, packet and
  overload (:data:`ATEN_CONSTRUCTORS`: ``torch.ops.aten.sparse_csr_tensor`` and
  ``.crow_col_value_size``, the ``_unsafe`` ones, ``_sparse_coo_tensor_with_dims_and_tensors``
  ...; FX graphs and decompositions call them by name) build without reading the index data;
  what they build is validated before it is handed back;
* ``torch.load`` validates every sparse tensor it loads, as :func:`safesparse.load` does (with
  the caller's ``weights_only`` and torch's default for it);
* torch's index conversions ``torch._convert_indices_from_coo_to_csr`` (PyTorch Geometric's
  ``index2ptr``) and ``torch._convert_indices_from_csr_to_coo`` write out of bounds for indices
  outside the target size, and the first reads its rows' memory as if it were contiguous. By
  every route (the torch functions, ``torch._VF``'s, the aten packets and their overloads),
  every integral index dtype and ``size`` as an int or a 0-d tensor, their inputs are made
  contiguous and checked first (``[COO 5.1]`` / ``[COO 5.2]`` for the row
  indices against ``size``, ``[COO 5.3]`` for rows out of order, ``[CSR 5.x]`` / ``[CSC 5.x]``
  for the compressed indices against the nnz, ``[CSR 3.x]`` for batches that disagree), with
  the position, and torch is handed exactly the tensors that were checked (traced by
  ``torch.compile``, the call becomes an operator that checks the data it runs on; see
  :mod:`safesparse.enforcement.conversions`).

Each result is a checked :class:`~safesparse.SafeSparseTensor` (or an
:class:`~safesparse.InvariantError` is raised, naming the call that built the tensor and where
it was made: ``(built by torch.sparse_csr_tensor at train.py:12)``), so kernels only ever read
validated data and the guard of :class:`~safesparse.SafeSparseTensor` covers everything
computed from it. Dense code never meets a wrapper on its hot path: only these functions are
replaced (a torch function mode looking at every call would cost dense code a quarter of its
speed).

Otherwise an enforced program runs as it runs without safesparse: a sparse tensor prints as
torch prints it (:meth:`SafeSparseTensor.__repr__ <safesparse.SafeSparseTensor.__repr__>`),
TorchScript compiles a call of every replaced torch function to the same operator as before,
and tensors that carry no data to validate are torch's business: ``meta`` tensors,
``FakeTensor`` s, and tensor subclasses that dispatch in Python (torch's ``MaskedTensor``) go to
torch's function (plain index data among the arguments checked first) and come back as torch
returns them. Below autograd (inside a ``__torch_dispatch__`` handler) and while a dispatch
mode is active (``make_fx``, ``FakeTensorMode``), a validated result comes back as the plain
tensor torch returned (see :mod:`safesparse.enforcement.routes`).

Mechanism
---------
The switch is a :class:`contextvars.ContextVar`, like debug mode's
(:mod:`safesparse.base.enforce_flag`):
``enforce()`` and ``set_enforce()`` act on the current thread (or asyncio task) only; the process
default (``SAFESPARSE_ENFORCE``, read once at import, or :func:`set_process_default`, used by
``safesparse run`` and the pytest option) is what every context starts from, so it holds in
every thread, including threads started before or after.

The routes are intercepted by replacing their attributes (``torch.<factory>``,
``torch.load`` / ``torch.serialization.load``, ``torch.sparse.<Type>Tensor``, ``Tensor.new``,
``torch.ops.aten.<op>``, ``torch._convert_indices_*``) with thin wrappers. They are installed
the first time enforce mode is switched on, and removed again when the last
``with enforce():`` block ends unless ``set_enforce(True)`` or the process default made
enforcement lasting. Until then ``torch`` is untouched; while they are installed, a call
outside enforce mode goes straight to the function that was there before (torch's own, or a
user's monkeypatch), unchanged. An aten operator's stand-in passes for the packet (``isinstance``,
hash and equality, attributes), so registries keyed by the packet (``MaskedTensor``'s dispatch
table, inductor's lowerings) work whether they were filled before or after it went in.

While :func:`safesparse.load` reads a file (its torch function mode is active), the wrappers
hand the call to torch's function, so that the load validates the data and reports its key
path; ``torch.load`` inside :func:`safesparse.load` is torch's own, never a second validating
load.

Limits
------
* Code that took a reference before the wrappers were installed (``from torch import
  sparse_coo_tensor`` at import time, ``torch._C._VariableFunctions.sparse_coo_tensor``, an
  aten packet or overload object held since then) calls torch's function directly
  (``torch._C._VariableFunctions`` is an immutable type: its names cannot be replaced);
  enforcement does not see those calls. ``python -m safesparse run`` and the environment
  variable switch enforce mode on before the program imports anything.
* Sparse tensors built by C++ code from data that is already checked (``Tensor.to_sparse()``,
  kernels) are not births from unchecked data: the guard of ``SafeSparseTensor`` validates
  what its operations build.
* TorchScript functions and ``torch.compile`` d graphs call torch's operators themselves:
  their calls are compiled, not validated.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.serialization

from ..base import enforce_flag as _enforcing
from ..base import originals as _originals
from . import conversions, routes

__all__ = ["enforce", "is_enforced", "set_enforce"]

#: The switch itself (a ContextVar; benchmarks/group_enforce.py sets it per context).
_ENFORCE = _enforcing._ENFORCE


def is_enforced() -> bool:
    """Whether enforce mode is on in the current thread/context.

    Returns:
        ``True`` inside ``with enforce():``, after ``set_enforce(True)`` in this
        thread/context, or with ``SAFESPARSE_ENFORCE=1`` (unless switched off here).
    """
    return _enforcing.is_enforced()


# ---------------------------------------------------------------------------------------------
# Installing and removing the wrappers

_install_lock = threading.Lock()
_MISSING = object()
# (owner, attr) -> (what owner.__dict__ held before, or _MISSING; ours)
_installed: dict[tuple[Any, str], tuple[Any, Any]] = {}
_blocks = 0  # live ``with enforce():`` blocks, all threads
_lasting = _enforcing.ENV_DEFAULT  # set_enforce(True) or the process default: never removed

#: torch's aten constructors of sparse tensors (operator packets under ``torch.ops.aten``; each
#: overload is reached through its packet): the factories' own operators, the ``_unsafe``
#: ones, and those building from dims (``_with_dims_and_tensors``, used by decompositions).
ATEN_CONSTRUCTORS = (
    "sparse_coo_tensor", "_sparse_coo_tensor_unsafe", "_sparse_coo_tensor_with_dims",
    "_sparse_coo_tensor_with_dims_and_tensors",
    "sparse_compressed_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
    "sparse_bsc_tensor",
    "_sparse_compressed_tensor_unsafe", "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe",
    "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe",
    "_sparse_compressed_tensor_with_dims",
)
#: The legacy typed constructors' names in ``torch.sparse`` (and ``torch.cuda.sparse``).
LEGACY_TYPES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor",
                "CharTensor", "ShortTensor", "IntTensor", "LongTensor")
#: torch's index conversions, checked before they run: the torch functions (and ``torch._VF``'s
#: view of them) and the aten packets with their overloads (``.default``, ``.out``).
CONVERSIONS = {"_convert_indices_from_coo_to_csr": conversions.coo_to_csr,
               "_convert_indices_from_csr_to_coo": conversions.csr_to_coo}
CONVERSION_GATES = {"_convert_indices_from_coo_to_csr": conversions.gate_coo_to_csr,
                    "_convert_indices_from_csr_to_coo": conversions.gate_csr_to_coo}

#: (owner, attribute, make-wrapper-from-previous, TorchScript builtin of the attribute or None)
Route = tuple[Any, str, Callable[[Any], Any], "str | None"]


def _routes() -> list[Route]:
    """Every attribute that enforce mode replaces, with its wrapper maker."""
    out: list[Route] = [(torch, name, functools.partial(routes.factory, name), f"aten::{name}")
                        for name in _originals.FACTORY_NAMES]
    out += [(torch, "load", routes.load, None), (torch.serialization, "load", routes.load, None)]
    for module in (torch.sparse, getattr(getattr(torch, "cuda", None), "sparse", None)):
        for name in LEGACY_TYPES:
            if module is not None and hasattr(module, name):
                out.append((module, name, functools.partial(
                    routes.Builder, op=f"{module.__name__}.{name}"), None))
    out += [(torch.Tensor, "new", routes.new, None), (torch.Tensor, "type", routes.type_, None)]
    for name in ATEN_CONSTRUCTORS:
        if hasattr(torch.ops.aten, name):
            out.append((torch.ops.aten, name,
                        functools.partial(routes.stand_in, op=f"torch.ops.aten.{name}"),
                        f"aten::{name}"))
    out += [(torch, name, make, f"aten::{name}") for name, make in CONVERSIONS.items()]
    vf = getattr(torch, "_VF", None)  # torch._C._VariableFunctions itself is immutable
    out += [(vf, name, make, None) for name, make in CONVERSIONS.items()
            if vf is not None and hasattr(vf, name)]
    for name, gate in CONVERSION_GATES.items():
        if hasattr(torch.ops.aten, name):
            out.append((torch.ops.aten, name, functools.partial(
                routes.stand_in, op=f"torch.ops.aten.{name}", gate=gate), f"aten::{name}"))
    return out


def _install() -> None:
    with _install_lock:
        if _installed:
            return
        routes.builtins_seen()  # TorchScript's table holds torch's functions before ours
        for owner, attr, make, builtin in _routes():
            previous = getattr(owner, attr)
            ours = make(previous)
            own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else previous
            _installed[(owner, attr)] = (own, ours)
            setattr(owner, attr, ours)
            if builtin is not None:
                routes.register_builtin(ours, builtin)


def _uninstall() -> None:
    with _install_lock:
        if _blocks or _lasting:
            return
        for (owner, attr), (previous, ours) in list(_installed.items()):
            routes.unregister_builtin(ours)
            if getattr(owner, attr) is not ours:
                continue  # leave a later monkeypatch alone
            if previous is _MISSING:
                delattr(owner, attr)  # Tensor.new: TensorBase's shows through again
            else:
                setattr(owner, attr, previous)
        _installed.clear()


def set_enforce(enabled: bool) -> None:
    """Switch enforce mode on or off for the current thread/context (until switched again).

    Args:
        enabled: ``True``: every sparse tensor torch builds through its Python routes (the
            factories whatever ``check_invariants`` says, legacy and ``_unsafe``
            constructors, every ``torch.ops.aten`` sparse constructor and overload,
            ``Tensor.new``, ``torch.load``) is validated and returned as a checked
            ``SafeSparseTensor``, and torch's index conversions check their input first;
            ``False``: torch behaves as without safesparse.
    """
    global _lasting
    if enabled:
        with _install_lock:
            _lasting = True
        _install()
    _enforcing.set_here(enabled)


def set_process_default(enabled: bool) -> None:
    """Make enforce mode on (or off) the default of every thread/context of the process, as
    ``SAFESPARSE_ENFORCE`` does at import; contexts that switched it themselves keep their
    setting. Used by ``python -m safesparse run`` and the pytest option."""
    global _lasting
    if enabled:
        with _install_lock:
            _lasting = True
        _install()
    _enforcing.set_default(enabled)


@contextlib.contextmanager
def enforce(enabled: bool = True) -> Iterator[None]:
    """``with enforce():`` validates every sparse tensor torch builds (factories, legacy,
    ``_unsafe`` and aten constructors, ``Tensor.new``, ``torch.load``) and checks torch's index
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
    token = _enforcing.set_here(enabled)
    try:
        yield
    finally:
        _enforcing.reset(token)
        with _install_lock:
            _blocks -= 1
        _uninstall()


if _enforcing.ENV_DEFAULT:
    _install()

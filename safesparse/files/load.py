"""Loading: :func:`load` (``ss.load``) and :func:`load_and_validate`, the loader behind
``python -m safesparse check``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch

from ..catalog.errors import source_name
from ..state.memory import torch_loader
from . import safetensors as _safetensors
from .atomic import is_path
from .limits import vet_zip_file
from .modules import module_matrices
from .results import Found, LoadResult
from .session import (
    LEGACY_WRAPPED_MESSAGE,
    OnSparse,
    _BuildWatch,
    _LoadMode,
    _local,
    _Session,
    _session,
)
from .walk import _Walk

__all__ = ["load", "load_and_validate", "load_as"]


#: torch's own loader, as it was when safesparse was imported (enforce mode wraps torch.load).
_torch_load = torch.load


def _safetensors_device(map_location: Any) -> str:
    """``map_location`` as the device of a safetensors load, as ``torch.load`` converts it."""
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, bytes, torch.device)):
        return os.fsdecode(map_location) if isinstance(map_location, bytes) else str(map_location)
    raise RuntimeError("loading a safetensors file with a dict or callable map_location is not "
                       "supported (as in torch.load); use a device string or torch.device")


def load_and_validate(
    f: Any, *, on_sparse: OnSparse | None = None, **kwargs: Any
) -> LoadResult:
    """``torch.load(f, **kwargs)`` with every sparse tensor validated before it is used.

    Never raises :class:`InvariantError`: a refused tensor stays a :class:`SparseRecord` in the
    returned object and in ``found``; the matrices of ``safesparse.nn`` state dicts in it
    (index members and values beside their geometry) are validated too, each with its verdict
    in ``modules`` (:mod:`safesparse.files.modules`). Any other error of ``torch.load``
    propagates, except that one caused by a refused tensor (torch wrapping it in a Parameter,
    say) is reported as that tensor (``found`` then lists the refused tensors only, with no
    key path).
    ``on_sparse(count, layout, shape)`` is called after each sparse tensor is validated.

    A path ending in ``.safetensors`` is read as ``torch.load`` reads it (torch hands such a
    path to ``safetensors.torch.load_file``), but through :mod:`safesparse.safetensors`, so
    that its sparse tensors are rebuilt and validated rather than returned as loose members.
    """
    if is_path(f) and os.fsdecode(os.fspath(f)).endswith(".safetensors"):
        return _safetensors.load_and_validate(f, _safetensors_device(kwargs.get("map_location")))
    vet_zip_file(f)  # a zip whose entries declare more than a small multiple of it: unread
    session = _Session(on_sparse=on_sparse, own_indices=bool(kwargs.get("mmap")))
    prior = _session()
    _local.session = session
    try:
        # The dispatch watch sees what torch's C++ code builds (legacy typed constructors), at a
        # cost per operator; with weights_only=True the unpickler can only put such a tensor in
        # containers the walk reaches, and the function mode validates it before any use.
        watch = (_BuildWatch(session) if kwargs.get("weights_only") is not True
                 else contextlib.nullcontext())
        with _LoadMode(session), watch, torch_loader():
            obj = _torch_load(f, **kwargs)
    except Exception as exc:
        if session.rejected:
            return LoadResult(None, [Found(None, r) for r in session.rejected], aborted=exc)
        if session.pending or any(b.item is None for b in session.built.values()):
            raise RuntimeError(LEGACY_WRAPPED_MESSAGE) from exc
        raise
    finally:
        _local.session = prior
    try:
        result = _Walk(session, session.resolve_pending()).run(obj)
    except RecursionError:
        raise RuntimeError(
            "the loaded object is nested too deeply for safesparse to check every tensor in it"
        ) from None
    return dataclasses.replace(result, modules=module_matrices(result.obj))


def load(f: Any, **kwargs: Any) -> Any:
    """``torch.load`` that validates every sparse tensor in the file before returning it.

    A checkpoint is untrusted input: ``torch.load`` builds sparse tensors without checking their
    indices, and the first kernel that reads a malformed one may read out of bounds. ``ss.load``
    runs ``torch.load`` itself (``weights_only=True`` unless you pass ``weights_only=False``)
    and validates every sparse tensor anywhere in the loaded object (dicts and their keys,
    lists, tuples, sets, state dicts, object attributes, legacy constructors, nested) before
    anything uses it. Each is returned as a checked :class:`SafeSparseTensor`; one whose index
    storage another loaded tensor shares gets its own copy of its index members. Everything
    else is returned as ``torch.load`` gives it. The matrices of ``safesparse.nn`` state dicts
    (each layer's index members and values, dense tensors beside its geometry) are validated
    too, in place. A path ending in ``.safetensors`` (which ``torch.load`` hands to plain
    safetensors) is read with ``safesparse.safetensors.load_file``: its sparse tensors come
    back rebuilt and checked.

    Example::

        state = ss.load("model.pt", map_location="cpu")
        model.load_state_dict(state)  # the model's sparse tensors stay checked

    Args:
        f: a file name, path or file-like object, as for ``torch.load``.
        **kwargs: keyword arguments of ``torch.load`` (``map_location``, ``weights_only``,
            ``mmap`` ...).

    Returns:
        The loaded object, with every sparse tensor a checked ``SafeSparseTensor``.

    Raises:
        InvariantError: a sparse tensor, or a ``safesparse.nn`` layer's saved matrix, breaks
            an invariant; ``str(err)`` and ``err.path`` name its key path, e.g.
            ``['layer.weight']``, ``['fc1.plain_indices']``.
        ValueError: a ``safesparse.nn`` layer's saved geometry is damaged
            (``GeometryError``, naming ``['fc1._extra_state']``).
        RuntimeError: a legacy-format file holds sparse tensors where they cannot be put back
            validated (save it again in torch's default format).
        pickle.UnpicklingError: ``torch.load`` refused the file (e.g. ``weights_only=True``
            and an unsupported global), as with ``torch.load``.
    """
    kwargs.setdefault("weights_only", True)
    return load_as("ss.load", f, **kwargs)


def load_as(loader: str, f: Any, **kwargs: Any) -> Any:
    """:func:`load` with ``kwargs`` as given (no ``weights_only`` default), for ``loader``
    (``"ss.load"``, ``"torch.load"`` in enforce mode), which a refusal names with the file."""
    result = load_and_validate(f, **kwargs)
    err = result.first_error
    if err is not None:
        raise err.with_context(loaded_by=f"{loader} from {source_name(f)}") from result.aborted
    if result.unplaced:
        raise RuntimeError(
            "a legacy-format checkpoint holds sparse tensors where safesparse cannot put the "
            "validated tensors back (inside a set or an object); save it again in torch's "
            "default (zip) format"
        )
    return result.obj

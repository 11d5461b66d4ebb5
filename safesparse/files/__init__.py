"""Files from elsewhere: ``ss.load``, ``ss.save`` and the loader behind ``python -m safesparse
check``.

Where things are
----------------
* :mod:`~safesparse.files.load`: :func:`load` and :func:`load_and_validate`, the entry points;
* :mod:`~safesparse.files.session`: what happens while ``torch.load`` reads the file (the load
  session, its torch function mode and dispatch watch, refused tensors as records);
* :mod:`~safesparse.files.walk`: the deep walk over the loaded object, and aliasing;
* :mod:`~safesparse.files.results`: key paths, :class:`Found`, :class:`LoadResult`;
* :mod:`~safesparse.files.save`: :func:`save` and :func:`unwrap_all`;
* :mod:`~safesparse.files.pickling`: how a ``SafeSparseTensor`` pickles and unpickles;
* :mod:`~safesparse.files.safetensors`: safetensors files, no pickle at all (public as
  :mod:`safesparse.safetensors`);
* :mod:`~safesparse.files.atomic`: writing a file whole or not at all.
* :mod:`~safesparse.files.owned`: the loaders' copy of index members off a file mapping.

A checkpoint is untrusted input. ``torch.load`` rebuilds every sparse tensor in a file with
``torch._utils._rebuild_sparse_tensor``, which calls ``torch.sparse_coo_tensor`` /
``torch.sparse_compressed_tensor`` with ``check_invariants=False``; torch validates the result
afterwards only when ``torch.sparse.check_sparse_tensor_invariants`` is enabled globally (it is
not by default). So a file whose CSR column index is ``10**9`` loads silently, and the first
kernel that reads it (``t @ dense``) reads far out of bounds.

How the data is intercepted
---------------------------
Everything here runs ``torch.load`` itself, unchanged (its ``weights_only`` unpickler with its
allowlist, opcode restrictions and user safe globals, ``map_location``, the zip and legacy
formats), inside a :class:`~torch.overrides.TorchFunctionMode` (:class:`_LoadMode`). The mode
sees every torch function called while the file is read, whichever pickled function called it
(torch's rebuild function, an allowlisted user global, ours):

* the factories through which torch turns loaded member tensors into a sparse tensor get the
  raw members (indices, values, size, coalesced flag) handed to the safe factories instead,
  which check every invariant on the strided members and only then build the tensor with
  torch's factory (a checked :class:`SafeSparseTensor`). When a check fails, *nothing is built*:
  the mode returns a :class:`SparseRecord` (the layout, the raw members and the
  :class:`InvariantError`) in place of the tensor, and loading goes on;
* any other torch function that returns a sparse tensor builds it (building reads no index
  data) and the result is validated at once, and so is any sparse tensor a torch function
  receives that the mode has not seen (a legacy constructor's, built from C++), before the
  function runs. A valid one is noted as built; an invalid one is *tainted*: any later torch
  function that receives it while the file is still being read (other than metadata
  accessors) raises its :class:`InvariantError` instead of running, so no kernel ever reads its
  index data. Where the file may run code of its own (``weights_only`` not ``True``),
  :class:`_BuildWatch`, a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, also sees
  every aten operator, which validates a legacy constructor's tensor as it is built and refuses
  operators that torch's C++ code runs on a tainted one. (With ``weights_only=True`` the
  unpickler can only put such a tensor in containers the walk reaches, and a mode on every
  operator costs time on every tensor of every file.)

After ``torch.load`` returns, :class:`_Walk` goes through the whole loaded object: dicts of any
kind (``OrderedDict`` state dicts, ``Counter``, ``defaultdict``) *and their keys*, lists, tuples,
named tuples, sets, frozensets, deques, the attributes (``__dict__`` and ``__slots__``) of other
objects and of tensors. It names every sparse tensor by its key path (``['layer.weight']``,
``['s']{0}`` for an element of a set, ``['w'].keys()[0]`` for a dict key, ``.weight`` for an
attribute), validates any it has not seen validated (a sparse ``nn.Parameter``, say), and puts
the checked :class:`SafeSparseTensor` in its place, rebuilding immutable containers (tuples,
frozensets) and dict keys where needed. A tensor built while reading that the walk cannot reach
still counts: an invalid one refuses the load (with no key path); so nothing can be hidden.

Aliasing
--------
``torch.load`` gives every tensor of a file its own version counter, even when two share a
storage; safesparse's checked state watches the counters of a tensor's index members. A file
can therefore pair a sparse tensor with a dense tensor (or another sparse tensor's values, or
other index members) on the same bytes as its index members: a write through that other tensor
would change the index data without any counter safesparse watches moving. The walk compares
the byte ranges of every tensor it reaches with the index members of every checked sparse
tensor; a checked tensor whose index storage is shared with anything else (other than tensors
on the very same index members, which share its checked state) gets a private copy of its index
members (a clone, validated again), so no returned object aliases it. :attr:`Found.aliased_with`
names what it shared storage with; ``check`` reports it.

The legacy file format (``torch.save(..., _use_new_zipfile_serialization=False)``, the default
before torch 1.6) writes the storages *after* the pickle, so torch rebuilds its sparse tensors
before their data has been read. There the mode builds nothing either: it returns a pending
record, and the members are validated (and the tensor built) once ``torch.load`` has read the
storages, before the object is handed back. A pending tensor that torch wraps during loading
(a sparse ``nn.Parameter`` in a legacy file) cannot be validated first, so such a file is
refused with a ``RuntimeError``; plain ``torch.load`` of a legacy file holding a
``SafeSparseTensor`` is refused the same way (``ss.load`` reads it).

Why this route rather than a custom unpickler: a ``find_class`` override (or a copy of torch's
weights-only unpickler) would have to re-implement torch's allowlist and its opcode restrictions
and follow them from release to release, and torch refuses a ``pickle_module`` with
``weights_only=True``; the mode leaves all of that to torch, is thread-local (no global state is
patched), and sees construction itself, whichever pickled function asked for it.

``torch.load`` is called through a reference taken when this module is imported, so that
wrapping ``torch.load`` later (enforce mode does) never makes this loader call itself.

Saving for plain torch
----------------------
:func:`save` is ``torch.save`` of :func:`unwrap_all`: every ``SafeSparseTensor`` in dicts, lists,
tuples and sets becomes the plain torch tensor, so the file names no safesparse global and
``torch.load(f, weights_only=True)`` reads it where safesparse is not installed.
"""

from __future__ import annotations

from . import pickling as _pickling  # noqa: F401  (SafeSparseTensor.__reduce_ex__)
from .load import load, load_and_validate, load_as
from .results import Found, LoadResult, PathKey, path_str
from .save import save, unwrap_all
from .session import OnSparse, SparseRecord

__all__ = [
    "Found",
    "LoadResult",
    "OnSparse",
    "PathKey",
    "SparseRecord",
    "load",
    "load_and_validate",
    "load_as",
    "path_str",
    "save",
    "unwrap_all",
]

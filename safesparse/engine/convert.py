"""Arguments as torch's sparse factories read them: index data, sizes and COO indices.

Shared by the factories (:mod:`safesparse.factories.core`) and the index checks
(:mod:`safesparse.engine.indices`), so both convert their inputs by one rule and neither imports the
other.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..catalog.invariants import explain


def _as_index(x: Any, device: torch.device | None) -> torch.Tensor:
    """Index input as a tensor: tensors keep their dtype, other integer data becomes int64."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        t = torch.as_tensor(x)
        if t.numel() == 0 and not t.dtype.is_complex and t.dtype.is_floating_point:
            t = t.to(torch.int64)  # an empty list of indices
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def _size_error(fname: str, detail: str) -> TypeError:
    return TypeError(f"{fname}(): argument 'size' must be tuple of ints, but {detail}")


def _as_size(size: Any, fname: str = "sparse_compressed_tensor") -> tuple[int, ...] | None:
    """``size`` as torch's argument parser reads it: a tuple, list or ``torch.Size`` of integers
    (Python or NumPy integers, one-element integer tensors). Anything else, a float, a bool,
    a string or a tensor as the whole size included, is a ``TypeError``, as in torch. (torch
    refuses a bool as the first extent only; later ones are read as 0 / 1, and so here.)"""
    if size is None:
        return None
    if not isinstance(size, (tuple, list)):
        raise _size_error(fname, f"got {type(size).__name__}")
    out = []
    for pos, extent in enumerate(size):
        try:
            if isinstance(extent, bool) and pos == 0:
                raise TypeError
            out.append(operator.index(extent))
        except (TypeError, RuntimeError, ValueError):
            raise _size_error(
                fname, f"found element of type {type(extent).__name__} at pos {pos}"
            ) from None
    return tuple(out)


def _coo_index(x: Any, device: torch.device | None, *, check: bool = True) -> torch.Tensor:
    """COO indices as torch converts them (int64). ``check``: refuse uint64 indices that do
    not survive the conversion (a validating caller; without it they wrap, as in torch)."""
    t = _as_index(x, device)
    # torch converts indices of every other dtype (integer, bool, floating point, complex) to
    # int64, truncating like ``.to(torch.int64)``; out-of-range results are caught by 5.1/5.2
    if t.dtype != torch.int64 and t.layout == torch.strided:
        unsigned64 = t.dtype == torch.uint64
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "discards the imaginary part"
            t = t.to(torch.int64)
        if unsigned64 and check:
            _refuse_wrapped(t)
    return t


def _refuse_wrapped(t: torch.Tensor) -> None:
    """uint64 indices of 2**63 and more wrap around to negative int64 values; report the first
    (in the engine's order: by position, then sparse dim) with its real value. It breaks 5.2
    (index < size) whatever the size: no extent exceeds 2**63 - 1."""
    if t.dim() != 2 or t.device.type == "meta" or not bool((t < 0).any()):
        return  # (a wrong shape is the engine's to report)
    j, d = (int(x) for x in (t.t() < 0).nonzero()[0])
    real = int(t[d, j]) + 2**64
    raise InvariantError(torch.sparse_coo, "5.2",
                         f"position {j}, sparse dim {d}: indices[{d}, {j}] = {real} (uint64), "
                         "beyond any size (at most 2**63 - 1)",
                         location={"position": j, "dim": d, "value": real},
                         explanation=explain(torch.sparse_coo, "5.2", "uint64", value=real,
                                             dim=d))

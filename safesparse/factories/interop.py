"""SciPy bridge: :func:`from_scipy` and :func:`to_scipy`.

SciPy is optional (``pip install "safesparse[scipy]"``); it is imported on first use, and a
missing SciPy is an ``ImportError`` that names the extra.

Both directions copy the data: a SciPy matrix and a :class:`SafeSparseTensor` never share
memory, so an in-place SciPy operation (``m.sort_indices()``, ``m.indices[0] = 7``) can never
leave a checked tensor invalid behind safesparse's back, and the other way round.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.layouts import SHORT_NAMES, compressed_members, layout_name
from ..tensor.core import SafeSparseTensor, unwrap, validate
from .core import (
    DeviceLike,
    sparse_bsr_tensor,
    sparse_coo_tensor,
    sparse_csc_tensor,
    sparse_csr_tensor,
)

__all__ = ["from_scipy", "to_scipy"]

#: The SciPy formats with a torch layout of their own.
SCIPY_FORMATS = ("coo", "csr", "csc", "bsr")


def _scipy_sparse() -> ModuleType:
    """``scipy.sparse``, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("scipy.sparse")
    except ImportError as err:
        raise ImportError(
            "safesparse's SciPy bridge needs SciPy: pip install 'safesparse[scipy]' "
            "(or pip install scipy)"
        ) from err


def _tensor(array: Any) -> torch.Tensor:
    """A contiguous torch tensor holding a copy of the NumPy ``array`` (never a view of it).

    The copy also gives an empty array row-major strides: NumPy's ``(0,)`` strides of an empty
    index array would otherwise reach the checker as they are.
    """
    np = importlib.import_module("numpy")
    view = torch.from_numpy(np.ascontiguousarray(array))  # from_numpy refuses negative strides
    return view.clone(memory_format=torch.contiguous_format)


def from_scipy(
    m: Any,
    *,
    dtype: torch.dtype | None = None,
    device: DeviceLike = None,
    requires_grad: bool = False,
    canonicalize: bool = False,
) -> SafeSparseTensor:
    """A validated :class:`SafeSparseTensor` holding a copy of the SciPy sparse matrix ``m``.

    Works for SciPy sparse matrices and sparse arrays (``csr_matrix``, ``csr_array`` ...) of
    the formats with a torch layout: CSR -> ``torch.sparse_csr``, CSC -> ``torch.sparse_csc``,
    BSR -> ``torch.sparse_bsr`` (the same blocksize), COO -> ``torch.sparse_coo`` (any number
    of dims SciPy allows). The tensor is built by the safe factories, so every invariant is
    checked; the index dtype is SciPy's (int32 or int64; COO indices become int64, as in torch)
    and the values keep their dtype unless ``dtype`` is given. A COO matrix that SciPy marks
    canonical (``m.has_canonical_format``) becomes a coalesced tensor, which is verified (5.3).

    SciPy does not require sorted or distinct indices; torch does. By default a CSR/CSC/BSR
    matrix with unsorted or duplicate indices fails with invariant 5.6 (and ``m`` is taken as
    it is: no silent change of its entries). ``canonicalize=True`` converts a copy the way
    ``m.sum_duplicates()`` does: duplicates are summed and indices sorted, so the result equals
    ``m.toarray()``, and a COO result is coalesced; ``m`` itself is not modified. A matrix
    whose structure is broken beyond order (an index out of range, a decreasing ``indptr``) is
    not canonicalised but refused, as by default.

    Args:
        m: a ``scipy.sparse`` matrix or array in COO, CSR, CSC or BSR format.
        dtype: the values dtype of the result (default: the dtype of ``m.data``).
        device: the device of the result (default: CPU).
        requires_grad: make the result an autograd leaf that requires grad.
        canonicalize: sum duplicate entries and sort the indices (of a copy) first.

    Returns:
        A checked :class:`SafeSparseTensor` of the matching layout, with ``to_dense()`` equal
        to ``m.toarray()``. It shares no memory with ``m``.

    Raises:
        ImportError: SciPy is not installed.
        TypeError: ``m`` is not a SciPy sparse matrix, or is in a format torch has no layout for
            (DIA, DOK, LIL: convert it with ``m.tocsr()`` or ``m.tocoo()`` first), or its
            dtype has no torch equivalent.
        InvariantError: the data breaks an invariant (e.g. ``[CSR 5.6]`` for unsorted or
            duplicate column indices, without ``canonicalize``).
    """
    sparse = _scipy_sparse()
    if not sparse.issparse(m):
        raise TypeError(f"from_scipy() expects a scipy.sparse matrix or array, got {type(m)}")
    fmt = m.format
    if canonicalize and fmt in SCIPY_FORMATS:
        m = _canonical(m)
    kw: dict[str, Any] = {"dtype": dtype, "device": device, "requires_grad": requires_grad}
    shape = tuple(int(s) for s in m.shape)
    if fmt == "csr":
        return sparse_csr_tensor(
            _tensor(m.indptr), _tensor(m.indices), _tensor(m.data), shape, **kw
        )
    if fmt == "csc":
        return sparse_csc_tensor(
            _tensor(m.indptr), _tensor(m.indices), _tensor(m.data), shape, **kw
        )
    if fmt == "bsr":
        return sparse_bsr_tensor(
            _tensor(m.indptr), _tensor(m.indices), _tensor(m.data), shape, **kw
        )
    if fmt == "coo":
        coords = m.coords if hasattr(m, "coords") else (m.row, m.col)
        np = importlib.import_module("numpy")
        indices = _tensor(np.stack([np.asarray(c) for c in coords]).reshape(len(shape), -1))
        canonical = bool(getattr(m, "has_canonical_format", False))
        return sparse_coo_tensor(
            indices, _tensor(m.data), shape, is_coalesced=True if canonical else None, **kw
        )
    raise TypeError(
        f"from_scipy() supports the SciPy formats {', '.join(SCIPY_FORMATS)}; "
        f"convert this {fmt.upper()} matrix first, e.g. with m.tocsr() or m.tocoo()"
    )


def _canonical(m: Any) -> Any:
    """A canonical copy of ``m`` (duplicates summed, indices sorted), or ``m`` itself when its
    structure is broken beyond order: SciPy's compiled ``sum_duplicates`` trusts ``indptr`` and
    the index ranges, so those are checked first (``check_format``), and a matrix that fails
    goes to the factories unchanged, which name the broken invariant."""
    c = m.copy()
    if m.format != "coo":  # (COO is canonicalised by NumPy sorts, which check their bounds)
        try:
            c.check_format(full_check=True)
        except (ValueError, TypeError, IndexError):
            return m
        c.has_sorted_indices = False  # SciPy's flags are not rechecked: a stale one would
    c.has_canonical_format = False  # make sum_duplicates() a no-op
    c.sum_duplicates()
    return c


def _numpy(t: torch.Tensor) -> Any:
    """A NumPy copy of the strided tensor ``t`` (moved to the CPU first)."""
    return t.detach().cpu().resolve_conj().resolve_neg().numpy().copy()


def to_scipy(t: torch.Tensor, *, matrix: bool = False) -> Any:
    """A SciPy sparse array (or matrix) holding a copy of the sparse tensor ``t``.

    ``t`` is validated first (free for a tensor that is already checked), so the SciPy result
    is always well-formed. The format matches the layout: ``torch.sparse_coo`` -> ``coo``,
    ``sparse_csr`` -> ``csr``, ``sparse_csc`` -> ``csc``, ``sparse_bsr`` -> ``bsr`` (the same
    blocksize); index and values dtypes are kept. A CUDA tensor is copied to the host.

    Args:
        t: a 2-D sparse tensor (a :class:`SafeSparseTensor` or a plain torch sparse tensor)
            without batch or dense dims; a COO tensor may have any number of sparse dims if
            the installed SciPy supports n-D COO arrays.
        matrix: return the legacy ``scipy.sparse.*_matrix`` classes instead of the
            ``*_array`` ones.

    Returns:
        A ``scipy.sparse`` array (default) or matrix whose ``toarray()`` equals
        ``t.to_dense()``. It shares no memory with ``t``.

    Raises:
        ImportError: SciPy is not installed.
        TypeError: ``t`` is not a sparse tensor, or its values dtype has no NumPy equivalent
            (e.g. ``torch.bfloat16``: convert with ``t.to(torch.float32)`` first).
        ValueError: ``t`` is batched or hybrid, or is BSC (SciPy has no BSC format:
            ``t.mT`` is the BSR tensor of the transpose).
        InvariantError: ``t`` breaks an invariant.
    """
    sparse = _scipy_sparse()
    safe = validate(t)
    with DisableTorchFunctionSubclass():
        plain = unwrap(safe).detach()
        layout = plain.layout
        name = layout_name(layout)
        if layout == torch.sparse_bsc:
            raise ValueError(
                "SciPy has no BSC format; t.mT is the BSR tensor of the transpose (no copy), "
                "or convert with t.to_sparse_bsr(blocksize)"
            )
        if plain.dense_dim():
            raise ValueError(f"a hybrid {name} tensor (dense_dim > 0) has no SciPy equivalent")
        kind = "matrix" if matrix else "array"
        if layout == torch.sparse_coo:
            if plain.dim() != 2 and matrix:
                raise ValueError("SciPy's coo_matrix is 2-D; use matrix=False for n-D COO")
            indices = _numpy(plain._indices())
            values = _numpy(plain._values())
            coo = getattr(sparse, f"coo_{kind}")
            out = coo((values, tuple(indices)), shape=tuple(plain.shape))
            if plain.is_coalesced():
                out.has_canonical_format = True
            return out
        if plain.dim() != 2:
            raise ValueError(f"a batched {name} tensor (batch dims) has no SciPy equivalent")
        compressed, plain_idx = compressed_members(plain)
        fmt = SHORT_NAMES[layout]
        cls = getattr(sparse, f"{fmt}_{kind}")
        return cls(
            (_numpy(plain.values()), _numpy(plain_idx), _numpy(compressed)),
            shape=tuple(plain.shape),
        )

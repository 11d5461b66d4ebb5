"""torch's index conversions under enforce mode: they read what was checked.

``torch._convert_indices_from_coo_to_csr(rows, size)`` (PyTorch Geometric's ``index2ptr``)
and ``torch._convert_indices_from_csr_to_coo(crow, col)`` write out of bounds for indices
outside the target, and the first reads its rows' memory as if it were contiguous (the first
column of an ``(E, 2)`` edge list, ``edges.t()[0]``, read its columns). While enforce mode is
on, :mod:`safesparse.enforcement.mode` replaces both with the wrappers made here:

* the inputs are made contiguous (a private copy when ``out=`` is given: the kernel writes
  ``out`` while it reads them), checked (``[COO 5.1]`` / ``[COO 5.2]`` for the rows against
  ``size``, ``[COO 5.3]`` for rows out of order, ``[CSR 5.1-5.3]`` / ``[CSC ...]`` for the
  offsets against the nnz, ``[CSR 3.3]`` / ``[CSR 3.9]`` when ``col``'s batches are not
  ``crow``'s), and exactly those tensors are handed to torch;
* traced (``torch.compile``, ``torch.export``: FakeTensor or FunctionalTensor inputs, no data
  yet), the call becomes a ``safesparse::`` operator that checks the data when the traced
  program runs: torch's ``torch.compile`` records these two functions in its graphs by name,
  and the aten operator it would otherwise record runs unchecked;
* other tensors without data (``meta``) or that dispatch in Python (a subclass's own
  business) go to torch's function as they came.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import custom_op

from ..base import enforce_flag as _enforcing
from ..catalog.errors import InvariantError
from ..catalog.invariants import explain
from ..engine.indices import check_compressed_indices, check_coo_indices
from .routes import _arg, _foreign

__all__ = ["coo_to_csr", "csr_to_coo"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_ATEN_COO_TO_CSR = torch.ops.aten._convert_indices_from_coo_to_csr.default
_ATEN_CSR_TO_COO = torch.ops.aten._convert_indices_from_csr_to_coo.default


def _traced(*tensors: torch.Tensor) -> bool:
    """Tensors of a trace (``torch.compile``, ``torch.export``): no data now, real data when
    the traced program runs."""
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)


_COO_TO_CSR = "torch._convert_indices_from_coo_to_csr"
_CSR_TO_COO = "torch._convert_indices_from_csr_to_coo"


def _with_arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str,
              value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with argument ``i`` (keyword ``name``) replaced by ``value``."""
    if len(args) > i:
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}


def _private(t: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """What a conversion is handed in place of its input ``t``: ``t`` made contiguous (torch's
    kernels read the memory as if it were), or, when an ``out=`` tensor is given, a copy that
    nothing else shares: the kernel writes ``out`` while it reads the input, and an ``out``
    over the input's memory would turn checked indices into unchecked ones (heap corruption)."""
    if kwargs.get("out") is not None:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def coo_to_csr(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._convert_indices_from_coo_to_csr(rows, size)``: the rows, made contiguous (torch's
    kernel reads their memory as if it were), checked against ``size`` and for order (the
    kernel needs them sorted), then exactly that contiguous tensor handed to torch."""

    @functools.wraps(previous)
    def convert(*args: Any, **kwargs: Any) -> Any:
        if _enforcing.is_enforced():
            rows, size = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "size")
            if (isinstance(rows, torch.Tensor) and _traced(rows)
                    and isinstance(size, (int, torch.SymInt))
                    and rows.dtype in _INDEX_DTYPES and rows.dim() <= 1):
                out = checked_coo_to_csr(rows, size, bool(kwargs.get("out_int32", False)))
                return _into(out, kwargs.get("out"))
            if (isinstance(rows, torch.Tensor) and not _foreign(rows)
                    and rows.dtype in _INDEX_DTYPES and rows.dim() <= 1
                    and not isinstance(size, torch.Tensor)):
                rows = _private(rows, kwargs)
                _check_rows(rows, operator.index(size))
                args, kwargs = _with_arg(args, kwargs, 0, "input", rows)
        return previous(*args, **kwargs)

    convert.__ss_original__ = previous  # type: ignore[attr-defined]
    return convert


def _check_rows(rows: torch.Tensor, size: int) -> None:
    """Row indices for the COO -> CSR conversion: each in ``[0, size)`` ([COO 5.1] / [COO 5.2])
    and sorted ([COO 5.3]: the conversion is the CSR form of a coalesced tensor's rows), with
    the position of the first violation. One host sync when they hold: sorted rows lie in
    range when the first and last do."""
    flat = rows.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    if size >= 0:
        ends = flat[torch.tensor([0, n - 1], device=flat.device)].to(torch.int64)
        bad = torch.lt(flat[1:], flat[:-1]).any() | (ends[0] < 0) | (ends[1] >= size)
        if not bool(bad):
            return
    try:
        check_coo_indices(flat.reshape(1, -1), (size,))
    except InvariantError as err:
        raise err.with_context(op=_COO_TO_CSR) from None
    descents = torch.lt(flat[1:], flat[:-1]).nonzero()
    if descents.shape[0] == 0:
        raise AssertionError("the fast check refused rows the diagnosis accepts")
    j = int(descents[0, 0]) + 1
    cur, prev = int(flat[j]), int(flat[j - 1])
    raise InvariantError(
        torch.sparse_coo, "5.3", f"position {j}: rows[{j}] = {cur}, rows[{j - 1}] = {prev}",
        location={"position": j, "value": cur, "previous": prev}, op=_COO_TO_CSR,
        explanation=explain(torch.sparse_coo, "5.3", "rows", index=cur, previous=prev))


def csr_to_coo(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._convert_indices_from_csr_to_coo(crow, col)``: both made contiguous, the offsets
    checked against the nnz and the batch shapes against each other (torch's kernel reads past
    ``crow`` when ``col`` has more batches), then exactly those tensors handed to torch."""

    @functools.wraps(previous)
    def convert(*args: Any, **kwargs: Any) -> Any:
        if _enforcing.is_enforced():
            crow, col = _arg(args, kwargs, 0, "crow_indices"), _arg(args, kwargs, 1, "col_indices")
            if (isinstance(crow, torch.Tensor) and isinstance(col, torch.Tensor)
                    and _traced(crow, col) and crow.dtype in _INDEX_DTYPES
                    and crow.dim() >= 1 and col.dim() >= 1):
                out = checked_csr_to_coo(crow, col, bool(kwargs.get("out_int32", False)),
                                         bool(kwargs.get("transpose", False)))
                return _into(out, kwargs.get("out"))
            if (isinstance(crow, torch.Tensor) and isinstance(col, torch.Tensor)
                    and not _foreign(crow) and not _foreign(col)
                    and crow.dtype in _INDEX_DTYPES and crow.dim() >= 1 and col.dim() >= 1):
                crow, col = _private(crow, kwargs), _private(col, kwargs)
                _check_offsets(crow, col.shape, bool(kwargs.get("transpose", False)))
                args, kwargs = _with_arg(args, kwargs, 0, "crow_indices", crow)
                args, kwargs = _with_arg(args, kwargs, 1, "col_indices", col)
        return previous(*args, **kwargs)

    convert.__ss_original__ = previous  # type: ignore[attr-defined]
    return convert


def _check_offsets(compressed: torch.Tensor, plain_shape: torch.Size, transpose: bool) -> None:
    """The compressed offsets against the nnz (CSR 5.1-5.3; CSC with ``transpose``), the only
    index data the conversion reads: checked with a plain index of ``plain_shape`` (the shape
    of ``col``: 3.3 / 3.9 when its batch is not the offsets') that is valid by construction
    (``0 .. nnz-1``, sorted) against a plain extent of ``nnz``. One host sync when they hold:
    offsets that start at 0, end at the nnz and never decrease are running totals."""
    batch, nnz = tuple(compressed.shape[:-1]), plain_shape[-1]
    if (compressed.dim() == len(plain_shape) and batch == tuple(plain_shape[:-1])
            and compressed.shape[-1] > 0):
        c = compressed.reshape(-1, compressed.shape[-1])
        held = ((c[:, 0] == 0).all() & (c[:, -1] == nnz).all()
                & torch.ge(c[:, 1:], c[:, :-1]).all())
        if bool(held):
            return
    plain = torch.arange(nnz, dtype=compressed.dtype, device=compressed.device)
    plain = plain.expand(*plain_shape)
    n = max(compressed.shape[-1] - 1, 0)
    size = (*batch, nnz, n) if transpose else (*batch, n, nnz)
    try:
        check_compressed_indices(compressed, plain, size,
                                 layout=torch.sparse_csc if transpose else torch.sparse_csr)
    except InvariantError as err:
        raise err.with_context(op=_CSR_TO_COO) from None


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or ``out`` holding it (the ``out=`` form)."""
    if out is None:
        return result
    if out.shape != result.shape:  # torch resizes out (a traced resize_ only where needed)
        out.resize_(result.shape)
    return out.copy_(result)


# ---------------------------------------------------------------------------------------------
# The operators a traced program runs in their place


@custom_op("safesparse::checked_coo_to_csr", mutates_args=())
def checked_coo_to_csr(rows: torch.Tensor, size: int, out_int32: bool) -> torch.Tensor:
    """torch's COO -> CSR row conversion, the rows made contiguous and checked first (what a
    program traced under enforce mode runs in its place)."""
    rows = rows.contiguous()
    _check_rows(rows, size)
    return _ATEN_COO_TO_CSR(rows, size, out_int32=out_int32)  # type: ignore[no-any-return]


@checked_coo_to_csr.register_fake
def _(rows: torch.Tensor, size: int, out_int32: bool) -> torch.Tensor:
    return rows.new_empty((size + 1,), dtype=torch.int32 if out_int32 else torch.int64)


@custom_op("safesparse::checked_csr_to_coo", mutates_args=())
def checked_csr_to_coo(crow: torch.Tensor, col: torch.Tensor, out_int32: bool,
                       transpose: bool) -> torch.Tensor:
    """torch's CSR -> COO index conversion, the offsets made contiguous and checked against
    the nnz first (what a program traced under enforce mode runs in its place)."""
    crow, col = crow.contiguous(), col.contiguous()
    _check_offsets(crow, col.shape, transpose)
    return _ATEN_CSR_TO_COO(crow, col, out_int32=out_int32,  # type: ignore[no-any-return]
                            transpose=transpose)


@checked_csr_to_coo.register_fake
def _(crow: torch.Tensor, col: torch.Tensor, out_int32: bool,
      transpose: bool) -> torch.Tensor:
    return crow.new_empty((crow.dim() + 1, col.numel()),
                          dtype=torch.int32 if out_int32 else torch.int64)

"""torch's index conversions under enforce mode: they read what was checked.

``torch._convert_indices_from_coo_to_csr(rows, size)`` (PyTorch Geometric's ``index2ptr``)
and ``torch._convert_indices_from_csr_to_coo(crow, col)`` write out of bounds for indices
outside the target, and the first reads its rows' memory as if it were contiguous (the first
column of an ``(E, 2)`` edge list, ``edges.t()[0]``, read its columns). While enforce mode is
on, :mod:`safesparse.enforcement.mode` replaces both, by every route (the torch functions,
``torch._VF``'s view of them, the ``torch.ops.aten`` packets and their ``.default`` / ``.out``
overloads, whose stand-ins call :func:`gate_coo_to_csr` / :func:`gate_csr_to_coo`), with the
checks made here, for indices of every integral dtype and ``size`` as an int or a 0-d tensor:

* the inputs are made contiguous (a private copy when ``out=`` is given: the kernel writes
  ``out`` while it reads them; an int64 copy for dtypes other than int32 / int64: the checks
  compare in a dtype that cannot overflow, and torch's result does not depend on the input's
  dtype), ``size`` is read as the int torch would read, the inputs are checked
  (``[COO 5.1]`` / ``[COO 5.2]`` for the rows against ``size``, ``[COO 5.3]`` for rows out of
  order, ``[CSR 5.1-5.3]`` / ``[CSC ...]`` for the
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
from .routes import _foreign

__all__ = ["coo_to_csr", "csr_to_coo"]

#: The index dtypes the checks read as they are; every other is checked on an int64 copy: a
#: comparison with the size or the nnz in a narrow dtype would wrap (an int8 tensor holding 44
#: "equals" 300).
_INDEX_DTYPES = (torch.int32, torch.int64)
#: The narrow dtypes torch's kernels accept (uint8, int8, int16): torch is handed the int64
#: copy that was checked (its result does not depend on the input's dtype). The unsigned types
#: torch has no kernel for (uint16 ...) are checked too, and handed as they came: torch
#: refuses them as it does without safesparse.
_WIDENED = frozenset({torch.uint8, torch.int8, torch.int16})
#: Every integral dtype: what torch's conversions accept (uint8 ... int64), and the unsigned
#: ones it refuses today (checked all the same: a later torch may accept them).
_INTEGRAL = frozenset(d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                  getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                  getattr(torch, "uint64", None)) if d is not None)
_ATEN_COO_TO_CSR = torch.ops.aten._convert_indices_from_coo_to_csr.default
_ATEN_CSR_TO_COO = torch.ops.aten._convert_indices_from_csr_to_coo.default


def _traced(*tensors: torch.Tensor) -> bool:
    """Tensors of a trace (``torch.compile``, ``torch.export``): no data now, real data when
    the traced program runs."""
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)


#: How errors name the two conversions (the torch functions; an aten route names itself).
COO_TO_CSR = "torch._convert_indices_from_coo_to_csr"
CSR_TO_COO = "torch._convert_indices_from_csr_to_coo"
#: The first argument's keyword: ``input`` in the torch function, ``self`` in the aten schema.
_FIRST = ("input", "self")


def _find(args: tuple[Any, ...], kwargs: dict[str, Any], i: int,
          names: tuple[str, ...]) -> Any:
    """Argument ``i``, or the first of the keywords ``names`` given."""
    if len(args) > i:
        return args[i]
    return next((kwargs[n] for n in names if n in kwargs), None)


def _with_arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int,
              names: tuple[str, ...], value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with argument ``i`` (given as one of the keywords ``names``) replaced
    by ``value``."""
    if len(args) > i:
        return (*args[:i], value, *args[i + 1:]), kwargs
    name = next((n for n in names if n in kwargs), names[0])
    return args, {**kwargs, name: value}


def _index_tensor(x: Any) -> bool:
    """A strided tensor of an integral dtype: what the conversions read as indices."""
    return (isinstance(x, torch.Tensor) and x.layout == torch.strided
            and x.dtype in _INTEGRAL)


def _private(t: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """What a conversion is handed in place of its input ``t``: ``t`` made contiguous (torch's
    kernels read the memory as if it were), or, when an ``out=`` tensor is given, a copy that
    nothing else shares: the kernel writes ``out`` while it reads the input, and an ``out``
    over the input's memory would turn checked indices into unchecked ones (heap corruption).
    Indices of a dtype in :data:`_WIDENED` become an int64 copy (:func:`_checkable`)."""
    if t.dtype in _WIDENED:
        return t.to(torch.int64, memory_format=torch.contiguous_format, copy=True)
    if kwargs.get("out") is not None:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _checkable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype the checks compare without overflow: as it is (int32, int64), else
    an int64 copy."""
    return t if t.dtype in _INDEX_DTYPES else t.to(torch.int64)


def _size_of(size: Any) -> int | None:
    """``size`` as the int torch reads from it (an int, anything with ``__index__``, a 0-d
    integral tensor), or ``None`` where torch's parser refuses it (a bool, a float, a tensor of
    another shape or dtype): torch then raises its own ``TypeError`` before reading data."""
    if isinstance(size, bool):
        return None
    if isinstance(size, torch.Tensor):
        if size.dim() != 0 or size.dtype not in _INTEGRAL or size.is_meta or _foreign(size):
            return None
        return int(size)
    try:
        return operator.index(size)
    except TypeError:
        return None


def gate_coo_to_csr(call: Callable[..., Any], op: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """``call`` (torch's ``_convert_indices_from_coo_to_csr`` by one of its routes: the torch
    function, ``torch._VF``, an aten packet or overload) on checked data: the rows made
    contiguous (an int64 copy for other integral dtypes), checked against ``size`` and for
    order (the kernel needs them sorted), ``size`` read as an int (a 0-d tensor too); then
    exactly those are handed to torch. ``op`` names the route in an error."""
    rows, size = _find(args, kwargs, 0, _FIRST), _find(args, kwargs, 1, ("size",))
    if not _index_tensor(rows) or rows.dim() > 1:
        return call(*args, **kwargs)  # torch refuses it before reading anything
    if _traced(rows):
        if isinstance(size, (int, torch.SymInt)) and not isinstance(size, bool):
            out = checked_coo_to_csr(rows, size, bool(kwargs.get("out_int32", False)))
            return _into(out, kwargs.get("out"))
        return call(*args, **kwargs)
    n = _size_of(size)
    if _foreign(rows) or n is None:
        return call(*args, **kwargs)
    rows = _private(rows, kwargs)
    _check_rows(_checkable(rows), n, op)
    args, kwargs = _with_arg(args, kwargs, 0, _FIRST, rows)
    args, kwargs = _with_arg(args, kwargs, 1, ("size",), n)
    return call(*args, **kwargs)


def gate_csr_to_coo(call: Callable[..., Any], op: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """``call`` (torch's ``_convert_indices_from_csr_to_coo`` by one of its routes) on
    checked data: both made contiguous (the offsets an int64 copy for other integral dtypes),
    the offsets checked against the nnz and the batch shapes against each other (torch's
    kernel reads past ``crow`` when ``col`` has more batches), then exactly those tensors
    handed to torch."""
    crow = _find(args, kwargs, 0, ("crow_indices",))
    col = _find(args, kwargs, 1, ("col_indices",))
    if (not _index_tensor(crow) or not isinstance(col, torch.Tensor)
            or crow.dim() < 1 or col.dim() < 1):
        return call(*args, **kwargs)  # torch refuses it before reading anything
    if _traced(crow, col):
        out = checked_csr_to_coo(crow, col, bool(kwargs.get("out_int32", False)),
                                 bool(kwargs.get("transpose", False)))
        return _into(out, kwargs.get("out"))
    if _foreign(crow) or _foreign(col):
        return call(*args, **kwargs)
    crow = _private(crow, kwargs)
    col = _private(col, kwargs)
    _check_offsets(_checkable(crow), col.shape, bool(kwargs.get("transpose", False)), op)
    args, kwargs = _with_arg(args, kwargs, 0, ("crow_indices",), crow)
    args, kwargs = _with_arg(args, kwargs, 1, ("col_indices",), col)
    return call(*args, **kwargs)


def _wrapper(previous: Callable[..., Any], gate: Callable[..., Any],
             op: str) -> Callable[..., Any]:
    @functools.wraps(previous)
    def convert(*args: Any, **kwargs: Any) -> Any:
        if _enforcing.is_enforced():
            return gate(previous, op, args, kwargs)
        return previous(*args, **kwargs)

    convert.__ss_original__ = previous  # type: ignore[attr-defined]
    return convert


def coo_to_csr(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._convert_indices_from_coo_to_csr(rows, size)`` (and ``torch._VF``'s): checked
    by :func:`gate_coo_to_csr` while enforce mode is on."""
    return _wrapper(previous, gate_coo_to_csr, COO_TO_CSR)


def csr_to_coo(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._convert_indices_from_csr_to_coo(crow, col)`` (and ``torch._VF``'s): checked
    by :func:`gate_csr_to_coo` while enforce mode is on."""
    return _wrapper(previous, gate_csr_to_coo, CSR_TO_COO)


def _check_rows(rows: torch.Tensor, size: int, op: str = COO_TO_CSR) -> None:
    """Row indices for the COO -> CSR conversion: each in ``[0, size)`` ([COO 5.1] / [COO 5.2])
    and sorted ([COO 5.3]: the conversion is the CSR form of a coalesced tensor's rows), with
    the position of the first violation, naming ``op``. One host sync when they hold: sorted
    rows lie in range when the first and last do (compared as int64: no overflow)."""
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
        check_coo_indices(flat.reshape(1, -1).to(torch.int64), (size,))
    except InvariantError as err:
        raise err.with_context(op=op) from None
    descents = torch.lt(flat[1:], flat[:-1]).nonzero()
    if descents.shape[0] == 0:
        raise AssertionError("the fast check refused rows the diagnosis accepts")
    j = int(descents[0, 0]) + 1
    cur, prev = int(flat[j]), int(flat[j - 1])
    raise InvariantError(
        torch.sparse_coo, "5.3", f"position {j}: rows[{j}] = {cur}, rows[{j - 1}] = {prev}",
        location={"position": j, "value": cur, "previous": prev}, op=op,
        explanation=explain(torch.sparse_coo, "5.3", "rows", index=cur, previous=prev))


def _check_offsets(compressed: torch.Tensor, plain_shape: torch.Size, transpose: bool,
                   op: str = CSR_TO_COO) -> None:
    """The compressed offsets against the nnz (CSR 5.1-5.3; CSC with ``transpose``), the only
    index data the conversion reads: checked with a plain index of ``plain_shape`` (the shape
    of ``col``: 3.3 / 3.9 when its batch is not the offsets') that is valid by construction
    (``0 .. nnz-1``, sorted) against a plain extent of ``nnz``. One host sync when they hold:
    offsets that start at 0, end at the nnz (compared as int64: no overflow) and never
    decrease are running totals."""
    batch, nnz = tuple(compressed.shape[:-1]), plain_shape[-1]
    if (compressed.dim() == len(plain_shape) and batch == tuple(plain_shape[:-1])
            and compressed.shape[-1] > 0):
        c = compressed.reshape(-1, compressed.shape[-1])
        held = ((c[:, 0] == 0).all() & (c[:, -1].to(torch.int64) == nnz).all()
                & torch.ge(c[:, 1:], c[:, :-1]).all())
        if bool(held):
            return
    compressed = compressed.to(torch.int64)  # the diagnosis: no overflow (an nnz past int32)
    plain = torch.arange(nnz, dtype=torch.int64, device=compressed.device)
    plain = plain.expand(*plain_shape)
    n = max(compressed.shape[-1] - 1, 0)
    size = (*batch, nnz, n) if transpose else (*batch, n, nnz)
    try:
        check_compressed_indices(compressed, plain, size,
                                 layout=torch.sparse_csc if transpose else torch.sparse_csr)
    except InvariantError as err:
        raise err.with_context(op=op) from None


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
    rows = _private(rows, {})
    _check_rows(_checkable(rows), size)
    return _ATEN_COO_TO_CSR(rows, size, out_int32=out_int32)  # type: ignore[no-any-return]


@checked_coo_to_csr.register_fake
def _(rows: torch.Tensor, size: int, out_int32: bool) -> torch.Tensor:
    return rows.new_empty((size + 1,), dtype=torch.int32 if out_int32 else torch.int64)


@custom_op("safesparse::checked_csr_to_coo", mutates_args=())
def checked_csr_to_coo(crow: torch.Tensor, col: torch.Tensor, out_int32: bool,
                       transpose: bool) -> torch.Tensor:
    """torch's CSR -> COO index conversion, the offsets made contiguous and checked against
    the nnz first (what a program traced under enforce mode runs in its place)."""
    crow, col = _private(crow, {}), _private(col, {})
    _check_offsets(_checkable(crow), col.shape, transpose)
    return _ATEN_CSR_TO_COO(crow, col, out_int32=out_int32,  # type: ignore[no-any-return]
                            transpose=transpose)


@checked_csr_to_coo.register_fake
def _(crow: torch.Tensor, col: torch.Tensor, out_int32: bool,
      transpose: bool) -> torch.Tensor:
    return crow.new_empty((crow.dim() + 1, col.numel()),
                          dtype=torch.int32 if out_int32 else torch.int64)

"""The op table of :class:`SafeSparseTensor`: how each torch op's sparse result is trusted.

Three kinds (:class:`OpKind`):

* ``PRESERVING`` - the result has the input's index data (a view, or a copy of it): it is
  checked without validation.
* ``TRUSTED`` - torch built new indices itself (coalesce, add, sparse @ sparse, conversions):
  checked outside debug mode, when every sparse input was checked.
* ``UNKNOWN`` - everything not listed: the result is a SafeSparseTensor, but unchecked.

Strided results are never wrapped, whatever the kind. Extend the table with
``SafeSparseTensor.classify(kind, [funcs])`` or ``@SafeSparseTensor.implements([funcs], kind)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from .tensor import OpKind, SafeSparseTensor, wrap_results
from .validation import compressed_members

T = torch.Tensor
PRESERVING, TRUSTED = OpKind.PRESERVING, OpKind.TRUSTED


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, complex, bool)) or (
        isinstance(x, torch.Tensor) and x.dim() == 0 and x.layout == torch.strided
    )


def positive_power(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
    """``t ** p`` for a scalar p > 0 keeps zeros zero (the indices); anything else is unknown."""
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    ok = isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent > 0
    return PRESERVING if ok else OpKind.UNKNOWN


def scalar_else_trusted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
    """Multiplying/dividing by a scalar keeps the indices; with a tensor, torch builds new ones."""
    other = args[1] if len(args) > 1 else kwargs.get("other")
    return PRESERVING if _is_scalar(other) else TRUSTED


#: Zero-preserving elementwise ops torch applies to the values of a sparse tensor alone (f(0) is
#: 0, so the index data of the result is the input's): function, method and in-place forms.
VALUES_ONLY = (
    "abs", "absolute", "angle", "arcsin", "arcsinh", "arctan", "arctanh", "asin", "asinh",
    "atan", "atanh", "ceil", "conj_physical", "deg2rad", "erf", "erfinv", "expm1", "fix",
    "floor", "frac", "isinf", "isnan", "isneginf", "isposinf", "log1p", "nan_to_num", "neg",
    "negative", "positive", "rad2deg", "relu", "round", "sgn", "sign", "signbit", "sin", "sinh",
    "sqrt", "square", "tan", "tanh", "trunc",
)


def _forms(names: tuple[str, ...]) -> list[Any]:
    """``torch.name``, ``Tensor.name`` and ``Tensor.name_`` for each name, where torch has them."""
    return [f for name in names
            for f in (getattr(torch, name, None), getattr(T, name, None),
                      getattr(T, name + "_", None))
            if f is not None]


SafeSparseTensor.classify(PRESERVING, [
    # copies and views of the whole tensor
    T.clone, torch.clone, T.detach, torch.detach, T.detach_, T.requires_grad_,
    T.to, T.cpu, T.cuda, T.float, T.double, T.half, T.bfloat16, T.int, T.long, T.bool,
    T.type, T.pin_memory, T.__neg__, T.__pos__, T.__abs__,
    # elementwise ops on values only
    *_forms(VALUES_ONLY),
])
SafeSparseTensor.classify(positive_power, [T.pow, torch.pow, T.__pow__, T.pow_, T.__ipow__])
SafeSparseTensor.classify(scalar_else_trusted, [
    T.mul, torch.mul, T.__mul__, T.__rmul__, T.div, torch.div, T.__truediv__,
    T.mul_, T.__imul__, T.div_, T.__itruediv__,
])
SafeSparseTensor.classify(TRUSTED, [
    T.coalesce, T.add, torch.add, T.__add__, T.__radd__, T.sub, torch.sub, T.__sub__,
    torch.mm, T.mm, torch.matmul, T.matmul, T.__matmul__, torch.sparse.mm,
    T.to_sparse, T.to_sparse_coo, T.to_sparse_csr, T.to_sparse_csc, T.to_sparse_bsr,
    T.to_sparse_bsc, T.add_, T.__iadd__, T.sub_, T.__isub__,
])


@SafeSparseTensor.implements([T.contiguous], PRESERVING)
def _contiguous(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch refuses ``contiguous()`` on sparse tensors; here it means row-contiguous members.

    A compressed tensor whose values are not contiguous (a block-transposed BSR/BSC view) gets a
    contiguous copy of its values on the same, shared index tensors; anything else is returned
    as it is.
    """
    t = args[0]
    fmt = args[1] if len(args) > 1 else kwargs.get("memory_format", torch.contiguous_format)
    if fmt not in (torch.contiguous_format, torch.preserve_format):
        raise RuntimeError(f"contiguous(): sparse tensors support no memory format {fmt}")
    with DisableTorchFunctionSubclass():
        if t.layout == torch.sparse_coo or t.values().is_contiguous():
            return t
        compressed, plain = compressed_members(t)
        values = t.values().contiguous()
        out = torch.sparse_compressed_tensor(
            compressed, plain, values, t.shape, layout=t.layout, dtype=values.dtype,
            device=values.device, check_invariants=False,
        )
    return wrap_results(func, PRESERVING, args, kwargs, out)

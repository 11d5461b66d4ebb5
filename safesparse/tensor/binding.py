"""Arguments of the product functions, bound by name: one binding for every route that reads them.

torch passes a function's arguments to ``__torch_function__`` as the caller wrote them:
``torch.addmm(y, a, b)``, ``torch.addmm(input=y, mat1=a, mat2=b)`` and ``y.addmm_(mat1=a,
mat2=b)`` are the same call. The routes that inspect products (the block route of
:mod:`safesparse.tensor.products`, the CSC repair and the in-place / ``out=`` handling of
:mod:`safesparse.tensor.ops`) read them through :func:`bind`, which maps every accepted spelling to
one :class:`Product`, from explicit tables (no ``inspect.signature``: it is called per product).

A call :func:`bind` does not recognise (an unknown keyword, too many arguments, a missing one)
gives None: the caller leaves it to torch, which raises its own ``TypeError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from ..operators.functions import PRODUCT_FUNCTIONS

__all__ = ["Product", "bind"]

T = torch.Tensor


@dataclass(frozen=True)
class Product:
    """One product call, its arguments by name.

    The result is ``beta * input + alpha * (mat1 @ mat2)`` (``op == "addmm"``),
    ``mat1 @ mat2`` (``"mm"``: 2-D only; ``"matmul"``: ``torch.matmul``'s shapes), or
    ``mat1 @ mat2.mT + input`` (``"linear"``: ``mat1`` the input ``x``, ``mat2`` the weight,
    ``input`` the bias or None). ``out`` is the ``out=`` tensor or None; ``inplace`` says the
    result is written into ``input`` (``Tensor.addmm_``). ``extra`` holds arguments no route
    here handles (``reduce``, ``out_dtype``): a route is taken only when it is empty.
    """

    op: str
    mat1: Any
    mat2: Any
    input: Any = None
    beta: Any = 1
    alpha: Any = 1
    out: Any = None
    inplace: bool = False
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def target(self) -> Any:
        """The tensor the result is written into (``out=``, or ``input`` in place), or None."""
        return self.input if self.inplace else self.out


@dataclass(frozen=True)
class _Signature:
    """``positional``: the parameter names in order, ``roles``: the :class:`Product` field each
    one fills (``""``: an extra argument), ``required``: how many must be given, ``keyword``:
    keyword-only names (each a :class:`Product` field or an extra)."""

    op: str
    positional: tuple[str, ...]
    roles: tuple[str, ...]
    required: int
    keyword: tuple[str, ...] = ()
    swap: bool = False  # ``__rmatmul__``: the product is ``other @ self``
    inplace: bool = False


_MM = _Signature("mm", ("input", "mat2"), ("mat1", "mat2"), 2, ("out", "out_dtype"))
_MATMUL = _Signature("matmul", ("input", "other"), ("mat1", "mat2"), 2, ("out",))
_RMATMUL = _Signature("matmul", ("input", "other"), ("mat1", "mat2"), 2, swap=True)
_ADDMM_ROLES = ("input", "mat1", "mat2")
_ADDMM = _Signature("addmm", _ADDMM_ROLES, _ADDMM_ROLES, 3, ("beta", "alpha", "out"))
_ADDMM_ = _Signature("addmm", _ADDMM_ROLES, _ADDMM_ROLES, 3, ("beta", "alpha"), inplace=True)
_SPARSE_MM = _Signature("mm", ("sparse", "dense", "reduce"), ("mat1", "mat2", ""), 2)
_SPARSE_ADDMM = _Signature("addmm", _ADDMM_ROLES, _ADDMM_ROLES, 3, ("beta", "alpha"))
_LINEAR = _Signature("linear", ("input", "weight", "bias"), ("mat1", "mat2", "input"), 2)

_BY_KIND: Final[dict[str, _Signature]] = {
    "mm": _MM, "matmul": _MATMUL, "rmatmul": _RMATMUL, "addmm": _ADDMM, "addmm_": _ADDMM_,
    "sparse_mm": _SPARSE_MM, "sparse_addmm": _SPARSE_ADDMM, "linear": _LINEAR,
}
#: torch function -> how its arguments are named (the one list of product functions,
#: :data:`safesparse.operators.functions.PRODUCT_FUNCTIONS`).
SIGNATURES: Final[dict[Any, _Signature]] = {
    f: _BY_KIND[kind] for f, kind in PRODUCT_FUNCTIONS.items()}
_FIELDS: Final = frozenset({"input", "mat1", "mat2", "beta", "alpha", "out"})


def bind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Product | None:
    """``func(*args, **kwargs)`` as a :class:`Product`, or None (not a product function, or
    arguments torch itself would refuse)."""
    sig = SIGNATURES.get(func)
    if sig is None or len(args) > len(sig.positional):
        return None
    fields: dict[str, Any] = {"input": None, "beta": 1, "alpha": 1, "out": None}
    extra: list[tuple[str, Any]] = []
    for name, role, value in zip(sig.positional, sig.roles, args, strict=False):
        if role:
            fields[role] = value
        elif value is not None:
            extra.append((name, value))
    for key, value in kwargs.items():
        if key in sig.positional:
            i = sig.positional.index(key)
            if i < len(args):
                return None  # given twice
            role = sig.roles[i]
        elif key in sig.keyword:
            role = key if key in _FIELDS else ""
        else:
            return None
        if role:
            fields[role] = value
        elif value is not None:
            extra.append((key, value))
    if min(len(args), sig.required) + sum(
            1 for k in kwargs if k in sig.positional[len(args):sig.required]) < sig.required:
        return None
    if sig.swap:
        fields["mat1"], fields["mat2"] = fields["mat2"], fields["mat1"]
    return Product(sig.op, fields.get("mat1"), fields.get("mat2"), fields["input"],
                   fields["beta"], fields["alpha"], fields["out"], sig.inplace, tuple(extra))

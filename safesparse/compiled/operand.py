"""``SparseOperand``: a proven compressed matrix as a traceable input of compiled programs.

``torch.compile`` and ``torch.export`` take no sparse tensor (dynamo refuses to wrap one, and a
tensor subclass reporting a sparse layout aborts in torch's ``layout_impl``). A
``SparseOperand`` is a wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``) over
the dense members of a proven CSR / CSC / BSR / BSC matrix (``compressed``, ``plain``,
``values``) that reports *strided* layout to the compiler, flattens to those three tensors
(``__tensor_flatten__`` / ``__tensor_unflatten__``: the compiler traces through it), and whose
``__torch_function__`` turns the products it supports into the ``safesparse`` operators
(:mod:`safesparse.operators`), one graph node each:

* ``A @ x``, ``torch.mm``, ``torch.matmul``, ``torch.sparse.mm``, ``torch.sparse.addmm``,
  ``x @ A``, ``x @ A.mT``, ``F.linear(x, A, b)`` (``x`` dense, 1-D or 2-D);
* ``.t()``, ``.mT``, ``.T``, ``transpose(0, 1)``, ``adjoint()``: the zero-copy transposes (CSR <->
  CSC, BSR <-> BSC with the blocks transposed) over the same members, hence the same proof;
* values-only arithmetic with a scalar (``A * 2``, ``2 * A``, ``A / 2``, ``-A``) and
  ``A.values()``.

Anything else is refused with the op's name and the way out (:class:`UnsupportedOperandOp`),
never densified. The index members are never written and never read by anything but the
operators, whose real implementations confirm in O(1) at every call, forward and backward,
that they are the proven ones (a graph compiled on valid members refuses after a write).

Gradients: AOTAutograd decides from the outer tensor what needs a gradient, so an operand is
made from its values by one ``autograd.Function`` (:class:`_FromValues`: the backward gives the
gradient's values) and products read the values through another (:class:`_ToValues`: the
backward gives an operand over the same members), as torch's nested tensors do. The gradient of
an operand is an operand.

This file is traced by dynamo (``safesparse.base.compiling.TRACED``): it reads strided tensors
only and holds nothing that validates or records a proof (that happens at the boundary:
:mod:`safesparse.compiled.boundary`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from .. import operators as _operators  # noqa: F401  (registers torch.ops.safesparse.*)
from ..base.layouts import BY_SHORT_NAME, SHORT_NAMES
from ..operators.functions import PRODUCT_FUNCTIONS

__all__ = ["LAYOUTS", "SparseOperand", "UnsupportedOperandOp", "make", "read_values"]

#: layout names (the operators' ``layout`` argument) and their transposes
LAYOUTS = ("csr", "csc", "bsr", "bsc")
_FLIP = {"csr": "csc", "csc": "csr", "bsr": "bsc", "bsc": "bsr"}
_BLOCKED = ("bsr", "bsc")
_ops = torch.ops.safesparse


class UnsupportedOperandOp(RuntimeError):
    """An op a :class:`SparseOperand` does not support (it never densifies silently)."""


def _refuse(name: str) -> UnsupportedOperandOp:
    return UnsupportedOperandOp(
        f"SparseOperand: {name} is not supported on a sparse operand\n"
        "  Inside a compiled function a SparseOperand supports the products A @ x, x @ A, "
        "torch.mm, torch.matmul, torch.sparse.mm, torch.sparse.addmm, F.linear(x, A, b), the "
        "transposes .t() / .mT / .T, values-only arithmetic with a scalar and A.values().\n"
        "  For anything else convert back outside the compiled function: "
        "ss.from_operand(A) (a checked SafeSparseTensor; .to_dense() there if you mean it).")


class SparseOperand(torch.Tensor):
    """A proven 2-D compressed matrix (CSR, CSC, BSR, BSC) as an input of compiled code.

    Made by :func:`safesparse.as_operand` (from a sparse tensor), :meth:`from_members` (from
    members proven by ``torch.ops.safesparse.prove``) or by the supported ops; reports strided
    layout and the matrix's shape, dtype and device. :attr:`sparse_layout` is its real layout.
    """

    compressed: torch.Tensor
    plain: torch.Tensor
    stored: torch.Tensor
    layout_name: str

    @staticmethod
    def __new__(cls, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                layout_name: str, size: Sequence[Any], requires_grad: bool = False
                ) -> SparseOperand:
        out: SparseOperand = torch.Tensor._make_wrapper_subclass(
            cls, tuple(size), dtype=values.dtype, device=values.device,
            requires_grad=requires_grad)
        return out

    def __init__(self, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                 layout_name: str, size: Sequence[Any], requires_grad: bool = False) -> None:
        self.compressed = compressed
        self.plain = plain
        self.stored = values
        self.layout_name = layout_name

    # -- tracing ----------------------------------------------------------------------------

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key for an operand: what torch's default key holds (the
        shape, ``requires_grad``, each inner tensor's dtype, sizes, strides, device and
        ``requires_grad``; a key of the layout alone let a graph compiled without a values
        gradient serve one that needs it), with sizes written as text. torch's default
        pickles the sizes, which under dynamic shapes are symbolic and do not pickle:
        inductor then printed "Failed to pickle cache key" with a traceback and compiled
        without its cache (results were right)."""
        def text(sizes: Sequence[Any]) -> str:
            return ",".join(str(s) for s in sizes)  # (str: no guard on a symbolic size)

        parts = [type(self).__qualname__, self.layout_name, text(self.shape),
                 str(self.requires_grad)]
        for name in ("compressed", "plain", "stored"):
            t = getattr(self, name)
            parts.append(f"{name}:{t.dtype}:{text(t.shape)}:{text(t.stride())}:"
                         f"{t.device.type}:{t.requires_grad}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def __tensor_flatten__(self) -> tuple[list[str], str]:
        return ["compressed", "plain", "stored"], self.layout_name

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], layout_name: str,
                             outer_size: Sequence[Any], outer_stride: Sequence[Any]
                             ) -> SparseOperand:
        return SparseOperand(inner["compressed"], inner["plain"], inner["stored"],
                             layout_name, outer_size)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        # (no int() of a size: traced with dynamic shapes, logging's repr would specialize it)
        return (f"SparseOperand({self.layout_name.upper()}, shape={tuple(self.shape)}, "
                f"nnz={self.plain.shape[0]}, dtype={self.dtype})")

    @property
    def sparse_layout(self) -> torch.layout:
        """The matrix's own layout (``torch.sparse_csr`` ...; :attr:`layout` is strided)."""
        return BY_SHORT_NAME[self.layout_name]

    @classmethod
    def from_members(cls, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                     layout: str | torch.layout, size: Sequence[Any]) -> SparseOperand:
        """An operand over ``compressed`` / ``plain`` (index members proven together, as
        ``torch.ops.safesparse.prove`` returns them) with ``values``; gradients reach
        ``values``. Members that are not proven are refused by the first product.
        ``layout``: ``"csr"``, ``"csc"``, ``"bsr"`` or ``"bsc"`` (any case) or the
        ``torch.layout`` itself."""
        name = (SHORT_NAMES.get(layout) if isinstance(layout, torch.layout)
                else layout.lower() if isinstance(layout, str) else None)
        if name not in LAYOUTS:
            raise ValueError(f"SparseOperand.from_members: unknown layout {layout!r} "
                             f"(one of {', '.join(LAYOUTS)}, or the torch.layout)")
        return make(values, compressed, plain, name, size)

    def with_values(self, values: torch.Tensor) -> SparseOperand:
        """The operand over the same members with other ``values`` (the shape of
        :meth:`values`): O(1), gradients reach ``values`` directly (edge weights trained per
        call, without torch's sparse autograd)."""
        if not isinstance(values, torch.Tensor) or isinstance(values, SparseOperand) \
                or values.shape != self.stored.shape:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)
            raise ValueError(f"SparseOperand.with_values: values of shape "
                             f"{tuple(self.stored.shape)} are needed, got {got}")
        return make(values, self.compressed, self.plain, self.layout_name, self.shape)

    # -- routing ----------------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Sequence[type],
                           args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            with DisableTorchFunctionSubclass():
                return route(*args, **kwargs)
        with DisableTorchFunctionSubclass():  # metadata, autograd plumbing: torch's own
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                    torch.ops.aten.clone.default):
            # (a clone shares the index members: they are never written, and the operators
            # confirm them at every call)
            a = args[0]
            return SparseOperand(a.compressed, a.plain, func(a.stored, **kwargs),
                                 a.layout_name, a.shape)
        if func is torch.ops.aten.add.Tensor and len(args) == 2 and not kwargs \
                and all(isinstance(a, SparseOperand) for a in args) \
                and _same_pattern(args[0], args[1]):
            # gradient accumulation: two gradients of one operand
            a, b = args
            return SparseOperand(a.compressed, a.plain, a.stored + b.stored, a.layout_name,
                                 a.shape)
        raise _refuse(str(func))


def _same_pattern(a: SparseOperand, b: SparseOperand) -> bool:
    return (a.layout_name == b.layout_name and a.compressed is b.compressed
            and a.plain is b.plain and a.shape == b.shape)


# ---------------------------------------------------------------------------------------------
# Values <-> operand (autograd reaches the values)


class _FromValues(torch.autograd.Function):
    """values -> the operand over ``compressed`` / ``plain``; backward: the gradient's values."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor,
                layout_name: str, size: Sequence[Any]) -> SparseOperand:
        ctx.set_materialize_grads(False)  # (never dense zeros of the matrix's shape)
        return SparseOperand(compressed, plain, values.detach(), layout_name, size)

    @staticmethod
    def backward(ctx: Any, g: SparseOperand | None) -> tuple[Any, ...]:
        if g is None:
            return None, None, None, None, None
        return g.stored, None, None, None, None


class _ToValues(torch.autograd.Function):
    """operand -> its values; backward: an operand over the same members."""

    @staticmethod
    def forward(ctx: Any, a: SparseOperand) -> torch.Tensor:
        ctx.save_for_backward(a.compressed, a.plain)
        ctx.geometry = (a.layout_name, tuple(a.shape))
        return a.stored

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> SparseOperand:
        compressed, plain = ctx.saved_tensors
        layout_name, size = ctx.geometry
        return SparseOperand(compressed, plain, g, layout_name, size)


def make(values: torch.Tensor, compressed: torch.Tensor, plain: torch.Tensor, layout_name: str,
         size: Sequence[Any]) -> SparseOperand:
    """The operand over these members with ``values`` (gradients reach ``values``)."""
    if not values.requires_grad:  # (no autograd node: what export sees of an input)
        return SparseOperand(compressed, plain, values, layout_name, size)
    with DisableTorchFunctionSubclass():
        out: SparseOperand = _FromValues.apply(  # type: ignore[no-untyped-call]
            values, compressed, plain, layout_name, size)
    return out


def read_values(a: SparseOperand) -> torch.Tensor:
    """``a``'s values (gradients reach ``a``)."""
    if not a.requires_grad:  # (no autograd node: export reads the input's own values)
        return a.stored
    with DisableTorchFunctionSubclass():
        out: torch.Tensor = _ToValues.apply(a)  # type: ignore[no-untyped-call]
    return out


# ---------------------------------------------------------------------------------------------
# The routes (each runs with subclass torch functions disabled)


def _transpose(a: SparseOperand) -> SparseOperand:
    v = read_values(a)
    if a.layout_name in _BLOCKED:
        v = v.transpose(-2, -1)
    return make(v, a.compressed, a.plain, _FLIP[a.layout_name], (a.shape[1], a.shape[0]))


def _dense(name: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or isinstance(x, SparseOperand) \
            or x.layout != torch.strided or x.dim() not in (1, 2):
        what = (type(x).__name__ if not isinstance(x, torch.Tensor) else
                "another SparseOperand" if isinstance(x, SparseOperand) else
                f"a {x.dim()}-D {x.layout} tensor")
        raise _refuse(f"{name} with {what} (the other operand must be a dense 1-D or 2-D "
                      "tensor)")
    return x


def _left(a: SparseOperand, x: torch.Tensor) -> torch.Tensor:
    """``a @ x``."""
    col = x.dim() == 1
    x2 = x.unsqueeze(-1) if col else x
    y: torch.Tensor = _ops.matmul(a.compressed, a.plain, read_values(a), a.layout_name,
                                  a.shape[0], a.shape[1], x2)
    return y.squeeze(-1) if col else y


def _linear(x: torch.Tensor, w: SparseOperand) -> torch.Tensor:
    """``x @ w.T``."""
    row = x.dim() == 1
    x2 = x.unsqueeze(0) if row else x
    y: torch.Tensor = _ops.linear(x2, w.compressed, w.plain, read_values(w), w.layout_name,
                                  w.shape[0], w.shape[1])
    return y.squeeze(0) if row else y


def _product(name: str, a: Any, b: Any) -> torch.Tensor:
    if isinstance(a, SparseOperand):
        return _left(a, _dense(name, b))
    return _linear(_dense(name, a), _transpose(b))  # x @ A == x @ (A.T).T


def _mm(a: Any, b: Any, *, out: Any = None) -> torch.Tensor:
    if out is not None:
        raise _refuse("torch.mm with out=")
    return _product("torch.mm", a, b)


def _matmul(a: Any, b: Any, *, out: Any = None) -> torch.Tensor:
    if out is not None:
        raise _refuse("torch.matmul with out=")
    return _product("matmul", a, b)


def _rmatmul(a: Any, b: Any) -> torch.Tensor:  # Tensor.__rmatmul__(self=a, other=b): b @ a
    return _product("matmul", b, a)


def _sparse_mm(a: Any, b: Any, reduce: str = "sum") -> torch.Tensor:
    if reduce != "sum":
        raise _refuse(f"torch.sparse.mm with reduce={reduce!r}")
    return _product("torch.sparse.mm", a, b)


def _addmm(inp: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1,
           out: Any = None) -> torch.Tensor:
    if out is not None or isinstance(inp, SparseOperand):
        raise _refuse("addmm with a sparse input or out=")
    y = _product("addmm", a, b)
    if alpha != 1:
        y = y * alpha
    if beta == 0:
        return y
    total: torch.Tensor = y + (inp if beta == 1 else inp * beta)
    return total


def _f_linear(x: Any, weight: Any, bias: Any = None) -> torch.Tensor:
    if isinstance(x, SparseOperand) or isinstance(bias, SparseOperand):
        raise _refuse("F.linear with a sparse input or bias (only the weight may be one)")
    y = _linear(_dense("F.linear", x), weight)
    return y if bias is None else y + bias


def _t(a: Any) -> SparseOperand:
    return _transpose(a)


def _transpose_dims(a: Any, d0: int, d1: int) -> SparseOperand:
    if {d0 % 2, d1 % 2} != {0, 1}:
        return a if d0 % 2 == d1 % 2 else _transpose(a)
    return _transpose(a)


def _scalar(name: str, f: Callable[[torch.Tensor, Any], torch.Tensor]
            ) -> Callable[..., SparseOperand]:
    def route(a: Any, s: Any) -> SparseOperand:
        if not isinstance(a, SparseOperand) or isinstance(s, torch.Tensor) \
                or not isinstance(s, (int, float, torch.SymInt, torch.SymFloat)):
            raise _refuse(f"{name} with {type(a).__name__} and {type(s).__name__} (only an "
                          "operand and a Python scalar)")
        return make(f(read_values(a), s), a.compressed, a.plain, a.layout_name, a.shape)

    return route


def _neg(a: Any) -> SparseOperand:
    return make(-read_values(a), a.compressed, a.plain, a.layout_name, a.shape)


def _values(a: Any) -> torch.Tensor:
    return read_values(a)


#: ``safesparse.from_operand`` (set by :mod:`safesparse.compiled.boundary`, which validates and
#: is never traced: ``A.to_sparse()`` inside a compiled function is a graph break)
FROM_OPERAND: list[Callable[[SparseOperand], torch.Tensor]] = []


def _to_sparse(a: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        raise _refuse("to_sparse with arguments (A.to_sparse() gives the checked matrix in "
                      "its own layout)")
    return FROM_OPERAND[0](a)


def _to_dense(a: Any, *args: Any, **kwargs: Any) -> Any:
    raise _refuse("to_dense (densifying)")


#: the products, by kind (the in-place ``addmm_`` is refused: torch's own, which dispatch refuses)
_PRODUCT_ROUTES: dict[str, Callable[..., Any]] = {
    "mm": _mm, "matmul": _matmul, "rmatmul": _rmatmul, "addmm": _addmm,
    "sparse_mm": _sparse_mm, "sparse_addmm": _addmm, "linear": _f_linear,
}
_T = torch.Tensor
_ROUTES: dict[Callable[..., Any], Callable[..., Any]] = {
    **{f: _PRODUCT_ROUTES[kind] for f, kind in PRODUCT_FUNCTIONS.items()
       if kind in _PRODUCT_ROUTES},  # (the one list of product functions)
    torch.t: _t, _T.t: _t, _T.mT.__get__: _t, _T.T.__get__: _t,  # type: ignore[attr-defined]
    _T.H.__get__: _t, _T.mH.__get__: _t, _T.adjoint: _t,  # type: ignore[attr-defined]
    torch.adjoint: _t, torch.transpose: _transpose_dims, _T.transpose: _transpose_dims,
    torch.mul: _scalar("mul", lambda v, s: v * s), _T.mul: _scalar("mul", lambda v, s: v * s),
    _T.__mul__: _scalar("mul", lambda v, s: v * s),
    _T.__rmul__: _scalar("mul", lambda v, s: v * s),
    torch.div: _scalar("div", lambda v, s: v / s), _T.div: _scalar("div", lambda v, s: v / s),
    _T.__truediv__: _scalar("div", lambda v, s: v / s),
    torch.neg: _neg, _T.neg: _neg, _T.__neg__: _neg,
    _T.values: _values,
    _T.to_sparse: _to_sparse, _T.to_dense: _to_dense,
}

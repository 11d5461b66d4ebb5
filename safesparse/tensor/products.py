"""Block products: checked BSR / BSC tensors times dense tensors, forward and backward.

torch 2.13 multiplies a BSR tensor by a dense one on CPU only for square blocks (MKL), has no
CPU kernel for BSC (so none for ``A.mT @ g``, the BSC view of a BSR ``A``, nor for
``F.linear(x, W)`` with a BSR ``W``) and none for the gradient with respect to the dense
operand. Here every such product is computed by one of two routes:

* 2-D tensors on CPU (any block shape, float32 / float64 / float16 / bfloat16): the products
  of the ``safesparse`` operators (:mod:`safesparse.operators.autograd`'s four, whose gradients
  are its one formula, :func:`~safesparse.operators.autograd.gradients`), computed by their
  kernels (:mod:`safesparse.kernels.blocks`) through :class:`_KernelProduct` and the tensor's
  :class:`_Pattern` (a private copy of the checked index members and the other storage order,
  kept with the proof). Where the kernels' torch-op implementation is measured slower: the
  square-block BSR forward without a gradient takes torch's MKL kernel (:data:`_MKL_BLOCKS`),
  the values gradient of small blocks the element route below (:data:`_KERNEL_GRAD_FROM`), and
  batch-major products of small blocks (``F.linear``, ``x @ A``) the column-major kernel on
  the transposes (:data:`_BATCH_MAJOR_FROM`). With the native kernels the first is dropped
  (they are faster than MKL at every square block); the other two were measured on the
  torch-op kernels only.
* batched tensors and other devices: torch's CSR kernels, which exist on every device, on
  the element CSR form of the block matrix (:mod:`safesparse.tensor.elements`, kept with the
  proof), through :class:`_BlockProduct`: the product with the transpose, and
  ``sampled_addmm`` on the same element pattern (or one ``bmm`` for large blocks) for the
  values.

Only checked tensors reach either route (:func:`route`, under the ``SafeSparseTensor`` guard);
the kernels are pure functions over the members. Which calls take the block route:
:func:`route`, on the arguments bound by name (:func:`safesparse.tensor.binding.bind`); the
product functions are registered in :mod:`safesparse.tensor.ops`, which also writes ``out=``
and in-place results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import originals as _originals
from ..base.layouts import BLOCK_LAYOUTS, SWAPPED, compressed_members, extents
from ..kernels import blocks as kernels
from ..kernels import native
from ..kernels.pattern import by_rows, matrix
from ..operators.autograd import PRODUCTS, SparseProduct, gradients
from ..state import checked
from .binding import Product, bind
from .core import ToSafeSparseTensor, _is_checked, _ToPlain
from .elements import _BMM_MIN, Structure, pattern_positions, structure

T = torch.Tensor
#: dtypes with a CSR @ dense kernel on CPU (MKL); other devices take the half types too.
_CPU_DTYPES = (torch.float32, torch.float64)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)



class _BlockProduct(torch.autograd.Function):
    """``y = op(A) @ x`` for block values ``values`` (nnzb, r, c) of ``A`` (``op`` the identity
    or the transpose), ``x`` of shape (n_in * c, k). Backward: ``op(A)^T @ gy`` and the sampled
    block products, through the same structure.

    ``a`` is None when the gradient of ``A`` flows through ``values`` (``A.values()``, sparse
    all the way); otherwise ``a`` is ``A`` itself and gets a strided gradient, as torch's own
    BSR product gives it (torch 2.13 cannot accumulate a BSR / BSC gradient into a BSR / BSC
    leaf, see :func:`_gradient_through_values`).
    """

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, x: torch.Tensor, a: torch.Tensor | None,
                structure: Structure, transpose: bool) -> torch.Tensor:
        ctx.structure, ctx.transpose = structure, transpose
        ctx.a_meta = None if a is None else _Meta.of(a)
        ctx.save_for_backward(values, x)
        return structure.side(transpose).product(values, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        values, x = ctx.saved_tensors
        structure, transpose = ctx.structure, ctx.transpose
        gy = gy.contiguous()
        g_values = g_x = g_a = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            if structure.r * structure.c >= _BMM_MIN:
                g_values = structure.block_grad(gy, x, transpose)
            else:
                g_values = structure.side(transpose).sampled(gy, x, values.shape)
        if ctx.needs_input_grad[1]:
            g_x = structure.side(not transpose).product(values, gy)
        if ctx.needs_input_grad[2]:
            g_a = ctx.a_meta.dense(g_values)
        return (g_values if ctx.needs_input_grad[0] else None), g_x, g_a, None, None


@dataclass(frozen=True)
class _Meta:
    """What a strided gradient of a block tensor needs: its index members, shape and layout."""

    compressed: torch.Tensor
    plain: torch.Tensor
    values_shape: torch.Size
    shape: torch.Size
    layout: torch.layout

    @staticmethod
    def of(a: torch.Tensor) -> _Meta:
        return _Meta(*compressed_members(a), a.values().shape, a.shape, a.layout)

    def dense(self, g_values: torch.Tensor) -> torch.Tensor:
        return _originals.sparse_compressed_tensor(
            self.compressed, self.plain, g_values.reshape(self.values_shape), self.shape,
            layout=self.layout, dtype=g_values.dtype, device=g_values.device,
            check_invariants=False).to_dense()


#: Autograd nodes below which a sparse tensor's gradient is a dense one (its values' or a
#: dense tensor's): the walk of :func:`_gradient_through_values` stops there.
_TO_DENSE_NODES = frozenset({"SparseCompressedTensorBackward0", "ToSparseBsrBackward0",
                             "ToSparseBscBackward0", "ToSparseBackward0",
                             "ToSparseCsrBackward0", "ToSparseCscBackward0"})
_WALK_LIMIT = 64


def _gradient_through_values(a: torch.Tensor) -> bool:
    """Whether ``a``'s gradient can flow as ``a.values()``'s: no BSR / BSC leaf below ``a``
    (torch 2.13 fails to accumulate the BSR / BSC gradient ``values()`` gives into one). A
    bounded walk of ``a``'s graph; when in doubt, False (a strided gradient always works)."""
    if not a.requires_grad or a.grad_fn is None:
        return False
    stack = [a.grad_fn]
    seen = 0
    while stack:
        node = stack.pop()
        name = type(node).__name__
        if name in _TO_DENSE_NODES:
            continue
        if name == "AccumulateGrad":
            if getattr(node, "variable").layout != torch.strided:  # noqa: B009
                return False
            continue
        seen += 1
        if seen > _WALK_LIMIT:
            return False
        stack += [n for n, _ in node.next_functions if n is not None]
    return True


# ---------------------------------------------------------------------------------------------
# Which calls take the block route


@dataclass(frozen=True)
class BlockCall:
    """A call that takes the block route: ``a`` the block-sparse operand, ``x`` the dense one;
    ``form`` ``"left"`` (``a @ x``), ``"right"`` (``x @ a``) or ``"linear"`` (``x @ a.mT``);
    ``bias`` (addmm's dense ``input`` or linear's bias, or None), ``beta`` and ``alpha``."""

    a: torch.Tensor
    x: torch.Tensor
    form: str
    bias: torch.Tensor | None = None
    beta: Any = 1
    alpha: Any = 1

    @property
    def sparse_left(self) -> bool:
        return self.form == "left"


def _is_block(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout in BLOCK_LAYOUTS


def _is_dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _takes(a: torch.Tensor, x: torch.Tensor) -> bool:
    """``a`` (a checked, non-hybrid block tensor) and ``x`` (dense) share a dtype and device
    this route computes on."""
    return (_is_checked(a) and a.dense_dim() == 0 and x.dtype == a.dtype
            and x.device == a.device and a.dtype in _DTYPES
            and (a.device.type != "cpu" or a.dtype in _CPU_DTYPES or _kernels_cover(a)))


def _fits(a: torch.Tensor, x: torch.Tensor, sparse_left: bool, matmul: bool) -> bool:
    """``a`` and ``x`` multiply on this route (see :func:`_takes`); for ``matmul`` shapes
    that cannot be multiplied as batches raise a clear ``RuntimeError``."""
    if not _takes(a, x):
        return False
    if not matmul:
        side = int(sparse_left)
        return a.dim() == 2 and x.dim() == 2 and a.shape[side] == x.shape[1 - side]
    if x.dim() == 0:
        return False
    inner = x.shape[0] if x.dim() == 1 else x.shape[-2 if sparse_left else -1]
    if a.shape[-1 if sparse_left else -2] != inner:
        return False
    if a.dim() == 2 or x.dim() <= 2 or x.shape[:-2] == a.shape[:-2]:
        return True
    raise RuntimeError(
        f"matmul: a batched block-sparse {a.layout} tensor of shape {tuple(a.shape)} and a "
        f"dense tensor of shape {tuple(x.shape)}: the block product takes equal batch shapes, "
        "or one operand unbatched (expand the other to the same batch shape)")


def route(p: Product) -> BlockCall | None:
    """The block route for the bound product ``p``, or None: torch's own kernel runs.

    Taken for ``mm`` / ``matmul`` / ``@`` / ``addmm`` / ``torch.sparse.mm`` /
    ``torch.sparse.addmm`` where one factor is a checked, non-hybrid BSR or BSC tensor and the
    other a dense tensor of the same dtype and device (float32 / float64; the half types too
    off CPU and, on CPU, for 2-D tensors: :func:`_kernels_cover`),
    addmm's ``input`` dense; for ``F.linear`` a 2-D such weight, a dense input and a dense bias
    or none. ``out=`` and in-place forms are bound here too; writing the result is the
    caller's (:mod:`safesparse.tensor.ops`).
    """
    if p.extra:
        return None
    if p.op == "linear":
        w, x, bias = p.mat2, p.mat1, p.input
        if (_is_block(w) and _is_dense(x) and (bias is None or _is_dense(bias))
                and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
                and _takes(w, x)):
            return BlockCall(w, x, "linear", bias)
        return None
    bias = None
    if p.op == "addmm":
        if not _is_dense(p.input):
            return None
        bias = p.input
    matmul = p.op == "matmul"
    m1, m2 = p.mat1, p.mat2
    if _is_block(m1) and _is_dense(m2) and _fits(m1, m2, True, matmul):
        return BlockCall(m1, m2, "left", bias, p.beta, p.alpha)
    if _is_dense(m1) and _is_block(m2) and _fits(m2, m1, False, matmul):
        return BlockCall(m2, m1, "right", bias, p.beta, p.alpha)
    return None


def block_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall | None:
    """:func:`route` for ``func(*args, **kwargs)`` (bound by
    :func:`safesparse.tensor.binding.bind`)."""
    p = bind(func, args, kwargs)
    return None if p is None else route(p)


#: Square block sizes for which torch's MKL BSR kernel is the faster forward (no gradient):
#: one thread, CPU time, 5 % of blocks, kernels / MKL: 2048 x 2048, K 64: 1 x 1 0.95, 2 x 2
#: 0.99, 3 x 3 1.34, 4 x 4 1.61, 8 x 8 2.03, 12 x 12 1.06, 16 x 16 0.95; 1024 x 1024, K 256:
#: 2 x 2 1.14, 4 x 4 1.41, 8 x 8 1.71, 16 x 16 0.61-0.98.
_MKL_BLOCKS = frozenset(range(2, 16))


def _torch_is_faster(a: torch.Tensor, x: torch.Tensor) -> bool:
    """torch's own kernel for ``a @ x`` where it has one and beats the block kernels
    (benchmarks/group_blocks.py): MKL's square-block BSR @ dense on CPU for blocks of
    ``_MKL_BLOCKS``, float32 / float64, when no gradient is needed, and only where the native
    kernels do not run: they take 0.08-0.18 ms where MKL takes 0.31-0.78 ms (2040 x 2040, 5 %
    of 3 x 3 to 15 x 15 blocks, x 2040 x 64, 2 threads)."""
    if native.available():
        return False
    if not (a.layout == torch.sparse_bsr and a.device.type == "cpu" and a.dim() == 2
            and x.dim() == 2 and a.dtype in _CPU_DTYPES):
        return False
    r, c = a.values().shape[-2:]
    return (r == c and int(r) in _MKL_BLOCKS
            and not (torch.is_grad_enabled() and (a.requires_grad or x.requires_grad)))


def _left(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, x) if _torch_is_faster(a, x) else _product(a, x, True)


def block_product(call: BlockCall) -> torch.Tensor:
    """The dense result of ``call`` (its product, plus ``addmm``'s / ``linear``'s terms)."""
    a, x = call.a, call.x
    if call.form == "linear":  # x @ a^T, x flattened to (M, in)
        x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
        if _kernels_cover(a):
            y = _kernel_product(a, x2, batch_major=True, transpose=False)
        else:  # x @ a^T == (a @ x^T)^T
            y = _left(a, x2.mT).mT
        y = y.reshape(*x.shape[:-1], a.shape[0])
        return y if call.bias is None else torch.add(y, call.bias)
    y = _left(a, x) if call.form == "left" else _product(a, x, False)
    if call.bias is None:
        return y
    if isinstance(call.beta, (int, float)) and call.beta == 0:
        return torch.mul(y, call.alpha)  # torch ignores input (its NaNs too) when beta is 0
    return torch.add(call.bias * call.beta, y, alpha=call.alpha)


#: The autograd nodes of wrapping and unwrapping (identity Functions in tensor.py).
_IDENTITY_NODES = frozenset(f.__name__ + "Backward" for f in (ToSafeSparseTensor, _ToPlain))


def _signed(dim: int) -> int:
    return dim - 2**64 if dim >= 2**63 else dim  # autograd keeps saved dims as unsigned


def _values_source(a: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``a``'s values were built from, as ``a.values()`` sees it, connected to its
    own graph; None unless ``a`` is such a tensor after wrapping and transposes only.

    torch's backward of the sparse factory densifies its gradient (``sparse_mask`` through
    ``to_dense``: hundreds of ms for a 2048 x 2048 matrix); reading the values from the
    factory's node lets the gradient reach them directly, sparse. The tensor found must have
    exactly ``a.values()``'s shape, strides and memory, or it is not used.
    """
    node = a.grad_fn
    flips = 0
    for _ in range(_WALK_LIMIT):
        name = type(node).__name__
        if name == "SparseCompressedTensorBackward0":
            values: torch.Tensor = getattr(node, "_saved_values")  # noqa: B009
            if flips % 2:
                values = values.transpose(-2, -1)
            mine = a.values()
            same = (values.shape == mine.shape and values.stride() == mine.stride()
                    and values.data_ptr() == mine.data_ptr() and values.dtype == mine.dtype)
            return values if same else None
        if name == "TransposeBackward0":
            ndim = a.dim()
            dims = {_signed(getattr(node, "_saved_dim0")) % ndim,  # noqa: B009
                    _signed(getattr(node, "_saved_dim1")) % ndim}  # noqa: B009
            if dims != {ndim - 2, ndim - 1}:
                return None
            flips += 1
        elif name == "TBackward0":
            flips += 1
        elif name not in _IDENTITY_NODES:
            return None
        if node is None or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    return None


def _operands(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the values the product reads, ``a`` itself where its gradient must be a strided one
    (see :class:`_BlockProduct`), else None)."""
    grad = torch.is_grad_enabled() and a.requires_grad
    source = _values_source(a) if grad else None
    via_values = source is not None or (grad and _gradient_through_values(a))
    if source is None:
        source = a.values() if via_values else a.values().detach()
    return source, (a if grad and not via_values else None)


def _product(a: torch.Tensor, x: torch.Tensor, sparse_left: bool) -> torch.Tensor:
    """``a @ x`` or ``x @ a`` with matmul's shapes: through the kernels where they cover
    ``a`` (:func:`_kernel_matmul`), else through :class:`_BlockProduct`."""
    if _kernels_cover(a):
        return _kernel_matmul(a, x, sparse_left)
    values, target = _operands(a)
    batch = a.shape[:-2]
    m, n = a.shape[-2:]
    if not sparse_left:  # x @ a == (a^T @ x^T)^T
        if x.dim() == 1:
            return _product_left(a, target, values, x, batch, m, transpose=True)
        return _product_left(a, target, values, x.mT, batch, m, transpose=True).mT
    return _product_left(a, target, values, x, batch, n, transpose=False)


def _product_left(a: torch.Tensor, target: torch.Tensor | None, values: torch.Tensor,
                  x: torch.Tensor,
                  batch: torch.Size, inner: int, *, transpose: bool) -> torch.Tensor:
    """``op(a) @ x``, ``x`` of shape (inner,), (inner, k), or batched (*batch, inner, k); a
    batched ``a`` with an unbatched ``x`` multiplies every batch by the same ``x``."""
    vector = x.dim() == 1
    if vector:
        x = x.unsqueeze(1)
    flat = values.reshape(-1, *values.shape[-2:])
    out_rows = a.shape[-1] if transpose else a.shape[-2]
    k = x.shape[-1]
    if x.dim() > 2 and not batch:  # one matrix, many operands: (inner, B * k)
        lead = x.shape[:-2]
        x2 = x.movedim(-2, 0).reshape(inner, lead.numel() * k)
        y2 = _apply(flat, x2, target, structure(a, True, True), transpose)
        return y2.reshape(out_rows, *lead, k).movedim(0, -2)
    x2 = x.reshape(x.shape[:-1].numel(), k)
    # the output side is always per batch; the input side only for a batched operand
    shared = x.dim() == 2 and len(batch) > 0
    rows, cols = (not shared or not transpose), (not shared or transpose)
    y = _apply(flat, x2, target, structure(a, rows, cols), transpose)
    y = y.reshape(*batch, out_rows, k)
    return y.squeeze(-1) if vector else y


def _apply(values: torch.Tensor, x: torch.Tensor, target: torch.Tensor | None,
           structure: Structure, transpose: bool) -> torch.Tensor:
    y: torch.Tensor = _BlockProduct.apply(  # type: ignore[no-untyped-call]
        values, x, target, structure, transpose)
    return y


# ---------------------------------------------------------------------------------------------
# 2-D products on CPU: the operators' products and their gradients (safesparse.operators)


def _kernels_cover(a: torch.Tensor) -> bool:
    """Whether the kernels compute products with ``a`` (a checked, non-hybrid BSR / BSC
    tensor on the route): 2-D on CPU, any block shape, the four float dtypes. Batched tensors
    and other devices take the element CSR route (:class:`_BlockProduct`)."""
    return a.dim() == 2 and a.device.type == "cpu"


class _Pattern:
    """What the kernels read of a checked 2-D block tensor: its layout, a private copy of its
    index members (so that a backward reads the data that was checked for the forward,
    whatever is written later), its shape and block shape; kept with the proof
    (:func:`_pattern`).

    The kernels read a BSC tensor by block rows (``A @ x``, ``x @ A.T``) and a BSR tensor by
    block columns (``A.T @ g``, ``g @ A``) by regrouping its blocks on every call (a stable
    sort): :meth:`regrouped` is the same matrix stored the other way, built once, so that
    every call passes the kernels the orientation they read without a sort."""

    __slots__ = ("_other", "c", "compressed", "layout", "n_cols", "n_rows", "plain", "r")

    def __init__(self, a: torch.Tensor) -> None:
        self.layout = a.layout
        compressed, plain = compressed_members(a)
        self.compressed, self.plain = compressed.clone(), plain.clone()
        self.n_rows, self.n_cols = int(a.shape[0]), int(a.shape[1])
        self.r, self.c = (int(s) for s in a.values().shape[-2:])
        self._other: tuple[torch.layout, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def regrouped(self) -> tuple[torch.layout, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the other layout, its compressed and plain members, ``order``): the stored block
        ``order[q]`` is the other layout's ``q``-th."""
        if self._other is None:
            n_plain = extents(self.layout, self.n_rows, self.n_cols, self.r, self.c)[1]
            compressed, plain, order = by_rows(self.compressed, self.plain, n_plain)
            self._other = (SWAPPED[self.layout], compressed, plain, order)
        return self._other

    def apply(self, values: torch.Tensor, operand: torch.Tensor, batch_major: bool,
              transpose: bool) -> torch.Tensor:
        """``op(A) @ operand`` (``operand`` (n_in, N)) or, ``batch_major``, ``operand @
        op(A).T`` (``operand`` (N, n_in)); ``op(A)`` is ``A`` or, ``transpose``, ``A.T``: the
        product ``PRODUCTS[(batch_major, transpose)]`` (:mod:`safesparse.operators.autograd`),
        by its kernel."""
        layout, compressed, plain = self.layout, self.compressed, self.plain
        if (layout == torch.sparse_bsr) == transpose and plain.numel() > 0:
            layout, compressed, plain, order = self.regrouped()
            values = values.index_select(0, order)
        a = matrix(layout, compressed, plain, values, self.n_rows, self.n_cols)
        if batch_major:
            return (kernels.linear_grad_input if transpose else kernels.linear)(a, operand)
        return (kernels.matmul_grad_input if transpose else kernels.matmul)(a, operand)

    def values_grad(self, values: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                    batch_major: bool) -> torch.Tensor:
        """The gradient of the stored values of a product (``batch_major`` or not) for its
        ``(left, right)`` (:func:`safesparse.operators.autograd.gradients` says which)."""
        a = matrix(self.layout, self.compressed, self.plain, values, self.n_rows, self.n_cols)
        if batch_major:
            return kernels.linear_grad_values(a, left, right)
        return kernels.matmul_grad_values(a, left, right)


def _pattern(a: torch.Tensor, block: torch.Size | None = None) -> _Pattern:
    """``a``'s :class:`_Pattern` (``block``: its block shape, when the caller has it), kept
    with its index data's proof as :func:`structure`."""
    cache = checked.proof_cache(a)
    if cache is None:
        return _Pattern(a)
    key = ("kernels", a.layout, a.shape, a.values().shape[-2:] if block is None else block)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _Pattern(a)
    assert isinstance(found, _Pattern)
    return found


#: Blocks of fewer elements get their values' gradient (float32 / float64; the half types
#: have no CPU ``sampled_addmm``) from the element CSR route
#: (:meth:`Structure.block_grad` / ``sampled_addmm``), not from the kernels: with the
#: torch-op kernels the values gradient of small blocks costs 3-15x more (one thread, CPU
#: time, 5 % of blocks, / dense forward: 2048 x 2048, K 64: 2 x 2 0.66 against 0.16, 4 x 4
#: 2.0 against 0.14, 8 x 8 0.83-0.93 against 0.14-0.28; 1024 x 1024, K 256: 8 x 8 0.42-0.44
#: against 0.12-0.25; at 16 x 16 0.17-0.23 against 0.10, 16 x 32 0.12-0.16 against 0.08-0.10).
_KERNEL_GRAD_FROM = 256


#: Blocks of fewer elements multiply a batch-major operand (``F.linear``, ``x @ A``) as the
#: transpose of the column-major product: the kernels' batch-major path costs 3-11x more for
#: them (one thread, CPU time, 2048 x 2048, 5 % of blocks, x 64 x 2048, ``F.linear`` / dense:
#: 4 x 4 2.04-2.07 against 0.19-0.29, 8 x 8 0.64-0.66 against 0.19-0.29).
_BATCH_MAJOR_FROM = 256


class _KernelProduct(torch.autograd.Function):
    """``y = product(A, x)`` for a 2-D block tensor ``A`` on CPU, its stored values
    ``values`` and its :class:`_Pattern`: one of the operators' four products (``x`` (n_in,
    N), or (N, n_in) for a batch-major one), by the kernels. Its gradients are the operators'
    formula (:func:`safesparse.operators.autograd.gradients`) over the pattern; ``a`` /
    ``old`` as for :class:`_BlockProduct` (``old``: the element structure for the values
    gradient of small blocks, see ``_KERNEL_GRAD_FROM``)."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, x: torch.Tensor, a: torch.Tensor | None,
                pattern: _Pattern, old: Structure | None, product: SparseProduct) -> torch.Tensor:
        ctx.pattern, ctx.old, ctx.product = pattern, old, product
        ctx.a_meta = None if a is None else _Meta(pattern.compressed, pattern.plain,
                                                  a.values().shape, a.shape, a.layout)
        ctx.save_for_backward(values, x)
        return pattern.apply(values, x, product.batch_major, product.transpose)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        values, x = ctx.saved_tensors
        pattern, product, old = ctx.pattern, ctx.product, ctx.old
        batch_major, transpose = product.batch_major, product.transpose
        need_values = ctx.needs_input_grad[0] or ctx.needs_input_grad[2]
        g_x, g_values = gradients(
            product, gy, x, ctx.needs_input_grad[1], need_values and old is None,
            lambda p, o: pattern.apply(values, o, p.batch_major, p.transpose),
            lambda left, right: pattern.values_grad(values, left, right, batch_major))
        if need_values and old is not None:  # small blocks: the element structure, which
            gc, xc = (gy.mT, x.mT) if batch_major else (gy, x)  # reads column-major operands
            gc, xc = gc.contiguous(), xc.contiguous()
            if old.r * old.c >= _BMM_MIN:
                g_values = old.block_grad(gc, xc, transpose).view(values.shape)
            else:
                g_values = old.side(transpose).sampled(gc, xc, values.shape)
        g_a = ctx.a_meta.dense(g_values) if ctx.needs_input_grad[2] else None
        return ((g_values if ctx.needs_input_grad[0] else None), g_x, g_a, None, None, None)


def _kernel_product(a: torch.Tensor, x: torch.Tensor, *, batch_major: bool,
                    transpose: bool) -> torch.Tensor:
    """:class:`_KernelProduct` of the 2-D ``a`` and the 2-D ``x``; batch-major products of
    small blocks as the transpose of the column-major one (``_BATCH_MAJOR_FROM``)."""
    values, target = _operands(a)
    pattern = _pattern(a, values.shape[-2:])
    if batch_major and pattern.r * pattern.c < _BATCH_MAJOR_FROM:
        # x @ op(A).T == (op(A) @ x.T).T
        return _kernel_product(a, x.mT, batch_major=False, transpose=transpose).mT
    grad = torch.is_grad_enabled()
    if not (grad and (values.requires_grad or x.requires_grad or target is not None)):
        return pattern.apply(values, x, batch_major, transpose)  # no graph: no Function
    old = None
    if (grad and values.requires_grad and values.dtype in _CPU_DTYPES
            and pattern.r * pattern.c < _KERNEL_GRAD_FROM):
        old = structure(a, True, True)
    y: torch.Tensor = _KernelProduct.apply(  # type: ignore[no-untyped-call]
        values, x, target, pattern, old, PRODUCTS[(batch_major, transpose)])
    return y


def _kernel_matmul(a: torch.Tensor, x: torch.Tensor, sparse_left: bool) -> torch.Tensor:
    """``a @ x`` (``sparse_left``) or ``x @ a`` with matmul's shapes for a 2-D ``a``: ``a @
    x`` column-major (``x`` (n, k), a vector, or batches (..., n, k) side by side), ``x @ a``
    batch-major (the rows of every batch of ``x`` one batch of rows)."""
    if not sparse_left:
        lead = x.shape[:-1]
        x2 = x.reshape(lead.numel(), x.shape[-1])  # (explicit: -1 is ambiguous for 0 elements)
        y = _kernel_product(a, x2, batch_major=True, transpose=True)
        return y.reshape(*lead, a.shape[1])
    if x.dim() == 1:
        return _kernel_product(a, x.unsqueeze(1), batch_major=False, transpose=False).squeeze(1)
    if x.dim() == 2:
        return _kernel_product(a, x, batch_major=False, transpose=False)
    lead, k = x.shape[:-2], x.shape[-1]
    x2 = x.movedim(-2, 0).reshape(x.shape[-2], lead.numel() * k)
    y2 = _kernel_product(a, x2, batch_major=False, transpose=False)
    return y2.reshape(a.shape[0], *lead, k).movedim(0, -2)


__all__ = [
    "BLOCK_LAYOUTS",
    "BlockCall",
    "block_call",
    "block_product",
    "pattern_positions",
    "route",
    "structure",
]

"""The eager fast path of ``SparseLinear`` and ``SparseMatmul``: a call that costs what its
product costs.

The ``safesparse`` operators (:mod:`safesparse.nn.operators`) are the path for tracing,
compiling and exporting, and the *proving* path: every call confirms that the index members
are proven (validating them otherwise), checks the operands, and goes through the
``torch.library`` dispatcher, which is most of a batch-1 call. In eager mode, after one such
call succeeded, a module keeps a *plan*: the native product's arguments packed once
(:func:`safesparse.kernels.native.pack_product`: one ``int64`` array, one one-argument ctypes
call per product) and the *key* the plan was built for. A call takes the plan only when it
skips nothing whose answer could have changed, all re-checked in O(1) per call:

* the context: no ``torch.compile`` / ``torch.export`` trace (``torch.compiler.is_compiling``),
  no ``torch.jit.trace``, no ``torch.func`` transform, no torch-function mode, an empty
  dispatch-mode stack (``FakeTensorMode``, ``make_fx``, ``TorchDispatchMode``), autocast
  off on CPU (or on, with the dtype the plan was built for), not in a child started by
  ``fork()`` (:mod:`safesparse.base.forking`), not in debug mode, the native library not
  turned off (:func:`safesparse.kernels.native.disabled`);
* the input: an exact CPU ``torch.Tensor`` (no subclass, no ``SafeSparseTensor``) of the
  plan's dtype, contiguous, of the layer's width, whose memory holds its values (no negative
  view: its memory holds ``-x``; no zero tensor: it has none);
* the module's members: the very buffer and parameter objects (read from the module's own
  dicts, never through ``nn.Module.__getattr__``), at the same data address and shape; the
  values' and bias's address, shape, strides and dtype (the kernel reads them in place: a
  write to them changes the result, not the plan); where the plan holds a converted copy of
  them (autocast, half types) also their version counters and fingerprints (a write through
  ``.data`` moves no counter: :mod:`safesparse.nn.plan`): a write makes a new plan at the next
  call, on the same proof (:func:`~safesparse.nn.plan._build` asks the state again), so a stale
  copy is never read; a float32 / float64 block plan's pre-packed values (from 16 rows,
  :meth:`~safesparse.nn.plan._Plan.prepacked`: a transposed copy, made where two calls in a
  row saw the values' counter unmoved) are read only while that counter and the values'
  fingerprint are the ones they were copied at;
* the thread count;
* and the proof itself: the state layer's answer (:func:`safesparse.state.members_proof.proof`
  when the plan is built, then its O(1) re-check :func:`~safesparse.state.members_proof.holding`
  at every call): a write through any alias of the index memory, also one that moves no
  counter of the buffers themselves (``layer.weight.col_indices()``), voids it.

Any change falls back to the operators, which validate what they cannot prove (refusing only
invalid data) and, once they succeeded, the plan is built again. Members the state cannot
watch (shared memory, inference tensors, index buffers DDP broadcasts) are never proven, so
they never get a plan; nor do members of a tensor subclass (its ``__torch_function__`` decides
what the operators read) or a strided bias (the array would read a copy of it).

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a float32 layer's plan runs the bfloat16
kernels (:func:`safesparse.kernels.native.pack_product` with bfloat16 operands) on a cached
bfloat16 copy of its values and bias, the input rounded once (by the library inside the call
for small inputs, ``ss_product_packed_rounded``; by torch above; read in place when it is
bfloat16 already), the output bfloat16, as the operators' autocast kernel computes it. A
forward of at most 32 rows that records no gradient reads the float32 values and bias in place
instead, rounded to bfloat16 in the library's call (the values by the small-batch tile as it
reads them)
(:func:`safesparse.kernels.native.rounding_values`): no copy is read, so none is checked (the
copy's fingerprint at batch 1 cost as much as the product). A bfloat16 layer's plan reads its
values in place in the same kernels.

With gradients on, the plan's product runs inside a plain
``autograd.Function`` (called through its C ``apply``: the Python layer of
``autograd.Function.apply`` costs about 3 us at batch 1) whose backward is the operators' one
formula (:func:`safesparse.operators.autograd.gradients`) computed by the gradient kernels after
the same re-check (the gradient operators otherwise); not under saved-tensor hooks (activation
checkpointing compares what the forward saved with what its recomputation saves: both take the
operators). For block layouts the three gradients are one call too
(:meth:`_Plan.backward_args`: the backward's arguments packed at the first backward and kept
with the plan, :func:`safesparse.kernels.native.pack_linear_backward`), their outputs in the
dtypes autocast's casts would give (written so by the kernels). A batch-1 float32 fwd+bwd
(``torch.autograd.grad`` to the input and both parameters, 10 %): about 120-130 us, of which the
three kernels about 25 us, the autograd engine about 40 us.

What a batch-1 call costs (one thread, CPU time, 1024 x 1024, 10 % of 16 x 16 blocks, float32,
no_grad, 13-14 us against nn.Linear's 82-120 us): the kernel 5.5-6 us (74-78 GB/s from L2),
the output ``torch.empty`` 0.8 us, the layer's own ``__call__`` about 1 us (:func:`forward_only`:
``nn.Module.__call__`` and the ``forward`` take 0.4-0.6 us more), the context 0.6 us, the key
about 3 us (the input 0.5, the module's members 1.1, the state's re-check 1.6: two
``is_set_to``, the record's counter, pointers and storage sizes, the state's watches), the
ctypes call 0.2 us, the rest the calls between them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import addressof
from typing import Any

import torch
from torch.nn.modules import module as _module_globals

from ..base.debug_flag import is_debug
from ..base.forking import in_forked_child
from ..kernels import blocks as blockkernels
from ..kernels import native
from ..kernels.pattern import matrix
from ..operators.autograd import LINEAR, SparseProduct, again, apply, gradients
from ..operators.library import linear_grad_input, linear_grad_values
from .plan import (
    _AUTOCAST,
    _BF16,
    _F32,
    _ROUND_IN_CALL,
    _SMALL_ROWS,
    _STALE,
    _YES,
    PlanSlot,
    _build,
    _Plan,
    _slot,
    plan_of,
)

_SLOT_X, _SLOT_N, _SLOT_Y = native.SLOT_X, native.SLOT_N, native.SLOT_Y
_SLOT_XK, _SLOT_YI = native.SLOT_XK, native.SLOT_YI

__all__ = ["PlanSlot", "forward_only", "linear", "matmul", "plan_of"]

T = torch.Tensor
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_tracing = torch._C._get_tracing_state
_transforms = torch._C._are_functorch_transforms_active
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_any_autocast = torch._C._is_any_autocast_enabled
_cpu_autocast = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_grad_enabled = torch.is_grad_enabled
_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_threads = torch.get_num_threads
_ident = threading.get_ident
_empty = torch.empty
_default_dtype = torch.get_default_dtype
_Module = torch.nn.Module
#: the parameters' types the plan reads (no ``__torch_function__`` of their own)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: ``nn.Module.__call__`` as torch defines it (``torch.fx``'s symbolic trace replaces it while
#: it traces), and the global hooks it runs (dicts torch fills and empties in place)
_MODULE_CALL = torch.nn.Module.__call__
_profiling = torch._C._autograd._profiler_enabled
_native_off = native.forced_off
_GLOBAL_HOOKS = (_module_globals._global_forward_pre_hooks, _module_globals._global_forward_hooks,
                 _module_globals._global_backward_pre_hooks,
                 _module_globals._global_backward_hooks)

def forward_only(module: torch.nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether ``nn.Module.__call__`` would call nothing but ``forward`` (the class's) on
    ``module`` now: no hook of the module's own or global (forward, backward, pre), no
    ``forward`` set on the instance, no ``_call_impl`` of a subclass or set on the instance
    (``nn.Module.__call__`` calls it), no ``module.compile()``, no ``torch.jit.trace``, no
    profiler running (it names modules by ``nn.Module.__call__``'s frames), and
    ``nn.Module.__call__`` torch's own. The modules' ``__call__`` then calls the forward's
    eager path directly (:func:`safesparse.nn.forward.linear_call`)."""
    d = module.__dict__
    hooks = _GLOBAL_HOOKS
    try:
        return not (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"]
                    or d["_backward_hooks"] or hooks[0] or hooks[1] or hooks[2] or hooks[3]
                    or "forward" in d or d.get("_compiled_call_impl") is not None
                    or "_call_impl" in d or type(module)._call_impl is not _Module._call_impl
                    or type(module).forward is not forward or _Module.__call__ is not _MODULE_CALL
                    or _tracing() is not None or _profiling())
    except KeyError:  # (a module whose __init__ did not run: nn.Module.__call__ says what)
        return False


def _context() -> torch.dtype | None:
    """What nothing may observe: None where the fast path may not run; else the autocast
    dtype on CPU (``torch.float32`` standing for autocast off)."""
    return None if _is_compiling() else _eager_context()


def _eager_context() -> torch.dtype | None:
    """:func:`_context` where the caller knows no ``torch.compile`` / ``torch.export`` trace
    is running (the forwards of :mod:`safesparse.nn.forward` asked just before: the question
    costs about 0.15 us)."""
    if (_tracing() is not None or _transforms() or _function_mode() or _dispatch_modes()
            or in_forked_child() or is_debug() or _native_off()):
        return None
    if _any_autocast():
        if not torch.is_autocast_enabled("cpu"):
            return None  # (another device's autocast: the operators decide)
        return _autocast_dtype("cpu")
    return torch.float32

class _FastLinear(torch.autograd.Function):
    """The plan's product with gradients. The backward is the operators' one formula
    (:func:`safesparse.operators.autograd.gradients`) computed by the kernels directly where
    the plan still holds when it runs (the same O(1) questions: the context, the state's
    re-check of the proof, the values' address, shape and strides): for block layouts one
    call of the library over the plan's packed backward array (:meth:`_Plan.backward_args`:
    the three gradients), else the gradient kernels; where it does not hold, the gradient
    operators, which confirm (or validate) the members themselves. Under bfloat16 autocast the
    backward runs in bfloat16 from what the forward read (the input rounded once, the plan's
    copy of the values) and the gradients reach the float32 parameters and input converted,
    as autocast's own casts would (written so by the kernels: their bfloat16 rounding
    widened, no cast pass). A gradient given as a negative view or a zero tensor is read as
    the values it stands for; with ``create_graph=True`` the gradients are tied to
    :class:`_Again`, so that differentiating them again raises the operators' error."""

    @staticmethod
    def forward(ctx: Any, x: T, v: T, b: T | None, plan: _Plan, n: int,
                y_shape: tuple[int, ...]) -> T:
        vals = v
        # (its members: the backward confirms them, or the operators do)
        ctx.meta = plan, x.shape, x.dtype
        if plan.kind == _AUTOCAST:  # (the backward reads the plan's copy of the values and
            # the input rounded: a small float32 input is rounded by the library, in the
            # product's call (:meth:`_Plan.run`) and again in the backward's, no tensor)
            vals = plan.vals
            if x.dtype is not _BF16 and (plan.rounded is None
                                         or n * plan.width > _ROUND_IN_CALL):
                x = x.to(_BF16)
        y = plan.run(x, n, y_shape)
        if y is None:
            raise _Refused
        ctx.save_for_backward(x, vals)
        return y

    @staticmethod
    def backward(ctx: Any, g: T) -> tuple[T | None, ...]:
        if _grad_enabled():  # create_graph=True: computed without a graph, then tied to
            with torch.no_grad():  # one whose gradient raises (:class:`_Again`)
                first = _FastLinear.backward(ctx, g)
            return _again(ctx, g, first)
        if g.is_neg() or g._is_zerotensor():  # (the kernels read memory: a negative view's
            # holds -g, a zero tensor has none)
            g = g.resolve_neg() if g.is_neg() else torch.zeros(g.shape, dtype=g.dtype)
        x, vals = ctx.saved_tensors
        plan: _Plan
        plan, x_shape, x_dtype = ctx.meta
        n_out = plan.n_out
        need_x, need_v, need_b = ctx.needs_input_grad[:3]
        # (no call where it would be a no-op: the common case)
        g2 = g if g.dim() == 2 and g.is_contiguous() else g.reshape(-1, n_out).contiguous()
        if g2.dtype is not vals.dtype:
            g2 = g2.to(vals.dtype)
        if (_context() is not None and type(g2) is _Tensor and vals.dtype is plan.vals.dtype
                and vals.data_ptr() == plan.vals.data_ptr() and vals.is_set_to(plan.vals)
                and plan.still()):  # the kernels, on the plan's proof
            bwd = plan.backward_args() if _threads() == plan.threads else None
            if bwd is not None:
                got = _packed_backward(plan, bwd, g2, x, x_shape, x_dtype, need_x, need_v,
                                       need_b)
                if got is not None:
                    return got
            holds = True
        else:  # the gradient operators, which confirm (or validate) the members themselves
            holds = False
        if plan.kind == _AUTOCAST and x.dtype is not _BF16:
            x = x.to(_BF16)  # (as the forward read it)
        gx, gv = (_kernel_gradients(plan, g2, x, vals, x_dtype, need_x, need_v) if holds
                  else _operator_gradients(plan, g2, x, vals, need_x, need_v))
        gb = blockkernels.bias_grad(g2) if need_b else None
        if plan.kind == _AUTOCAST:  # (to the float32 parameters and input, as autocast's;
            # no-ops where the kernels wrote them so)
            gv = None if gv is None else gv.to(plan.dtype)
            gb = None if gb is None else gb.to(plan.dtype)
        return (None if gx is None else gx.view(x_shape).to(x_dtype)), gv, gb, \
            None, None, None


class _Again(torch.autograd.Function):
    """The plan's gradients computed with ``create_graph=True`` (``forward(grads, *operands)``
    returns the tensors of the tuple ``grads``: outputs of their own, not views), tied to what
    they depend on (the output's gradient, the input and values the forward read, the
    parameters): differentiating them again raises the operators' error
    (:func:`safesparse.operators.autograd.again`), never finds them unused (a second
    derivative of None)."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[T, ...], *operands: T) -> tuple[T, ...]:
        return grads

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise again()


def _again(ctx: Any, g: T, got: tuple[T | None, ...]) -> tuple[T | None, ...]:
    """:class:`_Again` over the gradients ``got`` of ``_FastLinear.backward``."""
    grads = [t for t in got[:3] if t is not None]
    if not grads:
        return got
    x, vals = ctx.saved_tensors
    plan: _Plan = ctx.meta[0]
    deps = (g, x, vals, plan.v) if plan.b is None else (g, x, vals, plan.v, plan.b)
    out = iter(apply(_Again, tuple(grads), *deps))
    return (*(None if t is None else next(out) for t in got[:3]), *got[3:])


_GradOut = tuple[T | None, T | None, T | None, None, None, None]
_BWD_G, _BWD_N, _BWD_GX, _BWD_GX_DT = native.BWD_G, native.BWD_N, native.BWD_GX, native.BWD_GX_DT
_BWD_L, _BWD_X, _BWD_VN, _BWD_GV, _BWD_GB = (native.BWD_L, native.BWD_X, native.BWD_VN,
                                             native.BWD_GV, native.BWD_GB)
_BWD_X_ROUND = native.BWD_X_ROUND


def _packed_backward(plan: _Plan, bwd: tuple[native.PackedArgs, int, Any, tuple[T, ...]],
                     g2: T, x: T, x_shape: torch.Size, x_dtype: torch.dtype, need_x: bool,
                     need_v: bool, need_b: bool) -> _GradOut | None:
    """The three gradients by one call over the plan's packed backward array (the caller
    confirmed that the plan holds), written in the dtypes the other routes give: the input's
    (under autocast a float32 input's gradient is the bfloat16 product's rounding, widened),
    the values' and bias's (under autocast likewise); the bias gradient summed where
    :func:`safesparse.kernels.blocks.bias_grad` sums it, in the library
    (:func:`~safesparse.kernels.blocks.native_bias_sum`, bfloat16) or by torch. None where
    the library refused (the caller's kernels run)."""
    n = g2.shape[0]
    if x.numel() != n * plan.width or g2.shape[1] != plan.n_out:
        return None  # (what the array's kernels read and write: never past these)
    args, addr, entry = bwd[0], bwd[1], bwd[2]
    if plan.thread != _ident():  # (another thread: its own copy of the array)
        args = type(args).from_buffer_copy(args)
        addr = addressof(args)
    autocast = plan.kind == _AUTOCAST
    vdtype = plan.vals.dtype  # (the product's dtype; plan.dtype: the parameters')
    gx = gv = gb = None
    if autocast:  # (a float32 input: rounded in the call, as the forward read it)
        args[_BWD_X_ROUND] = x.dtype is not _BF16
    if need_x:
        if autocast:
            rounded = x_dtype is not _BF16
            gx = _empty(x_shape, dtype=_F32 if rounded else _BF16)
            args[_BWD_GX_DT] = native.grad_input_code(_BF16, rounded)
        else:
            gx = _empty(x_shape, dtype=vdtype)
        args[_BWD_GX] = gx.data_ptr()
    else:
        args[_BWD_GX] = 0
    if need_v:
        gv = _empty(plan.vals.shape, dtype=plan.dtype)  # (the values the array reads)
        args[_BWD_GV] = gv.data_ptr()
    else:
        args[_BWD_GV] = 0
    native_sum = need_b and vdtype is _BF16 and blockkernels.native_bias_sum(n)
    if native_sum:
        gb = _empty(plan.n_out, dtype=plan.dtype)
        args[_BWD_GB] = gb.data_ptr()
    else:
        args[_BWD_GB] = 0
    ptr = g2.data_ptr()
    args[_BWD_G] = ptr
    args[_BWD_L] = ptr
    args[_BWD_N] = n
    args[_BWD_VN] = n
    args[_BWD_X] = x.data_ptr()
    rc = entry(addr)
    if rc != 0:
        if rc == native.E_NOKERNEL:
            plan.backward_failed()
        return None
    if need_b and not native_sum:  # (torch's sum, as bias_grad gives it)
        gb = blockkernels.bias_grad(g2)
        if autocast:
            gb = gb.to(plan.dtype)
    return gx, gv, gb, None, None, None


def _kernel_gradients(plan: _Plan, g2: T, x: T, vals: T, x_dtype: torch.dtype, need_x: bool,
                      need_v: bool) -> tuple[T | None, T | None]:
    """:func:`gradients` by the gradient kernels (the plan holds; no packed backward)."""
    n_out, width, cache = plan.n_out, plan.width, plan.cache
    w = matrix(plan.layout, plan.c, plan.p, vals, n_out, width)
    # under autocast: the dtypes autocast's casts take the gradients to (the float32
    # parameters; the input's), None where they stay in the product's dtype; the bfloat16
    # kernels write the rounded gradients widened to float32: the bits the casts would give
    gx_kw: dict[str, Any] = {}
    gv_kw: dict[str, Any] = {}
    if plan.kind == _AUTOCAST:
        gv_kw = {"dtype": plan.dtype, "rounded": True}
        if x_dtype is not vals.dtype:
            gx_kw = {"dtype": x_dtype, "rounded": True}

    def run(product: SparseProduct, operand: T) -> T:
        return _GRAD_KERNELS[product.name](w, operand, cache=cache, **gx_kw)

    def values_grad(left: T, right: T) -> T:
        return _GRAD_KERNELS[LINEAR.values_grad](w, left, right, cache=cache, **gv_kw)
    return gradients(LINEAR, g2, x.view(-1, width), need_x, need_v, run, values_grad)


def _operator_gradients(plan: _Plan, g2: T, x: T, vals: T, need_x: bool, need_v: bool
                        ) -> tuple[T | None, T | None]:
    """:func:`gradients` by the gradient operators (which confirm, or validate, the
    members themselves)."""
    matrix_args = (plan.c, plan.p, vals, plan.layout_name, plan.n_out, plan.width)

    def run(product: SparseProduct, operand: T) -> T:
        return _GRAD_OPERATORS[product.name](operand, *matrix_args)

    def values_grad(left: T, right: T) -> T:
        return _GRAD_OPERATORS[LINEAR.values_grad](left, right, *matrix_args)
    return gradients(LINEAR, g2, x.view(-1, plan.width), need_x, need_v, run, values_grad)


#: The gradient products of ``linear`` (:data:`LINEAR`; :func:`gradients` names them), by
#: their kernels and by their operators.
_GRAD_KERNELS: dict[str, Callable[..., T]] = {
    "linear_grad_input": blockkernels.linear_grad_input,
    "linear_grad_values": blockkernels.linear_grad_values}
_GRAD_OPERATORS: dict[str, Callable[..., T]] = {
    "linear_grad_input": linear_grad_input, "linear_grad_values": linear_grad_values}


#: ``_FastLinear.apply`` without ``autograd.Function.apply``'s Python layer (about 3 us at
#: batch 1): the fast path runs only where no ``torch.func`` transform is active and passes
#: no ``setup_context`` defaults; the dead functorch wrappers that layer unwraps have no
#: storage, so :meth:`_Plan.run` refuses them and the operators run.
_apply: Callable[..., T] = super(torch.autograd.Function, _FastLinear).apply


def _replan(module: Any, x: T, autocast: torch.dtype | None, batch_major: bool) -> None:
    """After a proving call that succeeded where the plan did not hold: a new plan (or none)."""
    if autocast is not None and type(x) is _Tensor and x.is_cpu:
        try:
            _slot(module).plan = _build(module, x, autocast, batch_major)
        except Exception:  # (no plan: the proving path keeps running)
            _slot(module).plan = None


def _refresh(module: Any, x: T, autocast: torch.dtype, batch_major: bool) -> _Plan | None:
    """A plan whose converted copy went stale (the values or bias written): a new one at
    once, on the same proof (no proving call: :func:`_build` asks the state again)."""
    _replan(module, x, autocast, batch_major)
    plan = plan_of(module)
    d = module.__dict__
    if plan is None or plan.holds(d["_buffers"], d["_parameters"], autocast) != _YES:
        return None
    return plan  # type: ignore[no-any-return]


def _records(module: Any, x: T) -> bool:
    """Whether a layer's call with grad enabled records a gradient (``x`` or a parameter
    requires one)."""
    if x.requires_grad:
        return True
    params = module.__dict__["_parameters"]
    return any(p is not None and p.requires_grad for p in params.values())


class _Refused(Exception):
    """The library refused the packed call (never seen by users: the proving path runs)."""


def _held(module: Any, x: T, shape: torch.Size, autocast: torch.dtype, batch_major: bool,
          small: bool = False) -> _Plan | None:
    """The plan to run (in a context that allows the fast path: ``autocast`` is
    :func:`_context`'s answer) where the module has one, ``x`` (of ``shape``) is a contiguous CPU
    ``torch.Tensor`` of a dtype and width the plan reads, and the plan's key holds: the plan
    itself, or one rebuilt on the same proof where only its converted copies are stale; else
    None (the proving path runs). ``small``: the call will run the plan with ``small``
    (:meth:`_Plan.run`: under autocast, the float32 values read in place, no copy), so the
    copies are not asked about. One function, cheapest questions first: this is the call's
    whole key."""
    d = module.__dict__
    slot: PlanSlot | None = d.get("_ss_fast")
    plan = None if slot is None else slot.plan
    if plan is None or type(x) is not _Tensor:
        return None
    dtype = x.dtype
    if ((dtype is not plan.x_dtype and dtype is not plan.x_alt) or not x.is_cpu
            or not x.is_contiguous() or x.is_neg()):  # (negative bit: its memory holds -x)
        return None
    if batch_major:  # (linear: (..., width); matmul: (width,) or (width, N))
        if not shape or shape[-1] != plan.width:
            return None
    elif len(shape) not in (1, 2) or shape[0] != plan.width:
        return None
    holds = plan.holds(d["_buffers"], d["_parameters"], autocast, small)
    if holds == _YES:
        return plan
    if holds == _STALE:
        return _refresh(module, x, autocast, batch_major)
    return None


def linear(module: Any, x: T, proving: Callable[[Any, T], T]) -> T:
    """``SparseLinear.forward`` in eager mode: the plan where it holds, else ``proving``
    (the operators), after which a plan is built."""
    autocast = _eager_context()  # (the forward asked whether a trace is running)
    shape = x.shape
    small = False  # (under autocast: a forward of a few rows recording no gradient, which
    # reads the float32 values in place where the plan can: no copy, so no fingerprint)
    if autocast is None:
        plan = None
    else:
        if autocast is not _F32 and shape and x.numel() <= _SMALL_ROWS * shape[-1]:
            small = not (_grad_enabled() and _records(module, x))
        plan = _held(module, x, shape, autocast, True, small)
    if plan is not None:
        if len(shape) == 2:
            n = shape[0]
            y_shape: tuple[int, ...] = (n, plan.n_out)
        else:
            n = x.numel() // plan.width
            y_shape = (*shape[:-1], plan.n_out)
        v = plan.v
        b = plan.b
        # (``small`` answered already that no gradient is recorded: its key did not ask about
        # the copies, which the gradient's route reads)
        if n and (small or not (_grad_enabled() and (x.requires_grad or v.requires_grad or (
                b is not None and b.requires_grad)))):
            y = plan.run(x, n, y_shape, small)
            if y is not None:
                return y
        elif n and plan.grad and _saved_hooks(False) is None:
            # (saved-tensor hooks: activation checkpointing recomputes the forward and
            # hands the graph the tensors saved then: both runs take the operators)
            try:
                y = _apply(x, v, b, plan, n, y_shape)
            except _Refused:
                pass
            else:
                return y
    y = proving(module, x)
    if plan is None:
        _replan(module, x, autocast, batch_major=True)
    return y


def matmul(module: Any, x: T, proving: Callable[[Any, T], T]) -> T:
    """``SparseMatmul.forward`` in eager mode (``y = A @ x``): the plan where it holds and no
    gradient is recorded (a trainable ``A`` or an ``x`` requiring grad take the operators),
    else ``proving``."""
    autocast = _eager_context()  # (the forward asked whether a trace is running)
    shape = x.shape
    plan = None if autocast is None else _held(module, x, shape, autocast, False)
    if plan is not None:
        n = 1 if len(shape) == 1 else shape[1]
        if n and not (_grad_enabled() and (x.requires_grad or plan.v.requires_grad)):
            y = plan.run(x, n, (plan.n_out,) if len(shape) == 1 else (plan.n_out, n))
            if y is not None:
                return y
    y = proving(module, x)
    if plan is None:
        _replan(module, x, autocast, batch_major=False)
    return y

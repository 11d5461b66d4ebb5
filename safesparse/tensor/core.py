"""``SafeSparseTensor``: a torch sparse tensor that remembers it was checked.

The class is a real ``torch.Tensor`` whose ``__torch_function__`` runs every torch function on
the underlying tensor and re-wraps sparse results, deciding their checked state from the
op table (:mod:`safesparse.tensor.ops`). Two paths:

* the **fast path** (:mod:`safesparse.tensor.fastpath`): the common operations on one checked tensor
  with scalar or dense arguments, in a straight line (one record check, no search);
* the **general path** (:func:`general`): everything else. The guard validates every sparse
  argument that is not checked, every SafeSparseTensor argument's record is shared (its memory
  may get a second counter inside the op), the op runs (or its implementation from the table),
  and sparse results are joined to the state of their index memory.

Results torch hands us as new objects are *retyped* (``ret.__class__ = SafeSparseTensor``: the
same object, autograd graph kept). A tensor the caller owns (``ss.validate(plain)``) is wrapped
with ``Tensor._make_subclass``, which detaches, so wrapping and unwrapping a tensor that takes
part in autograd go through identity :class:`torch.autograd.Function` s
(:class:`ToSafeSparseTensor`, :class:`_ToPlain`), which keep the graph connected.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard, TypeVar, cast

import torch
from torch._C import DisableTorchFunctionSubclass

from ..base.compiling import bind, not_traced, surface
from ..base.debug_flag import is_debug
from ..base.layouts import SPARSE_LAYOUTS
from ..catalog.errors import InvariantError
from ..engine.validation import validate_tensor
from ..state import checked, writers
from .adopt import copyable, own_indices
from .fastpath import FAST, MISS
from .optable import INDEX_ACCESSORS, INSPECTION, Classifier, OpEntry, OpKind, _mutates, op_name

F = TypeVar("F", bound=Callable[..., Any])


index_members = checked.index_members
geometry_of = checked.geometry_of
compressed_geometry = checked.compressed_geometry


# ---------------------------------------------------------------------------------------------
# The class


_T = torch.Tensor
#: Runs a torch function with subclass dispatch off and returns its raw result (torch's C impl).
_run_plain: Callable[..., Any] = torch._C._disabled_torch_function_impl

#: How many ``__torch_dispatch__`` modes are on the stack (export's ``FakeTensorMode``, ...).
_dispatch_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack


def _for_modes(args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with each SafeSparseTensor replaced by a plain alias (handed out, as
    :func:`unwrap` does): a dispatch mode on the stack refuses subclasses it does not know
    (``FakeTensorMode`` describing an input for ``torch.export``), and a plain alias is what a
    plain sparse input would give it. Only called while a mode is active."""
    out = []
    for a in args:
        if isinstance(a, SafeSparseTensor):
            alias = torch.Tensor._make_subclass(torch.Tensor, a, False)
            writers.hand_out(a, alias)  # shares a's counter and carries its record
            a = alias
        out.append(a)
    return tuple(out)


def _inspect(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``func`` (an inspection: metadata or a member accessor) run by torch itself."""
    if _dispatch_depth():
        return _run_plain(func, (), _for_modes(args), kwargs)
    return _run_plain(func, (), args, kwargs)


#: Getters a SafeSparseTensor reads without the ``__torch_function__`` round trip.
_FAST_GETTERS = ("layout", "is_sparse", "is_sparse_csr", "shape", "dtype", "device", "ndim",
                 "is_cuda")


def _plain_getter(name: str) -> Callable[[torch.Tensor], Any]:
    getter = getattr(_T, name).__get__

    def get(self: torch.Tensor) -> Any:  # (metadata of the TensorImpl: no dispatch, no mode)
        return _run_plain(getter, (), (self,), {})

    get.__name__ = name
    return get


class SafeSparseTensor(torch.Tensor):
    """A torch sparse tensor (COO, CSR, CSC, BSR, BSC) that remembers it was checked.

    A real ``torch.Tensor`` subclass (``isinstance(t, torch.Tensor)``): every torch function
    and method works on it. Build one with the safe factories (``ss.sparse_csr_tensor`` ...),
    :func:`validate`, :func:`load` or :func:`from_scipy`; never call the class directly.

    Sparse results of operations are ``SafeSparseTensor`` again, strided results and member
    tensors (``values()``, ``crow_indices()`` ...) are plain tensors. A result is checked when
    the operation keeps the indices (transposes, clone, detach, dtype/device moves, value-only
    ops, scalar multiplication) of checked inputs, or when torch built new indices from checked
    inputs and validation has seen them; otherwise it is unchecked until :func:`validate` sees
    it. Writing to index data in place drops the checked state. The operation table (shared
    by subclasses) is read and changed through :meth:`classify`, :meth:`implements` and
    :meth:`op_table`; see docs/ops.md.
    """

    _ss: checked.Record  # its checked state (see safesparse.state.checked)
    _OPS: ClassVar[dict[Callable[..., Any], OpEntry]] = {}
    #: The fast path's handlers that apply now: those whose op still has the entry it had
    #: when safesparse finished registering its own (:func:`_freeze_fast_path`); an op a user
    #: re-registers runs through the general path and its new entry.
    _FAST: ClassVar[dict[Callable[..., Any], Any]] = {}
    _FAST_EXPECTED: ClassVar[dict[Callable[..., Any], OpEntry | None] | None] = None

    @classmethod
    def implements(
        cls, funcs: Iterable[Callable[..., Any]], kind: OpKind | Classifier = OpKind.UNKNOWN
    ) -> Callable[[F], F]:
        """Decorator registering ``impl(func, args, kwargs)`` for each of ``funcs``."""

        def register(impl: F) -> F:
            for func in funcs:
                cls._OPS[func] = OpEntry(kind, impl)
            cls._refresh_fast()
            return impl

        return register

    @classmethod
    def classify(cls, funcs: Iterable[Callable[..., Any]], kind: OpKind | Classifier) -> None:
        """Record the kind of each of ``funcs`` (torch's own implementation runs)."""
        for func in funcs:
            cls._OPS[func] = OpEntry(kind)
        cls._refresh_fast()

    @classmethod
    def op_table(cls) -> dict[Callable[..., Any], OpEntry]:
        """A copy of the table (func -> entry)."""
        return dict(cls._OPS)

    @classmethod
    def set_op_table(cls, table: dict[Callable[..., Any], OpEntry]) -> None:
        """Replace the whole table, e.g. with a copy taken by :meth:`op_table` earlier."""
        cls._OPS.clear()
        cls._OPS.update(table)
        cls._refresh_fast()

    @classmethod
    def _freeze_fast_path(cls) -> None:
        """safesparse's own op table is complete (called once, at import): the fast path
        applies to each op of :data:`safesparse.tensor.fastpath.FAST` while it keeps this entry."""
        cls._FAST_EXPECTED = {f: cls._OPS.get(f) for f in FAST}
        cls._refresh_fast()

    @classmethod
    def _refresh_fast(cls) -> None:
        expected = cls._FAST_EXPECTED
        active = {} if expected is None else {
            f: h for f, h in FAST.items() if cls._OPS.get(f) is expected[f]}
        cls._FAST.clear()
        cls._FAST.update(active)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # (bound by safesparse.base.compiling.bind below: torch.compile never traces it)
        try:
            fast = cls._FAST.get(func)
            if fast is not None and not kwargs:
                ret = fast(cls, func, types, args, _fast_fallback)
                if ret is not MISS:
                    return ret
            if func in INSPECTION:
                # Metadata and member accessors: no sparse result, no kernel over index data.
                ret = _inspect(func, args, kwargs or {})
                if func in INDEX_ACCESSORS and isinstance(args[0], SafeSparseTensor):
                    writers.hand_out(args[0], ret)  # it shares args[0]'s counter
                return ret
            return general(cls._OPS.get(func), func, tuple(args), kwargs or {})
        except Exception as err:  # (no cost unless raised: a frame skip while dynamo probes)
            skip = surface(err)
            if skip is not err:
                raise skip from err
            raise

    def values(self) -> torch.Tensor:
        """The values member (a plain tensor sharing this tensor's memory and counter), as
        ``torch.Tensor.values``; read without the ``__torch_function__`` round trip."""
        out: torch.Tensor = _inspect(_T.values, (self,), {})
        return out

    # Metadata that model code reads on every call (PyG reads ``layout`` and ``size()``
    # several times per layer): torch's own getters (_FAST_GETTERS, bound below), without the
    # ``__torch_function__`` round trip (they read no index data; SPEC 5: never validating).

    def size(self, dim: int | None = None) -> Any:
        return _run_plain(_T.size, (), (self,) if dim is None else (self, dim), {})

    def dim(self) -> int:
        out: int = _run_plain(_T.dim, (), (self,), {})
        return out

    if TYPE_CHECKING:  # what users chain on a SafeSparseTensor stays one, for type checkers
        def transpose(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def t(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def adjoint(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def swapaxes(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def swapdims(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def coalesce(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse_coo(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse_csr(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse_csc(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse_bsr(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to_sparse_bsc(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def clone(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def detach(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def to(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def cpu(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def cuda(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def double(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def float(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def half(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def bfloat16(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def contiguous(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def requires_grad_(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def mul(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def div(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def neg(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def abs(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def pow(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def sin(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def relu(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def __mul__(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def __rmul__(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def __truediv__(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def __neg__(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...
        def __pow__(self, *args: Any, **kwargs: Any) -> SafeSparseTensor: ...

        mT: SafeSparseTensor
        mH: SafeSparseTensor

    def __deepcopy__(self, memo: dict[int, Any]) -> SafeSparseTensor:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():
            out = self.clone()
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        """While enforce mode is on, exactly torch's text for the same tensor (an enforced
        program prints as without safesparse); otherwise ``SafeSparseTensor(checked=...,
        ...)``, naming the class and the checked state. Reads no sparse data through a
        kernel (see :mod:`safesparse.tensor.printing`)."""
        from ..base import enforce_flag as _enforcing
        from . import printing as _printing

        if _enforcing.is_enforced():
            return _printing.torch_text(self, tensor_contents)
        return _printing.safe_text(self, _is_checked(self), tensor_contents)


bind(SafeSparseTensor, "__torch_function__",
     SafeSparseTensor.__dict__["__torch_function__"].__func__, kind="classmethod")
for _name in _FAST_GETTERS:  # (torch.compile graph-breaks at them instead of tracing them)
    bind(SafeSparseTensor, _name, _plain_getter(_name), kind="property")
for _name in ("values", "size", "dim"):
    bind(SafeSparseTensor, _name, SafeSparseTensor.__dict__[_name])


def general(entry: OpEntry | None, func: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """The general path of ``__torch_function__`` (see the module docstring)."""
    # Everything below sees SafeSparseTensors as plain tensors: no re-entry from our own
    # attribute accesses, and torch's results come back unwrapped for us to wrap.
    with DisableTorchFunctionSubclass():
        debug = is_debug()
        if debug:
            _validate_inputs(func, args, kwargs)
            before = False
            inputs = sparse_inputs(args, kwargs)
        else:
            # The guard: every sparse input is checked (validated now if it was not)
            # before any kernel reads it; True when all of them are SafeSparseTensors.
            inputs = []
            before = guard(func, args, kwargs, inputs)
        for x in inputs:
            # the op (or its implementation) may build a tensor with a counter of its own on
            # x's index memory: x's record must be found by memory range from now on
            rec = checked.record(x)
            if rec is not None:
                writers.share(rec)
        if entry is not None and entry.impl is not None:
            return entry.impl(func, args, kwargs)
        kind = entry.kind_for(args, kwargs) if entry is not None else OpKind.UNKNOWN
        # Checked before the op ran (the guard) and, in wrap_results, after it: a write
        # landing while torch copies the index data never goes unnoticed.
        ret = func(*args, **kwargs)
        return wrap_results(func, kind, args, kwargs, ret, before=before, inputs=inputs)


def _fast_fallback(func: Callable[..., Any], args: tuple[Any, ...], ret: Any) -> Any:
    """A fast-path result that needs the general wrapping: its kind is the table's, and the
    input (the only sparse argument) was checked before the op ran."""
    with DisableTorchFunctionSubclass():
        rec = checked.record(args[0])
        if rec is not None:
            writers.share(rec)  # the result may share its memory
        entry = SafeSparseTensor._OPS.get(func)
        kind = entry.kind_for(args, {}) if entry is not None else OpKind.UNKNOWN
        return wrap_results(func, kind, args, {}, ret, before=True)


# ---------------------------------------------------------------------------------------------
# Wrapping, unwrapping and checked state


class ToSafeSparseTensor(torch.autograd.Function):
    """Identity from a plain sparse tensor to a SafeSparseTensor, keeping the graph."""

    @staticmethod
    def forward(ctx: Any, plain: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an undefined grad stays undefined (no sparse zeros)
        return torch.Tensor._make_subclass(SafeSparseTensor, plain, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


class _ToPlain(torch.autograd.Function):
    """Identity from a SafeSparseTensor to the plain torch tensor, keeping the graph."""

    @staticmethod
    def forward(ctx: Any, safe: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an undefined grad stays undefined (no sparse zeros)
        return torch.Tensor._make_subclass(torch.Tensor, safe, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


def retype(plain: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> SafeSparseTensor:
    """``plain`` itself, typed SafeSparseTensor: a result torch just made (no record yet).
    Same object, so its autograd graph and view relations stay torch's. A result that is one
    of the op's sparse ``inputs`` (a plain tensor the caller holds) is not retyped but wrapped
    (see :func:`wrap`): torch returns a pre-existing object only when it returns an input."""
    if type(plain) is torch.Tensor and all(plain is not x for x in inputs):
        plain.__class__ = SafeSparseTensor
        return cast(SafeSparseTensor, plain)
    if plain.requires_grad:
        out = ToSafeSparseTensor.apply(plain)  # type: ignore[no-untyped-call]
    else:
        out = torch.Tensor._make_subclass(SafeSparseTensor, plain, False)
    return cast(SafeSparseTensor, out)


def wrap(plain: torch.Tensor, *, leaf_requires_grad: bool = False,
         **_legacy: Any) -> SafeSparseTensor:
    """A SafeSparseTensor sharing ``plain``'s data, joined to the state of its index memory and
    watched there, not yet checked (see :mod:`safesparse.state.checked`). ``leaf_requires_grad``
    makes a new autograd leaf; a ``plain`` that requires grad stays connected to its graph.
    ``plain`` itself is never retyped (the caller may hold it): use :func:`retype` for that.
    """
    if plain.requires_grad:
        out = ToSafeSparseTensor.apply(plain)  # type: ignore[no-untyped-call]
    else:
        out = torch.Tensor._make_subclass(SafeSparseTensor, plain, leaf_requires_grad)
    assert isinstance(out, SafeSparseTensor)
    writers.join(out)
    return out


@not_traced
def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain ``torch.Tensor`` behind a :class:`SafeSparseTensor` (no copy).

    Useful to hand a tensor to code that checks ``type(t) is torch.Tensor``, or to save a
    state dict that loads without safesparse (see also ``ss.save``). The result shares storage
    with ``t``; writes through it are not seen by ``t``'s checked state, so treat it as
    read-only if ``t`` must stay trustworthy. Autograd stays connected: gradients flow back
    to ``t``.

    Args:
        t: any tensor; anything that is not a ``SafeSparseTensor`` is returned unchanged.

    Returns:
        The plain tensor sharing ``t``'s data, or ``t`` itself.
    """
    if not isinstance(t, SafeSparseTensor):
        return t
    if t.requires_grad:
        with DisableTorchFunctionSubclass():
            out: torch.Tensor = _ToPlain.apply(t)  # type: ignore[no-untyped-call]
    else:
        out = torch.Tensor._make_subclass(torch.Tensor, t, False)
    # shared first (the plain tensor can build tensors with counters of their own); it shares
    # t's counter, and carries t's record to keep the watch alive
    writers.hand_out(t, out)
    return out


def _revalidates(t: torch.Tensor) -> bool:
    """A full validation of a tensor whose index data cannot be watched (volatile)."""
    try:
        writers.validated_now(lambda: validate_tensor(t))
    except (InvariantError, RuntimeError):  # (RuntimeError: it changed while it was read)
        return False
    return True


def _is_checked(t: torch.Tensor) -> bool:
    """The rule (checked.py), volatile records validated now."""
    if not isinstance(t, SafeSparseTensor):
        return False
    now = checked.standing(t)
    return _revalidates(t) if now is None else now


@not_traced
def is_checked(t: torch.Tensor) -> TypeGuard[SafeSparseTensor]:
    """Whether ``t`` is a :class:`SafeSparseTensor` known to satisfy every invariant now.

    True only for a tensor that validation has seen (or that a known, index-preserving
    operation made from checked tensors) and whose index data has not been written since: the
    rule is in :mod:`safesparse.state.checked` and docs/ops.md. Plain torch tensors and unchecked
    ``SafeSparseTensor`` s (``check_invariants=False``, results of unknown operations, tensors
    whose indices were modified in place) give ``False``; :func:`validate` checks them.
    O(1), except for index data that cannot be watched (inference tensors, storage shared with
    other processes), which is validated on every call. Never raises.

    Args:
        t: any tensor.

    Returns:
        ``True`` if ``t`` is checked, else ``False``.
    """
    return _is_checked(t)


@not_traced
def validate(t: torch.Tensor, *, copy_indices: bool = True) -> SafeSparseTensor:
    """Validate ``t`` and return it as a checked :class:`SafeSparseTensor`.

    The way to adopt a sparse tensor built elsewhere (by torch, a library, a file), or to
    re-check one whose checked state was lost. A plain torch tensor is adopted on a copy of its
    index members (the result shares ``t``'s values and autograd graph): torch keeps the index
    tensors ``t`` was built from as its members (your ``col``, a view of an ``edge_index``), and
    their writes bump counters safesparse cannot see, so the result is built on memory only it
    can write. A ``SafeSparseTensor`` is checked in place and returned itself. A tensor that is
    already checked is not validated again (outside debug mode), so calling ``validate``
    defensively costs nothing.

    For a module parameter, validate the *detached* tensor and wrap it:
    ``layer.weight = nn.Parameter(ss.validate(layer.weight.detach()))`` (see docs/models.md).

    Args:
        t: a sparse tensor of any layout (COO, CSR, CSC, BSR, BSC), plain or
            ``SafeSparseTensor``, on any device.
        copy_indices: ``False`` adopts a plain ``t`` without copying its index members (the
            result shares all of ``t``'s storage). You then state that nothing but ``t`` and
            what safesparse hands out writes them: a write through the index tensors ``t`` was
            built from is not seen, and leaves the result reporting checked over the written
            data (docs/ops.md, Limitations). Index memory that cannot be watched at all (a file
            mapping, shared memory, inference tensors) is then validated whenever asked.

    Returns:
        The checked ``SafeSparseTensor``: ``t`` itself if it is one, else a new tensor sharing
        ``t``'s values (and, with ``copy_indices=False``, its index storage).

    Raises:
        InvariantError: ``t`` breaks an invariant; ``str(err)`` names it and where.
        TypeError: ``t`` is not a torch tensor (a SciPy matrix: use ``ss.from_scipy``), or is
            strided.
        RuntimeError: another thread kept writing ``t``'s index data while it was validated.
    """
    if not isinstance(t, torch.Tensor):
        hint = ("; for a SciPy sparse matrix use ss.from_scipy(m)"
                if type(t).__module__.startswith("scipy.sparse") else "")
        raise TypeError(
            f"validate() expects a torch sparse tensor, got {type(t).__name__}{hint}")
    if (isinstance(t, SafeSparseTensor) and checked.held(t) is not None
            and not is_debug()):  # checked: nothing to do (O(1))
        checked.count("skipped")
        return t
    with DisableTorchFunctionSubclass():
        if t.layout not in SPARSE_LAYOUTS:
            raise TypeError(f"validate() expects a sparse tensor, got layout {t.layout}")
        debug = is_debug()
        if not debug and _is_checked(t):
            checked.count("skipped")
            return t  # type: ignore[return-value]
        if isinstance(t, SafeSparseTensor):
            out, watched = t, True
        elif copy_indices and copyable(t):
            # index members of its own (SPEC 4): only out's counter can write them
            out, watched = retype(own_indices(t)), True
            writers.fresh(out)
        else:
            if copy_indices:  # (members torch's checker refuses as laid out: validated as
                validate_into(wrap(t), debug, watched=False)  # they are, then copied)
                out = retype(own_indices(t))
                watched = True
                writers.fresh(out)
            else:
                out, watched = wrap(t), False
                writers.hand_out(out, t)  # t shares out's counter, and may outlive it
        validate_into(out, debug, watched=watched)
    return out


def validate_into(out: SafeSparseTensor, debug: bool = False, op: str | None = None, *,
                  watched: bool = True) -> None:
    """Validate ``out`` and record it as checked (:func:`safesparse.state.admission.revalidate`);
    ``op`` names the op in the error. ``watched=False``: ``out`` was only just wrapped, so
    writes through its counter before that went unseen."""
    try:
        writers.revalidate(out, lambda full: validate_tensor(out, check_indices=full),
                           debug=debug, watched=watched)
    except InvariantError as err:
        raise (err if op is None else err.with_context(op=op)) from None


def _is_sparse(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.layout in SPARSE_LAYOUTS


def sparse_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Every sparse tensor among the arguments (plain or SafeSparseTensor), one level deep,
    in the order of :func:`_sparse_args`."""
    return [x for _, x in _sparse_args(args, kwargs)]


def _sparse_args(args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every sparse argument, one level deep (as :func:`sparse_inputs`);
    the name is the position (``0``, ``1[2]``) or the keyword."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.layout in SPARSE_LAYOUTS:
                yield str(i), a
        elif isinstance(a, (list, tuple)):
            for j, x in enumerate(a):
                if _is_sparse(x):
                    yield f"{i}[{j}]", x
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            if v.layout in SPARSE_LAYOUTS:
                yield k, v
        elif isinstance(v, (list, tuple)):  # torch.cat(tensors=[...])
            for j, x in enumerate(v):
                if _is_sparse(x):
                    yield f"{k}[{j}]", x


def guard(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          found: list[torch.Tensor] | None = None) -> bool:
    """The guard (SPEC 5): every sparse argument of ``func`` that is not checked is validated
    now (remembered while its data is unchanged), before any torch kernel reads it.
    ``found``, if given, receives every sparse argument (as :func:`sparse_inputs` lists them),
    so the caller does not walk the arguments a second time.

    Returns:
        Whether every sparse argument is a SafeSparseTensor (all of them checked now); False
        when there is none, or a plain one (a result is never more trusted than its inputs).

    Raises:
        InvariantError: an argument is invalid; the error names the operation and the
            argument, and ``func`` has not run.
    """
    safe = plain = False
    for name, x in _sparse_args(args, kwargs):
        if found is not None:
            found.append(x)
        if isinstance(x, SafeSparseTensor):
            safe = True
            if _is_checked(x):
                continue
            where = f"{op_name(func)}, argument {name}"
            try:
                validate_into(x, False, where)
            except InvariantError as err:
                raise err.with_context(op=where) from None
        else:
            plain = True
            _guard_plain(func, name, x)
    return safe and not plain


def _guard_plain(func: Callable[..., Any], name: str, x: torch.Tensor) -> None:
    """A plain sparse argument: validated now, every time (nothing is remembered). Its members
    may be index tensors the caller holds, which torch kept as they are, each with a version
    counter no public API reaches from ``x`` (docs/ops.md): a write through one of them bumps
    nothing safesparse can see, so no earlier validation of ``x`` can be trusted (SPEC 4,
    ``ss.validate``). Adopt it (``ss.validate``, the safe factories) to validate it once."""
    try:
        writers.validated_now(lambda: validate_tensor(x))
    except InvariantError as err:
        raise err.with_context(op=f"{op_name(func)}, argument {name}") from None


def _inputs_checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every sparse input is a checked SafeSparseTensor (a plain one never is)."""
    inputs = sparse_inputs(args, kwargs)
    return bool(inputs) and all(_is_checked(x) for x in inputs)


def _validate_inputs(func: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
    """Debug mode: every sparse input is validated before the op runs, cache ignored."""
    for t in sparse_inputs(args, kwargs):
        if isinstance(t, SafeSparseTensor):
            validate_into(t, True, op_name(func))  # and it is checked from now on
            continue
        try:
            writers.validated_now(lambda t=t: validate_tensor(t))  # type: ignore[misc]
        except InvariantError as err:
            raise err.with_context(op=op_name(func)) from None


def wrap_results(
    func: Callable[..., Any],
    kind: OpKind,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ret: Any,
    geometry: Hashable | None = None,
    *,
    before: bool = True,
    inputs: list[torch.Tensor] | None = None,
    views: bool = False,
) -> Any:
    """Re-wrap the sparse tensors in ``ret`` and give them their checked state.

    ``geometry``: that of a single sparse result, when the op knows it (a transpose keeps its
    input's). ``before``: whether every sparse input was checked before the op ran (the
    caller knows; results that share storage with their inputs need only the check after).
    ``inputs``: ``sparse_inputs(args, kwargs)``, if the caller has it. ``views``: a result
    that is a view of its input (``_is_view()``) is returned as that very object, typed
    ``SafeSparseTensor``, so that ``_is_view()`` and ``_base`` are torch's."""
    if inputs is None:
        inputs = sparse_inputs(args, kwargs)
    if isinstance(ret, torch.Tensor):
        return _wrap_one(func, kind, args, inputs, ret, geometry, before, views)
    if isinstance(ret, (tuple, list)):
        return type(ret)(
            _wrap_one(func, kind, args, inputs, r, None, before, views)
            if isinstance(r, torch.Tensor) else r for r in ret)
    return ret


def _wrap_one(
    func: Callable[..., Any],
    kind: OpKind,
    args: tuple[Any, ...],
    inputs: list[torch.Tensor],
    ret: torch.Tensor,
    geometry: Hashable | None,
    before: bool,
    views: bool = False,
) -> torch.Tensor:
    if ret.layout not in SPARSE_LAYOUTS:
        return ret
    debug = is_debug()
    # A preserving result is trusted only if its inputs are checked after the op too (an
    # in-place op's own target moved its counter itself); a NEW_INDICES result is validated
    # anyway, so the guard's check before the op is all it needs (one lookup per input).
    if debug or not before or kind is OpKind.UNKNOWN or not inputs:
        trusted = False
    elif kind is OpKind.PRESERVING:
        trusted = all(_is_checked(x) for x in inputs if x is not ret)
    else:
        trusted = True
    if isinstance(ret, SafeSparseTensor):  # an in-place op, or one returning an input as is
        if not _mutates(func):
            return ret  # (e.g. ``t.to(t.dtype)``): nothing was written, its state stands
        if debug:
            validate_into(ret, True, op_name(func))
        elif kind is OpKind.NEW_INDICES:  # (its inputs passed the guard)
            validate_into(ret, False, op_name(func))
        else:
            after_inplace(ret, keeps_indices=trusted and kind is OpKind.PRESERVING)
        return ret
    if views and type(ret) is torch.Tensor and ret._is_view():
        # torch's own view object, retyped (_make_subclass would detach it from its base)
        ret.__class__ = SafeSparseTensor
        out = cast(SafeSparseTensor, ret)
    else:
        out = retype(ret, inputs)
    rec = writers.join(out)
    if debug or kind is OpKind.NEW_INDICES:
        # torch built the index data from inputs the guard passed (plain ones included):
        # validated, repaired or refused here rather than at its first use
        return _validated_result(func, out, debug)
    if trusted and kind is OpKind.PRESERVING and _metadata_kept(args, out):
        writers.mark_derived(rec, _geometry(args, out) if geometry is None else geometry)
    return out


def after_inplace(t: torch.Tensor, keeps_indices: bool) -> None:
    """``t`` ran an in-place op. One known to keep index data valid (a values-only op from the
    table, on a checked ``t``) re-arms ``t``'s own counter if everything else still holds; any
    other gives ``t`` a new, unchecked record on its current members (the op may have replaced
    them; views sharing the old record are left to its counter)."""
    rec = checked.record(t)
    if keeps_indices and rec is not None and rec is writers.current(t) and writers.rearm(rec):
        return
    writers.renew(t)


def _geometry(args: tuple[Any, ...], out: torch.Tensor) -> Hashable:
    """The geometry of a preserving op's result: its (compressed) input's when the shape and
    layout are the same (the index data is the input's), else computed."""
    first = args[0] if args else None
    if (isinstance(first, SafeSparseTensor) and first.layout == out.layout != torch.sparse_coo
            and first.shape == out.shape):
        return checked.proven_geometry(first)
    return geometry_of(out)


def _metadata_kept(args: tuple[Any, ...], out: torch.Tensor) -> bool:
    """A preserving op that moved the data to another device or dtype: the O(1) metadata
    checks (e.g. 4.1 refuses ``meta``) still have to pass."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is not None and first.device == out.device and first.dtype == out.dtype:
        return True
    try:
        validate_tensor(out, check_indices=False)
    except InvariantError:
        return False
    return True


#: Repairs for results torch builds wrongly, by the invariant they break: ``repair(t)``
#: returns a tensor equal to what ``t`` means, or None (ops.py registers them). The repaired
#: tensor is validated again.
REPAIRS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {}


def _validated_result(func: Callable[..., Any], out: SafeSparseTensor,
                      debug: bool) -> SafeSparseTensor:
    """A result whose index data torch built: checked only once validation has seen it. An
    invalid one is repaired where a repair for its broken invariant exists, else refused."""
    try:
        validate_into(out, debug, op_name(func))
    except InvariantError as err:
        repair = REPAIRS.get(err.invariant) if err.layout == out.layout else None
        fixed = repair(out) if repair is not None else None
        if fixed is None:
            raise err.with_context(
                op=f"{op_name(func)}: torch built this result; it is not returned") from None
        out = retype(fixed)
        writers.join(out)
        validate_into(out, debug, op_name(func))
    return out



__all__ = [
    "REPAIRS",
    "OpEntry",
    "OpKind",
    "SafeSparseTensor",
    "after_inplace",
    "compressed_geometry",
    "general",
    "geometry_of",
    "index_members",
    "is_checked",
    "op_name",
    "retype",
    "sparse_inputs",
    "unwrap",
    "validate",
    "validate_into",
    "wrap",
    "wrap_results",
]

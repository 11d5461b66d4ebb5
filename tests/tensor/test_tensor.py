"""SafeSparseTensor and its op table (docs/ops.md).

Sparse results of torch functions are SafeSparseTensor, strided results and members are plain
tensors. PRESERVING results of checked inputs are checked without a validation; NEW_INDICES
results are validated first; UNKNOWN results are unchecked. The op table list in docs/ops.md is
generated from the table (``python tests/tensor/test_tensor.py`` rewrites it) and a test keeps
the two equal.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from torch._C import DisableTorchFunctionSubclass

import safesparse as ss
from safesparse import OpKind, SafeSparseTensor

T = torch.Tensor
CSR = torch.sparse_csr
DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"
START, END = "<!-- optable:start -->", "<!-- optable:end -->"


def build_csr(**kwargs: Any) -> ss.SafeSparseTensor:
    return ss.sparse_csr_tensor(
        torch.tensor([0, 2, 3, 4]), torch.tensor([0, 2, 1, 2]),
        torch.tensor([1.0, -2.0, 3.0, 4.0]), (3, 3), **kwargs,
    )


def build_coo(**kwargs: Any) -> ss.SafeSparseTensor:
    return ss.sparse_coo_tensor(
        torch.tensor([[0, 1, 1, 2], [2, 0, 2, 1]]), torch.tensor([1.0, -2.0, 3.0, 4.0]),
        (3, 3), **kwargs,
    )


@pytest.fixture
def t() -> ss.SafeSparseTensor:
    out = build_csr()
    ss.reset_stats()
    return out


@pytest.fixture(params=["CSR", "COO"])
def s(request: pytest.FixtureRequest) -> ss.SafeSparseTensor:
    """A checked CSR or COO tensor."""
    out = build_csr() if request.param == "CSR" else build_coo()
    ss.reset_stats()
    return out


@contextlib.contextmanager
def op_table_restored() -> Iterator[dict[Any, Any]]:
    """Extend the (class-level) op table inside the block; the original comes back after it."""
    saved = SafeSparseTensor.op_table()
    try:
        yield saved
    finally:
        SafeSparseTensor.set_op_table(saved)


@pytest.fixture
def restore_op_table() -> Iterator[dict[Any, Any]]:
    with op_table_restored() as saved:
        yield saved


# ---------------------------------------------------------------------------------------------
# The class


def test_is_a_tensor_subclass(t: ss.SafeSparseTensor) -> None:
    assert isinstance(t, torch.Tensor)
    assert type(t) is SafeSparseTensor
    assert t.layout == CSR
    assert t.shape == (3, 3)


def test_repr_names_class_and_state(t: ss.SafeSparseTensor) -> None:
    text = repr(t)
    assert "SafeSparseTensor" in text
    assert "checked=True" in text
    assert "sparse_csr" in text
    u = build_csr(check_invariants=False)
    assert "checked=False" in repr(u)


def test_repr_of_a_parameter_reads_as_one_call(t: ss.SafeSparseTensor) -> None:
    p = torch.nn.Parameter(t)
    text = repr(p)
    assert text.startswith("Parameter(SafeSparseTensor(checked=True, crow_indices=")
    assert text.count("SafeSparseTensor(") == 1  # not SafeSparseTensor(..., Parameter(...))
    assert text.endswith("requires_grad=True))")


def test_grad_fn_of_a_wrapped_tensor_has_a_public_name() -> None:
    dense = torch.eye(2, requires_grad=True)
    a = ss.validate(dense.to_sparse_csr())
    assert a.grad_fn is not None
    assert a.grad_fn.name() == "ToSafeSparseTensorBackward"
    assert not type(a.grad_fn).__name__.startswith("_")


def test_deepcopy_is_checked_with_separate_storage(t: ss.SafeSparseTensor) -> None:
    c = copy.deepcopy(t)
    assert type(c) is SafeSparseTensor
    assert ss.is_checked(c)
    assert torch.equal(c.to_dense(), t.to_dense())
    assert c.values().data_ptr() != t.values().data_ptr()
    assert c.col_indices().data_ptr() != t.col_indices().data_ptr()
    assert c.crow_indices().data_ptr() != t.crow_indices().data_ptr()
    c.values().mul_(0)
    assert t.to_dense().abs().sum() > 0
    assert ss.stats().validations == 0


def test_deepcopy_inside_containers_keeps_identity(t: ss.SafeSparseTensor) -> None:
    a, b = copy.deepcopy([t, t])
    assert a is b
    assert ss.is_checked(a)


# ---------------------------------------------------------------------------------------------
# Strided results and members are plain tensors


def _dense(n: int = 2) -> torch.Tensor:
    return torch.arange(3.0 * n).reshape(3, n)


STRIDED_OPS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("torch.mm", lambda t: torch.mm(t, _dense())),
    ("matmul operator", lambda t: t @ _dense()),
    ("torch.matmul", lambda t: torch.matmul(t, _dense())),
    ("torch.sparse.mm", lambda t: torch.sparse.mm(t, _dense())),
    ("torch.addmm", lambda t: torch.addmm(torch.ones(3, 2), t, _dense())),
    ("to_dense", lambda t: t.to_dense()),
    ("values", lambda t: t.values()),
    ("crow_indices", lambda t: t.crow_indices()),
    ("col_indices", lambda t: t.col_indices()),
    ("sum", lambda t: t.sum()),
]


@pytest.mark.parametrize(("name", "fn"), STRIDED_OPS, ids=[n for n, _ in STRIDED_OPS])
def test_strided_results_are_plain(
    t: ss.SafeSparseTensor, name: str, fn: Callable[[torch.Tensor], Any]
) -> None:
    out = fn(t)
    assert type(out) is torch.Tensor
    assert out.layout == torch.strided
    expected = fn(ss.unwrap(t))
    assert torch.equal(out, expected)
    assert ss.stats().validations == 0


def test_spmm_equals_plain_torch(t: ss.SafeSparseTensor) -> None:
    x = torch.randn(3, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    plain = torch.sparse_csr_tensor(t.crow_indices(), t.col_indices(), t.values(), t.shape,
                                    check_invariants=True)
    for out in (t @ x, torch.mm(t, x), torch.sparse.mm(t, x)):
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, plain @ x, rtol=0, atol=0)
    torch.testing.assert_close(t @ x, t.to_dense() @ x)


def test_coo_spmm_equals_plain_torch() -> None:
    c = build_coo()
    x = torch.randn(3, 4)
    out = c @ x
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, ss.unwrap(c) @ x, rtol=0, atol=0)


def test_member_writes_reach_the_tensor(t: ss.SafeSparseTensor) -> None:
    values = t.values()
    assert type(values) is torch.Tensor
    assert values.data_ptr() == ss.unwrap(t).values().data_ptr()


# ---------------------------------------------------------------------------------------------
# Sparse results: wrapped, and checked by kind

PRESERVING_OPS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("clone", lambda t: t.clone()),
    ("torch.clone", lambda t: torch.clone(t)),
    ("detach", lambda t: t.detach()),
    ("to_float64", lambda t: t.to(torch.float64)),
    ("double", lambda t: t.double()),
    ("to_cpu", lambda t: t.to("cpu")),
    ("neg_operator", lambda t: -t),
    ("neg", lambda t: t.neg()),
    ("abs", lambda t: t.abs()),
    ("torch.abs", lambda t: torch.abs(t)),
    ("mul_scalar", lambda t: t * 2),
    ("rmul_scalar", lambda t: 2 * t),
    ("mul_0d_tensor", lambda t: t * torch.tensor(3.0)),
    ("torch.mul_scalar", lambda t: torch.mul(t, 2)),
    ("div_scalar", lambda t: t / 2),
    ("relu", lambda t: t.relu()),
    ("square", lambda t: torch.square(t)),
    ("transpose", lambda t: t.transpose(0, 1)),
    ("mT", lambda t: t.mT),
]

NEW_INDEX_OPS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("add", lambda t: t + t),
    ("torch.add", lambda t: torch.add(t, t)),
    ("sub", lambda t: t - t * 2),
    ("mul_sparse", lambda t: t * t),
    ("sparse_matmul", lambda t: t @ t),
    ("torch.sparse.mm_sparse", lambda t: torch.sparse.mm(t, t)),
    ("to_sparse_coo", lambda t: t.to_sparse_coo()),
    ("to_sparse_coo_coalesce", lambda t: t.to_sparse_coo().coalesce()),
    ("to_sparse_csc", lambda t: t.to_sparse_csc()),
    ("to_sparse_bsr", lambda t: t.to_sparse_bsr((1, 1))),
    ("to_sparse_bsc", lambda t: t.to_sparse_bsc((1, 1))),
    ("to_sparse_csr", lambda t: t.to_sparse_csr()),
]

UNKNOWN_OPS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("torch.zeros_like", lambda t: torch.zeros_like(t)),
    ("zero_", lambda t: t.clone().zero_()),
    ("torch.sparse.softmax", lambda t: torch.sparse.softmax(t, 1)),
    ("float_power", lambda t: t.float_power(2)),
]


def _run_like_torch(t: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn(t)``; where torch itself refuses ``fn`` on the plain tensor, the wrapper must raise
    the same error type and the test stops there."""
    try:
        with DisableTorchFunctionSubclass():
            fn(ss.unwrap(t))
    except (RuntimeError, NotImplementedError) as err:
        with pytest.raises(type(err)):
            fn(t)
        skip_unsupported(t.layout, err)
    return fn(t)


def skip_unsupported(layout: object, err: BaseException) -> NoReturn:
    """Skip: torch refuses the op. The reason is the first line of torch's error, shortened:
    torch's dispatcher errors list every registered kernel (~40 lines), which would flood the
    summary that ``pytest -ra`` prints."""
    text = str(err).strip() or type(err).__name__
    first = text.splitlines()[0].split(". ")[0]
    pytest.skip(f"torch does not support this on {layout}: {first[:80]}")


def test_skip_reasons_are_one_short_line() -> None:
    err = NotImplementedError("Could not run 'aten::foo' with arguments from the 'SparseCsrCPU'"
                              " backend. This could be because ...\n" + "Kernel: x\n" * 40)
    with pytest.raises(pytest.skip.Exception) as info:
        skip_unsupported(torch.sparse_csr, err)
    reason = str(info.value)
    assert "\n" not in reason and len(reason) <= 140 and "This could be" not in reason
    assert reason.startswith("torch does not support this on torch.sparse_csr: Could not run")


def _check_sparse_result(out: Any, t: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
    assert type(out) is SafeSparseTensor
    assert out.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                          torch.sparse_bsr, torch.sparse_bsc)
    with DisableTorchFunctionSubclass():
        expected = fn(ss.unwrap(t))
    assert torch.equal(out.to_dense(), expected.to_dense())


@pytest.mark.parametrize(("name", "fn"), PRESERVING_OPS, ids=[n for n, _ in PRESERVING_OPS])
def test_preserving_ops_are_checked_without_validation(
    s: ss.SafeSparseTensor, name: str, fn: Callable[[torch.Tensor], Any]
) -> None:
    out = _run_like_torch(s, fn)
    _check_sparse_result(out, s, fn)
    assert ss.is_checked(out)
    assert ss.stats().validations == 0
    assert ss.is_checked(s)


@pytest.mark.parametrize(("name", "fn"), NEW_INDEX_OPS, ids=[n for n, _ in NEW_INDEX_OPS])
def test_new_index_ops_are_validated_then_checked(
    s: ss.SafeSparseTensor, name: str, fn: Callable[[torch.Tensor], Any]
) -> None:
    # torch built the result's index data: it is checked only once validation has seen it
    out = _run_like_torch(s, fn)
    _check_sparse_result(out, s, fn)
    assert ss.is_checked(out)
    # validated, or built on index data validation already proved (the same storage), or
    # the input itself (to_sparse_csr of a CSR tensor)
    assert out is s or ss.stats().validations + ss.stats().skipped >= 1


@pytest.mark.parametrize(("name", "fn"), PRESERVING_OPS + NEW_INDEX_OPS,
                         ids=[n for n, _ in PRESERVING_OPS + NEW_INDEX_OPS])
@pytest.mark.parametrize("layout", ["CSR", "COO"])
def test_unchecked_inputs_are_validated_by_the_guard(
    name: str, fn: Callable[[torch.Tensor], Any], layout: str
) -> None:
    # the guard validates an unchecked input before the op runs: it is checked from then on
    u = (build_csr if layout == "CSR" else build_coo)(check_invariants=False)
    assert not ss.is_checked(u)
    out = _run_like_torch(u, fn)
    assert ss.is_checked(u)
    assert ss.stats().validations >= 1
    assert ss.is_checked(out)
    _check_sparse_result(out, u, fn)


@pytest.mark.parametrize(("name", "fn"), UNKNOWN_OPS, ids=[n for n, _ in UNKNOWN_OPS])
def test_unknown_ops_give_unchecked_safe_sparse_tensors(
    s: ss.SafeSparseTensor, name: str, fn: Callable[[torch.Tensor], Any]
) -> None:
    out = _run_like_torch(s, fn)
    assert type(out) is SafeSparseTensor
    assert not ss.is_checked(out)
    assert ss.stats().validations == 0
    _check_sparse_result(out, s, fn)  # the guard validates ``out`` on its first use
    assert ss.is_checked(out)


def test_mixed_checked_and_unchecked_inputs_are_all_checked_first(
    t: ss.SafeSparseTensor,
) -> None:
    u = build_csr(check_invariants=False)
    out = t + u  # the guard validated u: every input is a checked SafeSparseTensor
    assert type(out) is SafeSparseTensor
    assert ss.is_checked(u) and ss.is_checked(out)


def test_coo_coalesce_and_ops() -> None:
    c = build_coo()
    ss.reset_stats()
    for out in (c.coalesce(), c * 2, -c, c + c, c.to_sparse_csr(), c.t()):
        assert type(out) is SafeSparseTensor
        assert ss.is_checked(out)
    assert ss.stats().validations == 3  # coalesce, add and to_sparse_csr build new indices
    co = c.coalesce()
    assert co.is_coalesced()
    assert torch.equal(co.to_dense(), ss.unwrap(c).to_dense())


def test_plain_torch_kernel_on_plain_member_results(t: ss.SafeSparseTensor) -> None:
    # A dense operand first: the sparse tensor is still seen by __torch_function__.
    x = torch.ones(2, 3)
    out = x @ t
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, x @ t.to_dense())


def test_dtype_and_grad_helpers_preserve_state(t: ss.SafeSparseTensor) -> None:
    r = t.requires_grad_()
    assert r is t
    assert t.requires_grad
    assert ss.is_checked(t)
    d = t.detach()
    assert not d.requires_grad
    assert ss.is_checked(d)
    for out in (t.float(), t.double(), t.to(torch.float64), t.to(dtype=torch.float16)):
        assert type(out) is SafeSparseTensor
        assert ss.is_checked(out)
    assert ss.stats().validations == 0


# ---------------------------------------------------------------------------------------------
# In place


def test_inplace_table_op_keeps_checked(t: ss.SafeSparseTensor) -> None:
    dense = t.to_dense()
    out = t.mul_(2)
    assert out is t
    assert ss.is_checked(t)
    t *= 0.5
    t.abs_()
    assert ss.is_checked(t)
    assert torch.equal(t.to_dense(), dense.abs())
    assert ss.stats().validations == 0


def test_values_write_drops_state_and_revalidates(t: ss.SafeSparseTensor) -> None:
    # Documented limitation (docs/ops.md): torch 2.13 gives the member aliases one version
    # counter with the sparse tensor, so a values write looks like an index write.
    t.values()[0] = 10.0
    assert not ss.is_checked(t)
    assert ss.validate(t) is t
    assert ss.is_checked(t)
    assert ss.stats().validations == 1
    assert t.to_dense()[0, 0] == 10.0


# ---------------------------------------------------------------------------------------------
# One row per op


def test_one_explicit_call_registers_the_builtin_rows(
        restore_op_table: dict[Any, Any], t: ss.SafeSparseTensor) -> None:
    """safesparse's own table is what register_builtin_ops registers, rows whole (kind, impl,
    fast handler, product kind); the fast path's handlers are read off those rows."""
    from safesparse.tensor import ops

    fast = dict(SafeSparseTensor._FAST)
    SafeSparseTensor.set_op_table({})
    assert SafeSparseTensor._FAST == {}  # (no row, no fast handler)
    ops.register_builtin_ops(SafeSparseTensor)
    assert SafeSparseTensor.op_table() == restore_op_table == ops.builtin_rows()
    assert SafeSparseTensor._FAST == fast == {
        f: row.fast for f, row in restore_op_table.items() if row.fast is not None}
    assert ss.is_checked(t * 2) and ss.is_checked(t.mT)


def test_product_rows_are_the_bound_product_functions() -> None:
    """Every product function has a row with the kind of its product route's result, and
    arguments binding.py knows how to bind; and nothing else has a product kind."""
    from safesparse.tensor.binding import SIGNATURES

    products = {f for f, row in SafeSparseTensor.op_table().items() if row.product is not None}
    assert products == set(SIGNATURES)
    assert SafeSparseTensor.op_table()[torch.Tensor.__rmatmul__].product is OpKind.UNKNOWN


def test_inspection_rows_read_no_index_data() -> None:
    """The dispatcher's sets of inspection functions and index accessors are read off one row
    per function, and none of them is in the op table."""
    from safesparse.tensor import optable

    rows = optable.INSPECTION_ROWS
    assert set(rows) == optable.INSPECTION
    assert {f for f, row in rows.items() if row.hands_out} == optable.INDEX_ACCESSORS
    assert torch.Tensor.col_indices in optable.INDEX_ACCESSORS
    assert torch.Tensor.values not in optable.INDEX_ACCESSORS
    assert not optable.INSPECTION & set(SafeSparseTensor.op_table())


# ---------------------------------------------------------------------------------------------
# Extending the op table


def test_classify_a_new_op(restore_op_table: dict[Any, Any], t: ss.SafeSparseTensor) -> None:
    assert not ss.is_checked(torch.zeros_like(t))
    SafeSparseTensor.classify([torch.zeros_like], OpKind.NEW_INDICES)
    assert torch.zeros_like in SafeSparseTensor.op_table()
    out = torch.zeros_like(t)
    assert type(out) is SafeSparseTensor
    assert ss.is_checked(out)
    torch.testing.assert_close(out.to_dense(), torch.zeros_like(t.to_dense()))
    assert ss.stats().validations == 1


def test_classify_with_a_classifier(
    restore_op_table: dict[Any, Any], t: ss.SafeSparseTensor
) -> None:
    seen: list[tuple[Any, ...]] = []

    def classifier(args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpKind:
        seen.append(args)
        return OpKind.NEW_INDICES if kwargs.get("trust", True) else OpKind.UNKNOWN

    SafeSparseTensor.classify([torch.zeros_like], classifier)
    assert ss.is_checked(torch.zeros_like(t))
    assert len(seen) == 1 and seen[0][0] is t


def test_implements_decorator(restore_op_table: dict[Any, Any], t: ss.SafeSparseTensor) -> None:
    from safesparse.tensor.core import wrap_results

    calls: list[str] = []

    @SafeSparseTensor.implements([torch.zeros_like], OpKind.NEW_INDICES)
    def zeros_like(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append(func.__name__)
        assert type(args[0]) is SafeSparseTensor  # the impl gets the wrapper itself
        return wrap_results(func, OpKind.NEW_INDICES, args, kwargs, func(*args, **kwargs))

    assert zeros_like.__name__ == "zeros_like"  # the decorator returns the function
    out = torch.zeros_like(t)
    assert calls == ["zeros_like"]
    assert type(out) is SafeSparseTensor
    assert ss.is_checked(out)
    entry = SafeSparseTensor.op_table()[torch.zeros_like]
    assert entry.impl is zeros_like
    assert entry.kind is OpKind.NEW_INDICES


def test_restoring_the_table() -> None:
    before = SafeSparseTensor.op_table()
    with op_table_restored():
        SafeSparseTensor.classify([torch.zeros_like], OpKind.NEW_INDICES)
        SafeSparseTensor.classify([T.clone], OpKind.UNKNOWN)
        assert ss.is_checked(torch.zeros_like(build_csr()))
        assert not ss.is_checked(build_csr().clone())
    assert SafeSparseTensor.op_table() == before
    assert torch.zeros_like not in SafeSparseTensor.op_table()
    assert not ss.is_checked(torch.zeros_like(build_csr()))
    assert ss.is_checked(build_csr().clone())


def test_op_table_returns_a_copy() -> None:
    table = SafeSparseTensor.op_table()
    table.clear()
    assert SafeSparseTensor.op_table()


# ---------------------------------------------------------------------------------------------
# The generated list in docs/ops.md


def op_label(func: Any) -> str:
    """A stable, readable name for an op-table key."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and hasattr(owner, "__objclass__"):
        return f"Tensor.{owner.__name__}"  # a property getter, e.g. Tensor.mT
    name = getattr(func, "__name__", None)
    if name is None:
        return repr(func)
    for attr in dir(torch.sparse):
        if getattr(torch.sparse, attr, None) is func:
            return f"torch.sparse.{attr}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', '?')}.{name}"


def _callable_label(fn: Any) -> str:
    return f"`{fn.__module__}.{fn.__qualname__}`"


def render_op_table() -> str:
    """The Markdown list between the optable markers of docs/ops.md."""
    groups: dict[tuple[int, str], list[str]] = {}
    order = {OpKind.PRESERVING: 0, OpKind.NEW_INDICES: 2, OpKind.UNKNOWN: 3}
    for func, entry in SafeSparseTensor.op_table().items():
        if isinstance(entry.kind, OpKind):
            rank, head = order[entry.kind], f"**{entry.kind.value}**"
        else:
            rank, head = 1, f"**decided per call** by {_callable_label(entry.kind)}"
        if entry.impl is not None:
            head += f", implemented by {_callable_label(entry.impl)}"
        groups.setdefault((rank, head), []).append(op_label(func))
    lines = []
    for (_, head), labels in sorted(groups.items()):
        lines.append(f"- {head}: {', '.join(f'`{x}`' for x in sorted(set(labels)))}")
    return "\n".join(lines)


def doc_op_table(text: str) -> str:
    match = re.search(re.escape(START) + r"(.*?)" + re.escape(END), text, re.DOTALL)
    assert match, f"docs/ops.md has no {START} ... {END} section"
    return match.group(1).strip()


def write_doc_op_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    doc_op_table(text)  # the markers exist
    new = re.sub(re.escape(START) + r".*?" + re.escape(END),
                 lambda _: f"{START}\n{render_op_table()}\n{END}", text, flags=re.DOTALL)
    DOC.write_text(new, encoding="utf-8")


def test_op_labels_are_unique() -> None:
    labels = [op_label(f) for f in SafeSparseTensor.op_table()]
    assert len(labels) == len(set(labels)), sorted(labels)
    assert "Tensor.mT" in labels and "Tensor.mH" in labels
    assert "torch.sparse.mm" in labels


def test_docs_list_the_op_table() -> None:
    documented = doc_op_table(DOC.read_text(encoding="utf-8"))
    assert documented == render_op_table(), (
        "docs/ops.md is out of date with the op table; regenerate it with "
        "`PYTHONPATH=. python tests/tensor/test_tensor.py`"
    )


if __name__ == "__main__":  # regenerate the list: PYTHONPATH=. python tests/tensor/test_tensor.py
    write_doc_op_table()
    print(f"updated {DOC}")


# ---------------------------------------------------------------------------------------------
# Every values-only op of the table, in every form it has


def _values_only_forms() -> list[Any]:
    from safesparse.tensor.ops import VALUES_ONLY

    forms = []
    for name in VALUES_ONLY:
        for label, fn in ((f"torch.{name}", getattr(torch, name, None)),
                          (f"Tensor.{name}", getattr(torch.Tensor, name, None)),
                          (f"Tensor.{name}_", getattr(torch.Tensor, name + "_", None))):
            if fn is not None:
                forms.append(pytest.param(fn, label.endswith("_"), id=label))
    return forms


@pytest.mark.parametrize("layout", ["CSR", "COO"])
@pytest.mark.parametrize(("fn", "inplace"), _values_only_forms())
def test_every_values_only_op_is_preserving(fn: Any, inplace: bool, layout: str) -> None:
    dense = torch.tensor([[0.0, 0.25, 0.0], [0.4, 0.0, 0.1], [0.0, 0.3, 0.0]])
    t = ss.validate(dense.to_sparse_csr() if layout == "CSR" else dense.to_sparse().coalesce())
    assert fn in SafeSparseTensor.op_table()
    plain = ss.unwrap(t).clone()
    try:
        with DisableTorchFunctionSubclass():
            expected = fn(plain)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        with pytest.raises(type(err)):
            fn(t)
        skip_unsupported(layout, err)
    ss.reset_stats()
    out = fn(t)
    assert type(out) is SafeSparseTensor
    assert out is t or not inplace  # (positive, conj_physical of real values: t itself)
    assert ss.is_checked(out)
    assert ss.stats().validations == 0
    assert torch.equal(out.to_dense(), expected.to_dense())


# ---------------------------------------------------------------------------------------------
# Metadata reads of invalid data never validate, every layout (SPEC 5)


def _invalid(layout: str) -> ss.SafeSparseTensor:
    """An unchecked tensor of ``layout`` whose index data is out of range."""
    crow, bad = torch.tensor([0, 1, 2]), torch.tensor([0, 10**9])
    if layout == "COO":
        return ss.sparse_coo_tensor(torch.tensor([[0, 10**9]]), torch.tensor([1.0, 2.0]), (3,),
                                    check_invariants=False)
    if layout in ("CSR", "CSC"):
        values = torch.tensor([1.0, 2.0])
        size: tuple[int, ...] = (2, 2)
    else:
        values, size = torch.ones(2, 2, 3), (4, 6)
    factory = getattr(ss, f"sparse_{layout.lower()}_tensor")
    return factory(crow, bad, values, size, check_invariants=False)  # type: ignore[no-any-return]


#: SPEC 5's metadata list (and torch's other read-only facts about a tensor)
METADATA: list[tuple[str, Callable[[torch.Tensor], object]]] = [
    ("shape", lambda t: t.shape), ("dtype", lambda t: t.dtype), ("layout", lambda t: t.layout),
    ("device", lambda t: t.device), ("nnz", lambda t: t._nnz()),
    ("sparse_dim", lambda t: t.sparse_dim()), ("dense_dim", lambda t: t.dense_dim()),
    ("is_coalesced", lambda t: t.is_coalesced()), ("requires_grad", lambda t: t.requires_grad),
    ("grad", lambda t: t.grad), ("grad_fn", lambda t: t.grad_fn), ("nbytes", lambda t: t.nbytes),
    ("itemsize", lambda t: t.itemsize), ("element_size", lambda t: t.element_size()),
    ("is_leaf", lambda t: t.is_leaf),
    ("names", lambda t: t.names),  # type: ignore[attr-defined]
    ("retains_grad", lambda t: t.retains_grad),
    ("name", lambda t: t.name),  # type: ignore[attr-defined]
    ("is_mkldnn", lambda t: t.is_mkldnn), ("is_xpu", lambda t: t.is_xpu),
    ("is_mps", lambda t: t.is_mps), ("is_pinned", lambda t: t.is_pinned()),
    ("is_signed", lambda t: t.is_signed()), ("is_cuda", lambda t: t.is_cuda),
    ("dim", lambda t: t.dim()), ("numel", lambda t: t.numel()),
]


def _outcome(f: Callable[[torch.Tensor], object], t: torch.Tensor) -> object:
    try:
        return f(t)
    except Exception as exc:  # torch's own refusal (COO nbytes, sparse names): the same type
        return type(exc)


@pytest.mark.parametrize("layout", ["COO", "CSR", "CSC", "BSR", "BSC"])
@pytest.mark.parametrize(("name", "read"), METADATA, ids=[n for n, _ in METADATA])
def test_metadata_of_invalid_data_is_torchs_and_validates_nothing(
        layout: str, name: str, read: Callable[[torch.Tensor], object]) -> None:
    bad = _invalid(layout)
    if name == "is_coalesced" and layout != "COO":
        pytest.skip("is_coalesced is a COO fact")
    ss.reset_stats()
    got = _outcome(read, bad)
    assert ss.stats().validations == 0, name
    assert not ss.is_checked(bad)
    assert got is not ss.InvariantError
    assert got == _outcome(read, ss.unwrap(bad)), name

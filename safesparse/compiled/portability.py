"""``ss.portable(exported_program)``: an exported program any torch can serve.

A program exported from a model that holds ``SparseLinear`` / ``SparseMatmul`` layers keeps the
checked ``safesparse`` operators (SPEC 10): each call confirms in O(1) that its index members
are the proven ones and validates them otherwise. Loading it needs ``import safesparse`` first (the
operators are registered by the package); a process that never imports it stops at
``torch.export.load``'s "failed to resolve torch.ops.safesparse...".

:func:`portable` returns the same program with every ``safesparse`` operator replaced by plain
aten ops (``ExportedProgram.run_decompositions`` with a table of this module's formulas, the
rest of the graph untouched): the line of each stored block from the compressed member
(``searchsorted``), the dense operand's blocks gathered by the plain member
(``index_select``), one batched product per stored block (``einsum``) and the products summed
into their lines (``index_add``). ``torch.export.save`` / ``torch.export.load`` then run it
with plain torch. What it gives up: the run-time proof (no safesparse code runs; aten's own
bounds checks refuse an index out of range, nothing checks the order of the indices), and the
native kernels' speed. The members are recorded in the graph's metadata (``custom``:
``safesparse.matrices``) so that ``python -m safesparse check`` vets them in the archive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import operators as _operators  # noqa: F401  (registers torch.ops.safesparse.*)
from ..files.export_archive import PORTABLE_KEY
from . import prove as _prove  # noqa: F401  (registers torch.ops.safesparse.prove)

__all__ = ["portable"]
_T = torch.Tensor


def _blocks(layout: str, compressed: _T, plain: _T, values: _T
            ) -> tuple[_T, _T, _T, int, int]:
    """The block row and block column of each stored block, the values as ``(nnz, r, c)``
    blocks, and the block shape."""
    blocks = values.view(-1, 1, 1) if values.dim() == 1 else values
    r, c = blocks.shape[1], blocks.shape[2]
    position = torch.arange(plain.shape[0], device=plain.device, dtype=compressed.dtype)
    line = torch.searchsorted(compressed, position, right=True) - 1
    if layout in ("csr", "bsr"):
        return line, plain, blocks, r, c
    return plain, line, blocks, r, c


def _product(x: _T, compressed: _T, plain: _T, values: _T, layout: str, out_features: int,
             in_features: int) -> _T:
    """``x @ W.T`` (``x``: ``(n, in_features)``), over ``x`` transposed once: each stored
    block's operand is a contiguous ``(c, n)`` slab, one ``bmm`` for all blocks."""
    rows, cols, blocks, r, c = _blocks(layout, compressed, plain, values)
    n = x.shape[0]
    xt = x.t().contiguous().view(in_features // c, c, n)
    products = torch.bmm(blocks.to(x.dtype), xt.index_select(0, cols))       # (nnz, r, n)
    y = x.new_zeros(out_features // r, r, n).index_add(0, rows, products)
    return y.reshape(out_features, n).t()


def _product_t(g: _T, compressed: _T, plain: _T, values: _T, layout: str, out_features: int,
               in_features: int) -> _T:
    """``g @ W`` (``g``: ``(n, out_features)``)."""
    rows, cols, blocks, r, c = _blocks(layout, compressed, plain, values)
    n = g.shape[0]
    gathered = g.reshape(n, out_features // r, r).index_select(1, rows)      # (n, nnz, r)
    products = torch.einsum("nkr,krc->knc", gathered, blocks.to(g.dtype))     # (nnz, n, c)
    y = g.new_zeros(in_features // c, n, c).index_add(0, cols, products)
    return y.permute(1, 0, 2).reshape(n, in_features)


def _grad_values(g: _T, x: _T, compressed: _T, plain: _T, values: _T, layout: str,
                 out_features: int, in_features: int) -> _T:
    """The gradient of ``sum(g * (x @ W.T))`` to the stored values (their shape)."""
    rows, cols, _, r, c = _blocks(layout, compressed, plain, values)
    n = g.shape[0]
    gr = g.reshape(n, out_features // r, r).index_select(1, rows)
    xc = x.reshape(n, in_features // c, c).index_select(1, cols)
    return torch.einsum("nkr,nkc->krc", gr, xc).reshape(values.shape)


def _linear(x: _T, compressed: _T, plain: _T, values: _T, layout: str, out_features: int,
            in_features: int) -> _T:
    return _product(x, compressed, plain, values, layout, out_features, in_features)


def _linear_bias(x: _T, compressed: _T, plain: _T, values: _T, bias: _T, layout: str,
                 out_features: int, in_features: int) -> _T:
    return _product(x, compressed, plain, values, layout, out_features, in_features) + bias


def _linear_grad_input(g: _T, compressed: _T, plain: _T, values: _T, layout: str,
                       out_features: int, in_features: int) -> _T:
    return _product_t(g, compressed, plain, values, layout, out_features, in_features)


def _linear_grad_values(g: _T, x: _T, compressed: _T, plain: _T, values: _T, layout: str,
                        out_features: int, in_features: int) -> _T:
    return _grad_values(g, x, compressed, plain, values, layout, out_features, in_features)


def _matmul(compressed: _T, plain: _T, values: _T, layout: str, n_rows: int, n_cols: int,
            x: _T) -> _T:
    return _product(x.t(), compressed, plain, values, layout, n_rows, n_cols).t()


def _matmul_grad_input(compressed: _T, plain: _T, values: _T, layout: str, n_rows: int,
                       n_cols: int, g: _T) -> _T:
    return _product_t(g.t(), compressed, plain, values, layout, n_rows, n_cols).t()


def _matmul_grad_values(compressed: _T, plain: _T, values: _T, layout: str, n_rows: int,
                        n_cols: int, g: _T, x: _T) -> _T:
    return _grad_values(g.t(), x.t(), compressed, plain, values, layout, n_rows, n_cols)


_ops = torch.ops.safesparse
_FORMULAS: dict[str, Callable[..., _T]] = {
    "linear": _linear, "linear_bias": _linear_bias, "linear_grad_input": _linear_grad_input,
    "linear_grad_values": _linear_grad_values, "matmul": _matmul,
    "matmul_grad_input": _matmul_grad_input, "matmul_grad_values": _matmul_grad_values,
}
_SIZES = {"linear": ("out_features", "in_features"), "matmul": ("n_rows", "n_cols")}


def _members(program: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """The stored members (parameter, buffer or constant names), layout and size of each
    ``safesparse`` operator of ``program`` whose members it stores."""
    signature = program.graph_signature
    stored = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
              **signature.inputs_to_lifted_tensor_constants}
    found: list[dict[str, Any]] = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not _is_ours(node.target):
            continue
        name = node.target._schema.name.split("::", 1)[1]
        family = "linear" if name.startswith("linear") else "matmul"
        if name not in _FORMULAS:
            continue
        args = dict(zip((a.name for a in node.target._schema.arguments), node.args,
                        strict=False))
        args.update(node.kwargs)
        names = [stored.get(getattr(args.get(m), "name", None))
                 for m in ("compressed", "plain", "values")]
        if None in names:
            continue  # members given as inputs of the program: nothing stored to vet
        rows, cols = _SIZES[family]
        entry = {"compressed": names[0], "plain": names[1], "values": names[2],
                 "layout": args["layout"], "size": [int(args[rows]), int(args[cols])]}
        if entry not in found:
            found.append(entry)
    return found


def _is_ours(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "safesparse"


def portable(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The exported ``program`` with every ``safesparse`` operator replaced by plain aten ops.

    ``torch.export.save`` the result; ``torch.export.load(path).module()`` runs it in a
    process that never imports safesparse, with the results of the checked program (see the
    module doc for the formulation and what it gives up). The rest of the graph, its
    signature, parameters and buffers are kept; ``program`` itself is unchanged.

    Args:
        program: a ``torch.export.ExportedProgram`` (``torch.export.export`` of a model that
            holds ``SparseLinear`` / ``SparseMatmul`` layers, or of a function taking sparse
            operands).

    Returns:
        A new ``ExportedProgram`` without ``safesparse`` operators; its graph's ``custom``
        metadata lists the matrices' members under ``"safesparse.matrices"`` (what
        ``python -m safesparse check`` vets in the saved archive).

    Raises:
        ValueError: the program validates index tensors it computes
            (``torch.ops.safesparse.prove``): that check has no aten form.
    """
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"portable: an ExportedProgram (torch.export.export) is needed, got "
                        f"{type(program).__name__}")
    if any(node.op == "call_function" and node.target is _ops.prove.default
           for node in program.graph.nodes):
        raise ValueError(
            "portable: the program validates index tensors it computes "
            "(torch.ops.safesparse.prove), which plain torch cannot do\n"
            "  Keep the checked program (torch.export.load after `import safesparse`), or "
            "build the matrix outside the exported function.")
    matrices = _members(program)
    table = {getattr(_ops, name).default: fn for name, fn in _FORMULAS.items()}
    out: torch.export.ExportedProgram = program.run_decompositions(table)
    left = sorted({str(n.target) for n in out.graph.nodes
                   if n.op == "call_function" and _is_ours(n.target)})
    if left:
        raise ValueError(f"portable: {', '.join(left)} has no aten form here")
    custom = out.graph_module.meta.setdefault("custom", {})
    custom[PORTABLE_KEY] = matrices
    return out

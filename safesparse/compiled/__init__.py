"""Sparse matrices as inputs of compiled and exported code (SPEC 10, "Sparse inputs").

:func:`as_operand` turns a checked CSR / CSC / BSR / BSC tensor into a :class:`SparseOperand`,
a traceable wrapper over its proven members that ``torch.compile(fullgraph=True)`` and
``torch.export`` take as an input (:mod:`safesparse.compiled.operand`); :func:`compile` does
so at the boundary of ``torch.compile``; ``torch.ops.safesparse.prove`` validates index tensors
a graph computed (:mod:`safesparse.compiled.prove`); :func:`portable` replaces the
``safesparse`` operators of an exported program by plain aten ops
(:mod:`safesparse.compiled.portability`).
"""

from __future__ import annotations

from . import prove as _prove  # noqa: F401  (registers torch.ops.safesparse.prove)
from .boundary import as_operand, compile, from_operand
from .operand import SparseOperand, UnsupportedOperandOp
from .portability import portable

__all__ = ["SparseOperand", "UnsupportedOperandOp", "as_operand", "compile", "from_operand",
           "portable"]

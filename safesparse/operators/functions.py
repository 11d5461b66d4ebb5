"""The torch functions that are sparse products: one list for every door to the kernels.

A call of one of these with a sparse matrix and a dense operand is a product the ``safesparse``
operators compute (:mod:`.autograd`'s four products, plus ``addmm``'s and ``linear``'s terms).
The tensor layer binds their arguments by name (:mod:`safesparse.tensor.binding`) and the
compiled operand routes them to the operators (:mod:`safesparse.compiled.operand`); both read
this list, each with its own table per kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn.functional as F

__all__ = ["PRODUCT_FUNCTIONS"]

T = torch.Tensor

#: torch function -> its kind: how its arguments are named (torch 2.13's signatures).
#: ``"mm"`` ``(input, mat2)``; ``"matmul"`` ``(input, other)``; ``"rmatmul"`` the same, the
#: product ``other @ input``; ``"addmm"`` ``(input, mat1, mat2, *, beta, alpha, out)``;
#: ``"addmm_"`` the in-place form; ``"sparse_mm"`` ``(sparse, dense, reduce)``;
#: ``"sparse_addmm"`` ``(input, mat1, mat2, *, beta, alpha)``; ``"linear"``
#: ``(input, weight, bias)``.
PRODUCT_FUNCTIONS: Final[dict[Callable[..., Any], str]] = {
    torch.mm: "mm", T.mm: "mm",
    torch.matmul: "matmul", T.matmul: "matmul", T.__matmul__: "matmul",
    T.__rmatmul__: "rmatmul",
    torch.addmm: "addmm", T.addmm: "addmm", T.addmm_: "addmm_",
    torch.sparse.mm: "sparse_mm",
    torch.sparse.addmm: "sparse_addmm",
    F.linear: "linear",
}

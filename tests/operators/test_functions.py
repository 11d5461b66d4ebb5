"""One list of the torch functions that are sparse products (issue 48): the tensor layer's op
table rows and argument binding and the compiled operand's routes are all made from
``operators.functions.PRODUCT_FUNCTIONS``, so a product function added there reaches each.
"""

from __future__ import annotations

import torch

from safesparse.compiled import operand
from safesparse.operators.functions import PRODUCT_FUNCTIONS
from safesparse.tensor import binding, ops


def test_the_tensor_layer_binds_every_product_function() -> None:
    assert set(binding.SIGNATURES) == set(PRODUCT_FUNCTIONS)
    for func, kind in PRODUCT_FUNCTIONS.items():
        assert binding.SIGNATURES[func] is binding._BY_KIND[kind]
    # the in-place form binds as in place, the reflected one swapped
    assert binding.SIGNATURES[torch.Tensor.addmm_].inplace
    assert binding.SIGNATURES[torch.Tensor.__rmatmul__].swap


def test_the_op_tables_product_rows_are_the_product_functions() -> None:
    assert set(ops._PRODUCT_KINDS) == set(PRODUCT_FUNCTIONS)
    assert all(ops._ROWS[f].impl is ops._product_route for f in PRODUCT_FUNCTIONS)


def test_the_compiled_operand_routes_every_product_function_but_the_in_place_one() -> None:
    routed = {f for f in PRODUCT_FUNCTIONS if f in operand._ROUTES}
    assert routed == {f for f, kind in PRODUCT_FUNCTIONS.items() if kind != "addmm_"}
    assert torch.Tensor.addmm_ not in operand._ROUTES  # (refused: torch's own, which dispatch
    #                                                    refuses for an operand)

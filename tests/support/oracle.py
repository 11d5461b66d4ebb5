"""An oracle independent of safesparse's engine: torch's own checker on clones of a sparse
tensor's members (the semantics of ``check_invariants=True``), for tests that ask whether a
tensor that reports checked really is valid."""

from __future__ import annotations

import torch
from torch._C import DisableTorchFunctionSubclass

from safesparse.state import checked


def really_valid(t: torch.Tensor) -> bool:
    """Whether torch's checker accepts ``t``'s current members (and, for compressed layouts,
    values with no dense dims: the tests that use this build none, so 3.10 is checked too)."""
    with DisableTorchFunctionSubclass():
        try:
            if t.layout == torch.sparse_coo:
                torch._validate_sparse_coo_tensor_args(
                    t._indices().clone(), t._values().clone(), t.shape, t.is_coalesced())
            else:
                c, p = checked.index_members(t)
                values = t.values().clone()
                blocked = t.layout in (torch.sparse_bsr, torch.sparse_bsc)
                if values.dim() != c.dim() + (2 if blocked else 0):
                    return False
                torch._validate_sparse_compressed_tensor_args(
                    c.clone(), p.clone(), values, t.shape, t.layout)
        except RuntimeError:
            return False
    return True

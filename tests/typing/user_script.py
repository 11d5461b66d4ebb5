"""A user's script, type-checked with ``mypy --strict`` (tests/package/test_typing.py and .ci/run):
what a user chains on a SafeSparseTensor stays a SafeSparseTensor for the type checker, and
``ss.is_checked`` narrows, so no ``cast`` is needed."""

from __future__ import annotations

import torch

import safesparse as ss


def pipeline() -> ss.SafeSparseTensor:
    a = ss.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2))
    coalesced: ss.SafeSparseTensor = a.coalesce()
    csr: ss.SafeSparseTensor = coalesced.to_sparse_csr()
    csc: ss.SafeSparseTensor = csr.mT
    scaled: ss.SafeSparseTensor = csr * 2
    halved: ss.SafeSparseTensor = (2 * csr).mul(0.5).neg()
    moved: ss.SafeSparseTensor = csc.to(torch.float64).clone().detach()
    back: ss.SafeSparseTensor = moved.transpose(0, 1).t()
    assert ss.is_checked(scaled) and ss.is_checked(halved) and ss.is_checked(back)
    return csr


def adopt(t: torch.Tensor) -> ss.SafeSparseTensor | None:
    if ss.is_checked(t):
        return t  # narrowed by the TypeGuard
    return None


def dense_result(t: ss.SafeSparseTensor) -> torch.Tensor:
    return t @ torch.ones(t.shape[1], 1)


if __name__ == "__main__":
    pipeline()

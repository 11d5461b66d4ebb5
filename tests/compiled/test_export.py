"""Export parity (SPEC 10): a ``SafeSparseTensor`` input exports as a plain sparse input does.

Non-strict ``torch.export.export`` describes each input under its ``FakeTensorMode``, which
refuses tensor subclasses it does not know; a ``SafeSparseTensor`` hands torch a plain alias of
itself while a dispatch mode is active, so the exported graph is plain torch's, and the exported
program, run on a ``SafeSparseTensor``, goes through its guard (an input written after
validation is validated again and refused when invalid).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import safesparse as ss
from safesparse import InvariantError

pytestmark = pytest.mark.slow  # (exports: dynamo and AOT tracing)

CSR, CSC, BSR, BSC = torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
CASES = [(CSR, None), (CSC, None), (BSR, (2, 2)), (BSC, (2, 2))]
IDS = ["csr", "csc", "bsr", "bsc"]


class Layer(torch.nn.Module):
    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ x)


def matrix(layout: torch.layout, blocksize: tuple[int, int] | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(4, 6, generator=g, dtype=torch.float64)
    dense[:, 2:4] = 0
    return dense.to_sparse(layout=layout, blocksize=blocksize)


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_export_gives_plain_torchs_graph(layout: torch.layout,
                                         blocksize: tuple[int, int] | None) -> None:
    plain = matrix(layout, blocksize)
    x = torch.randn(6, 3, dtype=torch.float64)
    try:
        want = torch.export.export(Layer(), (plain, x))
    except Exception as err:  # plain torch cannot export this layout: neither can we
        with pytest.raises(type(err)):
            torch.export.export(Layer(), (ss.validate(plain.clone()), x))
        return
    got = torch.export.export(Layer(), (ss.validate(plain.clone()), x))
    assert str(got.graph) == str(want.graph)
    s = ss.validate(plain.clone())
    try:
        expected = want.module()(plain, x)
    except RuntimeError as err:  # (torch has no BSC product on CPU): the same refusal
        with pytest.raises(RuntimeError, match=str(err)[:40]):
            got.module()(s, x)
        return
    torch.testing.assert_close(got.module()(s, x), expected)


def test_exported_program_keeps_the_guard() -> None:
    s = ss.validate(torch.eye(4, dtype=torch.float64).to_sparse_csr())
    x = torch.randn(4, 3, dtype=torch.float64)
    program = torch.export.export(Layer(), (s, x)).module()
    torch.testing.assert_close(program(s, x), torch.relu(x))
    s.col_indices()[1] = 99  # written after validation: invalid
    with pytest.raises(InvariantError, match=r"\[CSR 5\.5\]"):
        program(s, x)


def test_inspection_under_a_fake_mode_sees_a_plain_alias() -> None:
    plain = torch.eye(4).to_sparse_csr()
    s = ss.validate(plain.clone())
    with FakeTensorMode(allow_non_fake_inputs=True):
        # (each of these raised "Multiple dispatch failed" before: the mode refuses subclasses)
        for get in (lambda t: t.crow_indices(), lambda t: t.col_indices(),
                    lambda t: t.values()):
            assert get(s).shape == get(plain).shape
        assert s.size() == (4, 4) and s.dim() == 2 and s.layout == CSR
    assert ss.is_checked(s)
    s.col_indices()[0] = 3  # a member handed out under the mode still voids the proof
    assert not ss.is_checked(s)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
def test_strict_export_is_refused_where_plain_torch_exports() -> None:
    """Strict export traces with dynamo, which never traces safesparse's
    ``__torch_function__`` (validation and checked-state bookkeeping run eagerly, never baked
    into a graph): the frame cannot be captured whole, so strict export refuses. A plain sparse
    input exports strictly (the documented difference: export non-strict, the default)."""
    from torch._dynamo.exc import Unsupported

    x = torch.randn(4, 3)
    torch.export.export(Layer(), (torch.eye(4).to_sparse_csr(), x), strict=True)
    with pytest.raises(Unsupported, match="__torch_function__"):
        torch.export.export(Layer(), (ss.validate(torch.eye(4).to_sparse_csr()), x),
                            strict=True)

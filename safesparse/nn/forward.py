"""The forward passes of the ``safesparse.nn`` modules: the one file of safesparse that
``torch.compile`` traces (see :mod:`safesparse._compile`).

They read strided tensors only (the index buffers, the values, the bias, the input) and call
the ``safesparse`` operators, which appear in the graph as one node each; the operators' real
implementations (the O(1) confirmation of the index members, the kernels) run eagerly.
Nothing here may build or inspect a sparse tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ..catalog.errors import InvariantError
from ..operators.autograd import LinearFunction, MatmulFunction, apply
from ..operators.library import linear, linear_bias, matmul
from . import eager
from .errors import keyed

__all__ = ["linear_call", "linear_forward", "linear_operators", "matmul_call", "matmul_forward",
           "matmul_operators"]


# ---------------------------------------------------------------------------------------------
# The forward passes


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev) is active in eager code: the
    products then go through the autograd.Functions above (traced code calls the operators:
    the same formulas, registered with ``register_autograd``)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def linear_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``SparseLinear.__call__``: ``nn.Module.__call__``, which calls :func:`linear_forward`
    where the module has no hooks; in eager mode where it would call nothing else
    (:func:`safesparse.nn.eager.forward_only`), the eager path directly (``nn.Module.__call__``
    costs about 1 us, a tenth of a batch-1 call). Traced (``torch.compile``, ``torch.export``),
    always ``nn.Module.__call__``."""
    if (not torch.compiler.is_compiling() and len(args) == 1 and not kwargs
            and eager.forward_only(self, linear_forward)):
        return eager.linear(self, args[0], linear_operators)
    return torch.nn.Module.__call__(self, *args, **kwargs)


def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseLinear.forward``: ``x @ W.T + b`` over any leading dims of ``x`` (in eager
    mode through the fast path of ``safesparse.nn.eager`` where it holds)."""
    if not torch.compiler.is_compiling():
        return eager.linear(self, x, linear_operators)
    return linear_operators(self, x)


def linear_operators(self: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`linear_forward` through the ``safesparse`` operators (the proving path)."""
    if x.dim() == 0 or x.shape[-1] != self.in_features:
        raise RuntimeError(
            f"SparseLinear: the input's last dim must be in_features={self.in_features}, got "
            f"{x.shape[-1] if x.dim() else 'a 0-dim tensor'} (input of shape "
            f"{tuple(x.shape)})")
    lead = x.shape[:-1]
    try:
        rows = x.unsqueeze(0) if x.dim() == 1 else x.flatten(0, -2)  # (in_features=0 too)
        args = (rows, self.compressed_indices, self.plain_indices,
                self.values, self._layout_name, self.out_features, self.in_features)
        y: torch.Tensor
        if _transformed():  # torch.func: the autograd.Function, the bias added after
            y = apply(LinearFunction, *args)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif self.bias is None:
            y = linear(*args)
        else:  # the bias added in the product's pass (under autocast: its dtype, as nn.Linear)
            y = linear_bias(*args[:4], self.bias, *args[4:])
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    # (a 2-D input's output is returned as it is, not as a reshaped view: FSDP2 warns about a
    # module returning a view on every forward)
    return y if x.dim() == 2 else y.reshape(*lead, self.out_features)


def matmul_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``SparseMatmul.__call__``: as :func:`linear_call`, for :func:`matmul_forward`."""
    if (not torch.compiler.is_compiling() and len(args) == 1 and not kwargs
            and eager.forward_only(self, matmul_forward)):
        return eager.matmul(self, args[0], matmul_operators)
    return torch.nn.Module.__call__(self, *args, **kwargs)


def matmul_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``SparseMatmul.forward``: ``A @ x`` for ``x`` of shape ``(n_cols,)`` or
    ``(n_cols, N)`` (in eager mode through the fast path of ``safesparse.nn.eager`` where it
    holds)."""
    if not torch.compiler.is_compiling():
        return eager.matmul(self, x, matmul_operators)
    return matmul_operators(self, x)


def matmul_operators(self: Any, x: torch.Tensor) -> torch.Tensor:
    """:func:`matmul_forward` through the ``safesparse`` operators (the proving path)."""
    if x.dim() not in (1, 2) or x.shape[0] != self.n_cols:
        raise RuntimeError(  # (as torch's A @ x, and SparseLinear's in_features check)
            f"SparseMatmul: x must have shape (n_cols,) or (n_cols, N) with "
            f"n_cols={self.n_cols}, got {tuple(x.shape)} (A is {self.n_rows} x {self.n_cols})")
    vector = x.dim() == 1
    try:
        args = (self.compressed_indices, self.plain_indices, self.values, self._layout_name,
                self.n_rows, self.n_cols, x.unsqueeze(1) if vector else x)
        y: torch.Tensor = (apply(MatmulFunction, *args) if _transformed()
                             else matmul(*args))
    except InvariantError as err:  # (eager: the error names the module's key)
        raise keyed(self, err) from None
    return y.squeeze(1) if vector else y

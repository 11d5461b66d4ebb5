"""Kernels: CPU products over the dense members of a compressed matrix.

:mod:`safesparse.kernels.blocks` computes ``x @ W.T``, ``A @ x`` and their gradients for a
CSR / CSC / BSR / BSC matrix described by one :class:`~safesparse.kernels.pattern.Matrix`
(layout, index members, values, size, block shape; built by
:func:`~safesparse.kernels.pattern.matrix`), passed first to every kernel, then the dense
operands, trusting its caller (``safesparse.nn``'s operators, which confirm the members are
proven first): in the native library (:mod:`safesparse.kernels.native`, plain C built at
install where a compiler was found; ``csrc/blockprod.h`` declares its entry points) on CPU,
in torch ops otherwise. :mod:`safesparse.kernels.pattern` holds the description and the
pattern helpers both paths share. This layer knows nothing of the rest of safesparse.
"""

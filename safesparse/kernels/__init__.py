"""Kernels: CPU products over the dense members of a compressed matrix.

:mod:`safesparse.kernels.blocks` computes ``x @ W.T``, ``A @ x`` and their gradients for a
CSR / CSC / BSR / BSC matrix given by its members, trusting its caller (``safesparse.nn``'s
operators, which confirm the members are proven first): in the native library
(:mod:`safesparse.kernels.native`, plain C built at install where a compiler was found) on CPU,
in torch ops otherwise. This layer knows nothing of the rest of safesparse.
"""

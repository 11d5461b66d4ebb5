"""The ``safesparse`` operators: the one door from the layers above to the kernels.

Every sparse product safesparse computes over the dense members of a proven 2-D compressed
matrix on CPU goes through here: the ``torch.library`` custom operators
(``torch.ops.safesparse.linear``, ``linear_bias``, ``matmul`` and their gradients,
:mod:`.library`), their autograd formulas (one per product, :mod:`.autograd`), their batching
and autocast rules (:mod:`.transforms`) and the torch functions that are products
(:mod:`.functions`). ``safesparse.nn``'s layers, the compiled
operand (:mod:`safesparse.compiled`) and the tensor layer's block products call them; below
them are the kernels (:mod:`safesparse.kernels`). Whether the index members are proven is
asked of :mod:`safesparse.state` (O(1)); members that are not are validated first.
"""

from __future__ import annotations

from . import autograd as autograd  # (registers the operators' autograd formulas)
from . import library as library  # (registers torch.ops.safesparse.*)
from . import transforms as transforms  # (torch.func, vmap and autocast registrations)

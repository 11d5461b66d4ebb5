"""The factories: validated drop-ins for torch's sparse factories, and SciPy conversion.

The public factories and their argument handling (:mod:`.core`), the build path that validates
once and attaches the checked state (:mod:`.build`), and :mod:`.interop` (``from_scipy`` /
``to_scipy``). Reads the tensor layer and below.
"""

from __future__ import annotations

from . import core
from .core import *  # noqa: F403  (the names core.__all__ lists: the public factories)

__all__ = core.__all__

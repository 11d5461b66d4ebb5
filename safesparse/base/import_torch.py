"""Import torch for safesparse without torch's NumPy warning.

torch 2.13 works without NumPy, but the first ``import torch`` in an environment without it
warns "Failed to initialize NumPy: No module named 'numpy'" (raised while torch imports its own
submodules). When safesparse is what imports torch first (``python -m safesparse demo`` in a
fresh install, a script whose first import is ``import safesparse``), that warning is noise
caused by safesparse's import: it is silenced here, and only here. A program that imports torch
itself first gets torch's behaviour unchanged; nothing in safesparse needs NumPy.
"""

from __future__ import annotations

import sys
import warnings

NUMPY_WARNING = r"Failed to initialize NumPy"

if "torch" not in sys.modules:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
        import torch  # noqa: F401

#: torch warns once per process that compressed layouts are "in beta state", from whatever line
#: first builds one. When that line is safesparse's own (a factory, a transpose, a load), the
#: warning would point into safesparse rather than at the user's code: it is silenced for
#: warnings attributed to safesparse's modules only (a module-scoped filter, thread-safe).
BETA_WARNING = r".*support is in beta state"
warnings.filterwarnings("ignore", message=BETA_WARNING, category=UserWarning,
                        module=r"safesparse(\..*)?$")

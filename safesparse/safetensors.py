"""Sparse tensors in safetensors files: ``save_file``, ``load_file``, ``save``, ``load``.

Mirrors ``safetensors.torch`` (same names and arguments). Dense tensors are stored as
safetensors stores them; a sparse tensor of any layout is stored as its member tensors
(``K.__ss_crow_indices`` ...) with one metadata entry (``__ss_sparse__:K``), so plain
safetensors reads the file, and :func:`load_file` rebuilds it through the validating factories.
The on-disk naming and what is refused are described in :mod:`safesparse.files.safetensors`
and docs/checkpoints.md. Needs the optional dependency: ``pip install
"safesparse[safetensors]"``.
"""

from __future__ import annotations

from .files.safetensors import (
    FORMAT_VERSION,
    FormatError,
    load,
    load_and_validate,
    load_file,
    save,
    save_file,
)

__all__ = [
    "FORMAT_VERSION",
    "FormatError",
    "load",
    "load_and_validate",
    "load_file",
    "save",
    "save_file",
]

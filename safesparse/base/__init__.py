"""The bottom layer: what every other layer may read and nothing here reads back.

torch's saved originals (:mod:`.originals`, taken before enforce mode replaces them), the layout
vocabulary (:mod:`.layouts`), the two process-wide switches (:mod:`.enforce_flag`,
:mod:`.debug_flag`), the statistics counters (:mod:`.stats`), the torch.compile boundary
(:mod:`.compiling`) and torch's import without its NumPy warning (:mod:`.import_torch`).
Imports nothing of safesparse.
"""

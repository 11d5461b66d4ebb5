"""The checked state: which index memory has been proven valid, and whether a proof still holds.

Index memory and its states, found by range (:mod:`.memory`), and the records, proofs and the
one rule deciding whether a proof holds (:mod:`.checked`). Knows nothing of tensors' operations
or factories; reads :mod:`safesparse.base` only.
"""

"""The checked state: which index memory has been proven valid, and whether a proof still holds.

Index memory and its states, found by range (:mod:`.memory`); the records and the one rule
deciding whether a proof holds (:mod:`.records`); sharing, registration and marking
(:mod:`.checked`, which re-exports the records' names); the one way index members come to be
trusted (:mod:`.admission`). Knows nothing of tensors' operations
or factories; reads :mod:`safesparse.base` only.
"""

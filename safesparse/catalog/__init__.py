"""The catalog: what a valid sparse tensor is, and what an error says.

The invariants and their ids (:mod:`.invariants`), :class:`~.errors.InvariantError`
(:mod:`.errors`), the texts several documents state alike (:mod:`.doctext`) and how an
uncaught error is shown (:mod:`.tracebacks`). Reads only :mod:`safesparse.base`.
"""

"""The validation engine: checks index data against the catalog, and knows no checked state.

A tensor's metadata (:mod:`.metadata`), the invariants as masks (:mod:`.masks`), the fast
check (:mod:`.validation`), the diagnosis that names the first violation (:mod:`.diagnose`),
arguments as torch's factories read them (:mod:`.convert`) and the public index checks
(:mod:`.indices`). Reads :mod:`safesparse.catalog` and :mod:`safesparse.base`.
"""

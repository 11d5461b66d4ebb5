"""Enforce mode: torch's sparse factories and loaders replaced by validating ones, process-wide.

Turning it on and off (:mod:`.mode`), the replacements and the routes they take
(:mod:`.routes`), and ``python -m safesparse run`` (:mod:`.runner`). The flag itself lives in
:mod:`safesparse.base.enforce_flag`, so lower layers can read it without importing this one.
"""

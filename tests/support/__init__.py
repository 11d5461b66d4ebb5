"""What the tests of every layer share: the hypothesis strategies (:mod:`.strategies`), the
independent validity oracle (:mod:`.oracle`), call counters and thread runners (:mod:`.spies`)
and the scripts tests run in child processes (:mod:`.dist_worker`, one rank of the
distributed tests; :mod:`.pyg_corrupt`, PyG under enforce mode). ``tests/`` is on
``sys.path`` (tests/conftest.py), so tests import ``support.strategies`` and so on.
"""

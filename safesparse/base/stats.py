"""The statistics counters: index validations run and avoided, counted by every layer above.

Kept at the bottom so that the validation engine (:mod:`safesparse.engine.indices`) and the
tensor layer count without importing the checked state; :mod:`safesparse.state.checked`
re-exports these names, and ``ss.stats()`` / ``ss.reset_stats()`` read them.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

__all__ = ["Stats", "count", "reset_stats", "stats"]


@dataclass(frozen=True)
class Stats:
    """Counters since the last :func:`reset_stats`, as returned by :func:`stats` (frozen).

    Attributes:
        validations: full O(nnz) index validations run.
        skipped: index validations avoided because the index data was known valid (a rebuild
            on checked indices, ``validate`` of a checked tensor).
    """

    validations: int = 0
    skipped: int = 0


_stats_lock = threading.Lock()
#: one ``itertools.count`` per field: ``next()`` is atomic, so counting takes no lock; the
#: value is the number of ``next`` calls minus the reads (:func:`stats` advances it too)
_counters = {"validations": itertools.count(), "skipped": itertools.count()}
_reads = {"validations": 0, "skipped": 0}


def count(field: str) -> None:
    next(_counters[field])


def _read(field: str) -> int:
    n = next(_counters[field]) - _reads[field]
    _reads[field] += 1
    return n


def stats() -> Stats:
    """Counters of index validations since the last :func:`reset_stats` (all threads).

    Shows whether the checked-state cache works for your code, e.g. that rebuilding a tensor
    with new values in a training loop skips the O(nnz) index check::

        ss.reset_stats()
        for _ in range(10):
            w = ss.sparse_csr_tensor(p.crow_indices(), p.col_indices(), values, p.shape)
        assert ss.stats().skipped == 10 and ss.stats().validations == 0

    Returns:
        A frozen :class:`Stats` snapshot: ``validations`` (full index validations run) and
        ``skipped`` (validations avoided because the index data was known valid).
    """
    with _stats_lock:
        return Stats(validations=_read("validations"), skipped=_read("skipped"))


def reset_stats() -> None:
    """Set the :func:`stats` counters (``validations``, ``skipped``) back to zero.

    Process-wide, for every thread. The counters are diagnostics only: resetting them changes
    no checked state and clears no cache (that is :func:`clear_cache`).
    """
    with _stats_lock:
        for k in _counters:
            _counters[k] = itertools.count()
            _reads[k] = 0

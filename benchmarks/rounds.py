"""Interleaved rounds for the standalone benchmark scripts (bench_*.py)."""

from __future__ import annotations

from collections.abc import Callable


def best_of(fs: dict[str, Callable[[], object]], rounds: int,
            clock: Callable[[], float]) -> dict[str, float]:
    """Min over interleaved rounds of each function's time by ``clock``, ms (one warm-up call
    each first)."""
    for f in fs.values():
        f()
    best = dict.fromkeys(fs, float("inf"))
    for _ in range(rounds):
        for k, f in fs.items():
            t0 = clock()
            f()
            best[k] = min(best[k], clock() - t0)
    return {k: v * 1e3 for k, v in best.items()}

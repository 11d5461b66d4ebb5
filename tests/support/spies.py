"""Test helpers for counting calls and running work in threads: :class:`Spy` (a function
replaced for one test by one that counts its calls) and :func:`in_threads` (threads whose
exceptions reach the test)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["Spy", "in_threads"]


class Spy:
    """Replaces ``owner.attr`` (a function, or a method of a class) for the test that holds
    ``monkeypatch`` by one that calls it and counts: ``calls``, every call (counted before it
    runs, so a call that raises counts too); ``done``, the calls that returned something other
    than None."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: object, attr: str) -> None:
        self.calls = 0
        self.done = 0
        real = getattr(owner, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            got = real(*args, **kwargs)
            self.done += got is not None
            return got

        monkeypatch.setattr(owner, attr, counted)


def in_threads(run: Callable[[int], None], n: int) -> None:
    """``run(0)`` ... ``run(n - 1)`` in ``n`` threads at once; returns when all have ended,
    raising the first exception a thread raised (a thread's exception is otherwise only
    printed, and the test would pass without having run)."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            run(t)
        except BaseException as err:  # (re-raised in the test's thread below)
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]

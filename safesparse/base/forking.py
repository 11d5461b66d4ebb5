"""Forked children: torch's intra-op threads at one while safesparse works in one.

In a process started by ``fork()`` after its parent ran a parallel region of torch's OpenMP
thread pool, any parallel region hangs for good (GNU OpenMP keeps the parent's pool state).
torch's COO checker opens one at every size, the vectorised index checks above torch's grain
size, ``embedding_bag`` at any size, and the native kernels' own region: plain torch never runs
them by default, so a child would hang only because safesparse validates or computes. In a
forked child these stages run with torch's intra-op threads set to one (every parallel region
runs inline), restored after; one reference count for every stage and thread of the process,
so nested and concurrent stages restore the parent's setting once, at the end of the last.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch

__all__ = ["in_forked_child", "one_thread", "serial_in_forked_child"]

_forked = False
_lock = threading.Lock()
_depth = 0
_saved = 1


def _after_fork_in_child() -> None:
    global _forked, _lock, _depth
    _forked = True
    _lock = threading.Lock()  # (a lock held by another parent thread stays held)
    _depth = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_forked_child() -> bool:
    """Whether this process was started by ``fork()`` from one that imported safesparse."""
    return _forked


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads at one for the block (reference-counted: see above)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.set_num_threads(_saved)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def serial_in_forked_child(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` with torch's intra-op threads at one while it runs in a forked child (see
    above); unchanged elsewhere."""
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not _forked:
            return fn(*args, **kwargs)
        with one_thread():
            return fn(*args, **kwargs)
    return wrapper

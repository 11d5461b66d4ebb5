"""Short tracebacks: an :class:`InvariantError` reaches the user without safesparse's frames.

When safesparse refuses data, the frames that matter are the user's: where the tensor was
built, where it was used. The dozen frames below them (the guard, the factories, validation,
the diagnosis, and the torch functions safesparse called on the way) say nothing about the
data. So, as JAX does with its own frames, they are left out of the traceback that is shown:
the user's frames and the error stay, and a note says how to see everything.

The switch: the environment variable ``SAFESPARSE_TRACEBACK``, read when an error is shown
(so it may be set before the program starts or at any time in it):

* ``short`` (the default): safesparse's frames, and torch's frames that safesparse called, are
  left out of an :class:`InvariantError`'s traceback;
* ``full``: the traceback is shown as Python records it.

Nothing runs on the happy path: the frames are removed only where an uncaught
:class:`InvariantError` is about to be shown, by the hooks installed here
(``sys.excepthook`` and ``threading.excepthook``, chained to the ones in place), by
``python -m safesparse run`` and by safesparse's pytest plugin (which also honours pytest's
``--full-trace``). An error the program catches keeps its traceback: call :func:`shorten` to
shorten it too.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import torch

import safesparse_hooks

from .errors import InvariantError

__all__ = ["ENV", "MODES", "install", "mode", "shorten"]

#: The environment variable that selects the traceback shown for an ``InvariantError``.
ENV: Final = "SAFESPARSE_TRACEBACK"
#: Its values: ``short`` (the default) and ``full``.
MODES: Final = ("short", "full")

NOTE: Final = (f"(safesparse's own frames are hidden from this traceback; set {ENV}=full to "
               "see them)")


def _root(module_file: str | None) -> str:
    return os.path.normcase(os.path.dirname(os.path.abspath(module_file or ""))) + os.sep


_OURS: Final = (_root(os.path.dirname(__file__)), _root(safesparse_hooks.__file__))
_TORCH: Final = _root(torch.__file__)


def mode() -> str:
    """The traceback mode in force: ``SAFESPARSE_TRACEBACK`` (``short`` when unset or blank),
    lower-cased; a value that is neither ``short`` nor ``full`` is returned as it is."""
    value = os.environ.get(ENV, "").strip().lower()
    return value or "short"


def _where(tb: TracebackType) -> str:
    return os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename))


def _entries(tb: TracebackType | None) -> list[TracebackType]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _kept(entries: list[TracebackType]) -> list[TracebackType]:
    """The entries shown: not safesparse's own, nor torch's when safesparse called them."""
    kept: list[TracebackType] = []
    inside = False  # whether the nearest caller that is not torch is safesparse
    for tb in entries:
        where = _where(tb)
        if where.startswith(_OURS):
            inside = True
        elif where.startswith(_TORCH):
            if not inside:
                kept.append(tb)
        else:
            inside = False
            kept.append(tb)
    return kept


def _relink(kept: list[TracebackType]) -> TracebackType | None:
    for tb, nxt in itertools.pairwise(kept):
        tb.tb_next = nxt
    if kept:
        kept[-1].tb_next = None
        return kept[0]
    return None


def _shorten_one(exc: BaseException, tb: TracebackType | None) -> tuple[TracebackType | None,
                                                                       bool]:
    """Remove the hidden entries of one traceback in place; (new head, whether any went)."""
    entries = _entries(tb)
    kept = _kept(entries)
    if len(kept) == len(entries):
        return tb, False
    if not kept:  # every frame is safesparse's (an error from a bare callback): keep one
        kept = entries[-1:]
    head = _relink(kept)
    exc.__traceback__ = head
    return head, True


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen: list[BaseException] = []
    todo: BaseException | None = exc
    while todo is not None and all(todo is not s for s in seen):
        seen.append(todo)
        todo = todo.__cause__ or (None if todo.__suppress_context__ else todo.__context__)
    return seen


def shorten(exc: BaseException, tb: TracebackType | None = None) -> TracebackType | None:
    """Remove safesparse's frames from the traceback of every :class:`InvariantError` in
    ``exc``'s chain (``exc`` itself, its ``__cause__`` and ``__context__``), in place.

    Kept: every frame that is not safesparse's, except torch's frames called by safesparse.
    An exception that safesparse raised and handled on the way (a ``__context__`` whose frames
    are all safesparse's) is no longer shown. A note names the switch that shows everything.
    Does nothing when ``SAFESPARSE_TRACEBACK=full``; with a value that is neither ``short`` nor
    ``full``, it only adds a note saying so (the full traceback is shown).

    Args:
        exc: the exception about to be shown.
        tb: its traceback as the caller holds it (default: ``exc.__traceback__``).

    Returns:
        The head of ``exc``'s traceback after shortening, to show instead of ``tb``.
    """
    head = exc.__traceback__ if tb is None else tb
    chain = _chain(exc)
    errors = [e for e in chain if isinstance(e, InvariantError)]
    if not errors:
        return head
    current = mode()
    if current == "full":
        return head
    if current != "short":
        _note(errors[0], f"({ENV}={os.environ.get(ENV, '')!r} is neither 'short' nor "
                         "'full': the full traceback is shown)")
        return head
    removed = False
    for e in chain:
        if not isinstance(e, InvariantError):
            continue
        new, gone = _shorten_one(e, head if e is exc else e.__traceback__)
        removed |= gone
        if e is exc:
            head = new
        context = e.__context__
        if (context is not None and e.__cause__ is None and not e.__suppress_context__
                and all(_where(t).startswith(_OURS) for t in _entries(context.__traceback__))):
            e.__suppress_context__ = True  # safesparse's own business, handled on the way
    if removed:
        _note(errors[0], NOTE)
    return head


def _note(exc: BaseException, text: str) -> None:
    notes = getattr(exc, "__notes__", None)
    if notes is not None and text in notes:
        return
    add = getattr(exc, "add_note", None)  # Python 3.11+
    if add is not None:
        add(text)


# ---------------------------------------------------------------------------------------------
# Where uncaught errors are shown


def _sys_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(exc_type: type[BaseException], exc: BaseException,
                   tb: TracebackType | None) -> Any:
        if isinstance(exc, BaseException):
            tb = shorten(exc, tb)
        return previous(exc_type, exc, tb)

    excepthook.__wrapped__ = previous  # type: ignore[attr-defined]
    excepthook._safesparse = True  # type: ignore[attr-defined]
    return excepthook


def _thread_hook(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def excepthook(args: Any) -> Any:
        exc = args.exc_value
        if isinstance(exc, BaseException):
            tb = shorten(exc, args.exc_traceback)
            if tb is not args.exc_traceback:
                args = threading.ExceptHookArgs(
                    (args.exc_type, exc, tb, args.thread))
        return previous(args)

    excepthook.__wrapped__ = previous  # type: ignore[attr-defined]
    excepthook._safesparse = True  # type: ignore[attr-defined]
    return excepthook


def install() -> None:
    """Shorten uncaught ``InvariantError`` tracebacks wherever Python shows them: wraps
    ``sys.excepthook`` and ``threading.excepthook`` (once; the hooks in place are called with
    the shortened traceback). Called when safesparse is imported."""
    if not getattr(sys.excepthook, "_safesparse", False):
        sys.excepthook = _sys_hook(sys.excepthook)
    if not getattr(threading.excepthook, "_safesparse", False):
        threading.excepthook = _thread_hook(threading.excepthook)

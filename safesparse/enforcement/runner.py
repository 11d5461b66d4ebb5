"""``python -m safesparse run [--debug] script.py [args...]`` / ``run [--debug] -m module``.

Runs a program with enforce mode on (and debug mode with ``--debug``) the way ``python
script.py`` / ``python -m module`` would: ``sys.argv`` is ``[script, args...]`` (``python -m``
puts the module's file first), the code runs as ``__main__`` in a fresh module that replaces
``sys.modules["__main__"]`` (so pickling and multiprocessing find its classes),
``sys.path[0]`` is the script's directory (the current directory for ``-m``), the exit status
is the program's, and an uncaught exception prints the traceback Python would print, without
the runner's own frames, and exits 1 (an ``InvariantError`` also without safesparse's frames,
unless ``SAFESPARSE_TRACEBACK=full``: :mod:`safesparse.catalog.tracebacks`).

Protection is switched on for the whole process before the program imports anything
(:func:`protect_process`): enforce (and debug) mode become the default of every thread, and
``SAFESPARSE_ENFORCE=1`` (``SAFESPARSE_DEBUG=1``) are set so that subprocesses and DataLoader
workers, which run safesparse's startup hook, are protected too.
"""

from __future__ import annotations

import builtins
import os
import runpy
import signal
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

from safesparse_hooks import env

__all__ = ["USAGE", "main", "protect_process"]

USAGE = """\
usage: safesparse run [--debug] script.py [args ...]
       safesparse run [--debug] -m module [args ...]

Run a Python program with safesparse's enforce mode on: every sparse tensor torch builds
(factories, legacy and _unsafe constructors, Tensor.new, torch.load) is validated and torch's
index conversions check their input, in every thread, subprocess and DataLoader worker.
The program runs as `python script.py` / `python -m module` would run it.

options:
  --debug     debug mode too: every sparse input and result of every operation is validated
  -m module   run a library module as a script
  -h, --help  show this help and exit

A refusal (InvariantError) is shown without safesparse's own frames;
SAFESPARSE_TRACEBACK=full shows the whole traceback.
"""

_OWN_FILES = frozenset({
    os.path.normcase(os.path.abspath(__file__)),
    os.path.normcase(os.path.abspath(runpy.__file__)),
})


def protect_process(*, debug: bool = False) -> None:
    """Switch enforce mode (and, with ``debug``, debug mode) on for the whole process and, via
    the environment, for the processes it starts.

    Args:
        debug: also switch debug mode on.
    """
    os.environ[env.ENFORCE] = "1"
    if debug:
        os.environ[env.DEBUG] = "1"
    # (not `from . import enforce`: the package's attribute of that name is the function)
    from ..base.debug_flag import set_process_default as debug_default
    from .mode import set_process_default as enforce_default

    enforce_default(True)
    if debug:
        debug_default(True)


def _fail(message: str) -> int:
    sys.stderr.write(f"{USAGE}\nsafesparse run: error: {message}\n")
    return 2


def main(argv: Sequence[str]) -> int:
    """Parse ``run``'s arguments and run the program; returns the exit status (a program's
    ``sys.exit`` propagates as Python's would)."""
    args = list(argv)
    debug = False
    module: str | None = None
    while args:
        head = args[0]
        if head in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        if head == "--debug":
            debug = True
            args.pop(0)
        elif head == "-m":
            if len(args) < 2:
                return _fail("-m needs a module name")
            module = args[1]
            args = args[2:]
            break
        elif head.startswith("-m") and len(head) > 2:
            module = head[2:]
            args = args[1:]
            break
        elif head == "--":
            args.pop(0)
            break
        elif head.startswith("-"):
            return _fail(f"unknown option {head!r}")
        else:
            break
    if module is None and not args:
        return _fail("a script or -m module is required")
    try:
        protect_process(debug=debug)
    except ValueError as err:  # a bad SAFESPARSE_* value already in the environment
        sys.stderr.write(f"safesparse run: {err}\n")
        return 2
    if module is not None:
        return _run(lambda: _run_module(module, args))
    return _run(lambda: _run_script(args[0], args[1:]))


def _fresh_main() -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


def _run_script(script: str, args: list[str]) -> None:
    path = Path(script)
    if not path.exists():
        sys.stderr.write(f"{sys.executable}: can't open file {str(path.absolute())!r}: "
                         "[Errno 2] No such file or directory\n")
        raise SystemExit(2)
    sys.argv = [script, *args]
    if path.is_dir() or not path.is_file():  # a directory or zip file with __main__.py
        sys.path.insert(0, script)
        _fresh_main()
        runpy.run_path(script, run_name="__main__")
        return
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    filename = os.path.abspath(script)  # as Python >= 3.9 sets __main__.__file__
    with open(filename, "rb") as f:
        source = f.read()
    code = compile(source, filename, "exec", dont_inherit=True)
    main = _fresh_main()
    main.__dict__.update(__file__=filename, __cached__=None, __spec__=None, __package__=None,
                         __loader__=None)
    exec(code, main.__dict__)


def _run_module(module: str, args: list[str]) -> None:
    sys.argv = [module, *args]  # argv[0] becomes the module's file, as with python -m
    sys.path[0] = os.getcwd()
    _fresh_main()
    runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]


def _run(target: Callable[[], None]) -> int:
    try:
        target()
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and os.path.normcase(
                os.path.abspath(tb.tb_frame.f_code.co_filename)) in _OWN_FILES:
            tb = tb.tb_next
        from ..catalog.tracebacks import shorten

        tb = shorten(exc, tb)  # an InvariantError: without safesparse's frames
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # as Python: die of SIGINT
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0

"""The child process of a batch (tests/support/batch.py): runs its programs one after another.

``python batch_child.py SPEC OUTDIR``: SPEC is a JSON list of ``{"key", "code", "args"}``. Each
program runs as ``__main__`` in a namespace of its own, in an empty working directory of its
own, with ``sys.argv`` set to ``[key, *args]``, the warning filters and ``sys.path`` restored
after it, and its ``sys.stdout`` and ``sys.stderr`` going to ``OUTDIR/<i>.out`` and
``OUTDIR/<i>.err`` (line buffered, so what a program printed before a crash is there). Its exit
status (0, the code of ``SystemExit``, or 1 for any other exception, whose traceback goes to its
stderr) is written to ``OUTDIR/<i>.rc`` when it ends: a program with an ``.out`` file and no
``.rc`` file is the one the process died in.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    sys.path[0] = ""  # as under ``python -c``: the working directory, not this file's folder
    programs = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    home = os.getcwd()
    for i, program in enumerate(programs):
        workdir = outdir / f"{i}.cwd"
        workdir.mkdir()
        os.chdir(workdir)
        path = list(sys.path)
        status = 0
        with open(outdir / f"{i}.out", "w", buffering=1) as out, \
                open(outdir / f"{i}.err", "w", buffering=1) as err, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            sys.argv = [program["key"], *program["args"]]
            code = compile(program["code"], f"<batch program {program['key']!r}>", "exec")
            try:
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as exit_:
                status = _status(exit_.code)
            except BaseException:
                traceback.print_exc()
                status = 1
        os.chdir(home)
        sys.path[:] = path
        (outdir / f"{i}.rc").write_text(str(status))


if __name__ == "__main__":
    main()

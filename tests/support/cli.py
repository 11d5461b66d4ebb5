"""``safesparse``'s command line run in this process: its exit status and what it printed."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from safesparse import cli


def run_cli(*argv: str | Path) -> tuple[int, str]:
    """``cli.main(argv)``'s exit status and its standard output."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main([str(a) for a in argv])
    return code, buf.getvalue()

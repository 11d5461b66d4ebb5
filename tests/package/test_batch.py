"""The suite's batches (tests/support/batch.py): one child process runs many tests' programs, and
each test still sees what a child of its own would have shown it, a crash included."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from support.batch import Batch

EACH = Batch("self-test", env=dict(os.environ))
QUIET = EACH.add("quiet", "print('out'); import sys; print('err', file=sys.stderr)")
EXITS = EACH.add("exits", "import sys; print('bye', flush=True); sys.exit(3)", "a1", "a2")
RAISES = EACH.add("raises", "raise ValueError('no good')")
LEAVES = EACH.add("leaves", """
    import os, sys, warnings
    warnings.simplefilter("error")
    sys.path.append("/nowhere")
    open("left.txt", "w").write("x")
    sys.stdout.write(repr(sys.argv))
""", "x")
FINDS = EACH.add("finds", """
    import os, sys, warnings
    warnings.warn("only a warning")  # the filter the program before set is gone
    print(os.listdir("."), __name__, "/nowhere" in sys.path)
""")

CRASH = Batch("self-test crash", env=dict(os.environ))
BEFORE = CRASH.add("before", "print('fine')")
DIES = CRASH.add("dies", "import os; print('started', flush=True); os.abort()")
AFTER = CRASH.add("after", "print('never')")


@EACH.mark
def test_each_program_gets_its_own_status_output_and_directory() -> None:
    quiet, exits, raises = EACH.run(QUIET), EACH.run(EXITS), EACH.run(RAISES)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "out\n", "err\n")
    assert (exits.returncode, exits.stdout) == (3, "bye\n")
    assert raises.returncode == 1 and raises.stderr.rstrip().endswith("ValueError: no good")
    assert EACH.run(LEAVES).stdout == "['leaves', 'x']"
    finds = EACH.run(FINDS)
    assert finds.returncode == 0, finds.stderr
    assert finds.stdout == "[] __main__ False\n" and "only a warning" in finds.stderr


@CRASH.mark
@pytest.mark.skipif(sys.platform == "win32", reason="os.abort's status is POSIX's here")
def test_a_crash_fails_its_program_and_every_program_after_it() -> None:
    assert CRASH.run(BEFORE).returncode == 0
    dies = CRASH.run(DIES)
    assert dies.returncode == -signal.SIGABRT and dies.stdout == "started\n"
    assert "ended in this program" in dies.stderr
    after = CRASH.run(AFTER)
    assert after.returncode != 0 and after.stdout == ""
    assert "not run: the batch's child ended in program 'dies'" in after.stderr


def test_programs_are_added_before_the_batch_runs() -> None:
    batch = Batch("self-test late", env=dict(os.environ))
    key = batch.add("one", "pass")
    with pytest.raises(ValueError, match="already has"):
        batch.add("one", "pass")
    assert batch.run(key).returncode == 0
    with pytest.raises(RuntimeError, match="already run"):
        batch.add("two", "pass")

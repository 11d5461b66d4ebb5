"""The walk of ``crow_indices`` from ``ss.sparse_csr_tensor`` (tools/walk.py, issue 48): the
factories' straight path hands the caller's members to the engine's metadata stage and then
to the admission once, so the walk climbs back up into a higher layer at most once; by file at
most three times (the factory between the metadata stage and the admission; the admission
between opening the first validation, the engine's index stage and settling)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The walk in a fresh interpreter: in a test worker, what earlier tests left in the state
#: (index memory they registered, records dying meanwhile) can route a call off the straight
#: path (a full ``-n 2`` run saw 6 layer climbs twice, never alone); the shape measured here is
#: the straight path's, the first call of a process after a warm-up.
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import walk
call, target = walk.CASES[sys.argv[2]]()
call()
s = walk.summarize(walk.walk(call, target))
print(json.dumps({"layer_climbs": s.layer_climbs, "climbs": s.climbs, "lines": s.lines}))
"""


@pytest.mark.parametrize("case", ["int64", "int32"])
def test_the_straight_factory_path_climbs_back_up_three_files_one_layer(case: str) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "tools"), case],
                         capture_output=True, text=True, timeout=300, check=True)
    s = json.loads(out.stdout.strip().splitlines()[-1])
    lines = "\n".join(s["lines"])
    assert s["layer_climbs"] <= 1, lines
    assert s["climbs"] <= 3, lines
    # the first move into state/ is the one hand-off to the admission's straight path
    into_state = [line for line in s["lines"] if "-> state/" in line]
    assert into_state and "state/admission.py:straight" in into_state[0], lines

"""The walk of ``crow_indices`` from ``ss.sparse_csr_tensor`` (tools/walk.py, issue 48): the
factories' straight path hands the caller's members to the engine's metadata stage and then
to the admission once, so the walk climbs back up into a higher layer at most once; by file at
most three times (the factory between the metadata stage and the admission; the admission
between opening the first validation, the engine's index stage and settling)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("walk_tool", ROOT / "tools" / "walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["walk_tool"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["int64", "int32"])
def test_the_straight_factory_path_climbs_back_up_three_files_one_layer(case: str) -> None:
    walk = _tool()
    call, target = walk.CASES[case]()
    call()
    s = walk.summarize(walk.walk(call, target))
    assert s.layer_climbs <= 1
    assert s.climbs <= 3
    # the first move into state/ is the one hand-off to the admission's straight path
    into_state = [line for line in s.lines if "-> state/" in line]
    assert into_state and "state/admission.py:straight" in into_state[0]

"""Walk one argument of a safesparse call: which files of the package the argument visits.

The walk of ``crow_indices`` from ``ss.sparse_csr_tensor`` (issue 48) follows the argument from
the public factory to where it is validated and stored. A profile function
(:func:`sys.setprofile`) looks, at every call and return inside the package, for the innermost
frame of the package that holds the argument (the object itself, or a tensor on the same
memory: ``detach()``, an alias) among its locals. The walk is the sequence of those frames:

- a *hand-off* is a move of the walk into another file, one call deeper;
- a *climb back* is a move of the walk back up into a file higher in the chain that then hands
  off again (control went back up to hand the argument down once more: the shape a straight
  path avoids). Counted by file, and by layer (the subpackages of docs/design.md: a climb back
  up into a higher layer, e.g. the factories going back and forth between the engine and the
  checked state; moves between the files of one layer are not counted there).

Run from a checkout::

    python tools/walk.py                 # CSR from int64 members, checks on (the common case)
    python tools/walk.py --case int32    # int32 members
    python tools/walk.py --case list     # Python lists: the converting path
    python tools/walk.py --all           # every case, one summary line each

The output lists the steps (``file:function``), then ``hand-offs N across F files, climbs
back C (by file), L (by layer)``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

import safesparse as ss

PACKAGE = os.path.dirname(os.path.abspath(ss.__file__)) + os.sep


@dataclass(frozen=True)
class Step:
    """The innermost package frame holding the argument: its file, function and depth."""

    file: str
    function: str
    depth: int


def _is(value: Any, target: Any, ptr: int) -> bool:
    return value is target or (
        ptr != 0 and type(value) is torch.Tensor and value.layout is torch.strided
        and value.numel() > 0 and value.data_ptr() == ptr)


def _holds(frame: FrameType, target: Any, ptr: int) -> bool:
    """Whether a local of ``frame`` is ``target`` (or a tensor on its memory), directly or as
    an item of a tuple or list (``members=(c, p)``)."""
    for value in frame.f_locals.values():
        if _is(value, target, ptr):
            return True
        if type(value) in (tuple, list) and any(_is(v, target, ptr) for v in value):
            return True
    return False


def _position(frame: FrameType | None, target: Any, ptr: int) -> Step | None:
    """The innermost package frame at or above ``frame`` that holds ``target``."""
    depth = 0
    f = frame
    while f is not None:
        depth += 1
        f = f.f_back
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(PACKAGE) and _holds(f, target, ptr):
            return Step(os.path.relpath(name, PACKAGE), f.f_code.co_name, depth)
        depth -= 1
        f = f.f_back
    return None


def walk(call: Callable[[], Any], target: Any) -> list[Step]:
    """The steps of ``target`` through the package while ``call()`` runs (one entry per
    change of the innermost holding frame)."""
    ptr = target.data_ptr() if isinstance(target, torch.Tensor) and target.numel() else 0
    steps: list[Step] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return
        at = _position(frame if event == "call" else frame.f_back, target, ptr)
        if at is not None and (not steps or steps[-1] != at):
            steps.append(at)

    # (no cyclic collection while it walks: a collection that an earlier test's garbage
    # triggers runs the package's finalizers inside the call, steps that are not the call's)
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return steps


@dataclass
class Summary:
    hand_offs: int
    files: int
    climbs: int
    layer_climbs: int
    lines: list[str]


def _stops(steps: list[Step], key: Callable[[Step], str]) -> list[Step]:
    """Consecutive steps with one ``key`` (a file, a layer) as one stop, at its outermost
    depth."""
    stops: list[Step] = []
    for s in steps:
        if stops and key(stops[-1]) == key(s):
            if s.depth < stops[-1].depth:
                stops[-1] = s
            continue
        stops.append(s)
    return stops


def _climbs(stops: list[Step]) -> tuple[int, int, list[str]]:
    """Hand-offs (a move one call deeper) and climbs back (a move back up followed by a
    hand-off), with one line per move."""
    hand_offs = climbs = 0
    climbed = False
    lines = [f"  {stops[0].file}:{stops[0].function}"] if stops else []
    for prev, s in itertools.pairwise(stops):
        if s.depth > prev.depth:
            hand_offs += 1
            if climbed:
                climbs += 1
                climbed = False
            lines.append(f"  -> {s.file}:{s.function}  (hand-off {hand_offs})")
        else:
            climbed = True
            lines.append(f"  <- {s.file}:{s.function}  (back up)")
    return hand_offs, climbs, lines


def layer(s: Step) -> str:
    """The layer of a step: its subpackage (``state``, ``engine``...), or the module."""
    return s.file.split(os.sep)[0].removesuffix(".py")


def summarize(steps: list[Step]) -> Summary:
    """Hand-offs and climbs back of a walk, by file (consecutive steps in one file are one
    stop) and by layer (consecutive steps in one subpackage are one stop: the climbs back up
    into a higher layer)."""
    stops = _stops(steps, lambda s: s.file)
    hand_offs, climbs, lines = _climbs(stops)
    _, layer_climbs, _ = _climbs(_stops(steps, layer))
    return Summary(hand_offs, len({s.file for s in stops}), climbs, layer_climbs, lines)


CASES: dict[str, Callable[[], tuple[Callable[[], Any], Any]]] = {}


def _case(name: str) -> Callable[[Callable[[], tuple[Callable[[], Any], Any]]],
                                  Callable[[], tuple[Callable[[], Any], Any]]]:
    def add(f: Callable[[], tuple[Callable[[], Any], Any]]
            ) -> Callable[[], tuple[Callable[[], Any], Any]]:
        CASES[name] = f
        return f
    return add


def _matrix(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dense = (torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    t = dense.to_sparse_csr()
    return t.crow_indices().to(dtype), t.col_indices().to(dtype), t.values()


@_case("int64")
def _int64() -> tuple[Callable[[], Any], Any]:
    crow, col, values = _matrix(torch.int64)
    return (lambda: ss.sparse_csr_tensor(crow, col, values, (64, 64))), crow


@_case("int32")
def _int32() -> tuple[Callable[[], Any], Any]:
    crow, col, values = _matrix(torch.int32)
    return (lambda: ss.sparse_csr_tensor(crow, col, values, (64, 64))), crow


@_case("nosize")
def _nosize() -> tuple[Callable[[], Any], Any]:
    crow, col, values = _matrix(torch.int64)
    return (lambda: ss.sparse_csr_tensor(crow, col, values)), crow


@_case("list")
def _list() -> tuple[Callable[[], Any], Any]:
    crow, col, values = _matrix(torch.int64)
    crow_list = crow.tolist()
    return (lambda: ss.sparse_csr_tensor(crow_list, col.tolist(), values, (64, 64))), crow_list


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="int64")
    parser.add_argument("--all", action="store_true", help="every case, one line each")
    args = parser.parse_args(argv)
    for name in sorted(CASES) if args.all else [args.case]:
        call, target = CASES[name]()
        call()  # warm: imports and first-call caches are no part of the walk
        s = summarize(walk(call, target))
        if not args.all:
            print(f"crow_indices from ss.sparse_csr_tensor ({name}):")
            print("\n".join(s.lines))
        print(f"{name}: hand-offs {s.hand_offs} across {s.files} files, climbs back "
              f"{s.climbs} (by file), {s.layer_climbs} (by layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

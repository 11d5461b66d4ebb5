"""safesparse benchmark suite.

Usage (from the repository root)::

    python benchmarks/run.py                  # every group, full sizes (a few minutes)
    python benchmarks/run.py --quick          # smoke test: small sizes, short timings (< 60 s)
    python benchmarks/run.py --only validate  # one group (repeat --only for several)
    python benchmarks/run.py --sizes 1e5 1e6  # override the nnz sizes
    python benchmarks/run.py --list           # list the registered groups

The harness (timing, numeric tables, registry) is ``benchmarks/harness.py``; each group lives
in its own ``benchmarks/group_*.py``. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import group_blocks  # noqa: F401  (registers the group)
import group_debug  # noqa: F401
import group_transpose  # noqa: F401
import group_validate  # noqa: F401
import group_wrapper  # noqa: F401
from harness import (
    GROUPS,
    PROBLEMS,
    Config,
    header,
    set_safesparse_root,
)

DEFAULT_PLOT = Path(__file__).resolve().parent / "validation.png"


def parse_size(text: str) -> int:
    value = float(text)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive integer size: {text}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and short timings (CI smoke test, < 60 s)")
    parser.add_argument("--only", action="append", metavar="NAME", choices=sorted(GROUPS),
                        help="run only this group (repeatable)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="N",
                        help="nnz sizes, e.g. 1e4 1e5 (default: each group's own)")
    parser.add_argument("--min-run-time", type=float, default=None, metavar="S",
                        help="seconds of timing per statement (default 0.4, quick 0.05)")
    parser.add_argument("--rounds", type=int, default=None, metavar="R",
                        help="interleaved timing rounds per measurement (default 4, quick 2)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="statistic over the timed blocks (min: for a loaded machine)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's default)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write all tables (raw numbers) as JSON to PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="where the validate group writes its plot (default: "
                             "benchmarks/validation.png in a full run, none with --quick)")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--safesparse", type=Path, default=None, metavar="DIR",
                        help="import safesparse from this checkout instead (before/after)")
    parser.add_argument("--list", action="store_true", help="list the groups and exit")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse (CSR|BSR|CSC|BSC) tensor support is in beta")

    if args.list:
        for g in GROUPS.values():
            print(f"{g.name}: {g.description}")
        return 0
    if args.safesparse is not None:
        set_safesparse_root(args.safesparse)
    default_threads = torch.get_num_threads()
    threads = args.threads if args.threads is not None else default_threads
    torch.set_num_threads(threads)
    min_run_time = args.min_run_time if args.min_run_time is not None else (
        0.05 if args.quick else 0.4)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    plot = None if args.no_plot else args.plot if args.plot is not None else (
        None if args.quick or args.sizes else DEFAULT_PLOT)
    cfg = Config(quick=args.quick, sizes=tuple(args.sizes) if args.sizes else None,
                 min_run_time=min_run_time, rounds=max(rounds, 1), stat=args.stat,
                 threads=threads, plot=plot)

    print(header(cfg, default_threads), flush=True)
    results: dict[str, Any] = {"config": {**asdict(cfg), "plot": str(cfg.plot)},
                               "torch": torch.__version__, "groups": {}}
    for name in args.only or list(GROUPS):
        group = GROUPS[name]
        start = time.perf_counter()
        tables = group.fn(cfg)
        elapsed = time.perf_counter() - start
        for table in tables:
            print("\n" + table.render(), flush=True)
        print(f"\n_group {name}: {elapsed:.1f} s_", flush=True)
        results["groups"][name] = [t.as_json() for t in tables]
    results["problems"] = PROBLEMS
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if PROBLEMS:
        print("\nFAILED:", *PROBLEMS, sep="\n- ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Before/after table of the ``validate`` group from two ``run.py --json`` files.

    python benchmarks/run.py --only validate --safesparse OLD_CHECKOUT --json before.json
    python benchmarks/run.py --only validate --json after.json
    python benchmarks/compare.py before.json after.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Column, Table, fmt_n, fmt_ratio, fmt_time


def _rows(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    data = json.loads(path.read_text())
    (table,) = data["groups"]["validate"]
    cols = table["columns"]
    return {(r[0], r[1]): dict(zip(cols, r, strict=True)) for r in table["rows"]}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = _rows(Path(argv[0])), _rows(Path(argv[1]))
    table = Table("validate: before / after (safesparse / torch check_invariants=True)", [
        Column("case"), Column("nnz", fmt_n), Column("torch (before run)", fmt_time),
        Column("safesparse before", fmt_time), Column("ratio before", fmt_ratio),
        Column("torch (after run)", fmt_time), Column("safesparse after", fmt_time),
        Column("ratio after", fmt_ratio), Column("ratio after (min)", fmt_ratio),
    ])
    for key, a in after.items():
        b = before.get(key, {})
        table.add(key[0], key[1], b.get("torch checked"), b.get("safesparse"), b.get("ratio"),
                  a["torch checked"], a["safesparse"], a["ratio"], a["ratio (min)"])
    print(table.render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Group ``files``: safetensors checkpoints with a sparse weight, against plain safetensors.

``safesparse.safetensors.load_file`` of a checkpoint holding a large CSR weight (and a dense
bias) is timed against what a careful user of plain safetensors pays for the same thing:
``safetensors.torch.load_file`` of the same file (the members come back as dense tensors) plus
``torch.sparse_csr_tensor(..., check_invariants=True)`` on them. ``save_file`` is timed against
``safetensors.torch.save_file`` of the members. Files are written to a temporary directory
(reads come from the page cache; writes go through it).
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable

import torch
from common import DebugOff, checked_csr, large_size, make_csr
from harness import (
    SEED,
    Column,
    Config,
    Table,
    fmt_ms,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_text,
    fmt_verdict,
    judge,
    load_safesparse,
    measure,
    num,
    ratio,
    register,
    target_text,
)

#: (key, description, limit, unit): this group's targets, merged into benchmarks/targets.py.
TARGETS = [
    ("files.load_file",
     "safesparse.safetensors.load_file of a checkpoint with a CSR weight vs "
     "safetensors.torch.load_file of the same file + torch.sparse_csr_tensor(..., "
     "check_invariants=True); safesparse keeps the index members on a private copy (the "
     "file can be rewritten under a mapping), the baseline reads them from the mapping",
     2.2, "x"),
    ("files.save_file",
     "safesparse.safetensors.save_file vs safetensors.torch.save_file of the members",
     1.2, "x"),
]

COLUMNS = [
    Column("measurement"), Column("nnz", fmt_n), Column("safesparse (ms)", fmt_ms),
    Column("baseline"), Column("baseline (ms)", fmt_ms), Column("ratio", fmt_ratio),
    Column("target", fmt_text), Column("met", fmt_verdict), Column("spread", fmt_pct),
]


@register("files", "safetensors checkpoints with a sparse CSR weight: safesparse.safetensors "
          "load_file / save_file vs plain safetensors")
def bench_files(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    nnz = large_size(cfg)
    table = Table(f"files: safetensors checkpoint with a CSR weight (float32, int64 indices, "
                  f"nnz {fmt_n(nnz)})", COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    try:
        import safetensors.torch as st

        sst = load_safesparse("safetensors")
    except ImportError:
        table.notes.append("safetensors is not installed: pip install 'safesparse[safetensors]'.")
        return [table]
    if sst is None:
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    with DebugOff(ss), tempfile.TemporaryDirectory(prefix="safesparse-bench-") as tmp:
        inp = make_csr(nnz, gen)
        weight = checked_csr(ss, inp)
        bias = torch.rand(inp.size[0], generator=gen)
        size = inp.size
        members = {"w.__ss_crow_indices": inp.compressed, "w.__ss_col_indices": inp.plain,
                   "w.__ss_values": inp.values, "bias": bias}
        path = os.path.join(tmp, "ss.safetensors")
        sst.save_file({"w": weight, "bias": bias}, path)
        load_file, plain_load = sst.load_file, st.load_file

        def plain_load_and_build() -> object:
            f = plain_load(path)
            return torch.sparse_csr_tensor(f["w.__ss_crow_indices"], f["w.__ss_col_indices"],
                                           f["w.__ss_values"], size, check_invariants=True)

        fns: dict[str, Callable[[], object]] = {
            "ss": lambda: load_file(path), "plain": plain_load_and_build}
        tm = measure(fns, cfg, f"files load_file nnz={fmt_n(nnz)}")
        r = ratio(num(tm["ss"]), num(tm["plain"]))
        table.add("load_file (validated, checked result)", nnz, tm["ss"],
                  "st.load_file + check_invariants=True build", tm["plain"], r,
                  target_text("files.load_file"), judge("files.load_file", r), tm.max_spread())

        out_ss, out_plain = os.path.join(tmp, "out_ss"), os.path.join(tmp, "out_plain")
        save_file, plain_save = sst.save_file, st.save_file
        fns = {"ss": lambda: save_file({"w": weight, "bias": bias}, out_ss),
               "plain": lambda: plain_save(members, out_plain)}
        tm = measure(fns, cfg, f"files save_file nnz={fmt_n(nnz)}")
        r = ratio(num(tm["ss"]), num(tm["plain"]))
        table.add("save_file (checked weight)", nnz, tm["ss"], "st.save_file of the members",
                  tm["plain"], r, target_text("files.save_file"), judge("files.save_file", r),
                  tm.max_spread())
        fns.clear()
    gc.collect()
    table.notes += [
        "load_file: safesparse.safetensors.load_file (index members copied off the file "
        + "mapping, then handed to the validating factory, a checked SafeSparseTensor back) "
        + "vs safetensors.torch.load_file of the same file plus torch.sparse_csr_tensor(crow, "
        + "col, values, size, check_invariants=True), which reads the indices from the "
        + "mapping: another process rewriting the file changes them under the tensor. The "
        + "copy (safesparse.files.owned.own_copy, huge pages above 2 MiB) is the ratio's "
        + "floor: at 1e7 int64 indices, check ~7 ms + copy ~6.5 ms against the check alone.",
        "save_file: of {'w': checked CSR, 'bias'} (no validation: the weight is checked; "
        + "written through a temporary file renamed over the target) vs "
        + "safetensors.torch.save_file of the three members and the bias.",
        "The file sits in a temporary directory: reads come from the page cache, writes go "
        + "through it; spread above ~20% means a busy disk or machine, rerun.",
    ]
    return [table]

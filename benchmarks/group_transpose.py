"""Group ``transpose``: zero-copy transposes of checked tensors vs torch's transpose."""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType

import torch
from common import DebugOff, large_size, make_bsr, make_csr
from harness import (
    SEED,
    Column,
    Config,
    Table,
    diff,
    fmt_n,
    fmt_pct,
    fmt_ratio,
    fmt_signed_us,
    fmt_us,
    fmt_verdict,
    judge,
    load_safesparse,
    measure,
    ratio,
    register,
    target_text,
)
from inputs import CompressedInput

COLUMNS = [
    Column("layout"), Column("op"), Column("nnz", fmt_n), Column("torch (µs)", fmt_us),
    Column("safesparse (µs)", fmt_us),
    Column(f"overhead (µs, target {target_text('transpose.overhead')})", fmt_signed_us),
    Column(f"flat ratio (large/small, target {target_text('transpose.flat')})", fmt_ratio),
    Column("met", fmt_verdict),
    Column("spread", fmt_pct),
]
SMALL = 10**3
TORCH_REFUSES = "n/a (torch refuses)"


@register("transpose", "zero-copy transposes of checked CSR / BSR 4x4 / hybrid CSR: constant "
          "overhead over torch's transpose(-2, -1), flat in nnz")
def bench_transpose(cfg: Config) -> list[Table]:
    ss = load_safesparse()
    large = max(large_size(cfg), SMALL)
    table = Table("transpose: .mT / transpose on checked tensors vs torch's transpose(-2, -1)",
                  COLUMNS)
    if ss is None:
        table.notes.append("safesparse could not be imported: nothing to measure.")
        return [table]
    gen = torch.Generator().manual_seed(SEED)
    cases: list[tuple[str, Callable[[int], CompressedInput], int, int]] = [
        # (label, maker, small nnz, large nnz); BSR counts stored elements (16 per block)
        ("CSR", lambda n: make_csr(n, gen), SMALL, large),
        ("BSR 4x4", lambda n: make_bsr(n, gen), 16 * SMALL, max(large, 16 * 10**3)),
        ("CSR hybrid (dense_dim=1)", lambda n: _hybrid(make_csr(n, gen)), SMALL, large),
    ]
    with DebugOff(ss):
        for label, make, n_small, n_large in cases:
            small: dict[str, float | str] = {}
            for n in (n_small, n_large):
                inp = make(n)
                _rows(table, cfg, ss, label, inp, small)
                del inp
                gc.collect()
    table.notes += [
        "Tensors are checked (built by ss.sparse_*_tensor); the results are checked views "
        + "(no copy, no validation). torch: plain.transpose(-2, -1) on the same tensor "
        + "unwrapped (torch also returns a CSC / BSC view for non-hybrid layouts).",
        "Hybrid CSR has values (nnz, 2): its sparse dims are 0 and 1, so safesparse's op is "
        + "transpose(0, 1); torch refuses any transpose of a hybrid compressed tensor.",
        f"Sizes: small = {fmt_n(SMALL)} stored elements (BSR: {fmt_n(SMALL)} blocks of 4x4), "
        + f"large = {fmt_n(large)} stored elements.",
        "overhead = safesparse - torch; flat ratio = safesparse large / safesparse small "
        + "(same op), on the large row.",
    ]
    return [table]


def _hybrid(inp: CompressedInput) -> CompressedInput:
    """The same index data with values (nnz, 2): dense_dim=1."""
    values = torch.rand(inp.values.shape[0], 2)
    return CompressedInput(inp.compressed, inp.plain, values, (*inp.size, 2), inp.layout,
                           inp.nnz)


def _rows(table: Table, cfg: Config, ss: ModuleType, label: str, inp: CompressedInput,
          small: dict[str, float | str]) -> None:
    factory = {torch.sparse_csr: ss.sparse_csr_tensor,
               torch.sparse_bsr: ss.sparse_bsr_tensor}[inp.layout]
    t = factory(inp.compressed, inp.plain, inp.values, inp.size)
    plain = ss.unwrap(t)
    hybrid = inp.values.dim() > (3 if inp.layout == torch.sparse_bsr else 1)
    ops: dict[str, Callable[[], object]] = (
        {"transpose(0, 1)": lambda: t.transpose(0, 1)} if hybrid else
        {".mT": lambda: t.mT, "transpose(-2, -1)": lambda: t.transpose(-2, -1)})
    fns: dict[str, Callable[[], object]] = dict(ops)
    torch_refuses = False
    try:
        plain.transpose(-2, -1)
        fns["torch"] = lambda: plain.transpose(-2, -1)
    except RuntimeError:
        torch_refuses = True
    tm = measure(fns, cfg, f"transpose {label} nnz={fmt_n(inp.nnz)}")
    t_torch = None if torch_refuses else tm["torch"]
    is_large = bool(small)
    for op in ops:
        t_ss = tm[op]
        if not is_large:
            small[op] = t_ss
        flat = ratio(t_ss, small[op]) if is_large else None
        overhead = diff(t_ss, t_torch)
        oks = [x for x in (judge("transpose.overhead", overhead),
                           judge("transpose.flat", flat)) if x is not None]
        table.add(label, op, inp.nnz, TORCH_REFUSES if torch_refuses else t_torch, t_ss,
                  overhead, flat, int(all(oks)) if oks else None, tm.max_spread())

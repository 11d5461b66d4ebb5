"""The diagnostic path of validation: runs only after the fast path refused the index data,
and finds the first violation (id, batch, line, position, value) in catalog order. It may sync
as often as it likes; the happy path never reaches it.
"""

from __future__ import annotations

import torch

from ..catalog.errors import InvariantError
from ..catalog.invariants import explain
from .masks import (
    bad_counts,
    bad_first,
    bad_last,
    bad_lines,
    bad_negative,
    bad_order,
    bad_too_large,
    coo_bad_order,
)
from .metadata import CompressedMeta, CooMeta

# --------------------------------------------------------------------------------------------
# Diagnostic path: runs only after the fast path failed; may sync as often as it likes.


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of ``mask`` in row-major order, or None."""
    hit = mask.nonzero()
    return tuple(int(x) for x in hit[0].tolist()) if hit.shape[0] else None


def _batch_index(meta: CompressedMeta, b: int) -> tuple[int, ...]:
    idx: list[int] = []
    for extent in reversed(meta.batch):
        idx.append(b % extent)
        b //= extent
    return tuple(reversed(idx))


def _where(meta: CompressedMeta, b: int) -> str:
    return f"batch {_batch_index(meta, b)}, " if meta.batch else ""


def _fail(layout: torch.layout, iid: str, detail: str, words: dict[str, object],
          case: str = "", **location: object) -> InvariantError:
    """The error for ``iid`` with its location (``detail``, ``location``) and the violation
    in plain words (the catalog's template for ``case``, filled with ``words``)."""
    return InvariantError(layout, iid, detail, location=location,
                          explanation=explain(layout, iid, case, **words))


def diagnose_compressed(
    meta: CompressedMeta, c: torch.Tensor, p: torch.Tensor, n_plain: int
) -> InvariantError:
    """The first violated index invariant of a compressed tensor (5.1 ... 5.6) with location."""
    info, lay = meta.info, meta.info.layout
    cn, pn = info.compressed_name, info.plain_name
    hit = _first(bad_first(c))
    if hit is not None:
        (b,) = hit
        v = int(c[b, 0])
        return _fail(lay, "5.1", f"{_where(meta, b)}{cn}[0] = {v}", {"value": v},
                     batch=_batch_index(meta, b), position=0, value=v)
    hit = _first(bad_last(c, meta.nnz))
    if hit is not None:
        (b,) = hit
        v = int(c[b, -1])
        return _fail(lay, "5.2", f"{_where(meta, b)}{cn}[{meta.n_compressed}] = {v}, "
                     f"nnz = {meta.nnz}", {"value": v, "nnz": meta.nnz},
                     batch=_batch_index(meta, b), position=meta.n_compressed, value=v)
    # A line whose count is out of range first; the [0, nnz] guard of bad_lines flags the
    # line *before* an out-of-range offset, whose own count may be fine.
    hit = _first(bad_counts(c, n_plain))
    counts_ok = hit is None
    if counts_ok:
        hit = _first(bad_lines(c, meta.nnz, n_plain))
    if hit is not None:
        b, i = hit
        lo, hi = int(c[b, i]), int(c[b, i + 1])
        what = (f"{cn}[{i + 1}] = {hi} lies outside [0, nnz = {meta.nnz}]" if counts_ok
                else f"{cn}[{i + 1}] - {cn}[{i}] = {hi} - {lo} = {hi - lo}, n_plain = {n_plain}")
        case = "outside" if counts_ok else "negative" if hi < lo else ""
        words: dict[str, object] = {"index": i, "count": hi - lo, "n_plain": n_plain,
                                     "position": i + 1, "offset": hi, "nnz": meta.nnz,
                                     "previous": lo, "value": hi}
        return _fail(lay, "5.3", f"{_where(meta, b)}{info.line} {i}: {what}", words, case,
                     batch=_batch_index(meta, b), **{info.line.replace(" ", "_"): i},
                     position=i + 1, value=hi - lo)
    for iid, mask in (
        ("5.4", bad_negative(p)),
        ("5.5", bad_too_large(p, n_plain)),
    ):
        hit = _first(mask)
        if hit is not None:
            b, j = hit
            return _located(meta, c, p, iid, b, j, f"{pn}[{j}] = {int(p[b, j])}"
                            + (f", n_plain = {n_plain}" if iid == "5.5" else ""),
                            {"n_plain": n_plain})
    hit = _first(bad_order(c, p))
    if hit is not None:
        b, j = hit
        cur, prev = int(p[b, j + 1]), int(p[b, j])
        return _located(meta, c, p, "5.6", b, j + 1,
                        f"{pn}[{j + 1}] = {cur} does not exceed {pn}[{j}] = {prev}",
                        {"previous": prev}, "duplicate" if cur == prev else "")
    raise AssertionError("fast path rejected a tensor the diagnostic path accepts")


def _located(meta: CompressedMeta, c: torch.Tensor, p: torch.Tensor, iid: str, b: int, j: int,
             what: str, words: dict[str, object], case: str = "") -> InvariantError:
    line = int(torch.searchsorted(c[b].contiguous(), j, right=True)) - 1
    info = meta.info
    value = int(p[b, j])
    return _fail(info.layout, iid, f"{_where(meta, b)}{info.line} {line}, position {j}: {what}",
                 {"value": value, "index": line, **words}, case,
                 batch=_batch_index(meta, b), **{info.line.replace(" ", "_"): line},
                 position=j, value=value)


def diagnose_coo(meta: CooMeta, indices: torch.Tensor, *, is_coalesced: bool) -> InvariantError:
    lay = torch.sparse_coo
    hit = _first(bad_negative(indices).t())
    if hit is not None:
        j, d = hit
        v = int(indices[d, j])
        return _fail(lay, "5.1", f"position {j}, sparse dim {d}: indices[{d}, {j}] = {v}",
                     {"value": v, "dim": d, "bound": meta.size[d],
                      "sparse_dim": meta.sparse_dim},
                     position=j, dim=d, value=v)
    bounds = torch.tensor(meta.size[:meta.sparse_dim], dtype=torch.int64,
                          device=indices.device).unsqueeze(1)
    hit = _first(bad_too_large(indices, bounds).t())
    if hit is not None:
        j, d = hit
        v = int(indices[d, j])
        return _fail(lay, "5.2", f"position {j}, sparse dim {d}: indices[{d}, {j}] = {v}, "
                     f"size[{d}] = {meta.size[d]}",
                     {"value": v, "dim": d, "bound": meta.size[d],
                      "sparse_dim": meta.sparse_dim},
                     position=j, dim=d, value=v)
    if is_coalesced:
        hit = _first(coo_bad_order(indices))
        if hit is not None:
            (j,) = hit
            cur, prev = tuple(indices[:, j + 1].tolist()), tuple(indices[:, j].tolist())
            return _fail(lay, "5.3", f"position {j + 1}: index {cur} does not follow {prev}",
                         {"index": cur, "previous": prev},
                         "duplicate" if cur == prev else "", position=j + 1, value=cur)
    raise AssertionError("fast path rejected a tensor the diagnostic path accepts")


__all__ = [
    "diagnose_compressed",
    "diagnose_coo",
]

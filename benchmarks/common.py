"""Helpers shared by the wrapper, transpose and debug groups."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from harness import Config
from inputs import CompressedInput, make_compressed


def main_size(cfg: Config) -> int:
    """The one size of the wrapper and debug groups: 1e6 (full), 1e5 (quick), or the largest
    ``--sizes`` entry when that is smaller."""
    default = 10**5 if cfg.quick else 10**6
    return default if cfg.sizes is None else min(default, max(cfg.sizes))


def large_size(cfg: Config) -> int:
    """The large size of the transpose group: 1e7 (full), 1e5 (quick), or the largest
    ``--sizes`` entry."""
    default = 10**5 if cfg.quick else 10**7
    return default if cfg.sizes is None else max(cfg.sizes)


def make_csr(nnz: int, gen: torch.Generator) -> CompressedInput:
    return make_compressed(nnz, torch.sparse_csr, gen)


def make_bsr(nnz: int, gen: torch.Generator, block: int = 4) -> CompressedInput:
    """``nnz`` stored elements in ``block`` x ``block`` blocks (nnz / block**2 blocks)."""
    out = make_compressed(max(nnz // (block * block), 1), torch.sparse_bsr, gen, block=block)
    out.nnz *= block * block
    return out


def checked_csr(ss: ModuleType, inp: CompressedInput) -> torch.Tensor:
    """A checked SafeSparseTensor built by the safe factory (one full validation)."""
    t: torch.Tensor = ss.sparse_csr_tensor(inp.compressed, inp.plain, inp.values, inp.size)
    return t


class DebugOff:
    """Context: debug mode off for the block (a ``SAFESPARSE_DEBUG=1`` environment would
    otherwise turn every cache hit into a full validation), restored on exit."""

    def __init__(self, ss: ModuleType | None) -> None:
        self.ss = ss
        self.saved = False

    def __enter__(self) -> None:
        if self.ss is not None:
            self.saved = bool(self.ss.is_debug())
            self.ss.set_debug(False)

    def __exit__(self, *exc: object) -> None:
        if self.ss is not None:
            self.ss.set_debug(self.saved)


def stats_delta(ss: ModuleType, fn: Callable[[], object]) -> tuple[int, int]:
    """(validations, skipped) counted by ``ss.stats()`` during one call of ``fn``."""
    before = ss.stats()
    fn()
    after = ss.stats()
    return after.validations - before.validations, after.skipped - before.skipped

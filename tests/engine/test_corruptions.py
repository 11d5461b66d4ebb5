"""Every reachable invariant, broken on purpose, is refused with its own id and location.

The main table pairs a layout, an invariant id and a corruption of a valid tensor that breaks
exactly that invariant. Each corruption prepares its (bad) inputs and returns a zero-argument
call; the call runs with torch's sparse constructors replaced by a spy, so a refused input is
also shown never to have reached a torch sparse kernel.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from support.strategies import SS_FACTORIES, TORCH_FACTORIES, layout_id

import safesparse as ss
import safesparse.base.originals as ss_originals
from safesparse.catalog.errors import source_name

CSR, CSC, BSR, BSC, COO = (
    torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc, torch.sparse_coo,
)
COMPRESSED = (CSR, CSC, BSR, BSC)
BLOCKED = (BSR, BSC)
LINE = {CSR: "row", CSC: "column", BSR: "block row", BSC: "block column"}
I64_MAX = 2**63 - 1
I32_MAX = 2**31 - 1
HAS_CUDA = torch.cuda.is_available()


# --- valid starting points ---------------------------------------------------------------------

# Block pattern of one batch: 3 block rows x 2 block columns; block row 1 is empty and the first
# line holds two entries in every layout.
PATTERN = torch.tensor([[1, 1], [0, 0], [1, 0]], dtype=torch.bool)


@dataclass
class Members:
    """The inputs of a compressed factory call (or COO: ``compressed`` holds the indices)."""

    layout: torch.layout
    compressed: torch.Tensor
    plain: torch.Tensor | None
    values: torch.Tensor
    size: tuple[int, ...]

    def call(self, **kwargs: Any) -> Callable[[], torch.Tensor]:
        factory = SS_FACTORIES[self.layout]
        args = (self.compressed, self.values) if self.layout == COO else (
            self.compressed, self.plain, self.values)
        return lambda: factory(*args, self.size, **kwargs)

    def torch_unchecked(self) -> torch.Tensor:
        factory = TORCH_FACTORIES[self.layout]
        args = (self.compressed, self.values) if self.layout == COO else (
            self.compressed, self.plain, self.values)
        return factory(*args, self.size, check_invariants=False)


def base(layout: torch.layout, *, batch: tuple[int, ...] = (), hybrid: bool = False,
         index_dtype: torch.dtype = torch.int64) -> Members:
    """A valid tensor: 6 x 6 (block 2 x 3 for BSR/BSC), empty line(s), nnz > 1."""
    blocksize = (2, 3) if layout in BLOCKED else (1, 1)
    grid = PATTERN if layout in BLOCKED else PATTERN.repeat_interleave(2, 0).repeat(1, 3)
    mask = torch.kron(grid.long(), torch.ones(blocksize, dtype=torch.long)).bool()
    dense_extra = (2,) if hybrid else ()
    dense = torch.arange(1.0, 1 + mask.numel() * (2 if hybrid else 1))
    dense = dense.reshape(*mask.shape, *dense_extra) * mask.reshape(*mask.shape, *(
        (1,) if hybrid else ()))
    if layout == COO:
        t = dense.to_sparse(2).coalesce()
        return Members(COO, t._indices(), None, t._values(), tuple(t.shape))
    dense = dense.expand(*batch, *dense.shape).clone()
    dd = 1 if hybrid else 0
    t = {
        CSR: lambda: dense.to_sparse_csr(dense_dim=dd),
        CSC: lambda: dense.to_sparse_csc(dense_dim=dd),
        BSR: lambda: dense.to_sparse_bsr(blocksize, dense_dim=dd),
        BSC: lambda: dense.to_sparse_bsc(blocksize, dense_dim=dd),
    }[layout]()
    if layout in (CSR, BSR):
        c, p = t.crow_indices(), t.col_indices()
    else:
        c, p = t.ccol_indices(), t.row_indices()
    return Members(layout, c.to(index_dtype), p.to(index_dtype), t.values(), tuple(t.shape))


def test_bases_are_valid() -> None:
    for layout in (*COMPRESSED, COO):
        for batch in ((), (2,)) if layout != COO else ((),):
            for hybrid in (False, True):
                m = base(layout, batch=batch, hybrid=hybrid)
                t = m.call()()
                assert ss.is_checked(t)
                assert torch.equal(t.to_dense(), m.torch_unchecked().to_dense())
                if layout != COO:
                    assert m.plain is not None and m.plain.shape[-1] > 2


# --- spy: refused input never reaches a torch sparse constructor -------------------------------

SPARSE_CONSTRUCTORS = (
    "sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
    "sparse_bsc_tensor", "sparse_compressed_tensor", "_sparse_coo_tensor_unsafe",
    "_sparse_compressed_tensor_unsafe", "_sparse_csr_tensor_unsafe",
)


@pytest.fixture
def torch_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    calls: list[str] = []
    for name in SPARSE_CONSTRUCTORS:
        original = getattr(torch, name, None)
        if original is None:
            continue

        def spy(*args: Any, _name: str = name, _orig: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _orig(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
        # safesparse calls torch's factories as held at import (safesparse.base.originals)
        if hasattr(ss_originals, name):
            monkeypatch.setattr(ss_originals, name, spy)
    yield calls


# --- corruption helpers ------------------------------------------------------------------------


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """Same data, every other element of a wider buffer."""
    out = torch.stack([t, t], dim=-1)[..., 0]
    assert torch.equal(out, t) and not out.is_contiguous()
    return out


def with_value(t: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


def qint8(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated
        return torch.quantize_per_tensor(values.float(), 0.5, 0, torch.qint8)


def compressed_table() -> list[tuple[torch.layout, str, str, Callable[[Members], Any]]]:
    """(layout, id, description, corrupt) for every compressed layout."""
    rows: list[tuple[str, str, Callable[[Members], Any]]] = [
        ("1.1", "float compressed", lambda m: replace(m, compressed=m.compressed.float()).call()),
        ("1.2", "float plain", lambda m: replace(m, plain=m.plain.double()).call()),
        ("1.2", "int32 compressed, int64 plain",
         lambda m: replace(m, compressed=m.compressed.int()).call()),
        ("1.2", "int64 compressed, int32 plain", lambda m: replace(m, plain=m.plain.int()).call()),
        ("1.3", "both float",
         lambda m: replace(m, compressed=m.compressed.float(), plain=m.plain.float()).call()),
        ("1.3", "both int16",
         lambda m: replace(m, compressed=m.compressed.short(), plain=m.plain.short()).call()),
        ("1.3", "both uint8",
         lambda m: replace(m, compressed=m.compressed.to(torch.uint8),
                           plain=m.plain.to(torch.uint8)).call()),
        ("1.5", "quantized values", lambda m: replace(
            m, values=qint8(m.values)).call()),
        ("2.1", "sparse compressed", lambda m: replace(
            m, compressed=m.compressed.to_sparse()).call()),
        ("2.2", "sparse plain", lambda m: replace(m, plain=m.plain.to_sparse()).call()),
        ("2.3", "sparse values", lambda m: replace(m, values=m.values.to_sparse()).call()),
        ("3.1", "size with one dim", lambda m: replace(m, size=m.size[:1]).call()),
        ("3.1", "empty size", lambda m: replace(m, size=()).call()),
        ("3.1", "negative size", lambda m: replace(m, size=(m.size[0], -m.size[1])).call()),
        ("3.2", "compressed with an extra dim",
         lambda m: replace(m, compressed=m.compressed[None]).call()),
        ("3.2", "0-dim compressed",
         lambda m: replace(m, compressed=m.compressed[0]).call()),
        ("3.3", "plain with an extra dim", lambda m: replace(m, plain=m.plain[None]).call()),
        ("3.3", "0-dim plain", lambda m: replace(m, plain=m.plain[0]).call()),
        ("3.4", "values with an extra trailing dim",
         lambda m: replace(m, values=m.values[..., None]).call()),
        ("3.4", "0-dim values", lambda m: replace(m, values=m.values.flatten()[0]).call()),
        # the factories copy such members (as torch requires them); validate refuses them
        ("3.5", "torch tensor holding a non-contiguous compressed member (validate)",
         lambda m: (lambda t: lambda: ss.validate(t))(
             replace(m, compressed=noncontiguous(m.compressed)).torch_unchecked())),
        ("3.6", "torch tensor holding a non-contiguous plain member (validate)",
         lambda m: (lambda t: lambda: ss.validate(t))(
             replace(m, plain=noncontiguous(m.plain)).torch_unchecked())),
        ("3.7", "torch tensor holding non-contiguous values (validate)",
         lambda m: (lambda t: lambda: ss.validate(t))(
             replace(m, values=noncontiguous(m.values)).torch_unchecked())),
        ("3.8", "compressed one entry too long", lambda m: replace(
            m, compressed=torch.cat([m.compressed, m.compressed[-1:]])).call()),
        ("3.8", "size with an extra compressed line", lambda m: replace(
            m, size=grow_compressed(m)).call()),
        ("3.10", "values one entry short", lambda m: replace(m, values=m.values[:-1]).call()),
        ("3.10", "values one entry long", lambda m: replace(
            m, values=torch.cat([m.values, m.values[:1]])).call()),
        ("4.1", "device='meta'", lambda m: m.call(device="meta")),
        ("4.1", "all members on meta", lambda m: replace(
            m, compressed=m.compressed.to("meta"), plain=m.plain.to("meta"),
            values=m.values.to("meta")).call()),
        ("4.2", "compressed on another device (meta)", lambda m: replace(
            m, compressed=m.compressed.to("meta")).call()),
        ("4.3", "plain on another device (meta)", lambda m: replace(
            m, plain=m.plain.to("meta")).call()),
        ("5.1", "compressed[0] = 1", lambda m: replace(
            m, compressed=with_value(m.compressed, (0,), 1)).call()),
        ("5.2", "compressed[-1] = nnz - 1", lambda m: replace(
            m, compressed=with_value(m.compressed, (-1,), m.plain.shape[-1] - 1)).call()),
        ("5.2", "compressed[-1] = nnz + 1", lambda m: replace(
            m, compressed=with_value(m.compressed, (-1,), m.plain.shape[-1] + 1)).call()),
        ("5.3", "compressed decreasing", lambda m: replace(
            m, compressed=with_value(m.compressed, (1,), m.compressed[2].item() + 1)).call()),
        ("5.3", "a line longer than n_plain", lambda m: too_many_in_line(m).call()),
        ("5.4", "negative plain index", lambda m: replace(
            m, plain=with_value(m.plain, (0,), -1)).call()),
        ("5.5", "plain index == n_plain", lambda m: replace(
            m, plain=with_value(m.plain, (m.plain.shape[-1] - 1,), n_plain(m))).call()),
        ("5.6", "duplicate plain index in a line", lambda m: replace(
            m, plain=with_value(m.plain, (1,), m.plain[0].item())).call()),
        ("5.6", "unsorted plain indices in a line", lambda m: replace(
            m, plain=m.plain[[1, 0, *range(2, m.plain.shape[-1])]]).call()),
    ]
    blocked_rows: list[tuple[str, str, Callable[[Members], Any]]] = [
        ("3.1", "size not divisible by the blocksize", lambda m: replace(
            m, size=(m.size[0] + 1, m.size[1])).call()),
        ("3.4", "values without block dims", lambda m: replace(
            m, values=m.values[:, 0, 0].contiguous()).call()),
        ("3.4", "non-contiguous values without block dims", lambda m: replace(
            m, values=m.values[:, 0, 0]).call()),
        ("3.7", "torch tensor holding block-strided values (validate)",
         lambda m: (lambda t: lambda: ss.validate(t))(
             replace(m, values=torch.cat([m.values, m.values], -1)[..., ::2]).torch_unchecked())),
    ]
    out = []
    for layout in COMPRESSED:
        for iid, what, fn in rows + (blocked_rows if layout in BLOCKED else []):
            out.append((layout, iid, what, fn))
    return out


def n_plain(m: Members) -> int:
    return m.size[1] // m.values.shape[2] if m.layout == BSR else (
        m.size[0] // m.values.shape[1] if m.layout == BSC else (
            m.size[1] if m.layout == CSR else m.size[0]))


def grow_compressed(m: Members) -> tuple[int, ...]:
    b = m.values.shape[1:3] if m.layout in BLOCKED else (1, 1)
    rows, cols = m.size[0], m.size[1]
    return (rows + b[0], cols) if m.layout in (CSR, BSR) else (rows, cols + b[1])


def too_many_in_line(m: Members) -> Members:
    """All entries in line 0, one plain slot fewer than entries.

    (By pigeonhole such a line also breaks 5.5 or 5.6; 5.3 comes first in id order.)
    """
    b = m.values.shape[1:3] if m.layout in BLOCKED else (1, 1)
    c = torch.zeros_like(m.compressed)
    c[1:] = m.plain.shape[-1]
    plain = torch.arange(m.plain.shape[-1], dtype=m.plain.dtype)
    extent = m.plain.shape[-1] - 1  # one slot short
    size = (m.size[0], extent * b[1]) if m.layout in (CSR, BSR) else (extent * b[0], m.size[1])
    return replace(m, compressed=c, plain=plain, size=size)


def coo_table() -> list[tuple[torch.layout, str, str, Callable[[Members], Any]]]:
    rows: list[tuple[str, str, Callable[[Members], Any]]] = [
        ("1.2", "quantized values", lambda m: replace(
            m, values=qint8(m.values)).call()),
        ("2.1", "sparse indices", lambda m: replace(
            m, compressed=m.compressed.to_sparse()).call()),
        ("2.2", "sparse values", lambda m: replace(m, values=m.values.to_sparse()).call()),
        ("3.1", "1-D indices", lambda m: replace(m, compressed=m.compressed[0]).call()),
        ("3.1", "3-D indices", lambda m: replace(m, compressed=m.compressed[None]).call()),
        ("3.2", "more sparse dims than size", lambda m: replace(m, size=m.size[:1]).call()),
        ("3.2", "negative size", lambda m: replace(m, size=(m.size[0], -1)).call()),
        ("3.3", "values hold fewer entries", lambda m: replace(m, values=m.values[:-1]).call()),
        ("3.3", "indices hold fewer entries", lambda m: replace(
            m, compressed=m.compressed[:, :-1].contiguous()).call()),
        ("3.4", "values with a dense dim the size lacks", lambda m: replace(
            m, values=m.values[:, None]).call()),
        ("3.4", "dense size disagrees", lambda m: replace(
            m, values=m.values[:, None].expand(-1, 2).contiguous(), size=(*m.size, 3)).call()),
        ("4.1", "device='meta'", lambda m: m.call(device="meta")),
        ("4.1", "all members on meta", lambda m: replace(
            m, compressed=m.compressed.to("meta"), values=m.values.to("meta")).call()),
        ("4.2", "indices on another device (meta)", lambda m: replace(
            m, compressed=m.compressed.to("meta")).call()),
        ("5.1", "negative index", lambda m: replace(
            m, compressed=with_value(m.compressed, (1, 2), -1)).call()),
        ("5.2", "index == size", lambda m: replace(
            m, compressed=with_value(m.compressed, (0, 3), m.size[0])).call()),
        ("5.2", "index == int64 max", lambda m: replace(
            m, compressed=with_value(m.compressed, (1, 0), I64_MAX)).call()),
        ("5.3", "coalesced flag on unsorted indices", lambda m: replace(
            m, compressed=m.compressed[:, [1, 0, *range(2, m.compressed.shape[1])]]
        ).call(is_coalesced=True)),
        ("5.3", "coalesced flag on duplicate indices", lambda m: replace(
            m, compressed=m.compressed[:, [0, 0, *range(1, m.compressed.shape[1] - 1)]]
        ).call(is_coalesced=True)),
    ]
    return [(COO, iid, what, fn) for iid, what, fn in rows]


TABLE = compressed_table() + coo_table()
#: The longest first line a refusal may have (what is wrong and where; issue 33).
FIRST_LINE_MAX = 200

# Rows that currently fail: (id, description) -> reason. The lead removes an entry with the fix.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _table_params() -> list[Any]:
    params = []
    for lay, iid, what, fn in TABLE:
        bug = KNOWN_BUGS.get((iid, what))
        marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
        params.append(pytest.param(lay, iid, fn, id=f"{layout_id(lay)}-{iid}-{what}",
                                   marks=marks))
    return params


@pytest.mark.parametrize(("layout", "iid", "corrupt"), _table_params())
def test_corruption_is_refused_with_its_id(
    layout: torch.layout, iid: str, corrupt: Callable[[Members], Any], torch_spy: list[str]
) -> None:
    call = corrupt(base(layout))
    torch_spy.clear()
    with pytest.raises(ss.InvariantError) as excinfo:
        call()
    err = excinfo.value
    assert (err.layout, err.invariant) == (layout, iid), str(err)
    assert str(err).startswith(f"[{layout_id(layout)} {iid}] ")
    assert ss.CATALOG["coo" if layout == COO else "compressed"][iid].text in str(err)
    # the first line says what and where, short; the repair hint (if any) on the last line
    first, *rest = str(err).splitlines()
    assert len(first) <= FIRST_LINE_MAX, first
    assert (rest[-1] == f"to repair: {err.hint}") if err.hint else "to repair" not in str(err)
    assert not torch_spy, f"refused input reached a torch sparse constructor: {torch_spy}"


#: A directory deep enough that a file's path alone runs past FIRST_LINE_MAX, and a script in it.
LONG_DIR = os.path.join(os.sep, "tmp", *(["a-directory-of-some-experiment-series"] * 8))
LONG_SCRIPT = "train_graph_attention_on_citations.py"
#: Whatever enforce mode names a file by (base name and line) is no longer than this.
PROVENANCE = {"key": "['model']['encoder.layers.11.attention.adjacency']",
              "file": "checkpoint-epoch-0042.pt"}


def _torch_factory_in(path: str, name: str) -> Callable[..., Any]:
    """torch's own ``torch.<name>``, called (line 2) from code whose file is ``path``."""
    code = compile(f"def build(*args, **kwargs):\n    return torch.{name}(*args, **kwargs)\n",
                   path, "exec")
    scope: dict[str, Any] = {"torch": torch}
    exec(code, scope)  # our own two lines, under a long file name
    return scope["build"]  # type: ignore[no-any-return]


def _enforce_params() -> list[Any]:
    """The rows whose call reaches torch's factory with real data under enforce mode: not
    those of ``ss.validate`` ("(validate)"), nor those with a ``meta`` argument (torch's
    business there, docs/protecting.md: nothing is refused)."""
    return [p for p in _table_params()
            if "(validate)" not in p.id and "meta" not in p.id.split("-", 2)[2]]


@pytest.mark.parametrize(("layout", "iid", "corrupt"), _enforce_params())
def test_first_line_is_short_under_enforce_and_with_a_loaders_provenance(
    layout: torch.layout, iid: str, corrupt: Callable[[Members], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41: under enforce mode the building call's place named the file by its path
    (relative or absolute), and first lines ran to 200-340 characters; a loader named the
    file by its path too. The place is now the base name and line (the traceback has the
    path), and the first line stays within FIRST_LINE_MAX with a key path and a loader."""
    for lay, factory in TORCH_FACTORIES.items():
        monkeypatch.setitem(SS_FACTORIES, lay, _torch_factory_in(
            os.path.join(LONG_DIR, LONG_SCRIPT), factory.__name__))
    call = corrupt(base(layout))
    with warnings.catch_warnings(), ss.enforce(), pytest.raises(ss.InvariantError) as excinfo:
        warnings.simplefilter("ignore")
        call()
    err = excinfo.value
    assert (err.layout, err.invariant) == (layout, iid), str(err)
    assert err.built_by is not None and err.built_by.endswith(f" at {LONG_SCRIPT}:2")
    first, second, *_ = str(err).splitlines()
    assert len(first) <= FIRST_LINE_MAX, first
    # whole, or shortened (at a word boundary) with the next line holding all of it
    built = f"(built by {err.built_by})"
    assert first.endswith(built) or second.endswith(built), str(err)
    loaded = err.with_context(path=PROVENANCE["key"], loaded_by="ss.load from " + source_name(
        os.path.join(LONG_DIR, PROVENANCE["file"])))
    first, *rest = str(loaded).splitlines()
    assert len(first) <= FIRST_LINE_MAX, first
    # what and where stay whole; the provenance is what shortens (whole words), and the
    # message's next line has all of it (issue 46)
    assert first.startswith(str(err).splitlines()[0].rsplit(" (built by ", 1)[0]), first
    full = f"(loaded by ss.load from {PROVENANCE['file']!r})"
    assert full in first or full in rest[0], str(loaded)


def test_table_covers_every_reachable_id() -> None:
    # covered by dedicated tests below
    unreachable_compressed = {"1.4", "2.4", "3.9", "4.4"}
    unreachable_coo = {"1.1"}  # the factories convert every index dtype to int64, as torch
    for layout in COMPRESSED:
        covered = {iid for lay, iid, _, _ in TABLE if lay == layout}
        assert covered | unreachable_compressed == set(ss.CATALOG["compressed"]), layout
    covered = {iid for lay, iid, _, _ in TABLE if lay == COO}
    assert covered | unreachable_coo == set(ss.CATALOG["coo"])


# --- ids outside the table ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_coo, None], ids=str)
def test_2_4_layout_must_be_sparse_compressed(layout: torch.layout | None,
                                              torch_spy: list[str]) -> None:
    m = base(CSR)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_compressed_tensor(m.compressed, m.plain, m.values, m.size,
                                    layout=layout)  # type: ignore[arg-type]
    assert excinfo.value.invariant == "2.4"
    assert excinfo.value.layout in COMPRESSED
    assert not torch_spy


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_3_9_plain_batch_shape(layout: torch.layout, torch_spy: list[str]) -> None:
    m = base(layout, batch=(2,))
    bad = replace(m, plain=torch.cat([m.plain, m.plain[:1]]))  # 3 batches of plain indices
    with pytest.raises(ss.InvariantError) as excinfo:
        bad.call()()
    assert (excinfo.value.layout, excinfo.value.invariant) == (layout, "3.9")
    assert not torch_spy


def test_1_4_requested_dtype_is_converted_not_refused() -> None:
    """Through the factories dtype= converts the values, as torch does, so 1.4 cannot fire."""
    m = base(CSR)
    t = replace(m, values=m.values.float()).call(dtype=torch.float64)()
    assert t.dtype == torch.float64


def test_1_4_engine_refuses_values_of_another_dtype() -> None:
    from safesparse.engine.validation import validate_compressed

    m = base(BSR)
    with pytest.raises(ss.InvariantError) as excinfo:
        validate_compressed(m.compressed, m.plain, m.values.float(), m.size, BSR,
                            dtype=torch.float64)
    assert (excinfo.value.layout, excinfo.value.invariant) == (BSR, "1.4")


def test_4_4_engine_refuses_values_on_another_device() -> None:
    """4.4 is not reachable through the factories on CPU: the values define the device and
    ``device=`` moves every member. The engine still checks it."""
    from safesparse.engine.validation import validate_compressed

    m = base(CSC)
    with pytest.raises(ss.InvariantError) as excinfo:
        validate_compressed(m.compressed, m.plain, m.values.to("meta"), m.size, CSC,
                            device=torch.device("cpu"))
    assert (excinfo.value.layout, excinfo.value.invariant) == (CSC, "4.4")


@pytest.mark.skipif(not HAS_CUDA, reason="4.2-4.4 with real devices need a CUDA device")
@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
@pytest.mark.parametrize(("member", "iid"), [("compressed", "4.2"), ("plain", "4.3")])
def test_4_x_members_on_two_devices(layout: torch.layout, member: str, iid: str) -> None:
    m = base(layout)
    bad = replace(m, **{member: getattr(m, member).cuda()})
    with pytest.raises(ss.InvariantError) as excinfo:
        bad.call()()
    assert (excinfo.value.layout, excinfo.value.invariant) == (layout, iid)


@pytest.mark.skipif(not HAS_CUDA, reason="validation on a CUDA device needs one")
@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_cuda_index_corruption_is_located(layout: torch.layout) -> None:
    m = base(layout, batch=(2,))
    plain = m.plain.clone()
    plain[1, 0] = -3
    cuda = replace(m, compressed=m.compressed.cuda(), plain=plain.cuda(), values=m.values.cuda())
    with pytest.raises(ss.InvariantError) as excinfo:
        cuda.call()()
    assert excinfo.value.invariant == "5.4"
    assert "-3" in str(excinfo.value)
    good = replace(m, compressed=m.compressed.cuda(), plain=m.plain.cuda(),
                   values=m.values.cuda()).call()()
    assert good.device.type == "cuda" and ss.is_checked(good)


# --- index invariants with their location ------------------------------------------------------


def _line_with_entries(m: Members, batch: int) -> tuple[int, int]:
    """The last line of ``batch`` holding an entry, and the position of its first entry."""
    c = m.compressed[batch].tolist()
    line = max(i for i in range(len(c) - 1) if c[i + 1] > c[i])
    return line, c[line]


def _assert_location(err: ss.InvariantError, *, batch: int | None, line: int | None,
                     position: int, value: int) -> None:
    msg = str(err)
    if batch is not None:
        assert re.search(rf"batch \(?{batch}\b", msg), msg
    if line is not None:
        assert re.search(rf"\b{LINE[err.layout]} {line}\b", msg), msg
    assert re.search(rf"\b{position}\b", msg), msg
    assert re.search(rf"(?<![\d-]){value}\b", msg), msg


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(("iid", "kind"), [
    ("5.4", "negative"), ("5.5", "too large"), ("5.6", "not increasing"),
])
def test_plain_index_violation_names_batch_line_position_value(
    layout: torch.layout, index_dtype: torch.dtype, iid: str, kind: str
) -> None:
    m = base(layout, batch=(3,), index_dtype=index_dtype)
    line, j = _line_with_entries(m, 1)
    plain = m.plain.clone()
    if kind == "negative":
        value = -5
    elif kind == "too large":
        value = n_plain(m) + 3
    else:  # repeat the previous entry of line 0 (two entries in every layout's base)
        line, j = 0, int(m.compressed[1, 0]) + 1
        assert int(m.compressed[1, 1]) > j
        value = int(plain[1, j - 1])
    plain[1, j] = value
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, plain=plain).call()()
    err = excinfo.value
    assert (err.layout, err.invariant) == (layout, iid), str(err)
    _assert_location(err, batch=1, line=line, position=j, value=value)


def test_bsr_batch_1_block_row_2() -> None:
    m = base(BSR, batch=(2,))
    assert m.compressed[1].tolist() == [0, 2, 2, 3]  # block row 2 holds position 2
    col = m.plain.clone()
    col[1, 2] = 7
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_bsr_tensor(m.compressed, col, m.values, m.size)
    err = excinfo.value
    assert (err.layout, err.invariant) == (BSR, "5.5")
    _assert_location(err, batch=1, line=2, position=2, value=7)
    assert "col_indices" in str(err)


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
@pytest.mark.parametrize(("iid", "index", "value"), [
    ("5.1", 0, 1),  # compressed[..., 0]
    ("5.2", -1, 1),  # compressed[..., -1] != nnz
])
def test_compressed_endpoint_violation_names_batch_and_value(
    layout: torch.layout, iid: str, index: int, value: int
) -> None:
    m = base(layout, batch=(2, 2))
    c = m.compressed.clone()
    c[1, 0, index] = value
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, compressed=c).call()()
    err = excinfo.value
    assert (err.layout, err.invariant) == (layout, iid)
    assert re.search(r"batch \(1, 0\)", str(err)), str(err)
    assert re.search(rf"\b{value}\b", str(err))


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_negative_line_count_names_batch_line_and_count(layout: torch.layout) -> None:
    m = base(layout, batch=(2,))
    c = m.compressed.clone()
    c[1, 1] = -4  # line 0 of batch 1 gets a negative count
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, compressed=c).call()()
    err = excinfo.value
    assert err.invariant == "5.3"
    assert re.search(r"batch \(?1\b", str(err)), str(err)
    assert re.search(rf"\b{LINE[layout]} 0\b", str(err)), str(err)
    assert "-4" in str(err)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_5_3_names_the_line_whose_count_is_wrong(index_dtype: torch.dtype) -> None:
    """crow [0, 2, 5, 3]: row 1 holds 3 <= n_plain entries, fine; row 2 holds -2.

    crow[2] = 5 > nnz also trips the int64 wrap-around guard, which used to name row 1."""
    crow = torch.tensor([0, 2, 5, 3], dtype=index_dtype)
    col = torch.tensor([0, 1, 2], dtype=index_dtype)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, torch.ones(3), (3, 5))
    err = excinfo.value
    assert err.invariant == "5.3"
    assert re.search(r"\brow 2\b", str(err)), str(err)
    assert "= -2" in str(err), str(err)


def test_first_violating_batch_is_reported() -> None:
    m = base(CSR, batch=(3,))
    plain = m.plain.clone()
    plain[2, 0] = 99
    plain[1, 5] = 98
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, plain=plain).call()()
    assert excinfo.value.invariant == "5.5"
    assert "98" in str(excinfo.value) and "99" not in str(excinfo.value)


@pytest.mark.parametrize(("iid", "dim", "pos", "value"), [
    ("5.1", 1, 2, -4),
    ("5.2", 0, 3, 6),
])
def test_coo_violation_names_position_dim_and_value(
    iid: str, dim: int, pos: int, value: int
) -> None:
    m = base(COO)
    idx = with_value(m.compressed, (dim, pos), value)
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, compressed=idx).call()()
    err = excinfo.value
    assert (err.layout, err.invariant) == (COO, iid)
    assert re.search(rf"position {pos}\b", str(err)), str(err)
    assert re.search(rf"(?<![\d-]){value}\b", str(err)), str(err)


def test_coo_uncoalesced_duplicates_are_fine_without_the_flag() -> None:
    m = base(COO)
    idx = m.compressed[:, [1, 0, 0, *range(2, m.compressed.shape[1] - 1)]].contiguous()
    t = replace(m, compressed=idx).call()()
    assert ss.is_checked(t) and not t.is_coalesced()
    expected = torch.sparse_coo_tensor(idx, m.values, m.size, check_invariants=True)
    assert torch.equal(t.to_dense(), expected.to_dense())
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, compressed=idx).call(is_coalesced=True)()
    assert excinfo.value.invariant == "5.3"
    assert re.search(r"position 1\b", str(excinfo.value)), str(excinfo.value)


# --- several invariants broken at once: the first in id order wins -----------------------------


def _first_id(call: Callable[[], Any]) -> str:
    with pytest.raises(ss.InvariantError) as excinfo:
        call()
    return excinfo.value.invariant


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_first_violated_id_wins(layout: torch.layout) -> None:
    m = base(layout, batch=(2,))
    c, p = m.compressed.clone(), m.plain.clone()
    # compressed decreasing in batch 1 (5.3) and plain unsorted in batch 0 (5.6)
    c2 = c.clone()
    c2[1, 1] = c2[1, 2] + 1
    p2 = p.clone()
    p2[0, [0, 1]] = p2[0, [1, 0]]
    assert _first_id(replace(m, compressed=c2, plain=p2).call()) == "5.3"
    # 5.5 in batch 0 and 5.4 in batch 1: id order beats batch order
    p3 = p.clone()
    p3[0, 0] = 50
    p3[1, 0] = -1
    assert _first_id(replace(m, plain=p3).call()) == "5.4"
    # 5.1 and 5.5
    c4 = c.clone()
    c4[1, 0] = 1
    assert _first_id(replace(m, compressed=c4, plain=p3).call()) == "5.1"
    # 5.2 and 5.6
    c5 = c.clone()
    c5[0, -1] += 1
    assert _first_id(replace(m, compressed=c5, plain=p2).call()) == "5.2"
    # metadata before index data: 3.10 with 5.5
    assert _first_id(replace(m, plain=p3, values=m.values[:, :-1]).call()) == "3.10"
    # dtypes before dims: 1.2 with 3.3
    assert _first_id(replace(m, plain=p.int()[None]).call()) == "1.2"
    # 3.5 before 3.8 (validate: the factories copy a non-contiguous member)
    wrong = replace(m, compressed=noncontiguous(torch.cat([c, c[:, -1:]], -1)))
    assert _first_id(lambda: ss.validate(wrong.torch_unchecked())) == "3.5"


def test_first_violated_id_wins_coo() -> None:
    m = base(COO)
    idx = m.compressed.clone()
    idx[0, 0] = 6  # 5.2 at position 0
    idx[1, 3] = -1  # 5.1 at position 3
    assert _first_id(replace(m, compressed=idx).call()) == "5.1"
    unsorted = m.compressed[:, [1, 0, *range(2, m.compressed.shape[1])]].clone()
    unsorted[0, 4] = 6
    assert _first_id(replace(m, compressed=unsorted).call(is_coalesced=True)) == "5.2"
    # float indices are converted (as torch converts them) before any check: 3.3 is reported
    assert _first_id(replace(m, compressed=idx.float(), values=m.values[:1]).call()) == "3.3"


# --- what torch itself misses ------------------------------------------------------------------


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_hybrid_dense_dims_must_match_size(layout: torch.layout) -> None:
    m = base(layout, hybrid=True)  # values (..., 2), size (..., 2)
    bad = replace(m, size=(*m.size[:-1], 5))
    with pytest.raises(ss.InvariantError) as excinfo:
        bad.call()()
    assert (excinfo.value.layout, excinfo.value.invariant) == (layout, "3.10")


def test_hybrid_csr_spec_example() -> None:
    crow, col, values = torch.tensor([0, 1, 2]), torch.tensor([0, 2]), torch.ones(2, 2)
    # torch accepts this even when asked to check
    torch.sparse_csr_tensor(crow, col, values, (2, 3, 5), check_invariants=True)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, values, (2, 3, 5))
    assert (excinfo.value.layout, excinfo.value.invariant) == (CSR, "3.10")


def test_mismatched_index_dtypes_with_torch_checks_off() -> None:
    crow, col = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1])
    torch.sparse_csr_tensor(crow, col, torch.ones(2), (2, 2), check_invariants=False)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(crow, col, torch.ones(2), (2, 2))
    assert excinfo.value.invariant == "1.2"


@pytest.mark.parametrize("layout", COMPRESSED, ids=layout_id)
def test_non_contiguous_values_in_a_torch_tensor(layout: torch.layout) -> None:
    m = base(layout, batch=(2,))
    values = noncontiguous(m.values)
    t = replace(m, values=values).torch_unchecked()
    assert not t.values().is_contiguous()
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(t)
    assert (excinfo.value.layout, excinfo.value.invariant) == (layout, "3.7")
    # the factory itself accepts the same values and stores them contiguously
    good = replace(m, values=values).call()()
    assert good.values().is_contiguous()
    assert torch.equal(good.to_dense(), t.to_dense())


# --- zero-sized blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", BLOCKED, ids=layout_id)
@pytest.mark.parametrize("block", [(0, 3), (2, 0)], ids=str)
def test_zero_block_dim_needs_zero_size(layout: torch.layout, block: tuple[int, int]) -> None:
    c, p, v = torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, *block)
    zero_dim = block.index(0)
    for bad in (2, 3, 5):
        size = (bad, 3) if zero_dim == 0 else (2, bad)
        with pytest.raises(ss.InvariantError) as excinfo:
            SS_FACTORIES[layout](c, p, v, size)
        assert (excinfo.value.layout, excinfo.value.invariant) == (layout, "3.1")
    # nnz = 0 with the matching size 0 is fine in every orientation
    empty = SS_FACTORIES[layout](torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int64),
                                 torch.ones(0, *block), (0, 3) if zero_dim == 0 else (2, 0))
    assert ss.is_checked(empty) and empty.to_dense().numel() == 0


@pytest.mark.parametrize(("layout", "block"), [(BSR, (0, 3)), (BSC, (2, 0))], ids=["BSR", "BSC"])
def test_zero_block_dim_on_the_compressed_side(layout: torch.layout,
                                               block: tuple[int, int]) -> None:
    """Lines of zero extent may hold entries; the size along them must be 0."""
    c, p, v = torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, *block)
    size = (0, 3) if layout == BSR else (2, 0)
    t = SS_FACTORIES[layout](c, p, v, size)
    assert t.shape == size and ss.is_checked(t)
    assert t.to_dense().shape == size


def test_zero_block_dim_torch_misses() -> None:
    c, p, v = torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2, 0)
    torch.sparse_bsr_tensor(c, p, v, (2, 5), check_invariants=True)  # torch says fine
    with pytest.raises(ss.InvariantError):
        ss.sparse_bsr_tensor(c, p, v, (2, 5))


def test_zero_block_dim_with_nnz_zero() -> None:
    t = ss.sparse_bsr_tensor(torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int64),
                             torch.ones(0, 2, 0), (2, 0))
    assert t.shape == (2, 0) and t._nnz() == 0
    assert t.to_dense().shape == (2, 0)


def test_zero_block_dim_estimate_is_consistent() -> None:
    c, p, v = torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2, 0)
    try:
        estimated: torch.Tensor | None = ss.sparse_bsr_tensor(c, p, v)
    except ss.InvariantError:
        estimated = None
    ss.clear_cache()  # the cached state of the first build would let the second one through
    try:
        explicit: torch.Tensor | None = ss.sparse_bsr_tensor(c, p, v, (2, 0))
    except ss.InvariantError:
        explicit = None
    assert (estimated is None) == (explicit is None)


# --- hostile integers --------------------------------------------------------------------------


@pytest.mark.parametrize(("crow", "col", "size", "iid"), [
    ([0, I32_MAX], [0], (1, 3), "5.2"),
    ([0, 1, -(2**31)], [0], (2, 3), "5.2"),
    ([0, I32_MAX, 1], [0], (2, 3), "5.3"),
    ([0, I32_MAX, 1], [0], (2, I32_MAX), "5.3"),
    ([-(2**31), 0, 1], [0], (2, 3), "5.1"),
    ([0, 1], [I32_MAX], (1, I32_MAX), "5.5"),
    ([0, 1], [-(2**31)], (1, 3), "5.4"),
    ([0, 2], [I32_MAX - 1, 0], (1, I32_MAX), "5.6"),
    ([0, 2, 2], [0, 0], (2, 1), "5.3"),  # 2 entries in a line of width 1
])
def test_int32_extremes_are_refused_cleanly(
    crow: list[int], col: list[int], size: tuple[int, int], iid: str
) -> None:
    c, p = torch.tensor(crow, dtype=torch.int32), torch.tensor(col, dtype=torch.int32)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(c, p, torch.ones(len(col)), size)
    assert excinfo.value.invariant == iid


@pytest.mark.parametrize(("crow", "col", "size", "iid"), [
    ([0, I64_MAX], [0], (1, 3), "5.2"),
    ([0, 1, -(2**63)], [0], (2, 3), "5.2"),
    ([0, I64_MAX, 1], [0], (2, 3), "5.3"),
    ([0, -(2**63), 1], [0], (2, 3), "5.3"),
    ([0, 1], [I64_MAX], (1, 3), "5.5"),
    ([0, 1], [-(2**63)], (1, 3), "5.4"),
    ([0, 1], [I64_MAX], (1, I64_MAX), "5.5"),
])
def test_int64_extremes_are_refused_cleanly(
    crow: list[int], col: list[int], size: tuple[int, int], iid: str
) -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_csr_tensor(torch.tensor(crow), torch.tensor(col), torch.ones(len(col)), size)
    assert excinfo.value.invariant == iid


def test_int32_extreme_values_in_batched_bsc() -> None:
    m = base(BSC, batch=(2,), index_dtype=torch.int32)
    c = m.compressed.clone()
    c[1, 1] = I32_MAX
    with pytest.raises(ss.InvariantError) as excinfo:
        replace(m, compressed=c).call()()
    assert excinfo.value.invariant == "5.3"
    assert str(I32_MAX) in str(excinfo.value)


def test_int32_largest_valid_column() -> None:
    c, p = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([I32_MAX - 1], dtype=torch.int32)
    t = ss.sparse_csr_tensor(c, p, torch.ones(1), (1, I32_MAX))
    assert t.shape == (1, I32_MAX) and ss.is_checked(t)
    assert t.col_indices().dtype == torch.int32


def test_coo_extremes() -> None:
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor([[I64_MAX]], [1.0], (I64_MAX,))
    assert excinfo.value.invariant == "5.2"
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor([[-(2**63)]], [1.0], (3,))
    assert excinfo.value.invariant == "5.1"
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_coo_tensor([[2**62, 0], [2**62, 1]], [1.0, 2.0], is_coalesced=True)
    assert excinfo.value.invariant == "5.3"


# --- regressions: overflow and stride corner cases ---------------------------------------------


@pytest.mark.parametrize("ncols", [2**31, 2**40], ids=str)
def test_int32_indices_with_a_dim_beyond_int32(ncols: int) -> None:
    """int32 indices cannot address a sparse dim beyond 2**31 - 1; torch refuses it too."""
    c, p = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="32-bit integer overflow"):
        torch.sparse_csr_tensor(c, p, torch.ones(1), (1, ncols), check_invariants=True)
    with pytest.raises(ss.InvariantError):
        ss.sparse_csr_tensor(c, p, torch.ones(1), (1, ncols))


def test_estimate_with_int64_max_plain_index() -> None:
    """col.max() + 1 must not wrap around (an accepted (1, 1) tensor would hold column 2**63-1)."""
    with pytest.raises(ss.InvariantError):
        ss.sparse_csr_tensor([0, 1], [I64_MAX], [1.0])


def test_coo_estimate_with_int64_max_index() -> None:
    """max + 1 = 2**63 is not a size; refused cleanly, not by torch's constructor."""
    with pytest.raises(ss.InvariantError):
        ss.sparse_coo_tensor([[I64_MAX]], [1.0])


def test_estimate_with_numel_overflow() -> None:
    """An estimated size with more than 2**63 - 1 elements is refused before torch sees it."""
    with pytest.raises(ss.InvariantError):
        ss.sparse_csr_tensor([0, 1, 2], [0, 2**62], [1.0, 1.0])


def test_wrapping_compressed_differences_with_an_overflowing_size() -> None:
    with pytest.raises(ss.InvariantError):
        ss.sparse_csr_tensor(torch.tensor([0, I64_MAX, -2, 1]), torch.tensor([0]), torch.ones(1))


@pytest.mark.parametrize("size", [(0, I64_MAX), None], ids=["size", "estimated"])
def test_wrapping_compressed_differences(size: tuple[int, int] | None) -> None:
    """Line counts must not wrap around in int64: with zero-height blocks the numel is 0, so
    only 5.3 stands between this crow and a checked tensor whose to_sparse_coo() segfaults."""
    crow, col, values = torch.tensor([0, I64_MAX, -2, 1]), torch.tensor([0]), torch.ones(1, 0, 1)
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.sparse_bsr_tensor(crow, col, values, size)
    assert excinfo.value.invariant == "5.3"


@pytest.mark.parametrize("layout", [CSR, COO], ids=layout_id)
def test_size_with_an_overflowing_prefix_and_a_zero_dim(layout: torch.layout) -> None:
    """numel is 0, but torch multiplies dim by dim and overflows on the way there."""
    size = (3, I64_MAX, 0)
    with pytest.raises(ss.InvariantError):
        if layout == COO:
            ss.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.ones(1, 0), size)
        else:
            ss.sparse_csr_tensor(torch.tensor([0, 1, 1, 1]), torch.tensor([0]),
                                 torch.ones(1, 0), size)


@pytest.mark.parametrize("member", ["compressed", "plain"])
def test_index_member_with_size_one_last_dim_and_stride_2(member: str) -> None:
    """is_contiguous() ignores the stride of a size-1 dim; torch's check does not."""
    if member == "compressed":  # no rows: crow_indices == [0], stored with stride 2
        m = Members(CSR, torch.tensor([0, 9])[::2], torch.zeros(0, dtype=torch.int64),
                    torch.ones(0), (0, 1))
    else:  # one entry: col_indices == [0], stored with stride 2
        m = Members(CSR, torch.tensor([0, 1]), torch.tensor([0, 9])[::2], torch.ones(1), (1, 1))
    member_t = getattr(m, member)
    assert member_t.is_contiguous() and member_t.stride(-1) == 2
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.sparse_csr_tensor(m.compressed, m.plain, m.values, m.size, check_invariants=True)
    # the factories copy such a member (torch requires unit stride); validate refuses it
    built = m.call()()
    assert ss.is_checked(built)
    copied = built.crow_indices() if member == "compressed" else built.col_indices()
    assert copied.stride(-1) == 1
    with pytest.raises(ss.InvariantError) as excinfo:
        ss.validate(m.torch_unchecked())
    assert excinfo.value.invariant == {"compressed": "3.5", "plain": "3.6"}[member]

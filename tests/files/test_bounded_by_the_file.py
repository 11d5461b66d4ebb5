"""``check`` and the loaders allocate a small multiple of the file, never what it claims
(issue 47, item 3; SPEC 7).

Crafted files, each written here: a 2.5 KB ``.pt`` whose sparse members have stride 0 and
claim 3e8 elements (``check`` went to 4 GB making contiguous copies of them), a ``.pt`` and a
``.pt2`` holding a deflated entry that inflates to 3 GiB (a zip bomb: torch's reader and
``zipfile.read`` allocate what the entry declares), a JSON member larger than the archive
allows, a CSR whose offsets claim 3e8 entries. ``check`` runs in a child under a 3 GB
address-space limit (torch and safesparse import in about 0.7 GB): each file is reported
(INVALID, exit 1, or refused unread, exit 2) in seconds, never with ``MemoryError``.
"""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from support.batch import child_env
from support.cli import run_cli

import safesparse as ss
from safesparse.files.limits import ArchiveLimitError, entry_cap

pytestmark = pytest.mark.filterwarnings("ignore:.*support is in beta state:UserWarning")

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 3_000_000 * 1024  # bytes of address space: `ulimit -v 3000000`
CLAIM = 3 * 10**8
BOMB = 3 * 2**30  # what the bomb entry inflates to: more than the limit leaves


def _check_limited(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m safesparse check ...`` in a child under the address-space limit."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    return subprocess.run([sys.executable, "-m", "safesparse", "check", *map(str, argv)],
                          capture_output=True, text=True, env=child_env(ROOT), timeout=timeout,
                          preexec_fn=limit)


class _Members:
    """Pickles as a sparse tensor of ``layout`` with ``members`` (as torch pickles one), so
    that the members keep the strides they have here."""

    def __init__(self, layout: torch.layout, members: tuple[Any, ...]) -> None:
        self.layout, self.members = layout, members

    def __reduce_ex__(self, protocol: Any) -> Any:
        return torch._utils._rebuild_sparse_tensor, (self.layout, self.members)


def _stride0(path: Path) -> Path:
    """A COO and a CSR tensor whose members are one element each, viewed with stride 0 as
    3e8 (the file: 2.5 KB)."""
    one = torch.zeros(1, dtype=torch.long)
    vals = torch.ones(1).expand(CLAIM)
    coo = _Members(torch.sparse_coo,
                   (torch.zeros(2, 1, dtype=torch.long).expand(2, CLAIM), vals, (10, 10), False))
    csr = _Members(torch.sparse_csr, (one.expand(CLAIM + 1), one.expand(CLAIM), vals, (CLAIM, 10)))
    torch.save({"coo": coo, "csr": csr}, path)
    return path


def test_stride_0_members_are_invalid_before_any_copy(tmp_path: Path) -> None:
    path = _stride0(tmp_path / "stride0.pt")
    assert path.stat().st_size < 4000
    proc = _check_limited(path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert "MemoryError" not in proc.stdout + proc.stderr
    coo = next(line for line in lines if "['coo']" in line)
    csr = next(line for line in lines if "['csr']" in line)
    assert "INVALID [COO 3.3]" in coo and "claims 600000000 elements; the file holds 2" in coo
    assert "INVALID [CSR 3.8]" in csr and "claims 300000001 elements; the file holds 1" in csr
    assert "the file's index data is corrupt" in csr  # the hint for a file
    # ss.load refuses it the same way, in this process, before any copy
    with pytest.raises(ss.InvariantError) as info:
        ss.load(path)
    assert info.value.invariant in ("3.3", "3.8") and info.value.location["held"] in (1, 2)


def test_a_module_member_with_stride_0_is_invalid(tmp_path: Path) -> None:
    """A ``safesparse.nn`` state dict whose plain indices are viewed with stride 0."""
    from safesparse.nn import SparseLinear

    layer = SparseLinear.from_dense(torch.nn.Linear(4, 4), (1, 1), 0.5)
    sd = dict(layer.state_dict())
    sd["plain_indices"] = torch.zeros(1, dtype=sd["plain_indices"].dtype).expand(CLAIM)
    torch.save(sd, tmp_path / "m.pt")
    proc = _check_limited(tmp_path / "m.pt")
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    assert "plain_indices" in proc.stdout and "3.9" in proc.stdout, proc.stdout


def test_offsets_claiming_3e8_entries_are_an_o1_refusal(tmp_path: Path) -> None:
    """crow_indices ends at 3e8 over one column index: [CSR 5.2] (crow[-1] against the nnz),
    found before any work proportional to what the offsets claim."""
    crow, col = torch.tensor([0, CLAIM]), torch.tensor([0])
    torch.save({"a": _Members(torch.sparse_csr, (crow, col, torch.ones(1), (1, 10)))},
               tmp_path / "offsets.pt")
    proc = _check_limited(tmp_path / "offsets.pt")
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    assert "INVALID [CSR 5.2]" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------
# Zip bombs


def _zeros_crc(n: int, chunk: int) -> int:
    """zlib.crc32 of ``n * chunk`` zero bytes without reading them: appending ``chunk`` zero
    bytes is an affine map of the CRC, applied ``n`` times."""
    zeros = bytes(chunk)
    base = zlib.crc32(zeros, 0)
    columns = [zlib.crc32(zeros, 1 << i) ^ base for i in range(32)]
    crc = 0
    for _ in range(n):
        out = base
        for i in range(32):
            if crc >> i & 1:
                out ^= columns[i]
        crc = out
    return crc


def _bomb(size: int) -> tuple[bytes, int]:
    """A raw deflate stream inflating to ``size`` zero bytes (about size / 1000 bytes), and
    its CRC."""
    chunk = 1 << 20
    assert size % chunk == 0
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(chunk)) + c.flush(zlib.Z_FULL_FLUSH)  # the same for every chunk
    return block * (size // chunk) + c.flush(), _zeros_crc(size // chunk, chunk)


def _write_zip(path: Path, entries: dict[str, bytes],
               deflated: dict[str, tuple[bytes, int, int]]) -> None:
    """A zip archive: ``entries`` stored, ``deflated`` given as (raw deflate stream, crc,
    inflated size); written by hand (``zipfile`` compresses what it writes itself)."""
    local, central = bytearray(), bytearray()
    items = [(n, b, zlib.crc32(b), len(b), 0) for n, b in entries.items()]
    items += [(n, s, crc, size, 8) for n, (s, crc, size) in deflated.items()]
    for name, data, crc, size, method in items:
        raw = name.encode()
        offset = len(local)
        local += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc,
                             len(data), size, len(raw), 0) + raw + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21,
                               crc, len(data), size, len(raw), 0, 0, 0, 0, 0, offset) + raw
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(items), len(items), len(central),
                      len(local), 0)
    path.write_bytes(bytes(local + central + end))


def _entries(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def test_a_pt_zip_bomb_is_refused_unread(tmp_path: Path) -> None:
    """A torch checkpoint whose storage entry is deflated to 3 MB and inflates to 3 GiB: torch's
    reader would allocate it all; check refuses the file (exit 2) from its directory."""
    torch.save({"w": torch.zeros(8)}, tmp_path / "small.pt")
    entries = _entries(tmp_path / "small.pt")
    storage = next(n for n in entries if n.endswith("data/0"))
    del entries[storage]
    stream, crc = _bomb(BOMB)
    path = tmp_path / "bomb.pt"
    _write_zip(path, entries, {storage: (stream, crc, BOMB)})
    assert path.stat().st_size < 4 * 2**20
    proc = _check_limited(path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert f"declares {BOMB} bytes" in proc.stdout and "refused unread" in proc.stdout
    assert "MemoryError" not in proc.stdout + proc.stderr
    assert "allocate" not in proc.stdout
    with pytest.raises(ArchiveLimitError):
        ss.load(path)
    with pytest.raises(ArchiveLimitError), path.open("rb") as f:  # a file object too
        ss.load(f)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from safesparse.nn import SparseLinear

        torch.manual_seed(0)
        self.fc1 = SparseLinear.from_dense(torch.nn.Linear(8, 8), (2, 2), 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc1(x)
        return out


def _pt2(tmp_path: Path) -> tuple[Path, dict[str, bytes], str, dict[str, Any]]:
    """A torch.export archive of a SparseLinear; its entries, the name of its weights config
    and that config."""
    path = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(_Net(), (torch.randn(3, 8),)), path)
    entries = _entries(path)
    name = next(n for n in entries if n.endswith("model_weights_config.json"))
    return path, entries, name, json.loads(entries[name])


def test_a_pt2_zip_bomb_is_refused_without_memory_error(tmp_path: Path) -> None:
    path, entries, name, config = _pt2(tmp_path)
    weight = name.rsplit("/", 1)[0] + "/" + config["config"]["fc1.plain_indices"]["path_name"]
    del entries[weight]
    stream, crc = _bomb(BOMB)
    _write_zip(path, entries, {weight: (stream, crc, BOMB)})
    proc = _check_limited(path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert "torch.export archive" in proc.stdout and f"declares {BOMB} bytes" in proc.stdout
    assert "MemoryError" not in proc.stdout + proc.stderr


def test_a_pt2_json_member_is_capped(tmp_path: Path) -> None:
    """A program padded with 8 MB of spaces, deflated, in an archive of 1 MB (a stored entry
    of random bytes): within the archive's inflation cap, beyond what a JSON member may hold
    (parsed JSON costs several times its text)."""
    path, entries, _, _ = _pt2(tmp_path)
    model = next(n for n in entries if "/models/" in n and n.endswith(".json"))
    entries[model.rsplit("/", 2)[0] + "/extra/filler"] = torch.randint(
        0, 256, (2**20,), dtype=torch.uint8).numpy().tobytes()
    text = entries.pop(model) + b" " * (8 * 2**20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    _write_zip(path, entries, {model: (c.compress(text) + c.flush(), zlib.crc32(text),
                                       len(text))})
    assert len(text) < entry_cap(path.stat().st_size)
    code, out = run_cli("check", path)
    assert code == 2 and "torch.export archive" in out and "declares" in out, out


def test_a_pt2_member_with_stride_0_is_invalid(tmp_path: Path) -> None:
    """The archive's plain indices described as 3e8 elements with stride 0 over 8 bytes:
    INVALID (its shape, 3.9) before any copy; strides reaching past the bytes stay unreadable
    (checked against the entry's declared size, unread)."""
    path, entries, name, config = _pt2(tmp_path)
    meta = config["config"]["fc1.plain_indices"]["tensor_meta"]
    meta["sizes"], meta["strides"] = [{"as_int": CLAIM}], [{"as_int": 0}]
    entries[name] = json.dumps(config).encode()
    _write_zip(path, entries, {})
    proc = _check_limited(path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    assert "fc1.plain_indices" in proc.stdout and "[BSR 3.9]" in proc.stdout, proc.stdout
    meta["sizes"], meta["strides"] = [{"as_int": CLAIM}], [{"as_int": 1}]
    entries[name] = json.dumps(config).encode()
    _write_zip(path, entries, {})
    code, out = run_cli("check", path)
    assert code == 2 and "need" in out and "declares" in out, out


def test_files_torch_writes_pass_the_limits(tmp_path: Path) -> None:
    """torch writes its archives uncompressed: a checkpoint and an export archive pass, and
    one re-zipped with deflate (a few times smaller) too."""
    sparse = ss.sparse_csr_tensor([0, 1, 2], [1, 0], [1.0, 2.0], (2, 2))
    ss.save({"a": sparse, "w": torch.zeros(1000)}, tmp_path / "ok.pt")
    entries = _entries(tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in entries.items():
            z.writestr(n, b)
    for name in ("ok.pt", "deflated.pt"):
        code, out = run_cli("check", tmp_path / name)
        assert code == 0, out
        assert ss.is_checked(ss.load(tmp_path / name)["a"])
    path, _, _, _ = _pt2(tmp_path)
    code, out = run_cli("check", path)
    assert code == 0, out

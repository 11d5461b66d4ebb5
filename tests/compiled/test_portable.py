"""``ss.portable`` (SPEC 10): an exported program with every ``safesparse`` operator replaced by
plain aten ops, saved by one process and run by a fresh one that never imports safesparse,
with eager's results; ``python -m safesparse check`` vets the members the saved program still
holds (recorded in its graph's metadata) and refuses a tampered one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import safesparse as ss
from safesparse.nn import SparseLinear, SparseMatmul

pytestmark = [
    pytest.mark.slow,  # (exports; a child process)
    # (torch's own, raised inside torch.export)
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

CASES = [(torch.sparse_csr, None), (torch.sparse_csc, None), (torch.sparse_bsr, (4, 2)),
         (torch.sparse_bsc, (2, 4))]
IDS = ["csr", "csc", "bsr", "bsc"]
D = torch.float64


def weight(layout: torch.layout, blocksize: tuple[int, int] | None, rows: int, cols: int,
           seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r, c = blocksize or (1, 1)
    mask = torch.rand(rows // r, cols // c, generator=g) < 0.4
    mask[0, 0] = True
    full = mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    dense = torch.randn(rows, cols, generator=g, dtype=D) * full
    return dense.to_sparse(layout=layout, blocksize=blocksize)


class Model(nn.Module):
    """Dense, sparse with a bias, sparse without, and a fixed sparse matrix (``A @ x``)."""

    def __init__(self, layout: torch.layout, blocksize: tuple[int, int] | None) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16, dtype=D)
        self.fc1 = SparseLinear(weight(layout, blocksize, 24, 16, 1), bias=True)
        self.fc2 = SparseLinear(weight(layout, blocksize, 8, 24, 2))
        self.adj = SparseMatmul(weight(layout, blocksize, 8, 8, 3))
        with torch.no_grad():
            self.fc1.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(torch.relu(self.inp(x))))
        return self.adj(self.fc2(h).T).T


def _ours(program: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes
            if n.op == "call_function" and "safesparse" in str(n.target)]


@pytest.mark.parametrize(("layout", "blocksize"), CASES, ids=IDS)
def test_portable_program_has_aten_ops_only_and_eagers_results(
        layout: torch.layout, blocksize: tuple[int, int] | None) -> None:
    m = Model(layout, blocksize)
    x = torch.randn(5, 12, dtype=D)
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(m, (x,), dynamic_shapes=({0: batch},))
    assert _ours(program)  # the checked operators, by default
    port = ss.portable(program)
    assert _ours(port) == []
    assert _ours(program)  # (the program given is unchanged)
    for rows in (5, 3, 17):  # (the batch stays dynamic)
        x = torch.randn(rows, 12, dtype=D)
        torch.testing.assert_close(port.module()(x), m(x))
    matrices = port.graph_module.meta["custom"]["safesparse.matrices"]
    assert [(e["values"], e["size"]) for e in matrices] == [
        ("fc1.values", [24, 16]), ("fc2.values", [8, 24]), ("adj.values", [8, 8])]


def test_portable_gradient_formulas_match_the_operators() -> None:
    """The backward operators' aten forms (a program that differentiates holds them)."""
    from safesparse.compiled import portability as p

    for layout, blocksize in CASES:
        layer = SparseLinear(weight(layout, blocksize, 8, 12, 4))
        args = (layer.compressed_indices, layer.plain_indices, layer.values.detach(),
                layer._layout_name, 8, 12)
        g, x = torch.randn(3, 8, dtype=D), torch.randn(3, 12, dtype=D)
        ops = torch.ops.safesparse
        torch.testing.assert_close(p._linear_grad_input(g, *args), ops.linear_grad_input(g, *args))
        torch.testing.assert_close(p._linear_grad_values(g, x, *args),
                                   ops.linear_grad_values(g, x, *args))
        torch.testing.assert_close(p._matmul_grad_input(*args, g.T),
                                   ops.matmul_grad_input(*args, g.T))
        torch.testing.assert_close(p._matmul_grad_values(*args, g.T, x.T),
                                   ops.matmul_grad_values(*args, g.T, x.T))


CHILD = textwrap.dedent("""\
    import sys
    import torch
    program = torch.export.load(sys.argv[1])
    x, want = torch.load(sys.argv[2])
    torch.testing.assert_close(program.module()(x), want)
    assert "safesparse" not in sys.modules, sorted(m for m in sys.modules if "safesparse" in m)
    print("ran without safesparse")
""")


def test_saved_portable_program_runs_in_a_process_without_safesparse(tmp_path: Path) -> None:
    m = Model(torch.sparse_bsr, (4, 2))
    x = torch.randn(6, 12, dtype=D)
    path, io = tmp_path / "model.pt2", tmp_path / "io.pt"
    torch.export.save(ss.portable(torch.export.export(m, (x,))), path)
    torch.save((x, m(x).detach()), io)
    script = tmp_path / "serve.py"
    script.write_text(CHILD)
    environ = {"PATH": "/usr/bin:/bin"}  # (no PYTHONPATH: safesparse cannot be imported)
    proc = subprocess.run([sys.executable, "-I", str(script), str(path), str(io)],
                          capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran without safesparse"


def test_check_vets_a_portable_archive(tmp_path: Path) -> None:
    from safesparse.files.export_archive import read_export_archive

    m = Model(torch.sparse_csr, None)
    x = torch.randn(2, 12, dtype=D)
    path = tmp_path / "model.pt2"
    torch.export.save(ss.portable(torch.export.export(m, (x,))), path)
    result = read_export_archive(path)
    assert sorted(mm.prefix for mm in result.modules) == ["adj.", "fc1.", "fc2."]
    assert all(mm.error is None for mm in result.modules)
    # the same archive with fc2's last column index out of range
    tampered = tmp_path / "tampered.pt2"
    _tamper(path, tampered, "fc2.plain_indices")
    result = read_export_archive(tampered)
    bad = [mm for mm in result.modules if mm.error is not None]
    assert [mm.prefix for mm in bad] == ["fc2."]
    assert bad[0].error is not None and bad[0].error.invariant == "5.5"


def _tamper(path: Path, out: Path, fqn: str) -> None:
    """``path`` copied to ``out`` with the last int64 of the tensor stored for ``fqn`` set
    to 10**6."""
    import json

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        configs = [n for n in names if n.endswith("_config.json")]
        target = None
        for cfg in configs:
            entries = json.loads(z.read(cfg)).get("config", {})
            if fqn in entries:
                folder = cfg.rsplit("/", 1)[0] + "/"
                target = folder + entries[fqn]["path_name"]
        assert target is not None, configs
        with zipfile.ZipFile(out, "w") as w:
            for n in names:
                data = z.read(n)
                if n == target:
                    data = data[:-8] + (10**6).to_bytes(8, "little")
                w.writestr(z.getinfo(n), data)


def test_a_program_that_proves_indices_is_not_made_portable() -> None:
    class Build(nn.Module):
        def forward(self, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                    x: torch.Tensor) -> torch.Tensor:
            c, p = torch.ops.safesparse.prove(crow, col, "csr", 3, 3)
            return ss.SparseOperand.from_members(c, p, values, "csr", (3, 3)) @ x

    args = (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2]), torch.ones(3),
            torch.randn(3, 2))
    program = torch.export.export(Build(), args)
    with pytest.raises(ValueError, match=r"safesparse\.prove"):
        ss.portable(program)

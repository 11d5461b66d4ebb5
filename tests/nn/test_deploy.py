"""Sparse layers go wherever models go (SPEC 9, issue 39): index members that are not the
proven ones are validated (O(nnz)) and proven again, never refused for that alone.

A program saved with ``torch.export.save`` and loaded back runs (its first call validates), as
does its ``deepcopy``; ``share_memory()``, a module sent through a ``torch.multiprocessing``
queue (fork and spawn: memory another process can write, validated at every call), layers
built or loaded under ``torch.inference_mode()`` (inference tensors: no counter), and
``load_state_dict(assign=True)`` with inference tensors all run; ``to_empty()`` validates
nothing. A proven forward runs no validation; index data written invalid is refused before
any kernel reads it, eager, compiled and exported. The process cases run in a child under a
timeout.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

import safesparse as ss
from safesparse.nn import SparseLinear


def model() -> nn.Sequential:
    torch.manual_seed(0)
    sparse = SparseLinear.from_dense(nn.Linear(32, 16), (4, 4), 0.3)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), sparse, nn.ReLU(), nn.Linear(16, 4))


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def counted(run: object, x: torch.Tensor = X) -> tuple[torch.Tensor, int]:
    ss.reset_stats()
    y: torch.Tensor = run(x)  # type: ignore[operator]
    return y.detach(), ss.stats().validations


def test_a_proven_forward_runs_no_validation() -> None:
    m = model()
    m(X)
    assert counted(m)[1] == 0


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_exported_program_saved_and_loaded_runs(tmp_path: Path) -> None:
    m = model()
    want = m(X).detach()
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(m, (X,)), path)
    loaded = torch.export.load(path).module()
    got, validations = counted(loaded)
    torch.testing.assert_close(got, want)
    assert validations == 1  # the first call validates the loaded index buffers
    assert counted(loaded)[1] == 0  # then they are proven
    clone = copy.deepcopy(loaded)
    torch.testing.assert_close(counted(clone)[0], want)
    # invalid data in the loaded program's buffer: refused before any kernel reads it
    buffers = dict(loaded.named_buffers())
    with torch.no_grad():
        buffers["2.plain_indices"][0] = 1000
    with pytest.raises(ss.InvariantError, match=r"\[BSR 5\.5\].*safesparse::linear"):
        loaded(X)


def test_invalid_writes_are_refused_eager_compiled_and_exported() -> None:
    m = model()
    layer = m[2]
    dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    exported = torch.export.export(m, (X,)).module()
    for run in (m, compiled, exported):
        run(X)
    with torch.no_grad():
        layer.plain_indices[0] = -3
    for run in (m, compiled):
        with pytest.raises(ss.InvariantError, match=r"5\.4"):
            run(X)
    with torch.no_grad():
        dict(exported.named_buffers())["2.plain_indices"][0] = -3
    with pytest.raises(ss.InvariantError, match=r"5\.4"):
        exported(X)


def test_compiled_graph_keeps_one_operator_and_no_break() -> None:
    m = model()
    explained = dynamo.explain(m)(X)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    ops = [n for g in explained.graphs for n in g.graph.nodes
           if "safesparse" in str(n.target)]
    assert len(ops) == 1


def test_share_memory_validates_at_every_call() -> None:
    m = model()
    want = m(X).detach()
    m.share_memory()
    assert m[2].plain_indices.is_shared()
    for _ in range(2):  # memory another process can write: never remembered
        got, validations = counted(m)
        torch.testing.assert_close(got, want)
        assert validations == 1


def test_to_empty_validates_nothing_and_runs_once_loaded() -> None:
    m = model()
    want = m(X).detach()
    sd = m.state_dict()
    ss.reset_stats()
    m.to_empty(device="cpu")
    assert ss.stats().validations == 0
    m.load_state_dict(sd)
    torch.testing.assert_close(m(X), want)


def test_inference_mode_build_load_and_assign() -> None:
    m = model()
    want = m(X).detach()
    sd = m.state_dict()
    with torch.inference_mode():
        built = model()
        torch.testing.assert_close(built(X), want)
        loaded = model()
        loaded.load_state_dict(sd)
        torch.testing.assert_close(loaded(X), want)
        inference_sd = {k: v.clone() for k, v in sd.items()}
        # (as for nn.Linear, assigning inference tensors as parameters needs inference mode)
        assigned = model()
        assigned.load_state_dict(inference_sd, assign=True)
        assert assigned[2].plain_indices.is_inference()
        for _ in range(2):  # no counter to watch: validated at every call
            got, validations = counted(assigned)
            torch.testing.assert_close(got, want)
            assert validations == 1
        with torch.no_grad():
            assigned[2].plain_indices[0] = 1000
        with pytest.raises(ss.InvariantError, match=r"5\.5"):
            assigned(X)


_QUEUE = """
import sys
import torch
import torch.multiprocessing as mp
from torch import nn
import safesparse as ss
from safesparse.nn import SparseLinear

def child(q, out):
    m = q.get()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    out.put(m(x).detach().tolist())  # (a list: a tensor's shared memory dies with us)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    q, out = ctx.Queue(), ctx.Queue()
    # started first: a child forked after the parent used torch's threads hangs in plain
    # torch's own parallel ops (the dense layer), with or without safesparse
    p = ctx.Process(target=child, args=(q, out))
    p.start()
    torch.manual_seed(0)
    sparse = SparseLinear.from_dense(nn.Linear(32, 16), (4, 4), 0.3)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), sparse)
    want = m(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).detach()
    q.put(m)
    got = out.get(timeout=100)
    p.join(30)
    assert p.exitcode == 0, p.exitcode
    torch.testing.assert_close(torch.tensor(got), want)
    print("OK")
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_module_through_a_process_queue(tmp_path: Path, method: str) -> None:
    script = tmp_path / "send_module.py"
    script.write_text(textwrap.dedent(_QUEUE))
    done = subprocess.run([sys.executable, str(script), method], capture_output=True,
                          text=True, timeout=200, cwd=tmp_path)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


_FORK = """
import faulthandler
import multiprocessing as mp
import sys
import torch
from torch import nn
from safesparse.nn import SparseLinear

torch.set_num_threads(2)
torch.manual_seed(0)
layer = SparseLinear.from_dense(nn.Linear(1024, 1024), (16, 16), 0.1)
# (with its bias: added in the product's pass, its gradient by the kernels, both with one
# thread in the child; a separate bias add, 256 x 1024 elements, is torch's own parallel op,
# which hangs there as every large torch op does)
x = torch.randn(256, 1024)
want = layer(x).detach()[:2]
grad = torch.ones(256, 1024)  # (made here: plain torch's own large ops hang in the child)
# the parent's OpenMP pool is used (embedding_bag opens a parallel region at any size)
torch.nn.functional.embedding_bag(torch.tensor([0, 1]), torch.randn(4, 3), torch.tensor([0]))

def child():
    faulthandler.dump_traceback_later(50, exit=True)
    y = layer(x)
    y.backward(grad)  # the backward products too
    assert torch.allclose(y[:2], want)
    assert layer.values.grad is not None and layer.bias.grad is not None
    sys.exit(7)

p = mp.get_context("fork").Process(target=child)
p.start()
p.join(60)
assert not p.is_alive(), "the forked child hangs"
assert p.exitcode == 7, p.exitcode
print("OK")
"""


def test_forward_in_a_forked_child_does_not_hang(tmp_path: Path) -> None:
    """A product in a child started by ``fork()`` after the parent used torch's threads runs
    with one intra-op thread (as validation does there): no hang."""
    script = tmp_path / "fork_child.py"
    script.write_text(textwrap.dedent(_FORK))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]

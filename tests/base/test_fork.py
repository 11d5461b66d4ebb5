"""No safesparse path hangs in a forked child where plain torch does not (SPEC 8).

After a parent has run a parallel region of torch's OpenMP pool (building one COO tensor runs
torch's COO checker, which opens one), a parallel region in a child started by ``fork()``
hangs for good. Plain torch never validates by default, so a child building sparse tensors
would hang only because safesparse validates them. Each scenario runs in its own Python process
(the parent of the fork) under a timeout; the child's own join has a shorter one. The
children run no sparse kernel and no large dense op: in torch 2.13 those hang there too (even
``(t * 2).to_dense()`` of a 2-element COO tensor), with or without safesparse.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PARENT = """
import faulthandler
import multiprocessing as mp
import sys
import torch
import safesparse as ss

torch.set_num_threads(2)
idx = torch.tensor([[0, 1], [1, 0]])
ss.sparse_coo_tensor(idx, torch.ones(2), (2, 2))  # torch's COO checker: the pool is used
# made here: in the child, plain torch's own parallel ops (ones, randint) would hang too
big_idx, big_vals = torch.randint(0, 500, (2, 200_000)), torch.ones(200_000)
fresh_idx = big_idx.clone()  # validated first in the child
ss.sparse_coo_tensor(big_idx, big_vals, (500, 500))
ctx = mp.get_context("fork")
"""

_CASES = {
    # a child building COO tensors with the safe factory: small (torch's checker in the
    # parent) and large (the vectorised path's parallel ops)
    "process": """
def child():
    faulthandler.dump_traceback_later(50, exit=True)
    a = ss.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2))
    b = ss.sparse_coo_tensor(fresh_idx, big_vals, (500, 500))
    c = ss.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.ones(2),
                             (2, 2))
    assert ss.is_checked(a) and ss.is_checked(b) and ss.is_checked(c)
    try:
        ss.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.ones(2), (3,))
    except ss.InvariantError as err:
        assert err.invariant == "5.2"
    else:
        raise AssertionError("invalid COO accepted in the child")
    sys.exit(7)

p = ctx.Process(target=child)
p.start()
p.join(60)
assert not p.is_alive(), "the forked child hangs"
assert p.exitcode == 7, p.exitcode
""",
    "pool": """
def build(n):
    t = ss.sparse_coo_tensor(torch.tensor([[0, n], [n, 0]]), torch.ones(2), (n + 1, n + 1))
    return int(ss.is_checked(t)) + int(t._values().sum())  # (no sparse kernel: see above)

with ctx.Pool(2) as pool:
    res = pool.map_async(build, [1, 2, 3, 4])
    assert res.get(timeout=60) == [3, 3, 3, 3]
""",
    # enforce mode: torch's own factory, validated in the child
    "enforce": """
def child():
    with ss.enforce():
        t = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2))
    assert ss.is_checked(t)
    sys.exit(7)

p = ctx.Process(target=child)
p.start()
p.join(60)
assert not p.is_alive(), "the forked child hangs"
assert p.exitcode == 7, p.exitcode
""",
    # a checked COO tensor sent through a torch.multiprocessing queue to a forked child
    "queue": """
import torch.multiprocessing as tmp

def child(q, out):
    t = q.get(timeout=60)
    out.put((type(t).__name__, ss.is_checked(t), t._indices().tolist()))

tctx = tmp.get_context("fork")
q, out = tctx.Queue(), tctx.Queue()
p = tctx.Process(target=child, args=(q, out))
p.start()
q.put(ss.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2)))
got = out.get(timeout=60)
p.join(60)
assert not p.is_alive(), "the forked child hangs"
assert got == ("SafeSparseTensor", True, [[0, 1], [1, 0]]), got
""",
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_forked_child_never_hangs(case: str) -> None:
    script = textwrap.dedent(_PARENT) + textwrap.dedent(_CASES[case])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

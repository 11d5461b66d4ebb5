"""A sweep of ops x layouts x operand kinds on valid data: no crash, no wrong result.

Every torch op that takes two or three matrices (``addmm``, ``torch.sparse.addmm``, ``mm``,
``torch.sparse.mm``, ``@``, ``+``, ``-``, ``*``) is run with a checked ``SafeSparseTensor`` of each
layout as first matrix and every layout (and dense) for the others, each either a
``SafeSparseTensor`` or a plain torch tensor; unary ops (conversions, transposes, reductions) on
each layout. Each call must give the dense reference's result or refuse with a clear error
(torch 2.13's ``addmm`` of three CSC tensors segfaults or computes a wrong result: routed
through the CSR kernel; ``torch.sparse.mm`` of two CSC tensors: likewise). One program per
first layout, so a crash fails its test and names the last call started; the programs share
one child process (tests/support/batch.py), so a crash also fails the tests whose programs had
not run yet.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from support.batch import Batch, child_env

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = Batch("crash routes", env=child_env(ROOT, minimal=True))
LAYOUTS = ["coo", "csr", "csc", "bsr", "bsc"]
FORMS = ["addmm_", "addmm_kw", "out", "input_kw", "same_pattern"]

CHILD = textwrap.dedent('''
    import json, sys, warnings
    import torch
    import safesparse as ss
    warnings.filterwarnings("ignore")
    first = sys.argv[1]
    torch.manual_seed(0)
    D = (torch.rand(8, 8) < 0.35).double() * torch.rand(8, 8, dtype=torch.float64)
    D[0, 0] = 1.0
    LAYOUTS = ["coo", "csr", "csc", "bsr", "bsc"]

    def plain(kind):
        return {"coo": lambda: D.to_sparse().coalesce(), "csr": D.to_sparse_csr,
                "csc": D.to_sparse_csc, "bsr": lambda: D.to_sparse_bsr((2, 2)),
                "bsc": lambda: D.to_sparse_bsc((2, 2)), "dense": D.clone}[kind]()

    def operand(kind, safe):
        t = plain(kind)
        return ss.validate(t) if safe and kind != "dense" else t

    def dense(r):
        return r.to_dense() if r.layout != torch.strided else r

    def run(tag, fn, expected):
        print(json.dumps({"start": tag}), flush=True)
        try:
            r = fn()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(json.dumps({"tag": tag, "outcome": "refused", "why": msg[:120]}), flush=True)
            return
        ok = torch.allclose(dense(r).double(), expected, atol=1e-9)
        print(json.dumps({"tag": tag, "outcome": "ok" if ok else "wrong"}), flush=True)

    a = operand(first, True)
    for lb in LAYOUTS + ["dense"]:
        for safe_b in (True, False):
            b = operand(lb, safe_b)
            kb = f"{lb}{'' if safe_b else '(plain)'}"
            run(f"mm {first} {kb}", lambda: torch.mm(a, b), D @ D)
            run(f"sparse.mm {first} {kb}", lambda: torch.sparse.mm(a, b), D @ D)
            run(f"matmul {first} {kb}", lambda: a @ b, D @ D)
            run(f"rmatmul {kb} {first}", lambda: b @ a, D @ D)
            run(f"add {first} {kb}", lambda: a + b, 2 * D)
            run(f"sub {first} {kb}", lambda: a - b, 0 * D)
            run(f"mul {first} {kb}", lambda: a * b, D * D)
            for lc in LAYOUTS + ["dense"]:
                c = operand(lc, not safe_b)
                kc = f"{lc}{'(plain)' if safe_b else ''}"
                want = 0.5 * D + 2.0 * D @ D
                run(f"addmm {kc} {first} {kb}",
                    lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0), want)
                run(f"sparse.addmm {kc} {first} {kb}",
                    lambda: torch.sparse.addmm(c, a, b, beta=0.5, alpha=2.0), want)
                run(f"addmm {kc} {kb} {first}",
                    lambda: torch.addmm(c, b, a, beta=0.5, alpha=2.0), want)
    unary = {
        "to_dense": (lambda: a.to_dense(), D), "coalesce": (lambda: a.coalesce(), D),
        "t": (lambda: a.t(), D.t()), "mT": (lambda: a.mT, D.t()), "neg": (lambda: -a, -D),
        "mul2": (lambda: a * 2, 2 * D), "clone": (lambda: a.clone(), D),
        "to_coo": (lambda: a.to_sparse_coo(), D), "to_csr": (lambda: a.to_sparse_csr(), D),
        "to_csc": (lambda: a.to_sparse_csc(), D),
        "to_bsr": (lambda: a.to_sparse_bsr((2, 2)), D),
        "to_bsc": (lambda: a.to_sparse_bsc((2, 2)), D),
        "sum": (lambda: torch.sparse.sum(a, dim=(0, 1)).reshape(()), D.sum()),
        "mv": (lambda: torch.mv(a, D[0]), D @ D[0]),
        "addmv": (lambda: torch.addmv(D[1], a, D[0]), D[1] + D @ D[0]),
    }
    for name, (fn, want) in unary.items():
        run(f"{name} {first}", fn, want)
    print(json.dumps({"done": True}), flush=True)
''')


for _first in LAYOUTS:
    CHILDREN.add(f"sweep {_first}", CHILD, _first)


@CHILDREN.mark
@pytest.mark.parametrize("first", LAYOUTS)
def test_no_op_crashes_or_computes_wrongly_on_valid_data(first: str) -> None:
    done = CHILDREN.run(f"sweep {first}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [x["start"] for x in lines if "start" in x]
    assert done.returncode == 0, f"crashed in {started[-1] if started else '?'}: {done.stderr}"
    assert lines and lines[-1] == {"done": True}
    results = [x for x in lines if "outcome" in x]
    wrong = [x["tag"] for x in results if x["outcome"] == "wrong"]
    assert not wrong, f"wrong results: {wrong}"
    assert len(results) == len(started)
    # the sweep does compute: the products of the first layout with itself are among the
    # successes (torch's kernel, or the correct route safesparse takes around it)
    ok = {x["tag"] for x in results if x["outcome"] == "ok"}
    assert {f"to_dense {first}", f"mT {first}", f"clone {first}"} <= ok
    if first in ("coo", "csr"):
        assert f"add {first} {first}" in ok
    if first in ("coo", "csr", "csc"):
        assert f"sparse.mm {first} {first}" in ok and f"mm {first} dense" in ok
    if first in ("csr", "csc"):
        assert f"addmm {first}(plain) {first} {first}" in ok


# ---------------------------------------------------------------------------------------------
# In-place and out= products with sparse targets (issue 27, item 5)

TARGETS_CHILD = textwrap.dedent('''
    import json, sys, warnings
    import torch
    import safesparse as ss
    warnings.filterwarnings("ignore")
    form = sys.argv[1]
    torch.manual_seed(0)

    def rnd(p=0.4):
        return ss.validate((torch.randn(5, 5) * (torch.rand(5, 5) < p)).to_sparse_csc())

    c, a, b = rnd(), rnd(), rnd()
    dense_c = c.to_dense()
    ref = dense_c + a.to_dense() @ b.to_dense()
    twin = ss.sparse_csc_tensor(c.ccol_indices(), c.row_indices(), c.values().clone(), c.shape)
    twin_dense = twin.to_dense()
    view = c.mT
    outcome = {}
    try:
        if form == "addmm_":
            r = c.addmm_(a, b)
        elif form == "addmm_kw":
            r = c.addmm_(mat1=a, mat2=b)
        elif form == "out":
            r = torch.addmm(c, a, b, out=twin)
        elif form == "input_kw":
            r = torch.addmm(input=c, mat1=a, mat2=b)
        elif form == "same_pattern":
            full = ss.validate(torch.ones(5, 5).to_sparse_csc())
            full_twin = ss.sparse_csc_tensor(full.ccol_indices(), full.row_indices(),
                                             full.values().clone(), full.shape)
            r = full.addmm_(a, b)
            ref = torch.ones(5, 5) + a.to_dense() @ b.to_dense()
            ss.validate(full_twin)
            outcome["twin"] = bool(torch.equal(full_twin.to_dense(), torch.ones(5, 5)))
            twin_dense = twin.to_dense()
        outcome["result"] = bool(torch.allclose(r.to_dense(), ref, atol=1e-5))
        outcome["checked"] = ss.is_checked(r)
    except RuntimeError as err:
        outcome["refused"] = str(err).splitlines()[0]
    for name, t, want in (("twin", twin, twin_dense), ("view", view, dense_c.mT),
                          ("c", c, dense_c)):
        if form in ("addmm_", "addmm_kw") and name != "twin" and "refused" not in outcome:
            continue
        if form == "out" and name == "twin" and "refused" not in outcome:
            continue
        ss.validate(t)  # InvariantError if its index storage was written
        outcome[name] = outcome.get(name, True) and bool(torch.equal(t.to_dense(), want))
    print(json.dumps(outcome), flush=True)
''')


for _form in FORMS:
    CHILDREN.add(f"targets {_form}", TARGETS_CHILD, _form)


@CHILDREN.mark
@pytest.mark.parametrize("form", FORMS)
def test_sparse_targets_never_get_index_writes(form: str) -> None:
    """``c.addmm_(a, b)`` and ``torch.addmm(..., out=o)`` on CSC tensors used to run torch's
    broken CSC kernel, writing an invalid structure into index storage that a twin and the
    ``.mT`` view share. Now: the result is computed out of place first; only values are
    written when the pattern is the same, otherwise refused naming the out-of-place form;
    every tensor sharing the index storage keeps its (valid) data. ``torch.addmm(input=...,
    mat1=..., mat2=...)`` takes the CSC repair like the positional form."""
    done = CHILDREN.run(f"targets {form}")
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    if form in ("input_kw", "same_pattern"):
        assert outcome["result"] is True and outcome["checked"] is True
    else:
        assert "pattern differs" in outcome["refused"] and "torch.addmm" in outcome["refused"]
    shared = {k: v for k, v in outcome.items() if k in ("twin", "view", "c")}
    assert shared and all(v is True for v in shared.values()), outcome

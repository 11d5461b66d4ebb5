"""torch's index conversions under enforce mode read what was checked (issue 41, item 3).

``torch._convert_indices_from_coo_to_csr`` (PyTorch Geometric's ``index2ptr``) reads its row
indices' memory as if it were contiguous: the wrapper used to check a strided row index (the
first column of an ``(E, 2)`` edge list, ``edges.t()[0]``) by its values, then hand torch the
strided tensor, which read the interleaved column indices as rows and wrote past its output
(heap corruption, SIGABRT / SIGSEGV). Unsorted rows passed and gave a valid-looking wrong
``crow``. ``torch._convert_indices_from_csr_to_coo`` reads past ``crow`` when ``col`` has more
batches than ``crow``. An ``out=`` tensor over the input's memory let torch write offsets where
it then read indices. Every program runs in one child process (tests/support/batch.py): a
crash fails its test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.batch import Batch, child_env

from safesparse_hooks import env

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = Batch("conversions", env=child_env(ROOT, drop=env.VARIABLES))

#: An (E, 2) edge list with sorted rows in [0, 10) and columns up to 10**6: its first column,
#: read as if contiguous, holds columns among the rows.
EDGES = """
    import torch, safesparse as ss
    torch.manual_seed(0)
    rows = torch.randint(0, 10, (2000,)).sort().values
    cols = torch.randint(0, 10**6, (2000,))
    edges = torch.stack([rows, cols], 1)
    strided = edges.t()[0]
    assert not strided.is_contiguous()
    want = torch._convert_indices_from_coo_to_csr(strided.contiguous(), 10).tolist()
"""

STRIDED_TORCH = CHILDREN.add("strided rows through torch", EDGES + """
    with ss.enforce():
        for i in range(20):
            got = torch._convert_indices_from_coo_to_csr(strided, 10)
            assert got.tolist() == want, got
            got = torch._convert_indices_from_coo_to_csr(strided.to(torch.int32), 10,
                                                         out_int32=True)
            assert got.dtype == torch.int32 and got.tolist() == want, got
            got = torch._convert_indices_from_coo_to_csr(input=strided, size=10)
            assert got.tolist() == want, got
    print("SAME")
""")

STRIDED_PYG = CHILDREN.add("strided rows through PyG's index2ptr", EDGES + """
    from torch_geometric.index import index2ptr
    with ss.enforce():
        for i in range(20):
            assert index2ptr(strided, 10).tolist() == want
            assert index2ptr(strided.to(torch.int32), 10).tolist() == want
    print("SAME")
""")


@CHILDREN.mark
@pytest.mark.parametrize("key", [STRIDED_TORCH, STRIDED_PYG])
def test_strided_rows_give_torchs_result_on_the_contiguous_copy(key: str) -> None:
    """Crashed (SIGSEGV / SIGABRT) on the starting commit."""
    proc = CHILDREN.run(key)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SAME"]


UNSORTED = CHILDREN.add("unsorted rows", """
    import torch, safesparse as ss
    from torch_geometric.index import index2ptr
    edges = torch.tensor([[0, 5], [2, 1], [1, 7], [3, 0]])  # rows 0, 2, 1, 3
    with ss.enforce():
        for convert in (lambda r: torch._convert_indices_from_coo_to_csr(r, 4),
                        lambda r: index2ptr(r, 4)):
            for rows in (edges.t()[0], edges[:, 0].contiguous(), edges.t()[0].to(torch.int32)):
                try:
                    print("NOT REFUSED", convert(rows).tolist())
                except ss.InvariantError as err:
                    first = str(err).splitlines()[0]
                    print(err.layout, err.invariant, err.location["position"],
                          err.location["value"], err.location["previous"], err.op,
                          "rows[2] = 1" in first and "row 1 comes after row 2" in first)
""")


@CHILDREN.mark
def test_unsorted_rows_are_refused_with_the_coo_id_and_position() -> None:
    """Passed on the starting commit and gave crow [0, 1, 2, 3, 4] for rows 0, 2, 1, 3."""
    proc = CHILDREN.run(UNSORTED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == ["torch.sparse_coo 5.3 2 1 2 torch._convert_indices_from_coo_to_csr True"] * 6


BOUNDS = CHILDREN.add("rows out of range", """
    import torch, safesparse as ss
    with ss.enforce():
        for rows, size in (([0, 1, 4], 4), ([-1, 0, 1], 4), ([0, 3, 2], 3), ([0, 0], 0)):
            try:
                torch._convert_indices_from_coo_to_csr(torch.tensor(rows), size)
                print("NOT REFUSED")
            except ss.InvariantError as err:
                print(err.invariant, err.location["position"])
""")


@CHILDREN.mark
def test_rows_out_of_range_come_first() -> None:
    """An index outside the size is named before an unsorted one ([0, 3, 2] against 3: the
    3 at position 1, not the descent at position 2)."""
    proc = CHILDREN.run(BOUNDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["5.2 2", "5.1 0", "5.2 1", "5.2 0"]


EQUAL = CHILDREN.add("results equal plain torch's", """
    import torch, safesparse as ss
    torch.manual_seed(1)
    cases = []
    for dtype in (torch.int32, torch.int64):
        for n, size in ((0, 0), (0, 5), (1, 1), (7, 3), (500, 40)):
            base = torch.randint(0, max(size, 1), (n, 3)).sort(0).values.to(dtype)
            cases.append(("coo", base[:, 1], size, {}))            # strided column
            cases.append(("coo", base[:, 1].contiguous(), size, {"out_int32": True}))
        cases.append(("coo", torch.tensor(2, dtype=dtype), 4, {}))  # a 0-dim row index
    for dtype in (torch.int32, torch.int64):
        for batch in ((), (3,), (2, 2)):
            counts = torch.randint(0, 4, (*batch, 6))
            nnz = int(counts.sum(-1).max()) if counts.numel() else 0
            counts[..., -1] += nnz - counts.sum(-1)  # every batch holds nnz entries
            crow = torch.cat([torch.zeros(*batch, 1, dtype=torch.long), counts.cumsum(-1)], -1)
            col = torch.randint(0, 9, (*batch, nnz))
            wide = torch.stack([crow, crow], -1)[..., 0].to(dtype)  # strided last dim
            cases.append(("csr", wide, col.to(dtype), {}))
            cases.append(("csr", crow.to(dtype), torch.stack([col, col], -1)[..., 1].to(dtype),
                          {"transpose": True, "out_int32": True}))

    def run(kind, a, b, kw):  # torch's functions looked up when called: enforce replaces them
        if kind == "coo":
            return torch._convert_indices_from_coo_to_csr(a, b, **kw)
        return torch._convert_indices_from_csr_to_coo(a, b, **kw)

    plain = [run(kind, a.contiguous(), b.contiguous() if kind == "csr" else b, kw)
             for kind, a, b, kw in cases]
    with ss.enforce():
        for (kind, a, b, kw), want in zip(cases, plain):
            got = run(kind, a, b, kw)
            assert got.dtype == want.dtype and torch.equal(got, want), (kind, a, b, kw, got, want)
            out = torch.empty(0, dtype=want.dtype)
            kw_out = {**kw, "out": out}
            assert run(kind, a, b, kw_out) is out and torch.equal(out, want)
    print("SAME", len(cases))
""")


@CHILDREN.mark
def test_results_equal_plain_torchs_on_contiguous_copies() -> None:
    proc = CHILDREN.run(EQUAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SAME", "34"]


BATCHES = CHILDREN.add("csr to coo, batches disagree", """
    import torch, safesparse as ss
    with ss.enforce():
        for crow, col in (([[0, 1, 1]], [[0], [0]]), ([0, 1, 1], [[0], [0]]),
                          ([[0, 1, 1]], [0])):
            try:
                for i in range(50):
                    torch._convert_indices_from_csr_to_coo(torch.tensor(crow), torch.tensor(col))
                print("NOT REFUSED")
            except ss.InvariantError as err:
                print(err.layout, err.invariant)
            except RuntimeError as err:
                print("torch", str(err).splitlines()[0][:60])
""")


@CHILDREN.mark
def test_csr_to_coo_refuses_batches_that_disagree() -> None:
    """crow of one batch, col of two: torch reads past crow (a segfault on the starting
    commit, whose check took the nnz from col and the batches from crow)."""
    proc = CHILDREN.run(BATCHES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["torch.sparse_csr 3.9", "torch.sparse_csr 3.3",
                                        "torch.sparse_csr 3.3"]


ALIASED_OUT = CHILDREN.add("out= over the input's memory", """
    import torch, safesparse as ss
    with ss.enforce():
        for i in range(20):
            # COO -> CSR: out inside the rows; the kernel writes offsets (up to 1000) where it
            # then reads rows, and wrote past the buffer
            buf = torch.zeros(1003, dtype=torch.long)
            buf[500:1000] = 1
            out = buf[600:603]
            got = torch._convert_indices_from_coo_to_csr(buf[:1000], 2, out=out)
            assert got is out and out.tolist() == [0, 500, 1000], out
            # CSR -> COO: out's second row over crow; the kernel copies col there first, then
            # read col's 10**7 as an offset
            buf = torch.zeros(8, dtype=torch.long)
            buf[2:5] = torch.tensor([0, 1, 2])
            out = buf[:4].view(2, 2)
            got = torch._convert_indices_from_csr_to_coo(buf[2:5], torch.tensor([0, 10**7]),
                                                         out=out)
            assert got is out and out.tolist() == [[0, 1], [0, 10**7]], out
    print("SAME")
""")


@CHILDREN.mark
def test_an_out_tensor_over_the_inputs_memory_does_not_change_what_torch_reads() -> None:
    """Heap corruption / SIGSEGV on the starting commit (and in plain torch): the wrapper
    checked the input, then torch wrote ``out`` over it while reading it."""
    proc = CHILDREN.run(ALIASED_OUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SAME"]


COMPILED = textwrap.dedent(EDGES) + textwrap.dedent("""
    import warnings
    warnings.filterwarnings("ignore")

    def f(rows):
        return torch._convert_indices_from_coo_to_csr(rows, 10) * 2

    def h(crow, col):
        return torch._convert_indices_from_csr_to_coo(crow, col, transpose=True) + 1

    crow, col = torch.tensor([[0, 1, 3], [0, 2, 3]]), torch.tensor([[0, 1, 2], [1, 0, 1]])
    want_h = h(crow, col)
    with ss.enforce():
        g, g2 = torch.compile(f, backend="aot_eager"), torch.compile(h, backend="aot_eager")
        for i in range(5):
            assert g(strided).tolist() == [2 * x for x in want]
        try:
            g(torch.tensor([0, 5, 3]))
            print("NOT REFUSED")
        except ss.InvariantError as err:
            print(err.invariant, err.location["position"])
        g3 = torch.compile(lambda rows, out: torch._convert_indices_from_coo_to_csr(
            rows, 10, out=out) * 1, backend="aot_eager", dynamic=True)
        out = torch.empty(11, dtype=torch.long)
        assert g3(strided, out).tolist() == want and out.tolist() == want
        try:
            g3(torch.tensor([0, 5, 3]), out)
            print("NOT REFUSED")
        except ss.InvariantError as err:
            print("out=", err.invariant, err.location["position"])
        assert torch.equal(g2(crow, col), want_h)
        try:
            g2(torch.tensor([[0, 1, 7], [0, 2, 3]]), col)
            print("NOT REFUSED")
        except ss.InvariantError as err:
            print(err.layout, err.invariant)
""")


@pytest.mark.parametrize("first", ["inside enforce mode", "before enforce mode"])
def test_a_compiled_conversion_checks_the_data_it_runs_on(first: str) -> None:
    """torch.compile records the conversion in its graph by name; traced with FakeTensors,
    the wrapper had no data to check and the compiled program ran torch's aten operator on
    the strided rows (heap corruption on the starting commit). Traced, the call is now a
    ``safesparse::`` operator that checks the data it runs on. A fresh interpreter: what
    torch.compile records depends on what torch held when it first looked (before or inside
    enforce mode)."""
    code = COMPILED if first == "inside enforce mode" else (
        "import torch\ntorch.compile(lambda x: x + 1, backend='aot_eager')(torch.ones(2))\n"
        + COMPILED)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(ROOT, drop=env.VARIABLES), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["5.3 2", "out= 5.3 2", "torch.sparse_csc 5.2"]


# ---------------------------------------------------------------------------------------------
# Every route, every integral dtype, size as a 0-d tensor (issue 47, item 1)

#: Each repro of issue 47 (rc 134 / 139 under enforce mode on the starting commit): indices of
#: a dtype the gate let through unchecked (uint8, int8, int16), ``size`` as a 0-d tensor, and
#: the aten packets and overloads, which were not replaced at all. Each runs on its own line;
#: a crash names the last started.
ROUTE_REPROS = {
    "uint8 rows": "torch._convert_indices_from_coo_to_csr("
                  "torch.tensor([0, 200], dtype=torch.uint8), 3)",
    "int8 rows": "torch._convert_indices_from_coo_to_csr("
                 "torch.tensor([-100, 0], dtype=torch.int8), 3)",
    "int16 rows": "torch._convert_indices_from_coo_to_csr("
                  "torch.tensor([0, 30000], dtype=torch.int16), 3)",
    "0-d size": "torch._convert_indices_from_coo_to_csr(torch.tensor([0, 10**7]), "
                "torch.tensor(3))",
    "0-d uint8 size": "torch._convert_indices_from_coo_to_csr(torch.tensor([0, 10**7]), "
                      "size=torch.tensor(3, dtype=torch.uint8))",
    "aten packet": "torch.ops.aten._convert_indices_from_coo_to_csr(torch.tensor([0, 10**7]), 3)",
    "aten .default": "torch.ops.aten._convert_indices_from_coo_to_csr.default("
                     "torch.tensor([0, 10**7]), 3)",
    "aten .default self=": "torch.ops.aten._convert_indices_from_coo_to_csr.default("
                           "self=torch.tensor([0, 100], dtype=torch.int8), size=3)",
    "aten .out": "torch.ops.aten._convert_indices_from_coo_to_csr.out("
                 "torch.tensor([0, 10**7]), 3, out=torch.empty(0, dtype=torch.long))",
    "aten packet, 0-d size": "torch.ops.aten._convert_indices_from_coo_to_csr("
                             "torch.tensor([0, 10**7]), torch.tensor(3))",
    "torch._VF": "torch._VF._convert_indices_from_coo_to_csr(torch.tensor([0, 10**7]), 3)",
    "csr uint8 crow": "torch._convert_indices_from_csr_to_coo("
                      "torch.tensor([0, 255, 2], dtype=torch.uint8), torch.tensor([0, 1]))",
    "csr int8 crow": "torch._convert_indices_from_csr_to_coo("
                     "torch.tensor([0, 100, 2], dtype=torch.int8), torch.tensor([0, 1]))",
    "csr int16 crow": "torch._convert_indices_from_csr_to_coo("
                      "torch.tensor([0, 30000, 2], dtype=torch.int16), torch.tensor([0, 1]))",
    # 44 "equals" 300 in int8: a check in the index dtype would wrap
    "csr int8 crow, nnz past int8": "torch._convert_indices_from_csr_to_coo("
                                    "torch.tensor([0, 1, 44], dtype=torch.int8), "
                                    "torch.zeros(300, dtype=torch.long))",
    "csr aten packet": "torch.ops.aten._convert_indices_from_csr_to_coo("
                       "torch.tensor([0, 10**7, 2]), torch.tensor([0, 1]))",
    "csr aten .default": "torch.ops.aten._convert_indices_from_csr_to_coo.default("
                         "torch.tensor([0, 10**7, 2]), torch.tensor([0, 1]))",
    "csr aten .out": "torch.ops.aten._convert_indices_from_csr_to_coo.out("
                     "torch.tensor([0, 10**7, 2]), torch.tensor([0, 1]), "
                     "out=torch.empty(0, dtype=torch.long))",
    "csr torch._VF": "torch._VF._convert_indices_from_csr_to_coo("
                     "torch.tensor([0, 10**7, 2]), torch.tensor([0, 1]))",
}
REPROS = CHILDREN.add("issue 47 repros", """
    import json, sys, torch, safesparse as ss
    cases = json.loads(sys.argv[1])
    ss.set_enforce(True)
    for name, call in cases.items():
        print(json.dumps({"start": name}), flush=True)
        try:
            eval(call)
            print(json.dumps({"case": name, "outcome": "NOT REFUSED"}), flush=True)
        except ss.InvariantError as err:
            print(json.dumps({"case": name, "outcome": f"{err.layout} {err.invariant}",
                              "op": err.op}), flush=True)
""", json.dumps(ROUTE_REPROS))


@CHILDREN.mark
def test_every_route_and_dtype_of_the_issue_is_refused_never_a_crash() -> None:
    """Each of these crashed (rc 134 / 139) or ran unchecked under enforce mode on the
    starting commit; each is now refused with the id of what it breaks, naming its route."""
    proc = CHILDREN.run(REPROS)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    started = [x["start"] for x in lines if "start" in x]
    assert proc.returncode == 0, f"crashed in {started[-1:]}: {proc.stderr[-2000:]}"
    got = {x["case"]: (x["outcome"], x["op"]) for x in lines if "case" in x}
    assert set(got) == set(ROUTE_REPROS)
    for name, (outcome, op) in got.items():
        csr = name.startswith("csr")
        if name == "int8 rows":
            want = "torch.sparse_coo 5.1"
        elif name == "csr int8 crow, nnz past int8":
            want = "torch.sparse_csr 5.2"
        else:
            want = "torch.sparse_csr 5.3" if csr else "torch.sparse_coo 5.2"
        assert outcome == want, (name, outcome)
        stem = "_convert_indices_from_" + ("csr_to_coo" if csr else "coo_to_csr")
        if "aten" in name:
            suffix = {".default": ".default", ".out": ".out"}.get(name.split()[-1].rstrip("=")
                                                                   .split(" ")[0], "")
            if "self=" in name:
                suffix = ".default"
            assert op == f"torch.ops.aten.{stem}{suffix}", (name, op)
        else:
            assert op == f"torch.{stem}", (name, op)


VALID_ROUTES = CHILDREN.add("valid input by every route and dtype", """
    import numpy as np, torch, safesparse as ss
    torch.manual_seed(3)
    DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    SIZES = (lambda n: n, lambda n: torch.tensor(n), lambda n: torch.tensor(n, dtype=torch.uint8),
             lambda n: torch.tensor(n, dtype=torch.int32), lambda n: np.int64(n))

    def coo_routes(rows, size, kw):
        yield torch._convert_indices_from_coo_to_csr(rows, size, **kw)
        yield torch._convert_indices_from_coo_to_csr(input=rows, size=size, **kw)
        yield torch._VF._convert_indices_from_coo_to_csr(rows, size, **kw)
        yield torch.ops.aten._convert_indices_from_coo_to_csr(rows, size, **kw)
        yield torch.ops.aten._convert_indices_from_coo_to_csr.default(self=rows, size=size, **kw)
        out = torch.empty(1, dtype=torch.int32 if kw else torch.int64)
        got = torch.ops.aten._convert_indices_from_coo_to_csr.out(rows, size, **kw, out=out)
        assert got is out
        yield out

    def csr_routes(crow, col, kw):
        yield torch._convert_indices_from_csr_to_coo(crow, col, **kw)
        yield torch._VF._convert_indices_from_csr_to_coo(crow, col, **kw)
        yield torch.ops.aten._convert_indices_from_csr_to_coo(crow, col, **kw)
        yield torch.ops.aten._convert_indices_from_csr_to_coo.default(
            crow_indices=crow, col_indices=col, **kw)
        out = torch.empty(0, dtype=torch.int32 if kw.get("out_int32") else torch.int64)
        yield torch.ops.aten._convert_indices_from_csr_to_coo.out(crow, col, **kw, out=out)

    cases = 0
    for dtype in DTYPES:
        for n, size in ((0, 0), (1, 1), (9, 4), (60, 7)):
            rows = torch.randint(0, max(size, 1), (n, 2)).sort(0).values[:, 0].to(dtype)
            for kw in ({}, {"out_int32": True}):
                want = torch._convert_indices_from_coo_to_csr(rows.contiguous(), size, **kw)
                for make_size in SIZES:
                    with ss.enforce():
                        for got in coo_routes(rows, make_size(size), kw):
                            assert got.dtype == want.dtype and torch.equal(got, want), (
                                dtype, n, size, kw, got, want)
                            cases += 1
        counts = torch.randint(0, 4, (2, 5))
        nnz = int(counts.sum(-1).max())
        counts[:, -1] += nnz - counts.sum(-1)
        crow = torch.cat([torch.zeros(2, 1, dtype=torch.long), counts.cumsum(-1)], -1)
        if nnz > torch.iinfo(dtype).max:
            continue
        col = torch.randint(0, 9, (2, nnz))
        for c, p in ((crow[0], col[0]), (crow, col)):
            for kw in ({}, {"out_int32": True}, {"transpose": True}):
                want = torch._convert_indices_from_csr_to_coo(c.contiguous(), p.contiguous(),
                                                              **kw)
                with ss.enforce():
                    for got in csr_routes(c.to(dtype), p.to(dtype), kw):
                        assert got.dtype == want.dtype and torch.equal(got, want), (
                            dtype, kw, got, want)
                        cases += 1
    print("SAME", cases)
""")


@CHILDREN.mark
def test_valid_input_by_every_route_and_dtype_equals_plain_torch() -> None:
    """uint8 ... int64 indices, ``size`` as an int, a 0-d tensor of several dtypes or a NumPy
    integer, by the torch function, ``torch._VF``, the aten packet, ``.default`` (keywords
    ``self=`` / ``crow_indices=``) and ``.out``: torch's own result, bit for bit."""
    proc = CHILDREN.run(VALID_ROUTES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SAME", str(5 * 4 * 2 * 5 * 6 + 5 * 2 * 3 * 5)]


PASS_THROUGH = CHILDREN.add("what torch refuses is torch's to refuse", """
    import torch, safesparse as ss
    calls = (
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1]), 3.0),
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1]), True),
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1]), torch.tensor([3])),
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1]), torch.tensor(3.0)),
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0.0, 1.0]), 3),
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([[0, 1]]), 3),
        lambda: torch.ops.aten._convert_indices_from_coo_to_csr(torch.tensor([0, 1]), 3.0),
        lambda: torch._convert_indices_from_csr_to_coo(torch.tensor(0), torch.tensor(0)),
        # no kernel for these dtypes in torch 2.13: valid, checked, refused by torch itself
        lambda: torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1]).to(torch.uint16), 3),
        lambda: torch._convert_indices_from_csr_to_coo(torch.tensor([0, 1, 2]).to(torch.uint32),
                                                       torch.tensor([0, 1])),
    )
    for call in calls:
        try:
            call()
            plain = "ran"
        except Exception as err:
            plain = type(err).__name__
        with ss.enforce():
            try:
                call()
                ours = "ran"
            except ss.InvariantError as err:
                ours = "InvariantError"
            except Exception as err:
                ours = type(err).__name__
        print(plain, ours)
""")


@CHILDREN.mark
def test_arguments_torch_refuses_get_torchs_own_error() -> None:
    """A float or bool size, a 1-element size tensor, float or 2-D rows, unsigned dtypes
    torch has no kernel for: torch's parser or kernel refuses them before reading any data;
    enforce mode lets it, with the same error."""
    proc = CHILDREN.run(PASS_THROUGH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = [line.split() for line in proc.stdout.splitlines()]
    assert len(pairs) == 10 and all(a == b and a != "ran" for a, b in pairs), pairs


UNSIGNED = CHILDREN.add("unsigned dtypes torch has no kernel for", """
    import torch, safesparse as ss
    with ss.enforce():
        for dtype in (torch.uint16, torch.uint32, torch.uint64):
            try:
                torch._convert_indices_from_coo_to_csr(torch.tensor([0, 9]).to(dtype), 3)
                print("NOT REFUSED")
            except ss.InvariantError as err:
                print(err.invariant, err.location["position"])
""")


@CHILDREN.mark
def test_unsigned_dtypes_are_checked_before_torch_refuses_them() -> None:
    """uint16 / uint32 / uint64 rows out of range: the check runs first (a later torch may
    have a kernel for them)."""
    proc = CHILDREN.run(UNSIGNED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["5.2 1"] * 3

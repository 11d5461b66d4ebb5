"""Protecting programs you do not edit: ``safesparse run``, the environment variables (the
startup hook), the pytest option, and the routes enforce mode guards (legacy and ``_unsafe``
constructors, ``Tensor.new``, torch's index conversions), PyTorch Geometric as a program.

Everything that could crash runs in a child process.
"""

from __future__ import annotations

import ast
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from support.batch import Batch, child_env

from safesparse_hooks import env

ROOT = Path(__file__).resolve().parents[2]
TAMPERED = """
import torch
t = torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([10**7]), torch.ones(1), (1, 2),
                            check_invariants=False)
print("BUILT", type(t).__name__)
"""


def _child(args: list[str], *, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
           pythonpath: bool = True) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in env.VARIABLES}
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    environ.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ,
                          cwd=cwd, timeout=600)


def _hook_installed() -> bool:
    """The startup hook is in this interpreter's site-packages (pip install . / -e .)."""
    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    return any((Path(d) / "safesparse-startup.pth").exists() for d in dirs)


needs_install = pytest.mark.skipif(
    not _hook_installed(),
    reason="safesparse is not installed as a distribution with its startup hook "
           "(pip install . or pip install -e .): the .pth hook and entry points are absent")


# ---------------------------------------------------------------------------------------------
# Strict values


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " 1 "])
def test_true_spellings(value: str) -> None:
    assert env.parse(env.ENFORCE, value) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", "", None])
def test_false_spellings(value: str | None) -> None:
    assert env.parse(env.DEBUG, value) is False


@pytest.mark.parametrize("name", env.VARIABLES)
def test_bogus_value_at_import_is_an_error_naming_the_variable(name: str) -> None:
    proc = _child(["-c", "import safesparse"], env_extra={name: "ture"})
    assert proc.returncode != 0
    assert f"{name}='ture' is not a valid value" in proc.stderr


# ---------------------------------------------------------------------------------------------
# safesparse run


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import pickle, sys
        import torch
        class Point:
            pass
        pickle.dumps(Point())  # classes of the script pickle as in `python prog.py`
        print("ARGV", sys.argv, __name__, sys.path[0] == __import__("os").path.dirname(__file__))
        import safesparse as ss
        print("ENFORCED", ss.is_enforced(), ss.is_debug())
        if sys.argv[1:2] == ["boom"]:
            raise KeyError("boom")
        if sys.argv[1:2] == ["tampered"]:
            torch.sparse.FloatTensor(torch.tensor([[0, 10**7]]), torch.ones(2),
                                     torch.Size([3]))
        sys.exit(int(sys.argv[-1]))
    """))
    return script


def test_run_script_argv_main_and_exit_status(tmp_path: Path) -> None:
    script = _script(tmp_path)
    proc = _child(["-m", "safesparse", "run", str(script), "x", "3"])
    assert proc.returncode == 3, proc.stderr
    assert f"ARGV [{str(script)!r}, 'x', '3'] __main__ True" in proc.stdout
    assert "ENFORCED True False" in proc.stdout


def test_run_debug_module_form(tmp_path: Path) -> None:
    _script(tmp_path)
    proc = _child(["-m", "safesparse", "run", "--debug", "-m", "prog", "0"], cwd=tmp_path,
                  env_extra={"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])},
                  pythonpath=False)
    assert proc.returncode == 0, proc.stderr
    assert f"ARGV [{str(tmp_path / 'prog.py')!r}, '0'] __main__" in proc.stdout
    assert "ENFORCED True True" in proc.stdout


def test_run_traceback_is_the_program_s(tmp_path: Path) -> None:
    script = _script(tmp_path)
    proc = _child(["-m", "safesparse", "run", str(script), "boom"])
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith(f'  File "{script}"')  # no runner frame before the program's
    assert lines[-1] == "KeyError: 'boom'"
    assert "runner.py" not in proc.stderr and "runpy" not in proc.stderr


def test_run_refuses_a_tampered_legacy_tensor(tmp_path: Path) -> None:
    script = _script(tmp_path)
    proc = _child(["-m", "safesparse", "run", str(script), "tampered"])
    assert proc.returncode == 1
    assert "InvariantError: [COO 5.2]" in proc.stderr
    assert "torch.sparse.FloatTensor" in proc.stderr


def test_run_usage_errors() -> None:
    proc = _child(["-m", "safesparse", "run"])
    assert proc.returncode == 2 and "script or -m module is required" in proc.stderr
    proc = _child(["-m", "safesparse", "run", "--nope", "x.py"])
    assert proc.returncode == 2 and "unknown option '--nope'" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The startup hook (needs the installed .pth)


@needs_install
def test_environment_variable_protects_an_unmodified_script(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(TAMPERED)
    plain = _child([str(script)], pythonpath=False)
    assert plain.returncode == 0 and "BUILT Tensor" in plain.stdout  # torch's own, unchecked
    for name in env.VARIABLES[:1]:
        proc = _child([str(script)], env_extra={name: "1"}, pythonpath=False)
        assert proc.returncode == 1
        assert "InvariantError: [CSR 5.5]" in proc.stderr


@needs_install
def test_environment_variable_reaches_subprocesses(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        sys.exit(subprocess.run([sys.executable, "-c", {TAMPERED!r}]).returncode)
    """))
    proc = _child([str(script)], env_extra={env.ENFORCE: "yes"}, pythonpath=False)
    assert proc.returncode == 1 and "[CSR 5.5]" in proc.stderr


@needs_install
@pytest.mark.parametrize("how", ["variable", "run"])
def test_dataloader_workers_are_protected(tmp_path: Path, how: str) -> None:
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Tampered(Dataset):
            def __len__(self):
                return 1

            def __getitem__(self, i):
                t = torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([10**7]),
                                            torch.ones(1), (1, 2), check_invariants=False)
                return type(t).__name__

        if __name__ == "__main__":
            loader = DataLoader(Tampered(), batch_size=None, num_workers=1,
                                multiprocessing_context="spawn")
            try:
                print("WORKER BUILT", list(loader))
            except Exception as err:
                print("WORKER REFUSED", "[CSR 5.5]" in str(err))
    """))
    if how == "variable":
        proc = _child([str(script)], env_extra={env.ENFORCE: "1"}, pythonpath=False)
    else:
        proc = _child(["-m", "safesparse", "run", str(script)], pythonpath=False)
    assert "WORKER REFUSED True" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


@needs_install
def test_hook_bogus_value_stops_the_program(tmp_path: Path) -> None:
    proc = _child(["-c", "print('RAN')"], env_extra={env.ENFORCE: "ture"}, pythonpath=False)
    assert proc.returncode == 2 and "RAN" not in proc.stdout
    assert "SAFESPARSE_ENFORCE='ture' is not a valid value" in proc.stderr


@needs_install
def test_hook_costs_no_torch_import_without_torch() -> None:
    code = "import sys; print('torch' in sys.modules, 'safesparse' in sys.modules)"
    proc = _child(["-c", code], env_extra={env.ENFORCE: "1"}, pythonpath=False)
    assert proc.stdout.split() == ["False", "False"]
    proc = _child(["-c", code + "; import torch; print('safesparse' in sys.modules)"],
                  env_extra={env.ENFORCE: "1"}, pythonpath=False)
    assert proc.stdout.split() == ["False", "False", "True"]


#: What the startup hook may import in a process that never imports torch (docs/protecting.md:
#: "two small files"); ``__future__`` for their annotations.
HOOK_MODULES = {"safesparse_hooks", "safesparse_hooks.env", "safesparse_hooks.startup",
                "__future__"}


def _run_pth_line(code_after: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A child that runs the ``.pth`` line of this checkout itself (``python -S``: no
    site-packages hook ran before), then ``code_after``; this checkout and torch's
    site-packages on ``sys.path``."""
    pth = (ROOT / "safesparse-startup.pth").read_text()
    code = f"import sys\nbefore = set(sys.modules)\nexec({pth!r})\n{code_after}"
    purelib = sysconfig.get_paths()["purelib"]
    return _child(["-S", "-c", code],
                  env_extra={**env_extra, "PYTHONPATH": os.pathsep.join([str(ROOT), purelib])},
                  pythonpath=False)


def test_hook_imports_only_its_own_small_modules_without_torch() -> None:
    """Issue 26: with SAFESPARSE_ENFORCE=1 exported, a process that never imports torch paid
    ~20 ms for the modules the hook imported (importlib.util, typing, tempfile ...)."""
    report = "print(sorted(set(sys.modules) - before))"
    off = _run_pth_line(report, {})
    on = _run_pth_line(report, {env.ENFORCE: "1"})
    assert off.returncode == 0 and on.returncode == 0, (off.stderr, on.stderr)
    extra = set(ast.literal_eval(on.stdout.strip())) - set(ast.literal_eval(off.stdout.strip()))
    assert "safesparse_hooks.startup" in extra  # the hook ran
    assert extra <= HOOK_MODULES, sorted(extra - HOOK_MODULES)


def test_hook_imports_safesparse_right_after_torch() -> None:
    proc = _run_pth_line(
        "print('safesparse' in sys.modules)\n"
        "import torch\n"
        "import safesparse as ss\n"
        f"print(ss.__file__.startswith({str(ROOT)!r}), ss.is_enforced())",
        {env.ENFORCE: "on"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True"]


# ---------------------------------------------------------------------------------------------
# The pytest option (needs the pytest11 entry point)


@needs_install
def test_pytest_option(tmp_path: Path) -> None:
    test = tmp_path / "test_user.py"
    test.write_text(textwrap.dedent("""
        import torch
        def test_tampered():
            t = torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([7]), torch.ones(1),
                                        (1, 2), check_invariants=False)
            assert type(t) is torch.Tensor
    """))
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)]
    plain = _child(args, cwd=tmp_path, pythonpath=False)
    assert plain.returncode == 0, plain.stdout
    for mode in ("enforce", "debug"):
        proc = _child([*args, f"--safesparse={mode}"], cwd=tmp_path, pythonpath=False)
        assert proc.returncode == 1, proc.stdout
        assert "InvariantError" in proc.stdout and "[CSR 5.5]" in proc.stdout


def test_plugin_import_is_cheap() -> None:
    proc = _child(["-c", "import sys, safesparse_hooks.pytest_plugin; "
                         "print('torch' in sys.modules, 'safesparse' in sys.modules)"])
    assert proc.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------------------------
# The routes enforce mode guards

ROUTES = {
    "legacy": "torch.sparse.FloatTensor(i, v, torch.Size([3]))",
    "legacy_double": "torch.sparse.DoubleTensor(i, v.double(), torch.Size([3]))",
    "new": "torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.ones(0),"
           " (3,)).new(i, v, torch.Size([3]))",
    "coo_unsafe": "torch.ops.aten._sparse_coo_tensor_unsafe(i, v, [3])",
    "csr_unsafe": "torch.ops.aten._sparse_csr_tensor_unsafe(torch.tensor([0, 2]),"
                  " torch.tensor([0, 10**7]), v, [1, 3])",
    "compressed_unsafe": "torch.ops.aten._sparse_compressed_tensor_unsafe(torch.tensor([0, 2]),"
                         " torch.tensor([0, 10**7]), v, [1, 3], layout=torch.sparse_csr)",
}


# Each program below runs in the module's batch: one child process for all of them
# (tests/support/batch.py); each enforce block ends before the next program starts.
CHILDREN = Batch("protect", env=child_env(ROOT, drop=env.VARIABLES))

for _route, _call in ROUTES.items():
    CHILDREN.add(f"route {_route}", f"""
        import warnings; warnings.filterwarnings("ignore")
        import torch, safesparse as ss
        v = torch.ones(2)
        i = torch.tensor([[0, 10**7]])
        with ss.enforce():
            try:
                {_call}
                print("NOT REFUSED")
            except ss.InvariantError as err:
                print("REFUSED", err.invariant, err.op)
            i = torch.tensor([[0, 2]])
            ok = {_call.replace("10**7", "2")}
            print("GOOD", type(ok).__name__, ss.is_checked(ok))
        i = torch.tensor([[0, 10**7]])
        print("OUTSIDE", type({_call}).__name__)
    """)


@CHILDREN.mark
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_route_refuses_invalid_and_checks_valid(route: str) -> None:
    proc = CHILDREN.run(f"route {route}")
    assert proc.returncode == 0, proc.stderr
    refused = proc.stdout.splitlines()[0].split()
    assert refused[:2] == ["REFUSED", "5.5" if "csr" in route or "compressed" in route
                           else "5.2"], proc.stdout
    assert "GOOD SafeSparseTensor True" in proc.stdout
    assert "OUTSIDE Tensor" in proc.stdout  # outside enforce mode: torch's own, untouched


CONVERSIONS = [
    ("torch._convert_indices_from_coo_to_csr(torch.tensor([0, 1, 10**7]), 3)",
     ("coo", "5.2", 2)),
    ("torch._convert_indices_from_coo_to_csr(torch.tensor([0, -1, 2], dtype=torch.int32), 3)",
     ("coo", "5.1", 1)),
    ("torch._convert_indices_from_csr_to_coo(torch.tensor([0, 1, 10**7]), torch.tensor([0, 1]))",
     ("csr", "5.2", 2)),
    ("torch._convert_indices_from_csr_to_coo(torch.tensor([0, 5, 2]), torch.tensor([0, 1]))",
     ("csr", "5.3", 1)),
    ("torch._convert_indices_from_csr_to_coo(torch.tensor([-3, 1, 2]), torch.tensor([0, 1]),"
     " transpose=True)", ("csc", "5.1", 0)),
]
for _call, _ in CONVERSIONS:
    CHILDREN.add(f"conversion {_call}", f"""
        import torch, safesparse as ss
        with ss.enforce():
            try:
                {_call}
                print("NOT REFUSED")
            except ss.InvariantError as err:
                print(str(err.layout).split("_")[-1], err.invariant, err.location["position"])
        print(torch._convert_indices_from_coo_to_csr(torch.tensor([0, 0, 2]), 3).tolist())
    """)


@CHILDREN.mark
@pytest.mark.parametrize(("call", "expected"), CONVERSIONS)
def test_index_conversions_check_their_input(call: str, expected: tuple[str, str, int]) -> None:
    proc = CHILDREN.run(f"conversion {call}")
    assert proc.returncode == 0, proc.stderr
    layout, iid, position = proc.stdout.splitlines()[0].split()
    assert (layout, iid, int(position)) == expected
    assert proc.stdout.splitlines()[1] == "[0, 2, 2, 3]"


DEBUG_PLAIN = CHILDREN.add("debug mode, a plain tensor on its own", """
    import torch, safesparse as ss
    bad = torch.sparse_csr_tensor(torch.tensor([0, 2]), torch.tensor([1, 0]), torch.ones(2),
                                  (1, 2), check_invariants=False)
    print(bad.col_indices().tolist())  # accessors still inspect
    with ss.debug():
        try:
            bad.to_dense()
            print("NOT REFUSED")
        except ss.InvariantError as err:
            print("REFUSED", err.invariant, err.op)
    print(bad.to_dense().shape)  # outside debug mode: torch's own
""")


@CHILDREN.mark
def test_debug_mode_sees_a_plain_tensor_used_on_its_own() -> None:
    proc = CHILDREN.run(DEBUG_PLAIN)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["[1, 0]", "REFUSED 5.6 to_dense"]


# ---------------------------------------------------------------------------------------------
# PyTorch Geometric


def test_pyg_corrupted_edge_index_is_refused_never_a_crash() -> None:
    pytest.importorskip("torch_geometric")
    proc = _child([str(ROOT / "tests" / "support" / "pyg_corrupt.py")])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert len(lines) == 31
    for line in lines[:-1]:
        case, verdict = line.split()[:2]
        assert verdict in ("refused", "ok"), line  # ok: the result is a checked tensor
        if "/far/" in case or "/too_large/" in case:
            assert verdict == "refused", line
    assert lines[-1] == "EdgeIndex.to_sparse_csr/uncoalesced refused 5.6"


def test_block_end_puts_every_route_back() -> None:
    import torch

    import safesparse as ss

    before = {"new": torch.Tensor.new, "type": torch.Tensor.type,
              "legacy": torch.sparse.FloatTensor,
              "unsafe": torch.ops.aten._sparse_coo_tensor_unsafe,
              "convert": torch._convert_indices_from_coo_to_csr}
    own = set(torch.Tensor.__dict__)
    if ss.is_enforced():
        pytest.skip("enforce mode is on for the whole session (lasting wrappers)")
    with ss.enforce():
        assert torch.sparse.FloatTensor is not before["legacy"]
        assert isinstance(torch.sparse.FloatTensor(2), torch.sparse.FloatTensor)
        t = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (3,))
        assert ss.unwrap(t).type(torch.sparse.DoubleTensor).dtype == torch.float64
        assert torch.ops.aten._sparse_coo_tensor_unsafe.default is not None  # overloads reachable
    assert torch.Tensor.new is before["new"] and torch.Tensor.type is before["type"]
    assert set(torch.Tensor.__dict__) == own
    assert torch.sparse.FloatTensor is before["legacy"]
    assert torch.ops.aten._sparse_coo_tensor_unsafe is before["unsafe"]
    assert torch._convert_indices_from_coo_to_csr is before["convert"]

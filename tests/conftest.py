"""Test configuration: hypothesis profiles and a clean safesparse state for every test.

Profiles:

* ``ci`` - 300 examples per property, no deadline, derandomized (reproducible CI runs).
* ``dev`` - 40 examples per property, for quick local runs.
* ``thorough`` - 5000 random examples per property, for bug hunting (never selected by default).

``dev`` is loaded unless another is asked for: ``HYPOTHESIS_PROFILE=<name>`` (``.ci/run``
runs the property tests with ``HYPOTHESIS_PROFILE=ci python -m pytest -q -m hypothesis``) or
hypothesis's own option ``--hypothesis-profile=<name>`` (not seen by child processes). The
``CI`` variable selects nothing: the README's command takes the same few minutes everywhere.

Also: the suite runs in parallel (pytest-xdist, pyproject.toml's ``addopts``), each worker with
its share of torch's threads; the modules in :data:`SHARED_SESSION_MODULES` keep their tests on
one worker, the modules that start processes run first, and the number of tests collected is
kept for tests/package/test_docs.py, which holds the README's count to it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# Make ``import safesparse`` and ``import strategies`` work without an installed package.
_TESTS = Path(__file__).resolve().parent
for _path in (_TESTS.parent, _TESTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import safesparse as ss  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",  # bug hunting: HYPOTHESIS_PROFILE=thorough pytest tests/engine/test_properties.py
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _profile_name() -> str:
    return os.environ.get("HYPOTHESIS_PROFILE") or "dev"


settings.load_profile(_profile_name())

#: In parallel (pytest-xdist), the workers share the machine's cores: each takes its share for
#: torch's intra-op threads (one each, with one worker per core) rather than all of them, which
#: oversubscribes the cores and costs CPU time in OpenMP's spinning threads. Child processes
#: keep torch's default (nothing is set in the environment); ``-n 0`` keeps it too.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads()
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _fresh_safesparse_state() -> Iterator[None]:
    """Every test starts with an empty validation cache and zeroed counters, and leaves torch's
    process-wide invariant-check flag as it found it (a test that leaks it changes what every
    later test sees: torch then validates in its own factories and in torch.load)."""
    ss.clear_cache()
    ss.reset_stats()
    flag = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    yield
    now = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    if now != flag:
        if flag:
            torch.sparse.check_sparse_tensor_invariants.enable()
        else:
            torch.sparse.check_sparse_tensor_invariants.disable()
        pytest.fail(f"torch's sparse invariant-check flag was {flag}, the test left it {now}")


#: Test modules that mostly start other processes (Python children, distributed workers, mypy)
#: or compile: their tests are marked ``slow``, so ``pytest -m "not slow"`` is a quick subset
#: that still covers every module of the package in process (README, "Set up").
SLOW_MODULES = frozenset({
    "test_beta_warning",
    "test_compile",
    "test_conversions",
    "test_crash_routes",
    "test_distributed",
    "test_fork",
    "test_nn_compile",
    "test_nn_distributed",
    "test_import_warnings",
    "test_portable_checkpoints",
    "test_protect",
    "test_shared_memory",
    "test_state_machine",
    "test_tracebacks",
    "test_typing",
})


#: Test modules whose tests share one expensive module-scoped fixture (a 2-process distributed
#: session, a child process loading every hostile file): run on one xdist worker, so the fixture
#: runs once.
SHARED_SESSION_MODULES = frozenset({"test_distributed", "test_nn_distributed", "test_safetensors"})

#: What the session collected, before ``-m`` / ``-k`` deselect anything: the number of tests and
#: the test files they came from (each xdist worker collects the whole suite).
COLLECTED: dict[str, object] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    COLLECTED["count"] = len(items)
    COLLECTED["files"] = frozenset(Path(str(item.path)).resolve() for item in items)
    for item in items:
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if name in SHARED_SESSION_MODULES:
            item.add_marker(pytest.mark.xdist_group(name))
    # The modules that start processes first (a stable sort: each module keeps its order): in
    # parallel, their long tests then run while quick ones fill the gaps, rather than one of
    # them starting last and ending the run alone.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

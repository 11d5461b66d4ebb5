"""Test configuration: hypothesis profiles and a clean safesparse state for every test.

Profiles:

* ``ci`` - 300 examples per property, no deadline, derandomized (reproducible CI runs).
* ``dev`` - 40 examples per property, for quick local runs.
* ``thorough`` - 5000 random examples per property, for bug hunting (never selected by default).

``ci`` is loaded when the ``CI`` environment variable is set, ``dev`` otherwise;
``HYPOTHESIS_PROFILE=<name>`` overrides both.
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
    "thorough",  # bug hunting: HYPOTHESIS_PROFILE=thorough pytest tests/test_properties.py
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
    explicit = os.environ.get("HYPOTHESIS_PROFILE")
    if explicit:
        return explicit
    return "ci" if os.environ.get("CI") else "dev"


settings.load_profile(_profile_name())


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
    "test_crash_routes",
    "test_distributed",
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)

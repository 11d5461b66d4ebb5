"""``pytest --safesparse=enforce`` / ``--safesparse=debug``: a whole test session protected.

Registered through the ``pytest11`` entry point, so any project's pytest has the option once
safesparse is installed. Without the option nothing changes: this module imports neither torch
nor safesparse. With it, before any conftest or test module is imported, the session is
switched on as ``python -m safesparse run`` does: enforce mode (and debug mode with ``debug``)
becomes the default of every thread, and ``SAFESPARSE_ENFORCE`` / ``SAFESPARSE_DEBUG`` are set
so that subprocesses and DataLoader workers started by the tests are protected too.

Whenever safesparse has been imported (with the option or not), a test failing with an
``InvariantError`` is reported without safesparse's own frames, as Python shows such an error
(:mod:`safesparse.tracebacks`); pytest's ``--full-trace`` or ``SAFESPARSE_TRACEBACK=full`` show
them.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

import pytest

__all__ = [
    "pytest_addoption",
    "pytest_load_initial_conftests",
    "pytest_report_header",
    "pytest_runtest_makereport",
]

MODES = ("enforce", "debug")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("safesparse", "safesparse: validated sparse tensors")
    group.addoption(
        "--safesparse", choices=MODES, default=None, dest="safesparse",
        help="run the session with safesparse's enforce mode on (every sparse tensor torch "
             "builds is validated), or with debug mode on too ('debug')")


def _mode(config: pytest.Config) -> str | None:
    ns = getattr(config, "known_args_namespace", None)
    mode = getattr(ns, "safesparse", None)
    if mode is None:
        mode = config.getoption("safesparse", default=None)
    return mode if isinstance(mode, str) else None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    mode = _mode(early_config)
    if mode is not None:
        from safesparse.enforcement.runner import protect_process

        protect_process(debug=mode == "debug")


def pytest_report_header(config: pytest.Config) -> Any:
    mode = _mode(config)
    if mode is None:
        return None
    return f"safesparse: {'enforce and debug' if mode == 'debug' else 'enforce'} mode on"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, Any, None]:
    """A failure's traceback loses safesparse's frames before pytest renders it (only when
    safesparse is imported and the failure is an ``InvariantError``; nothing is imported)."""
    excinfo = call.excinfo
    tracebacks = sys.modules.get("safesparse.catalog.tracebacks")
    if (excinfo is not None and tracebacks is not None
            and not item.config.getoption("fulltrace", default=False)):
        tracebacks.shorten(excinfo.value, excinfo.tb)
    yield

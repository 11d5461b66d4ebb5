"""Build hook: ship ``safesparse-startup.pth`` at the root of site-packages.

Everything else is declared in pyproject.toml. The ``.pth`` file is the process-startup hook
that makes ``SAFESPARSE_ENFORCE=1`` / ``SAFESPARSE_DEBUG=1`` work in programs that never import
safesparse (see safesparse_hooks/startup.py and docs/protecting.md). setuptools has no
declarative way to put a file at the root of the wheel, so ``build_py`` copies it there; the
regular and the editable (PEP 660) wheel are both built through ``build_py``.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "safesparse-startup.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also puts :data:`PTH` at the root of the build directory."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})

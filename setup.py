"""Build hook: ship ``safesparse-startup.pth`` at the root of site-packages.

Everything else is declared in pyproject.toml. The ``.pth`` file is the process-startup hook
that makes ``SAFESPARSE_ENFORCE=1`` / ``SAFESPARSE_DEBUG=1`` work in programs that never import
safesparse (see safesparse_hooks/startup.py and docs/protecting.md). setuptools has no
declarative way to put a file at the root of the wheel, so ``build_py`` copies it into the
regular wheel, and ``editable_wheel`` (``pip install -e .``, PEP 660, whose wheel takes the
package from the source tree) puts it into the editable wheel's root.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "safesparse-startup.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also puts :data:`PTH` at the root of the build directory."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithStartupHook(editable_wheel):
    """``editable_wheel`` that also puts :data:`PTH` at the root of the editable wheel."""

    def _run_build_commands(self, dist_name: str, unpacked_wheel: Any, build_lib: Any,
                            tmp_dir: Any) -> Any:
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(HERE / PTH, Path(unpacked_wheel) / PTH)
        return result


setup(cmdclass={"build_py": BuildPyWithStartupHook,
                "editable_wheel": EditableWheelWithStartupHook})

"""Build hooks: ship ``safesparse-startup.pth`` at the root of site-packages, and build the
optional native block kernels.

Everything else is declared in pyproject.toml. The ``.pth`` file is the process-startup hook
that makes ``SAFESPARSE_ENFORCE=1`` / ``SAFESPARSE_DEBUG=1`` work in programs that never import
safesparse (see safesparse_hooks/startup.py and docs/protecting.md). setuptools has no
declarative way to put a file at the root of the wheel, so ``build_py`` copies it into the
regular wheel, and ``editable_wheel`` (``pip install -e .``, PEP 660, whose wheel takes the
package from the source tree) puts it into the editable wheel's root.

The native kernels (``safesparse/kernels/csrc/blockprod.c``: plain C, no torch or Python
headers, loaded with ctypes by ``safesparse/kernels/native.py``) are an *optional* extension:
:class:`OptionalBuildExt` never fails the install, whether no compiler is found or the compile
fails (the package then runs its torch-op kernels; ``python -m safesparse info`` says which
path runs and why). No ISA flags on the command line: the micro-kernels carry per-function
target attributes and are chosen at run time, so one binary serves every x86-64 CPU. For a
development tree: ``python setup.py build_ext --inplace`` (``pip install -e .`` builds it in
place too). ``SAFESPARSE_NO_NATIVE=1`` at build time skips it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
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


class OptionalBuildExt(build_ext):
    """``build_ext`` for which no compiler, or a failed compile, is a warning, not an error."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (DistutilsPlatformError and the like)
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    def get_ext_filename(self, fullname: str) -> str:
        # The native library is a plain shared object (ctypes, no Python module init): a name
        # with a dot in its stem, so that nothing takes it for an importable module
        # (pkgutil.walk_packages skips it), and no interpreter tag (it serves every Python).
        # (called with the full dotted name, and by distutils with its last part alone)
        parts = fullname.split(".")
        if parts[-1] == NATIVE.name.rsplit(".", 1)[-1]:
            return os.path.join(*parts[:-1], NATIVE_FILE)
        return str(super().get_ext_filename(fullname))

    @staticmethod
    def _skip(exc: BaseException) -> None:
        old = HERE / "safesparse" / "kernels" / NATIVE_FILE
        kept = (f"; an earlier build stays in place and will run ({old}: python -m safesparse "
                "info says whether it is stale)" if old.exists() else
                "; the torch-op kernels will run (python -m safesparse info says which path "
                "runs)")
        sys.stderr.write(f"safesparse: the native block kernels were not built "
                         f"({exc!s:.300}){kept}\n")


NATIVE = Extension(
    "safesparse.kernels._blockprod",
    sources=["safesparse/kernels/csrc/blockprod.c"],
    # every header (tests/kernels/test_interface.py checks the list against csrc/)
    depends=["safesparse/kernels/csrc/blockprod.h", "safesparse/kernels/csrc/kern.h",
             "safesparse/kernels/csrc/kern_dtype_end.h", "safesparse/kernels/csrc/kern_isa_end.h",
             "safesparse/kernels/csrc/simd_avx512.h", "safesparse/kernels/csrc/simd_avx2.h",
             "safesparse/kernels/csrc/kern_bf16.h", "safesparse/kernels/csrc/kern_bf16_grad.h",
             "safesparse/kernels/csrc/convert.h", "safesparse/kernels/csrc/region.h",
             "safesparse/kernels/csrc/fingerprint.h"],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing"],
    optional=True,
)
NATIVE_FILE = "_blockprod.native.so"
WANT_NATIVE = os.environ.get("SAFESPARSE_NO_NATIVE", "") in ("", "0") and os.name == "posix"

setup(cmdclass={"build_py": BuildPyWithStartupHook,
                "editable_wheel": EditableWheelWithStartupHook,
                "build_ext": OptionalBuildExt},
      ext_modules=[NATIVE] if WANT_NATIVE else [])

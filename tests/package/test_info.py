"""``python -m safesparse info`` says where the native library it loads came from (issue 46):
its path and build time, an in-place build in a source checkout or an installed one, and
whether C sources beside it changed after the build (a ``CC=false`` reinstall in a used
checkout keeps an old in-place build, which then runs silently)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from safesparse.cli import _native_origin, main
from safesparse.kernels import native


def _tree(root: Path, *, checkout: bool) -> Path:
    kernels = root / "safesparse" / "kernels"
    (kernels / "csrc").mkdir(parents=True)
    if checkout:
        (root / "setup.py").write_text("")
    library = kernels / native.LIB_FILE
    library.write_bytes(b"")
    for name in ("blockprod.c", "kern.h"):
        (kernels / "csrc" / name).write_text("")
        os.utime(kernels / "csrc" / name, (1_000_000, 1_000_000))
    os.utime(library, (2_000_000, 2_000_000))
    return library


def test_an_up_to_date_in_place_build(tmp_path: Path) -> None:
    library = _tree(tmp_path, checkout=True)
    lines = _native_origin(library)
    assert lines[0].startswith(f"library: {library} (built 1970-01-24 03:33 UTC; an in-place")
    assert lines[1] == "up to date with its C sources (blockprod.c, kern.h)"


def test_a_source_changed_after_the_build_is_called_stale(tmp_path: Path) -> None:
    library = _tree(tmp_path, checkout=True)
    os.utime(library.parent / "csrc" / "kern.h", (3_000_000, 3_000_000))
    lines = _native_origin(library)
    assert lines[1].startswith("STALE: kern.h changed after this build"), lines
    assert "python setup.py build_ext --inplace" in lines[1]


def test_an_installed_library_without_sources(tmp_path: Path) -> None:
    library = _tree(tmp_path, checkout=False)
    for src in (library.parent / "csrc").iterdir():
        src.unlink()
    lines = _native_origin(library)
    assert "; installed)" in lines[0]
    assert lines[1] == "its C sources are not installed beside it: not compared"
    assert _native_origin(None) == []


def test_an_installed_library_is_never_called_stale(tmp_path: Path) -> None:
    """pip writes an installed package's C sources a few ms after the library it built: their
    times are not compared there (every installed copy said STALE before)."""
    library = _tree(tmp_path, checkout=False)
    os.utime(library.parent / "csrc" / "kern.h", (3_000_000, 3_000_000))
    lines = _native_origin(library)
    assert "; installed)" in lines[0]
    assert lines[1] == ("installed with its C sources (blockprod.c, kern.h): built by the "
                        "install that wrote them"), lines


def test_info_names_the_library_it_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    path = native.library_path()
    if path is None:
        assert "library:" not in out
    else:
        assert f"  library: {path} (built " in out

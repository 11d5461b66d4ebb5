"""Licence, metadata and references: what a company checks before adopting the package."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import safesparse as ss

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _project() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data: dict[str, object] = tomllib.load(f)["project"]
    return data


def test_license_file_is_bsd_3_clause() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License")
    assert "the safesparse authors" in text
    assert "Neither the name of the copyright holder" in text  # the third clause


def test_pyproject_declares_license_and_authors() -> None:
    project = _project()
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "the safesparse authors"}]


def test_optional_extras() -> None:
    extras = _project()["optional-dependencies"]
    assert isinstance(extras, dict)
    assert any(req.startswith("scipy") for req in extras["scipy"])
    assert any(req.startswith("matplotlib") for req in extras["bench"])
    assert any(req.startswith("scipy") for req in extras["test"])  # the bridge is tested in CI
    assert any(req.startswith("safetensors") for req in extras["safetensors"])
    for extra in ("test", "dev"):  # safesparse.safetensors is tested in CI
        assert any(req.startswith("safetensors") for req in extras[extra])


def test_source_distribution_carries_the_docs() -> None:
    manifest = (ROOT / "MANIFEST.in").read_text(encoding="utf-8")
    assert re.search(r"^recursive-include docs \*\.md$", manifest, re.MULTILINE)
    assert "CHANGELOG.md" in manifest


_DANGLING = re.compile(r"SPEC\.md|SPEC section|\bseed 0\d\d\b|/work/")


@pytest.mark.parametrize(
    "path",
    [*sorted((ROOT / "safesparse").rglob("*.py")), *sorted((ROOT / "tools").glob("*.py")),
     *sorted((ROOT / "docs").glob("*.md")),
     ROOT / "README.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_references_to_documents_outside_the_repository(path: Path) -> None:
    hits = [line for line in path.read_text(encoding="utf-8").splitlines()
            if _DANGLING.search(line)]
    assert not hits, f"{path.name} points at documents users do not have: {hits}"


def test_help_of_the_package_is_self_contained() -> None:
    doc = ss.__doc__ or ""
    assert "SPEC" not in doc and "docs/" in doc and "help(safesparse.NAME)" in doc


def test_the_version_is_written_once() -> None:
    project = _project()
    assert "version" not in project, "pyproject.toml must not repeat safesparse.__version__"
    assert project["dynamic"] == ["version"]
    with (ROOT / "pyproject.toml").open("rb") as f:
        dynamic = tomllib.load(f)["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "safesparse.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ss.__version__)
    sources = (ROOT / "safesparse" / "__init__.py").read_text(encoding="utf-8")
    assert sources.count(f'__version__ = "{ss.__version__}"') == 1


def test_an_installed_copy_reports_the_same_version() -> None:
    import json
    from importlib import metadata

    try:
        dist = metadata.distribution("safesparse")
    except metadata.PackageNotFoundError:
        return  # running from a checkout that was never installed
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        return  # an editable install's metadata keeps the version it was installed with
    assert dist.version == ss.__version__ or Path(ss.__file__).parent != ROOT / "safesparse"


def test_no_invented_project_urls() -> None:
    """The project has no public address yet: pyproject names none (an invented one would be
    published in the package's metadata)."""
    assert "urls" not in _project()


def test_the_changelog_has_a_section_for_the_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert ss.__version__ in headings


def test_the_newest_release_in_the_changelog_is_the_version() -> None:
    """Releasing means: the version, and the newest dated section of the changelog for it."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", text, re.MULTILINE)
    assert releases and releases[0][0] == ss.__version__


def test_classifiers_claim_only_tested_python_versions() -> None:
    classifiers = _project()["classifiers"]
    assert isinstance(classifiers, list)
    claimed = {c.rsplit(" :: ", 1)[1] for c in classifiers
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert claimed == {"3.11"}  # what .ci/run runs; add a version here only with a CI run
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running in claimed, f"the suite runs on Python {running}, not a claimed version"

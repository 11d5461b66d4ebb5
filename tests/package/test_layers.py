"""The package is layered as pyproject.toml's import-linter contracts declare (lint-imports).

The contracts are the layer map: every module directly in the package is placed in a layer
(exhaustive), a module imports only its own layer and the layers below, and siblings never
import each other both ways. Imports inside functions count: grimp, import-linter's graph,
reads every import statement, not only the module-level ones.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import tomllib
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict[str, object]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        contracts: list[dict[str, object]] = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_contracts_hold() -> None:
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_the_package_contract_places_every_module() -> None:
    layered = [c for c in _contracts()
               if c["type"] == "layers" and c["containers"] == ["safesparse"]]
    assert len(layered) == 1 and layered[0]["exhaustive"] is True
    layers = layered[0]["layers"]
    assert isinstance(layers, list)
    # bottom to top: flags and torch's originals first, the face last
    assert layers[-1] == "base" and layers[0] == "__main__"


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = grimp.build_graph("safesparse")
    # cli.main imports the runner inside the function, at call time only
    assert graph.direct_import_exists(importer="safesparse.cli",
                                      imported="safesparse.enforcement.runner")
    # and the factories share the argument conversion with the index checks, never each other
    assert graph.direct_import_exists(importer="safesparse.factories.core",
                                      imported="safesparse.engine.convert")
    assert not graph.chain_exists(importer="safesparse.engine.indices",
                                  imported="safesparse.factories")


def test_one_door_to_the_kernels() -> None:
    """The operators are a layer of their own (issue 48): the compiled layer reaches them
    without ``nn/``, they reach the kernels without the factories or the tensor layer, and the
    tensor layer's block products take their gradients from them; one file is named
    ``blocks.py`` (the kernels')."""
    graph = grimp.build_graph("safesparse")
    assert not graph.chain_exists(importer="safesparse.compiled", imported="safesparse.nn",
                                  as_packages=True)
    for above in ("safesparse.factories", "safesparse.tensor", "safesparse.nn"):
        assert not graph.chain_exists(importer="safesparse.operators", imported=above,
                                      as_packages=True)
    assert graph.direct_import_exists(importer="safesparse.tensor.products",
                                      imported="safesparse.operators.autograd")
    assert graph.direct_import_exists(importer="safesparse.operators.library",
                                      imported="safesparse.kernels.blocks")
    named = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "safesparse").rglob("*.py")
                   if p.name == "blocks.py")
    assert named == ["safesparse/kernels/blocks.py"]

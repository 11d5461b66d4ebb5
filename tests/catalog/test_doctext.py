"""Texts said in several places are said alike (safesparse.catalog.doctext): the meaning of the
factories' ``check_invariants`` is one text, in every factory docstring (so ``help()`` and the
generated docs/api.md), the factories module, README.md and docs/protecting.md."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import safesparse as ss
from safesparse.catalog import doctext as _doctext
from safesparse.catalog.doctext import CHECK_INVARIANTS, markdown, normalized
from safesparse.factories import core as factories

ROOT = Path(__file__).resolve().parents[2]
FACTORIES: list[Callable[..., Any]] = [
    ss.sparse_coo_tensor, ss.sparse_csr_tensor, ss.sparse_csc_tensor, ss.sparse_bsr_tensor,
    ss.sparse_bsc_tensor, ss.sparse_compressed_tensor,
]
#: Documents that state the meaning of check_invariants, in Markdown.
DOCUMENTS = ["README.md", "docs/protecting.md"]
#: What the old, wrong text said (SPEC 5: the first operation validates an unchecked tensor).
WRONG = re.compile(r"nothing\s+guards\s+the\s+torch\s+kernels", re.IGNORECASE)


def _arg_entry(doc: str, name: str) -> str:
    """The text of ``name``'s entry in a docstring's Args section."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"{name}:"))
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = [lines[start].lstrip()[len(name) + 1:]]
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return normalized(" ".join(body))


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
def test_every_factory_docstring_states_the_one_text(factory: Callable[..., Any]) -> None:
    doc = inspect.getdoc(factory)
    assert doc is not None
    assert _arg_entry(doc, "check_invariants") == normalized(CHECK_INVARIANTS)


def test_the_factories_module_states_it() -> None:
    assert factories.__doc__ is not None
    assert normalized(CHECK_INVARIANTS) in normalized(factories.__doc__)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_the_documents_state_it(name: str) -> None:
    text = normalized((ROOT / name).read_text(encoding="utf-8"))
    assert normalized(markdown(CHECK_INVARIANTS)) in text


def test_the_generated_api_reference_states_it_for_each_factory() -> None:
    api = normalized((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert api.count(normalized(markdown(CHECK_INVARIANTS))) == len(FACTORIES)


def test_the_old_wrong_text_is_gone_everywhere() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "safesparse").rglob("*.py"))]
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if WRONG.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def test_the_text_says_what_the_code_does() -> None:
    """Each clause, checked: unchecked at first, validated by its first operation or by
    ss.validate, debug mode validates regardless, enforce mode ignores False."""
    def build(check: bool | None) -> ss.SafeSparseTensor:
        return ss.sparse_csr_tensor([0, 1, 2], [0, 9], [1.0, 2.0], (2, 3),
                                    check_invariants=check)

    for check in (None, True):
        with pytest.raises(ss.InvariantError):
            build(check)
    bad = build(False)
    assert isinstance(bad, ss.SafeSparseTensor) and ss.is_checked(bad) is False
    with pytest.raises(ss.InvariantError):
        bad.to_dense()  # its first operation
    with pytest.raises(ss.InvariantError):
        ss.validate(bad)
    with ss.debug(), pytest.raises(ss.InvariantError):
        build(False)
    import torch

    with ss.enforce(), pytest.raises(ss.InvariantError):
        torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 9]), torch.ones(2),
                                (2, 3), check_invariants=False)


def test_markdown_and_normalized() -> None:
    assert markdown("``a`` and ``b c``") == "`a` and `b c`"
    assert normalized(" a\n   b\tc ") == "a b c"
    assert _doctext.__all__ == ["CHECK_INVARIANTS", "factory", "markdown", "normalized"]


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                                    torch.sparse_bsc])
def test_one_docstring_for_the_four_compressed_factories(layout: torch.layout) -> None:
    """The four compressed factories' docstrings are one template filled per layout: their
    members, names and kind of line; the check_invariants text as written once."""
    name = {torch.sparse_csr: "csr", torch.sparse_csc: "csc", torch.sparse_bsr: "bsr",
            torch.sparse_bsc: "bsc"}[layout]
    factory = getattr(ss, f"sparse_{name}_tensor")
    assert factory.__doc__ == _doctext.factory(layout)
    doc = inspect.getdoc(factory)
    assert doc is not None
    members = list(inspect.signature(factory).parameters)[:2]
    assert all(f"{m}: " in doc for m in members)
    assert f"[{name.upper()} <id>]" in doc and f"torch.sparse_{name}_tensor" in doc
    assert normalized(CHECK_INVARIANTS) in normalized(doc)

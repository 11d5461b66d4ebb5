"""Texts that several docstrings and documents must say alike, written once.

Each is reST, as docstrings are written; :func:`markdown` gives the form the Markdown
documents use (the one ``docs/api.md`` renders). ``tests/catalog/test_doctext.py`` checks that every
docstring and document that states one of them states it in exactly these words, so they
cannot drift apart again.
"""

from __future__ import annotations

import re
from typing import Final

#: The meaning of the safe factories' ``check_invariants`` argument.
CHECK_INVARIANTS: Final = (
    "``None`` (default) or ``True``: validate every invariant first. ``False`` keeps torch's "
    "meaning: the tensor is built *without* validation and is unchecked "
    "(``ss.is_checked(t) is False``); its first operation validates it (the guard: no torch "
    "kernel reads unchecked sparse data), and ``ss.validate(t)`` validates it at once. Debug "
    "mode validates regardless. Enforce mode ignores ``False`` when torch's own factory is "
    "called."
)


def markdown(text: str) -> str:
    """``text`` as Markdown: reST ````code```` becomes ```code```."""
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def normalized(text: str) -> str:
    """``text`` with every run of whitespace made one space (line breaks do not count)."""
    return " ".join(text.split())


__all__ = ["CHECK_INVARIANTS", "markdown", "normalized"]

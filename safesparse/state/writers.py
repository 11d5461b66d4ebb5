"""The writers of checked state that the layers above use: every way a tensor or an index member
comes to carry, share, renew or lose a proof, in one list.

The tensor layer and the factories change checked state only through the names below (they
read it through :mod:`safesparse.state.checked`'s questions: ``holds``, ``record``,
``proof_cache``, ...). The protocols are written where the names are defined:
:mod:`.admission` (the ways in: factories, revalidation, fast-path results, the one retry
rule) and :mod:`.checked` (sharing, joining, marking).
"""

from __future__ import annotations

from .admission import (
    Admission,
    First,
    Validation,
    admit,
    give,
    opened,
    proven,
    revalidate,
    straight,
    validated_now,
)
from .checked import (
    before_copy,
    copied,
    current,
    hand_out,
    join,
    mark_derived,
    rearm,
    renew,
    replaced,
    share,
    watch,
)
from .records import born, fresh

__all__ = [
    "Admission",
    "First",
    "Validation",
    "admit",
    "before_copy",
    "born",
    "copied",
    "current",
    "fresh",
    "give",
    "hand_out",
    "join",
    "mark_derived",
    "opened",
    "proven",
    "rearm",
    "renew",
    "replaced",
    "revalidate",
    "share",
    "straight",
    "validated_now",
    "watch",
]

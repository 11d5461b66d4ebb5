"""The error raised for every violated invariant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .invariants import layout_name, lookup


class InvariantError(ValueError, RuntimeError):
    """A sparse tensor breaks an invariant of the catalog.

    Subclasses both :class:`ValueError` and :class:`RuntimeError`, so code written against
    torch's own ``RuntimeError`` keeps working.

    Attributes:
        layout: the sparse layout the invariant belongs to.
        invariant: the catalog id, e.g. ``"5.6"``.
        detail: where and how it is broken (may be empty for metadata invariants).
        location: machine-readable location fields (``batch``, ``row``, ``position``, ``value``...).
        op: the operation that produced or received the tensor (debug mode), else ``None``.
        path: the key path inside a loaded object (``ss.load``), else ``None``.
    """

    def __init__(
        self,
        layout: torch.layout,
        invariant: str,
        detail: str = "",
        *,
        location: Mapping[str, Any] | None = None,
        op: str | None = None,
        path: str | None = None,
    ) -> None:
        self.layout = layout
        self.invariant = invariant
        self.detail = detail
        self.location: dict[str, Any] = dict(location or {})
        self.op = op
        self.path = path
        super().__init__(self._message())

    @property
    def statement(self) -> str:
        """The invariant in words, from the catalog."""
        return lookup(self.layout, self.invariant).text

    def _message(self) -> str:
        msg = f"[{layout_name(self.layout)} {self.invariant}] {self.statement}"
        if self.detail:
            msg += f": {self.detail}"
        if self.path is not None:
            msg += f" (at {self.path})"
        if self.op is not None:
            msg += f" (in op {self.op})"
        return msg

    def __str__(self) -> str:
        return self._message()

    def with_context(self, *, op: str | None = None, path: str | None = None) -> InvariantError:
        """A copy that also names the operation or key path."""
        return InvariantError(
            self.layout,
            self.invariant,
            self.detail,
            location=self.location,
            op=op if op is not None else self.op,
            path=path if path is not None else self.path,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_error,
            (self.layout, self.invariant, self.detail, self.location, self.op, self.path),
        )


def _rebuild_error(
    layout: torch.layout,
    invariant: str,
    detail: str,
    location: dict[str, Any],
    op: str | None,
    path: str | None,
) -> InvariantError:
    return InvariantError(layout, invariant, detail, location=location, op=op, path=path)

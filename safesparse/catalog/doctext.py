"""Texts that several docstrings and documents must say alike, written once.

Each is reST, as docstrings are written; :func:`markdown` gives the form the Markdown
documents use (the one ``docs/api.md`` renders). ``tests/catalog/test_doctext.py`` checks that every
docstring and document that states one of them states it in exactly these words, so they
cannot drift apart again.
"""

from __future__ import annotations

import re
import textwrap
from typing import Final

import torch

from ..base.layouts import BLOCK_LAYOUTS, INDEX_MEMBERS, LAYOUT_NAMES, ROW_LAYOUTS

#: The meaning of the safe factories' ``check_invariants`` argument.
CHECK_INVARIANTS: Final = (
    "``None`` (default) or ``True``: validate every invariant first. ``False`` keeps torch's "
    "meaning: the tensor is built *without* validation and is unchecked "
    "(``ss.is_checked(t) is False``); its first operation validates it (the guard: no torch "
    "kernel reads unchecked sparse data), and ``ss.validate(t)`` validates it at once. Debug "
    "mode validates regardless. Enforce mode ignores ``False`` when torch's own factory is "
    "called."
)


#: The docstring of the four compressed factories (``ss.sparse_csr_tensor`` ...), filled per
#: layout by :func:`factory`.
_COMPRESSED_FACTORY: Final = (
    "Validated ``torch.{factory}``: every invariant is checked before torch sees the data."
    """

    Same signature, inputs, defaults and result as ``torch.{factory}``, with
    one difference: index data that breaks an invariant of the catalog (``ss.CATALOG``,
    ``docs/invariants.md``) raises :class:`InvariantError` instead of building a malformed
    tensor that a later kernel may read out of bounds. The result is built by torch's own
    factory (with ``check_invariants=False``: no second validation, no warning).
{example}
    Index tensors already validated together (the same tensors, unmodified, the same shape)
    are not checked again: rebuilding with new values in a training loop, e.g.
    ``ss.{factory}(t.{c}(), t.{p}(), new_values, t.shape)``,
    costs only O(1) metadata checks.

    Args:
        {c}: the compressed indices, ``batch + (n_{lines} + 1,)``:
            where each {line} starts in ``{p}``; int32 or int64 (a tensor, nested
            list or NumPy array; any strides).
        {p}: the {across} index of each specified {unit}, ``batch + (nnz,)``,
            sorted within each {line}; the same dtype.
{values}
{options}

    Returns:
        A checked :class:`SafeSparseTensor` of layout ``torch.{layout}`` (unchecked if
        ``check_invariants=False``) whose ``to_dense()`` equals torch's.

    Raises:
        InvariantError: an invariant of the catalog is broken; ``str(err)`` starts with
            ``[{name} <id>]`` and names the first violation's location (batch, {line},
            position, value). Nothing is built and no torch kernel has read the data.
        TypeError: an argument is not sparse data at all, with the exception type torch
            raises for it (e.g. a non-integral ``size``).
    """)
#: The docstring of ``ss.sparse_compressed_tensor`` (:func:`factory` of None).
_GENERAL: Final = (
    "Validated ``torch.sparse_compressed_tensor``: any compressed layout, chosen by ``layout``."
    """

    The general form of :func:`sparse_csr_tensor`, :func:`sparse_csc_tensor`,
    :func:`sparse_bsr_tensor` and :func:`sparse_bsc_tensor` (which call it): the same inputs,
    defaults and result as torch's, every invariant of the catalog checked before torch sees
    the data, and index tensors already validated together not checked again.

    Args:
        compressed_indices: ``crow_indices`` (CSR, BSR) or ``ccol_indices`` (CSC, BSC), shape
            ``batch + (n_compressed + 1,)``, int32 or int64.
        plain_indices: ``col_indices`` (CSR, BSR) or ``row_indices`` (CSC, BSC), shape
            ``batch + (nnz,)``, the same dtype.
        values: ``batch + (nnz,) + dense`` (CSR, CSC) or ``batch + (nnz, b0, b1) + dense``
            (BSR, BSC); copied when not contiguous (or, BSR/BSC, not contiguous after
            swapping the two block dims: 3.7), where torch keeps them strided.
        size: ``batch + (rows, cols) + dense``; ``None`` estimates it from the members.
        layout: ``torch.sparse_csr``, ``sparse_csc``, ``sparse_bsr`` or ``sparse_bsc``;
            required, as in torch (any other layout is invariant 2.4).
{options}

    Returns:
        A checked :class:`SafeSparseTensor` of the requested layout (unchecked if
        ``check_invariants=False``) whose ``to_dense()`` equals torch's.

    Raises:
        InvariantError: an invariant is broken (``[CSR 5.6]``, ``[BSC 3.1]`` ...), with the
            location of the first violation; nothing is built. A missing or non-compressed
            ``layout`` is ``[<LAYOUT> 2.4]``.
        TypeError: an argument is not sparse data at all, with the exception type torch
            raises for it (e.g. a non-integral ``size``).
    """
)
#: The docstring of ``ss.sparse_coo_tensor`` (:func:`factory` of ``torch.sparse_coo``).
_COO: Final = (
    "Validated ``torch.sparse_coo_tensor``: every invariant is checked before torch sees the data."
    """

    Same signature, overloads, accepted inputs, defaults and result as
    ``torch.sparse_coo_tensor``, with one difference: index data that breaks an invariant of
    the catalog raises :class:`InvariantError` instead of building a tensor that a later kernel
    may read out of bounds. Also ``sparse_coo_tensor(size, *, dtype=None, device=None,
    requires_grad=False)``: an empty tensor of that size.

    Index tensors already validated (the same tensor, unmodified, the same sparse sizes) are not
    checked again, so rebuilding with new values costs only O(1) metadata checks.

    Example::

        t = ss.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.0, 4.0, 5.0], (2, 3))

    Args:
        indices: ``(sparse_dim, nnz)`` indices; integer, bool and floating point indices are
            converted to int64 as torch does (a tensor, nested list or NumPy array).
        values: ``(nnz,) + size[sparse_dim:]``; a scalar is one specified element.
        size: the full shape; ``None`` estimates the sparse sizes as ``max index + 1`` per
            sparse dim.
{options}
        is_coalesced: ``True`` marks the result coalesced, which is verified (5.3: indices
            sorted lexicographically, no duplicates); ``None``/``False``: torch's default.

    Returns:
        A checked :class:`SafeSparseTensor` of layout ``torch.sparse_coo`` (unchecked if
        ``check_invariants=False``) whose ``to_dense()`` equals torch's.

    Raises:
        InvariantError: an invariant is broken, e.g. ``[COO 5.2]`` for an index past its size,
            with the position and value; ``[COO 5.3]`` for ``is_coalesced=True`` on unsorted
            or duplicate indices. Nothing is built.
        TypeError: an argument is not sparse data at all, with the exception type torch
            raises for it (e.g. a non-integral ``size``).
    """
)
#: The keyword arguments every factory takes (filled into every factory's text).
_OPTIONS: Final = """\
        dtype: the values dtype; default: that of ``values`` (torch's default dtype for
            Python floats). ``values`` are converted when it differs.
        device: the device of the result; default: that of ``values`` (the CPU for lists and
            NumPy arrays). Members on another device are moved.
        pin_memory: build the result in pinned memory (CPU only), as torch does.
        requires_grad: make the result an autograd leaf that requires grad (``.grad`` is
            filled by ``backward()``). Values that already require grad keep their graph
            connected instead."""
_EXAMPLE: Final = """
    Example::

        a = ss.sparse_csr_tensor([0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0], size=(2, 3))
        ss.sparse_csr_tensor([0, 2, 3], [2, 0, 1], [1.0, 2.0, 3.0], size=(2, 3))  # [CSR 5.6]
"""
_VALUES: Final = """        values: ``batch + (nnz,) + dense``
            (a tensor, nested list, NumPy array or scalar); copied when not contiguous
            (3.7), where torch keeps them strided.
        size: ``batch + (rows, cols) + dense``; ``None`` estimates it from the
            members, as torch does."""
_BLOCK_VALUES: Final = """        values: ``batch + (nnz, b0, b1) + dense``: one dense block per
            specified block; the blocksize ``(b0, b1)`` is read off its shape
            (a tensor, nested list, NumPy array or scalar); copied unless contiguous,
            or contiguous after swapping the two block dims (3.7); torch keeps them strided.
        size: ``batch + (rows, cols) + dense``; ``None`` estimates it from the members (for BSR,
            ncols = max(col_indices.max() + 1, crow_indices.diff(dim=-1).max())
            blocks), as torch does."""


def factory(layout: torch.layout | None) -> str:
    """The docstring of ``layout``'s safe factory (``ss.sparse_csr_tensor`` ...): one text for
    the four compressed layouts, their names and members from :mod:`safesparse.base.layouts`;
    for None, ``ss.sparse_compressed_tensor``'s; for COO, ``ss.sparse_coo_tensor``'s."""
    options = _OPTIONS + "\n" + textwrap.fill(
        "check_invariants: " + CHECK_INVARIANTS, width=96, initial_indent=" " * 8,
        subsequent_indent=" " * 12, break_on_hyphens=False, break_long_words=False)
    if layout is None:
        return _GENERAL.format(options=options)
    if layout is torch.sparse_coo:
        return _COO.format(options=options)
    name = LAYOUT_NAMES[layout]
    blocked = layout in BLOCK_LAYOUTS
    by_rows = layout in ROW_LAYOUTS
    line = ("block " if blocked else "") + ("row" if by_rows else "column")
    c, p = INDEX_MEMBERS[layout]
    return _COMPRESSED_FACTORY.format(
        factory=f"sparse_{name.lower()}_tensor", layout=f"sparse_{name.lower()}", name=name,
        example=_EXAMPLE if layout == torch.sparse_csr else "", c=c, p=p, line=line,
        lines=line.replace(" ", "_") + "s", across="column" if by_rows else "row",
        unit="block" if blocked else "element", values=_BLOCK_VALUES if blocked else _VALUES,
        options=options)


def markdown(text: str) -> str:
    """``text`` as Markdown: reST ````code```` becomes ```code```."""
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def normalized(text: str) -> str:
    """``text`` with every run of whitespace made one space (line breaks do not count)."""
    return " ".join(text.split())


__all__ = ["CHECK_INVARIANTS", "factory", "markdown", "normalized"]

"""A module's proven sparse pattern: index buffers, values parameter, geometry as extra state.

:class:`CompressedModule` is what :class:`~safesparse.nn.SparseLinear` and
:class:`~safesparse.nn.SparseMatmul` share: a fixed 2-D compressed matrix (CSR, CSC, BSR, BSC,
any block shape) held as two index buffers (``compressed_indices``, ``plain_indices``) handed
out by a checked tensor, so that the ``safesparse`` operators can confirm them in O(1), and
its stored values as one dense ``nn.Parameter`` (``values``).

Data enters, and is validated, in three places: construction, ``load_state_dict`` (a valid
pattern with another number of stored elements replaces pattern and values whole; an invalid
one raises before anything is written) and setting a new matrix. Module conversions
(``.to(dtype)``, ``.half()``, ``.to(device)``, ``copy.deepcopy``) keep the proof: a conversion
that leaves the index buffers as they are keeps them; one that moves them (another device,
shared memory) re-proves the buffers through the kept checked tensor (its own conversion is
checked without an O(nnz) check) where that route applies; elsewhere (``share_memory()``,
``to_empty()``) nothing is validated there: the operators validate the buffers at their next
call (:mod:`safesparse.operators`).

The geometry goes into the state dict as the module's extra state, one small int64 tensor
``[0x5353, 1, layout, rows, cols, block rows, block cols]`` (layout 0..3 for CSR, CSC, BSR,
BSC; blocks 1 x 1 for CSR / CSC): a tensor, so every checkpoint format stores it
(``torch.save`` with ``weights_only`` loads, safetensors) and ``python -m safesparse check``
finds the triple next to it and validates it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from ..base.compiling import dynamic_length
from ..base.layouts import BLOCK_LAYOUTS, ROW_LAYOUTS, compressed_members, extents
from ..catalog.errors import InvariantError
from ..catalog.invariants import STATE_DICT_LOADER
from ..catalog.module_geometry import (
    MEMBER_NAMES,
    GeometryError,
    geometry_tensor,
    member_of,
    parse_geometry,
    values_disagree,
)
from ..factories import sparse_compressed_tensor
from ..operators.library import check_matrix
from ..state import checked, members_proof  # (the one place that decides whether a proof holds)
from ..tensor import SafeSparseTensor, validate
from .errors import keyed

__all__ = ["CompressedModule", "block_shape"]

_log = logging.getLogger("safesparse.nn")

# One compile for every density (SPEC 10): the members whose length is the number of stored
# elements are dynamic in it under torch.compile (buffers and parameters are static by default)
dynamic_length("_buffers", MEMBER_NAMES[1])
dynamic_length("_parameters", MEMBER_NAMES[2])


def block_shape(blocksize: tuple[int, int] | int | None) -> tuple[int, int]:
    """``(r, c)`` of a block size given as a pair, an int (square blocks, as
    ``to_sparse_bsr`` takes) or None (single elements)."""
    if isinstance(blocksize, int):
        return int(blocksize), int(blocksize)
    r, c = blocksize or (1, 1)
    return int(r), int(c)


def _plain(values: torch.Tensor) -> bool:
    """Whether ``values`` (detached) is a plain tensor: not a wrapper subclass such as the
    ``DTensor`` shard FSDP2 puts in the values parameter's place."""
    return type(values) is torch.Tensor


class CompressedModule(nn.Module):
    """A fixed, proven 2-D compressed matrix as module state (module docstring)."""

    values: nn.Parameter
    _pattern: SafeSparseTensor | None
    compressed_indices: torch.Tensor
    plain_indices: torch.Tensor

    def _init_matrix(self, matrix: torch.Tensor, requires_grad: bool) -> None:
        check_matrix(type(self).__name__, matrix)
        # the module's own copy (a clone of a checked tensor is checked without validation)
        own = validate(matrix.detach()).clone()
        self.layout: torch.layout = own.layout
        self._size = (int(own.shape[0]), int(own.shape[1]))
        # values of their own: ``own.values()`` shares ``own``'s version counter, so training
        # it in place would void the proof of the index buffers at every step
        self.values = nn.Parameter(own.values().detach().clone(), requires_grad=requires_grad)
        self._prove(own)

    def _init_skeleton(self, layout: torch.layout, size: tuple[int, int],
                       blocksize: tuple[int, int], n_stored: int, dtype: torch.dtype,
                       requires_grad: bool) -> None:
        """A module on the meta device claiming ``n_stored`` blocks and no pattern: meta tensors
        hold no data, so nothing is proven; ``load_state_dict(sd, assign=True)`` (or
        ``to_empty`` and ``load_state_dict``) gives it the checkpoint's, validated."""
        r, c = blocksize if layout in BLOCK_LAYOUTS else (1, 1)
        self.layout = layout
        self._size = size
        shape = (n_stored, r, c) if layout in BLOCK_LAYOUTS else (n_stored,)
        self.values = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                   requires_grad=requires_grad)
        n_compressed = extents(layout, size[0], size[1], r, c)[0]
        self._pattern = None
        self._buffers["compressed_indices"] = torch.empty(n_compressed + 1, dtype=torch.int64,
                                                          device="meta")
        self._buffers["plain_indices"] = torch.empty(n_stored, dtype=torch.int64,
                                                     device="meta")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "values" and self.__dict__.get("_pattern") is not None:
            # another values parameter (FSDP2 swaps its shard and the gathered values in at
            # every forward): the kept tensor would hold the old values' memory alive; the
            # index buffers stay proven without it
            self.__dict__["_pattern"] = None
        super().__setattr__(name, value)

    # -- the proof --------------------------------------------------------------------------

    def _prove(self, proven: SafeSparseTensor) -> None:
        """Make the index members of the checked ``proven`` (this module's layout and size)
        this module's buffers: a checked tensor is built on them with the current values (no
        O(nnz) check) and kept, and its members, which carry its proof, become the buffers."""
        c, p = compressed_members(proven)
        self.__dict__.pop("_emptied", None)
        values = self.values.detach()
        if _plain(values):
            kept: SafeSparseTensor = sparse_compressed_tensor(
                c, p, values, self._size, layout=self.layout)
            self._pattern = kept
            c, p = compressed_members(kept)
        else:  # (a DTensor shard under FSDP2: the members alone, proven by ``proven``)
            self._pattern = None
        self._buffers["compressed_indices"] = c
        self._buffers["plain_indices"] = p

    def _stand_in(self, values: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Values to validate a pattern with: ``values`` when a plain tensor, else (a DTensor
        under FSDP2) zeros of its global shape on ``device`` (1 byte each, dropped after)."""
        if _plain(values):
            return values
        return torch.zeros(values.shape, dtype=torch.uint8, device=device)

    def _confirmed(self) -> bool:
        c, p = self.compressed_indices, self.plain_indices
        n_comp = c.shape[0] - 1 if c.dim() == 1 else -1
        n_plain = extents(self.layout, *self._size, *(self.blocksize or (1, 1)))[1]
        return members_proof.confirm(c, p, checked.compressed_geometry(n_comp, n_plain))

    @property
    def blocksize(self) -> tuple[int, int] | None:
        v = self.values
        return (int(v.shape[-2]), int(v.shape[-1])) if self.layout in BLOCK_LAYOUTS else None

    @property
    def matrix(self) -> SafeSparseTensor:
        """The current matrix: a checked ``SafeSparseTensor`` on the index buffers with the
        current :attr:`values` (gradients reach them); no O(nnz) check. On the meta device
        (a skeleton: no data to check) an unchecked one of the same metadata, as an
        ``nn.Linear``'s weight is a meta tensor there."""
        c, p = self.compressed_indices, self.plain_indices
        out: SafeSparseTensor = sparse_compressed_tensor(
            c, p, self.values, self._size, layout=self.layout,
            check_invariants=False if c.is_meta or p.is_meta else None)
        return out

    def block_mask(self) -> torch.Tensor:
        """The kept blocks: a bool tensor ``(rows // block_rows, cols // block_cols)`` (element
        layouts: blocks of 1 x 1), True where the pattern stores a block, from the index
        buffers, never from the values (a stored block of zeros is True). Buffers that are not
        proven (written since, shared memory) are validated first (``InvariantError`` when
        invalid); a module on the meta device gives a meta tensor."""
        r, c = self.blocksize or (1, 1)
        shape = (self._size[0] // r, self._size[1] // c)
        comp, plain = self.compressed_indices, self.plain_indices
        if comp.is_meta or plain.is_meta:
            return torch.empty(shape, dtype=torch.bool, device="meta")
        if not self._confirmed():  # validated copies (no writer can change them under us)
            comp, plain = comp.clone(), plain.clone()
            try:
                sparse_compressed_tensor(comp, plain, self._stand_in(self.values.detach(),
                                                                     comp.device),
                                         self._size, layout=self.layout)
            except InvariantError as err:
                raise keyed(self, err.with_context(path=member_of(err))) from None
        counts = (comp[1:] - comp[:-1]).to(torch.int64)
        major = torch.repeat_interleave(
            torch.arange(counts.shape[0], device=comp.device), counts,
            output_size=plain.shape[0])
        mask = torch.zeros(shape, dtype=torch.bool, device=comp.device)
        if self.layout in ROW_LAYOUTS:
            mask[major, plain] = True
        else:
            mask[plain, major] = True
        return mask

    def _set_matrix(self, matrix: torch.Tensor) -> None:
        """Replace pattern and values whole by those of ``matrix`` (same layout and size),
        validated first; nothing is written when it is refused."""
        check_matrix(type(self).__name__, matrix)
        if matrix.layout != self.layout or tuple(matrix.shape) != self._size:
            raise ValueError(
                f"{type(self).__name__}: the new matrix is {matrix.layout} of shape "
                f"{tuple(matrix.shape)}, the module holds {self.layout} of shape "
                f"{self._size}\n  Build a new module for another layout or size.")
        own = validate(matrix.detach()).clone()
        self._replace(own, own.values().detach().clone(), assign=True)

    def _replace(self, proven: SafeSparseTensor, values: torch.Tensor, assign: bool) -> None:
        """New pattern ``proven`` (checked) with ``values``: copied into the values parameter
        when it has their shape (optimizers keep it) unless ``assign``, else a new
        parameter."""
        with torch.no_grad():
            if not assign and values.shape == self.values.shape:
                self.values.copy_(values)
            else:
                self.values = nn.Parameter(values, requires_grad=self.values.requires_grad)
        self._prove(proven)

    # -- conversions ------------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> CompressedModule:
        before = (self.compressed_indices, self.plain_indices)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        c, p = self.compressed_indices, self.plain_indices
        kept = self._pattern
        if kept is not None and c is before[0] and p is before[1] and self._confirmed():
            proven = kept  # the buffers as they were (a dtype conversion): the same proof
        elif kept is not None and kept.device != c.device and c.device.type != "meta" \
                and kept.device.type != "meta" and c.shape == before[0].shape \
                and p.shape == before[1].shape:
            proven = kept.to(c.device)  # a move: checked without an O(nnz) check
        else:
            # buffers written or re-allocated in place (share_memory_, to_empty): nothing is
            # validated here (to_empty's memory is uninitialised); the operators validate the
            # buffers at their next call (shared memory: at every call) and refuse invalid data
            # (after to_empty, saying so: :func:`emptied`)
            self._pattern = None
            if getattr(fn, "__qualname__", "").startswith("Module.to_empty."):
                self.__dict__["_emptied"] = True
            return self
        self._prove(proven)  # (also drops the kept tensor's hold on the old values)
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and pickling give the buffers new objects: proven again (the kept
        # tensor's copy is checked: no O(nnz) check for a deepcopy)
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        kept = self.__dict__.get("_pattern")
        if kept is not None and not self._confirmed():
            c, p = self.compressed_indices, self.plain_indices
            if not members_proof.watchable(c, p):
                # shared memory (a process queue): the operators validate it at every call
                self._pattern = None
                return
            self._prove(validate(sparse_compressed_tensor(
                c, p, self.values.detach(), self._size, layout=self.layout)))

    # -- state dict ---------------------------------------------------------------------------

    def get_extra_state(self) -> torch.Tensor:
        return geometry_tensor(self.layout, self._size, self.blocksize)

    def set_extra_state(self, state: Any) -> None:
        self._incoming_geometry(state, "_extra_state")

    def _incoming_geometry(self, state: Any, key: str
                           ) -> tuple[torch.layout, tuple[int, int], tuple[int, int] | None]:
        """The checkpoint's geometry at ``key``: damaged (:class:`GeometryError`) or of
        another layout or size than this module's (``ValueError``) is refused, naming the
        key."""
        try:
            layout, size, blocksize = parse_geometry(state)
        except ValueError as exc:
            raise GeometryError(key, str(exc), loaded_by=self._loader()) from None
        if layout != self.layout or size != self._size:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint holds a {layout} matrix of shape "
                f"{size} (at {key}), this module a {self.layout} matrix of shape "
                f"{self._size}\n  Build the module with the checkpoint's layout and size.")
        return layout, size, blocksize

    def _loader(self) -> str:
        return f"{type(self).__name__}.{STATE_DICT_LOADER}"

    def _own_keys_refused(self, state_dict: dict[str, Any], prefix: str) -> list[str]:
        """This module's other keys in ``state_dict`` (the bias ...) that torch will refuse
        (not a tensor, another shape), so that the pattern is not written when it does."""
        refused = []
        local = {**self._parameters, **self._buffers}
        for name, mine in local.items():
            key = prefix + name
            if mine is None or name in MEMBER_NAMES or key not in state_dict:
                continue
            given = state_dict[key]
            if not isinstance(given, torch.Tensor):
                refused.append(key)
                continue
            shape = given.shape[1:] if mine.dim() == 0 and given.dim() == 1 else given.shape
            if shape != mine.shape:  # (torch's rules: a 1-element 1-D tensor fills a 0-D one)
                refused.append(key)
        return refused

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """The incoming pattern is validated (with the incoming values, or the current ones)
        against the checkpoint's geometry (or, in a state dict without one, saved by 0.2.0,
        this module's own), and this module's other keys are checked, before anything is
        written: an invalid pattern raises ``InvariantError`` naming its key, a damaged
        geometry ``GeometryError``, and the module is unchanged; so it is when torch refuses
        another of its keys (a bias of another shape). A valid one replaces pattern and values
        whole (another number of stored elements included: noted, see :meth:`_note_count`).
        The index buffers are always the module's own copies (``assign=True`` assigns the
        values only, with their dtype and device when the module is on the meta device). A
        module on the meta device without ``assign`` is left as torch leaves its parameters
        there (a no-op, with torch's warning). Values sharded by FSDP2 (``DTensor``) load
        into a layer of the same number of stored blocks."""
        keys = [prefix + n for n in MEMBER_NAMES]
        extra_key = prefix + "_extra_state"
        given = [k for k in keys if k in state_dict]
        if extra_key in state_dict:
            _, _, blocksize = self._incoming_geometry(state_dict[extra_key], extra_key)
        else:  # (a state dict saved by 0.2.0: the module's own geometry)
            blocksize = self.blocksize
        proven: SafeSparseTensor | None = None
        values: torch.Tensor | None = None
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        meta = self.values.is_meta
        if given:
            c, p, v = (state_dict[k] if k in state_dict else getattr(self, n).detach()
                       for k, n in zip(keys, MEMBER_NAMES, strict=True))
            for k, t in zip(keys, (c, p, v), strict=True):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{type(self).__name__}: {k} must be a tensor, got "
                                    f"{type(t).__name__}")
            disagree = values_disagree(self.layout, blocksize, v)
            if disagree is not None:
                raise disagree.with_context(path=prefix + "values", loaded_by=self._loader())
            if not meta and (v.dtype != self.values.dtype or v.device != self.values.device):
                v = v.to(self.values.device, self.values.dtype)
            v = v.detach()
            # the module's own copies of the index members, made before they are validated,
            # also under assign=True: a file mapping or shared memory can change under a check,
            # and a loaded file can put another tensor, with a version counter of its own, on
            # the same bytes (ss.load's walk copies such sparse tensors; these are dense)
            c, p = (t.clone() if t.layout == torch.strided else t for t in (c, p))
            try:
                proven = sparse_compressed_tensor(c, p, self._stand_in(v, c.device),
                                                  self._size, layout=self.layout)
            except InvariantError as err:
                raise err.with_context(path=prefix + member_of(err),
                                       loaded_by=self._loader()) from None
            values = proven.values().detach() if _plain(v) else v
            if not _plain(self.values.detach()) and values.shape != self.values.shape:
                raise ValueError(
                    f"{type(self).__name__}: the state dict stores {values.shape[0]} blocks (at "
                    f"{prefix}values), this layer {self.values.shape[0]}, sharded by FSDP2\n"
                    "  A sharded layer keeps its number of stored blocks: load the checkpoint "
                    "before fully_shard, or build the layer with its density.")
        refused = self._own_keys_refused(state_dict, prefix)
        failed_before = len(error_msgs)
        own = set(keys) | {extra_key}
        # what torch loads: the module's other keys (only the refused ones when there are:
        # torch reports them and nothing of this module is written)
        rest = {k: t for k, t in state_dict.items() if k not in own and (
            not refused or not k.startswith(prefix) or k in refused
            or k[len(prefix):].split(".", 1)[0] not in {**self._parameters, **self._buffers})}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        held_back = [k for k in state_dict if k not in rest]
        for k in [*held_back, *([extra_key] if given else [])]:
            while k in missing_keys:
                missing_keys.remove(k)
        if proven is None or values is None or refused or len(error_msgs) != failed_before:
            return
        if meta and not assign:
            warnings.warn(
                f"for {prefix}values: copying from a non-meta parameter in the checkpoint to a "
                "meta parameter in the current model, which is a no-op. (Did you mean to pass "
                "`assign=True` to assign items in the state dictionary to their corresponding "
                "key in the module instead of copying them in place?)", stacklevel=4)
            return
        self._note_count(prefix, int(values.shape[0]), assign or meta)
        self._replace(proven, values if assign or not _plain(values) else values.clone(),
                      assign)

    def _note_count(self, prefix: str, incoming: int, expected: bool) -> None:
        """A state dict of another number of stored blocks (another density) replaces the
        layer's pattern and values whole: the values parameter becomes a new object, so an
        optimizer built before holds the old one. Said by a ``UserWarning``, or, where the
        parameters are replaced anyway (``assign=True``, a meta skeleton), an info-level
        record of the ``safesparse.nn`` logger."""
        held = int(self.values.shape[0])
        if incoming == held:
            return
        name = prefix[:-1] or type(self).__name__
        what = ("blocks" if self.layout in BLOCK_LAYOUTS else "elements")
        text = (f"{name}: the state dict's pattern stores {incoming} {what}, the layer "
                f"stored {held}: pattern and values replaced")
        if expected:
            _log.info(text)
            return
        warnings.warn(
            f"{text}; `values` is a new parameter (an optimizer built before holds the old "
            "one: build it after loading)", UserWarning, stacklevel=4)

    # -- TorchScript ----------------------------------------------------------------------------

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` calls this first: the forward's checks and operators are Python
        that TorchScript cannot compile; name the way that works."""
        raise RuntimeError(
            f"torch.jit.script cannot script {type(self).__name__}: TorchScript does not "
            "compile its Python checks (TorchScript is deprecated)\n"
            "  Use torch.export.export(model, args) for a deployable program (torch.export.save "
            "/ torch.export.load), or torch.compile(model) for speed.")

    # -- printing -----------------------------------------------------------------------------

    def _describe(self) -> str:
        """The layout, the block shape and the number of stored elements, counted in blocks
        for BSR / BSC (as ``python -m safesparse check`` counts them)."""
        block = "" if self.blocksize is None else f", blocksize={self.blocksize}"
        return f"layout={self.layout}{block}, nnz={self.values.shape[0]}"

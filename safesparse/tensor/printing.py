"""How a ``SafeSparseTensor`` prints.

* **While enforce mode is on** it prints exactly as torch prints the same tensor
  (``tensor(crow_indices=tensor([0, 1]), ...)``, ``Parameter containing:`` for a parameter):
  an enforced program's output, and its doctests, are byte-for-byte what they are without
  safesparse (docs/protecting.md).
* **Otherwise** it names its class and checked state first:
  ``SafeSparseTensor(checked=True, crow_indices=tensor([0, 1]), ...)`` (a parameter:
  ``Parameter(SafeSparseTensor(checked=True, ...))``). Code that calls safesparse itself sees
  what it holds.

Printing reads only metadata and the member tensors (``crow_indices()``, ``values()``, ...),
as torch's printer does: it runs no kernel over the sparse data, so an unchecked tensor with
invalid data prints too (for diagnosis).

torch's printer (``torch._tensor_str``) is run on a plain alias of the tensor (same members,
no copy). The alias has no autograd history, so the last part of torch's text, the
``grad_fn=<...>`` / ``requires_grad=True`` suffix, is added the way torch adds it
(``_add_suffixes``), with the name of the node torch itself would show: safesparse's identity
node (``ToSafeSparseTensorBackward``) is looked through to the torch node behind it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

__all__ = ["safe_text", "torch_text"]

_PLAIN_PREFIX = "tensor("
#: safesparse's identity nodes between torch's node and a SafeSparseTensor / plain tensor.
_IDENTITY_NODES = ("ToSafeSparseTensorBackward", "_ToPlainBackward")


def safe_text(t: torch.Tensor, checked: bool, tensor_contents: Any = None) -> str:
    """``SafeSparseTensor(checked=..., <torch's text>)`` (outside enforce mode)."""
    with DisableTorchFunctionSubclass():
        body: str = torch.Tensor.__repr__(t, tensor_contents=tensor_contents)  # type: ignore[call-arg,no-untyped-call]
    prefix = f"{type(t).__name__}("
    if body.startswith(f"Parameter({prefix}"):  # an nn.Parameter of a SafeSparseTensor
        prefix = f"Parameter({prefix}"
    body = body[len(prefix):] if body.startswith(prefix) else body + ")"
    return f"{prefix}checked={checked}, {body}"


def torch_text(t: torch.Tensor, tensor_contents: Any = None) -> str:
    """Exactly what torch prints for a plain tensor with ``t``'s data and autograd state."""
    with DisableTorchFunctionSubclass():
        alias = torch.Tensor._make_subclass(torch.Tensor, t, False)
        text: str = torch._tensor_str._str(  # type: ignore[no-untyped-call]
            alias, tensor_contents=tensor_contents)
        suffix = _grad_suffix(t)
        is_param = isinstance(t, torch.nn.Parameter)
        if suffix is not None:
            text = _with_suffix(alias, text, suffix)
    return "Parameter containing:\n" + text if is_param else text


def _node_name(node: Any) -> str:
    name = type(node).__name__
    if name == "CppFunction":
        name = node.name().rsplit("::", 1)[-1]
    return name


def _grad_suffix(t: torch.Tensor) -> str | None:
    """The autograd suffix torch would print for the plain tensor behind ``t``."""
    try:
        node = t.grad_fn
    except RuntimeError:  # torch prints this for a view whose rebase fails
        return "grad_fn=<Invalid>"
    while node is not None and _node_name(node) in _IDENTITY_NODES:
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            break
        node = nexts[0]
        if _node_name(node) == "AccumulateGrad":  # the tensor behind ours is a leaf
            return "requires_grad=True"
    if node is not None:
        return f"grad_fn=<{_node_name(node)}>"
    return "requires_grad=True" if t.requires_grad else None


def _suffixes(t: torch.Tensor) -> list[str]:
    """The suffixes torch's printer gives a sparse tensor before the autograd one, in order
    (``torch._tensor_str._str_intern``)."""
    out = []
    device = t.device
    if (device.type != torch._C._get_default_device()
            or (device.type == "cuda" and torch.cuda.current_device() != device.index)
            or device.type == "mps"):
        out.append(f"device='{device}'")
    complex_default = (torch.cdouble if torch.get_default_dtype() == torch.double
                       else torch.cfloat)
    default_dtype = t.dtype in (torch.get_default_dtype(), complex_default, torch.int64,
                                torch.bool)
    out.append(f"size={tuple(t.shape)}")
    if not t.is_meta:
        out.append(f"nnz={t._nnz()}")
    if not default_dtype:
        out.append(f"dtype={t.dtype}")
    out.append(f"layout={t.layout}")
    return out


def _with_suffix(alias: torch.Tensor, text: str, suffix: str) -> str:
    """``text`` (torch's text for ``alias``) with one more suffix, placed as torch places it:
    the suffixes are taken off again and laid out by torch's own ``_add_suffixes``, checked
    to give ``text`` back first; where they do not, the suffix goes on a line of its own."""
    add = torch._tensor_str._add_suffixes
    indent = len(_PLAIN_PREFIX)
    suffixes = _suffixes(alias)
    head = text[:-1] if text.endswith(")") else None
    for part in reversed(suffixes):
        if head is None or not head.endswith(part):
            head = None
            break
        head = head[: -len(part)]
        for sep in (",\n" + " " * indent, ", "):
            if head.endswith(sep):
                head = head[: -len(sep)]
                break
        else:
            head = None
    force = alias.is_sparse
    if head is not None and add(head, suffixes, indent, force) == text:  # type: ignore[no-untyped-call]
        return str(add(head, [*suffixes, suffix], indent, force))  # type: ignore[no-untyped-call]
    return f"{text[:-1]},\n{' ' * indent}{suffix})"

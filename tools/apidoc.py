"""Generate ``docs/api.md``, the API reference, from the docstrings of the public modules.

The public modules are :data:`PUBLIC_MODULES`: the package itself (``safesparse.__all__``) and
the submodules users import by name (``safesparse.distributed``); every name in their
``__all__`` is documented, plus the few names of internal modules that the guides tell users to
import (:data:`EXTRA_NAMES`).

Run from a checkout::

    python tools/apidoc.py           # rewrite docs/api.md
    python tools/apidoc.py --check   # exit 1 if docs/api.md is out of date

Each public name gets its signature and its docstring, converted to Markdown: reST roles and
double-backquoted literals become code spans, Google-style sections (``Args:``, ``Returns:``,
``Raises:``, ``Attributes:``) become bold headings with one bullet per entry, and ``::``
literal blocks become fenced blocks. Classes also list their own public methods, properties,
fields and enum members. Names are grouped by the module that defines them. The output depends
only on the docstrings and signatures, so a test can compare it with the committed file.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# Run as a script (``python tools/apidoc.py``): the checkout's package, not an installed one.
_CHECKOUT = str(Path(__file__).resolve().parent.parent)
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

PACKAGE = "safesparse"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"
REGENERATE = "python tools/apidoc.py"

#: Section titles by defining module, in the order they appear; other modules follow, by name.
SECTIONS: dict[str, str] = {
    "safesparse.factories.core": "Factories",
    "safesparse.tensor.core": "Checked tensors",
    "safesparse.state.checked": "Statistics and the cache",
    "safesparse.files.load": "Files",
    "safesparse.files.save": "Saving",
    "safesparse.factories.interop": "SciPy",
    "safesparse.compiled.boundary": "Compiled code with sparse inputs",
    "safesparse.base.debug_flag": "Debug mode",
    "safesparse.enforcement.mode": "Enforce mode",
    "safesparse.engine.indices": "Index checks",
    "safesparse.catalog.errors": "Errors",
    "safesparse.catalog.invariants": "The invariant catalog",
}

#: Modules whose names join another module's section (one topic, split across layers).
SAME_SECTION: dict[str, str] = {
    "safesparse.base.stats": "safesparse.state.checked",  # the counters sit below the state
    "safesparse.compiled.operand": "safesparse.compiled.boundary",
    "safesparse.compiled.portability": "safesparse.compiled.boundary",
}

#: Submodules users import by name (``import safesparse.distributed as ssd``), with their
#: section titles: every name in their ``__all__`` gets an entry, titled ``module.name``.
PUBLIC_MODULES: dict[str, str] = {
    "safesparse.distributed": "Across processes: safesparse.distributed",
    "safesparse.safetensors": "safetensors checkpoints: safesparse.safetensors",
    "safesparse.nn": "Sparse weights in model code: safesparse.nn",
}

#: Names of internal modules that the guides tell users to import, by module; documented in
#: their own section, titled ``module.name``.
EXTRA_NAMES: dict[str, tuple[str, ...]] = {
    "safesparse.tensor": ("wrap_results",),  # docs/ops.md: implementing an op
}

#: Section title of :data:`EXTRA_NAMES`.
EXTRA_TITLE = "Extending the op table"

_SECTION_HEADER = re.compile(
    r"^(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Returns|Return|Yields|Raises|"
    r"Attributes|Examples?|Notes?|Warnings?|See Also)\s*:\s*$"
)
_ITEM_SECTIONS = {"Args", "Arguments", "Parameters", "Keyword Args", "Keyword Arguments",
                  "Raises", "Attributes"}
_ITEM = re.compile(r"^(?P<name>[\w.*\[\], |]+?)(?:\s*\((?P<type>[^)]*)\))?\s*:\s*(?P<text>.*)$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`~?(?P<x>[^`]+)`")
_DOUBLE = re.compile(r"``(?P<x>.+?)``")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# ---------------------------------------------------------------------------------------------
# Docstring -> Markdown


def _inline(text: str) -> str:
    """reST inline markup to Markdown; ``<`` outside code spans is escaped (not an HTML tag)."""
    text = _ROLE.sub(lambda m: f"`{_short(m['x'])}`", text)
    text = _DOUBLE.sub(lambda m: f"`{m['x']}`", text)
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "".join(parts)


def _short(target: str) -> str:
    """``safesparse.errors.InvariantError`` -> ``InvariantError``; other targets unchanged."""
    return target.rsplit(".", 1)[-1] if target.startswith(PACKAGE + ".") else target


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _literal_block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The lines of a ``::`` literal block that starts at ``start`` (after the ``::`` line)."""
    block: list[str] = []
    i = start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
        i -= 1
    while block and not block[0].strip():
        block.pop(0)
    strip = min((_indent(line) for line in block if line.strip()), default=0)
    return [line[strip:] for line in block], i


def _fence(body: list[str]) -> list[str]:
    longest = max((len(m) for line in body for m in re.findall(r"`{3,}", line)), default=2)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}text", *body, fence]


def docstring_markdown(doc: str) -> list[str]:
    """A cleaned docstring (``inspect.cleandoc``) as Markdown lines."""
    lines = doc.expandtabs().splitlines()
    out: list[str] = []
    i = 0
    section: str | None = None
    item_indent: int | None = None
    while i < len(lines):
        line = lines[i].rstrip()
        stripped = line.strip()
        indent = _indent(line)
        if stripped.endswith("::") and not stripped.startswith(".."):
            intro = stripped[:-2].rstrip()
            if intro:
                text = intro + ":" if not intro.endswith(":") else intro
                out.append(("  " if section in _ITEM_SECTIONS and indent else "") + _inline(text))
            body, i = _literal_block(lines, i + 1, indent)
            out += ["", *_fence(body), ""]
            continue
        header = _SECTION_HEADER.match(line)
        if header is not None:
            section, item_indent = header[1], None
            out += ["", f"**{section}:**", ""]
            i += 1
            continue
        if not stripped:
            out.append("")
            if section is not None and (i + 1 >= len(lines) or _indent(lines[i + 1]) == 0):
                section = None  # a section ends at the first unindented line after a blank
            i += 1
            continue
        if section is not None and indent == 0:
            section = None
        if section in _ITEM_SECTIONS:
            if item_indent is None:
                item_indent = indent
            item = _ITEM.match(stripped) if indent <= item_indent else None
            if item is not None:
                kind = f" ({item['type']})" if item["type"] else ""
                out.append(f"- `{item['name']}`{kind}: {_inline(item['text'])}".rstrip())
            else:
                out.append("  " + _inline(stripped))
        elif section is not None:
            out.append(_inline(stripped))
        else:
            out.append(_inline(line))
        i += 1
    return _squeeze(out)


def _squeeze(lines: list[str]) -> list[str]:
    """Drop leading/trailing blank lines and collapse runs of blank lines."""
    out: list[str] = []
    for line in lines:
        if not line.strip() and (not out or not out[-1].strip()):
            continue
        out.append(line.rstrip())
    while out and not out[-1]:
        out.pop()
    return out


# ---------------------------------------------------------------------------------------------
# Objects -> sections


class _Raw:
    """An annotation written as it is in the source (``'int'`` -> ``int``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation: Any) -> Any:
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(obj: Callable[..., Any], name: str) -> str | None:
    """``name(params) -> return`` as in the source, one parameter a line when it is long."""
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return None  # members are listed instead
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()]
    if isinstance(obj, type) and [p.kind for p in params] == [
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return None  # nothing to say: (*args, **kwargs)
    sig = sig.replace(parameters=params,
                      return_annotation=_unquoted(sig.return_annotation))
    text = _ADDRESS.sub("", f"{name}{sig}")
    if len(text) <= 88:
        return text
    parts = [str(p) for p in sig.parameters.values()]
    kinds = [p.kind for p in sig.parameters.values()]
    lines: list[str] = []
    for i, (part, kind) in enumerate(zip(parts, kinds, strict=True)):
        if (kind is inspect.Parameter.KEYWORD_ONLY
                and inspect.Parameter.VAR_POSITIONAL not in kinds
                and (i == 0 or kinds[i - 1] is not inspect.Parameter.KEYWORD_ONLY)):
            lines.append("    *,")
        lines.append(f"    {part},")
        if kind is inspect.Parameter.POSITIONAL_ONLY and (
                i + 1 == len(kinds) or kinds[i + 1] is not inspect.Parameter.POSITIONAL_ONLY):
            lines.append("    /,")
    ret = "" if sig.return_annotation is inspect.Signature.empty else (
        f" -> {inspect.formatannotation(sig.return_annotation)}")
    return _ADDRESS.sub("", "\n".join([f"{name}(", *lines, f"){ret}"]))


def _attribute_doc(module_name: str, name: str) -> str | None:
    """The attribute docstring (a string right after ``NAME = ...``) or ``#:`` comment lines
    right above it, in the module that defines ``name``."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        source = None
    if source is None:
        return None
    tree = ast.parse(source)
    lines = source.splitlines()
    for index, node in enumerate(tree.body):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        following = tree.body[index + 1] if index + 1 < len(tree.body) else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            return inspect.cleandoc(following.value.value)
        comments: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#:"):
            comments.insert(0, lines[row].lstrip()[2:].strip())
            row -= 1
        return "\n".join(comments) or None
    return None


def _modules() -> list[str]:
    """Every module of the package (imported here, so the answer does not depend on what the
    caller happened to import), sorted; ``__main__`` (the CLI entry point) excluded."""
    pkg = importlib.import_module(PACKAGE)
    subs = sorted(info.name for info in pkgutil.walk_packages(pkg.__path__, PACKAGE + ".")
                  if info.name != f"{PACKAGE}.__main__")
    names = [PACKAGE, *subs]
    for name in names:
        importlib.import_module(name)
    return names


def _defining_module(name: str, obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    if isinstance(obj, type) and module == PACKAGE:
        # a class printed by its public name (``InvariantError.__module__ = "safesparse"``):
        # documented with the module whose source defines it
        for modname in _modules()[1:]:
            held = sys.modules[modname]
            if (getattr(held, name, None) is obj
                    and f"class {name}(" in inspect.getsource(held)):
                return modname
    if isinstance(obj, (type, Callable)) and isinstance(module, str):  # type: ignore[arg-type]
        return module
    if type(obj).__module__.startswith(PACKAGE + "."):
        return type(obj).__module__  # an instance of a class of ours: documented by the class
    candidates = [m for m in _modules()[1:] if getattr(sys.modules[m], name, None) is obj]
    for modname in candidates:
        if _attribute_doc(modname, name) is not None:
            return modname
    for modname in candidates:
        return modname
    return PACKAGE


def _own_doc(obj: Any) -> str | None:
    """``obj``'s own docstring, not one inherited from a base class (or from ``dict``...)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _members(cls: type) -> Iterator[tuple[str, list[str]]]:
    """(heading, Markdown lines) for the public members ``cls`` defines itself."""
    if issubclass(cls, enum.Enum):
        for member in cls:
            yield f"`{cls.__name__}.{member.name}`", [f"Value `{member.value!r}`."]
        return
    if dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            yield (f"`{field.name}`", [f"Field of type `{_annotation(field.type)}`."])
    for name, raw in cls.__dict__.items():
        if name.startswith("_") or (dataclasses.is_dataclass(cls) and name in {
                f.name for f in dataclasses.fields(cls)}):
            continue
        func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if isinstance(raw, property):
            doc = _own_doc(raw.fget) if raw.fget is not None else None
            yield f"`{cls.__name__}.{name}` (property)", docstring_markdown(doc or "")
        elif callable(func):
            bound = getattr(cls, name, func)  # classmethods bound: no ``cls`` parameter
            sig = _signature(bound if isinstance(raw, classmethod) else func,
                             f"{cls.__name__}.{name}")
            kind = " (classmethod)" if isinstance(raw, classmethod) else (
                " (staticmethod)" if isinstance(raw, staticmethod) else "")
            doc = _own_doc(func)
            yield (f"`{cls.__name__}.{name}`{kind}",
                   (["```python no-run", sig, "```", ""] if sig else [])
                   + docstring_markdown(doc or "*No docstring.*"))


def _annotation(tp: Any) -> str:
    return tp if isinstance(tp, str) else getattr(tp, "__name__", repr(tp))


def _entry(name: str, obj: Any, module: str, title: str | None = None) -> list[str]:
    """The entry of ``name`` (as defined in ``module``), headed ``title`` (default: ``name``)."""
    title = name if title is None else title
    out = [f"### `{title}`", ""]
    if isinstance(obj, type) or callable(obj):
        kind = "class" if isinstance(obj, type) else "function"
        if isinstance(obj, type) and issubclass(obj, BaseException):
            kind = "exception"
        sig = _signature(obj, title)
        out += [f"*{kind}*", ""]
        if sig:
            out += ["```python no-run", sig, "```", ""]
        doc = _own_doc(obj)
    else:
        out += [f"*{type(obj).__name__}*", ""]
        doc = _attribute_doc(module, name)
        if doc is None and type(obj).__module__.startswith(PACKAGE + "."):
            doc = _own_doc(type(obj))
    out += [*docstring_markdown(doc or "*No docstring.*"), ""]
    if isinstance(obj, type):
        for heading, lines in _members(obj):
            out += [f"#### {heading}", "", *lines, ""]
    return out


def render(package: Any = None) -> str:
    """docs/api.md for ``package`` (default: safesparse), as a string."""
    pkg = package if package is not None else importlib.import_module(PACKAGE)
    names: Sequence[str] = list(getattr(pkg, "__all__", []))
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=str.lower):
        obj = getattr(pkg, name)
        module = _defining_module(name, obj)
        groups.setdefault(SAME_SECTION.get(module, module), []).append(name)
    order = [m for m in SECTIONS if m in groups] + sorted(m for m in groups if m not in SECTIONS)
    extra = package is None  # a fake package (tests) gets its own names only
    out = [
        "# API reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the docstrings; do not edit by hand. -->",
        "",
        f"Every name in `{PACKAGE}.__all__`, grouped by topic; `help({PACKAGE}.NAME)` shows the "
        "same text."
        + (" Then every name of the public submodules ("
           + ", ".join(f"`{m}`" for m in PUBLIC_MODULES)
           + ") and the internal names the guides use." if extra else ""),
        "",
    ]
    out += [f"- [{SECTIONS.get(m, m)}](#{_anchor(SECTIONS.get(m, m))}): "
            + ", ".join(f"`{n}`" for n in groups[m]) for m in order]
    if extra:
        out += [f"- [{title}](#{_anchor(title)}): "
                + ", ".join(f"`{n}`" for n in _public_names(m)) for m, title in
                PUBLIC_MODULES.items()]
        out.append(f"- [{EXTRA_TITLE}](#{_anchor(EXTRA_TITLE)}): " + ", ".join(
            f"`{m}.{n}`" for m, names in EXTRA_NAMES.items() for n in names))
    out.append("")
    body: list[str] = []
    for module in order:
        body += [f"## {SECTIONS.get(module, module)}", ""]
        for name in groups[module]:
            body += _entry(name, getattr(pkg, name), module)
    if extra:
        for modname, title in PUBLIC_MODULES.items():
            mod = importlib.import_module(modname)
            body += [f"## {title}", ""]
            summary = (_own_doc(mod) or "").split("\n\n")[0]
            body += [*docstring_markdown(summary), ""] if summary else []
            for name in _public_names(modname):
                body += _entry(name, getattr(mod, name), modname, f"{modname}.{name}")
        body += [f"## {EXTRA_TITLE}", ""]
        for modname, names in EXTRA_NAMES.items():
            mod = importlib.import_module(modname)
            for name in names:
                body += _entry(name, getattr(mod, name), modname, f"{modname}.{name}")
    signatures = "\n".join(
        line for line in body if line and not line.startswith(("#", "-", "*", "`")))
    aliases = _aliases(signatures)
    if aliases:
        body += ["## Type aliases", "", "Names used in the signatures above:", "", *aliases, ""]
    return "\n".join(_squeeze(out + body)) + "\n"


def _public_names(modname: str) -> list[str]:
    """The ``__all__`` of a public module, sorted as the package's names are."""
    return sorted(importlib.import_module(modname).__all__, key=str.lower)


def documented_names() -> list[str]:
    """Every name docs/api.md must have an entry for, as its heading spells it."""
    pkg = importlib.import_module(PACKAGE)
    return (list(pkg.__all__)
            + [f"{m}.{n}" for m in PUBLIC_MODULES for n in _public_names(m)]
            + [f"{m}.{n}" for m, names in EXTRA_NAMES.items() for n in names])


def _aliases(text: str) -> list[str]:
    """Markdown bullets defining the module-level type aliases of safesparse that ``text``
    (the rendered signatures) mentions, e.g. ``SizeLike = Sequence[int] | torch.Size | None``."""
    found: dict[str, str] = {}
    for modname in _modules():
        module = sys.modules[modname]
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        for node in ast.parse(source).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)):
                continue
            name = node.targets[0].id
            value = getattr(module, name, None)
            if (name in found or isinstance(value, type) or inspect.isfunction(value)
                    or not re.search(rf"(?<![\w.`]){re.escape(name)}(?![\w`])", text)):
                continue
            segment = ast.get_source_segment(source, node.value)
            if segment is not None:
                found[name] = " ".join(segment.split())
    return [f"- `{name}` = `{found[name]}`" for name in sorted(found)]


def _anchor(title: str) -> str:
    """GitHub's heading anchor for ``title``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/apidoc.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file differs from the generated text")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="the file to write or check (default: docs/api.md of the checkout)")
    args = parser.parse_args(argv)
    if args.output is None:
        if not (DEFAULT_OUTPUT.parent.parent / "pyproject.toml").is_file():
            parser.error("safesparse is not running from a source checkout; pass -o FILE")
        args.output = DEFAULT_OUTPUT
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; regenerate it with: {REGENERATE}",
                  file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One OmlxError tree: every exception class omlx defines is under it, is used somewhere, and is
drawn at the top of omlx/errors.py (so the drawing cannot drift from the code)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import omlx.errors
from omlx.errors import OmlxError

PKG = Path(omlx.errors.__file__).resolve().parent
#: Exception classes outside the tree, and why (errors.py's docstring says the same).
OUTSIDE = {
    "omlx.tool_parsers.gemma._Incomplete": "a signal within one parse; a parser imports only omlx.request",
    "omlx.tool_parsers.gemma._Invalid": "a signal within one parse; a parser imports only omlx.request",
}
SOURCES = {p: p.read_text() for p in sorted(PKG.rglob("*.py"))}


def _module(path: Path) -> str:
    return ".".join(("omlx", *path.relative_to(PKG).with_suffix("").parts))


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class whose bases name an exception (by name, then by closure)."""
    defs = [(p, n) for p, text in SOURCES.items() for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.ClassDef) and n.bases]
    names: set[str] = {"Exception", "BaseException", "ValueError", "RuntimeError", "OmlxError"}
    found: dict[tuple[str, str], None] = {}
    changed = True
    while changed:
        changed = False
        for path, node in defs:
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if (bases & names or any(b.endswith(("Error", "Exception")) for b in bases)) and (
                    (_module(path), node.name) not in found):
                found[(_module(path), node.name)] = None
                names.add(node.name)
                changed = True
    return sorted(found)


CLASSES = [(m, c) for m, c in _exception_classes() if issubclass(getattr(importlib.import_module(m), c), BaseException)]


def test_the_scan_finds_the_classes_it_should():
    assert ("omlx.errors", "ConfigError") in CLASSES and ("omlx.cache.blockfile", "OldFormatError") in CLASSES
    assert len(CLASSES) > 30


@pytest.mark.parametrize("module, name", CLASSES, ids=[f"{m}.{c}" for m, c in CLASSES])
def test_every_exception_class_is_under_omlx_error_and_drawn(module: str, name: str):
    cls = getattr(importlib.import_module(module), name)
    if f"{module}.{name}" in OUTSIDE:
        assert not issubclass(cls, OmlxError)
        assert name in omlx.errors.__doc__  # the docstring says why it is outside
        return
    assert issubclass(cls, OmlxError), f"{module}.{name} is outside the OmlxError tree"
    assert re.search(rf"[─ .]{re.escape(name)}\b", omlx.errors.__doc__), f"{name} is not drawn in errors.py"
    uses = sum(len(re.findall(rf"\b{re.escape(name)}\b", text)) for text in SOURCES.values())
    assert uses >= 2, f"{module}.{name} is defined but never raised or caught (dead)"


def test_the_drawing_names_only_classes_that_exist():
    drawn = re.findall(r"[├└]── (?:[\w.]+\.)?(\w+)", omlx.errors.__doc__)
    assert drawn and len(drawn) == len(set(drawn))
    known = {c for _, c in CLASSES}
    assert set(drawn) <= known, f"drawn but not defined: {set(drawn) - known}"

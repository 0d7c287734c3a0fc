"""Best-effort coercion of string argument values to the types a tool's JSON schema declares.

Only top-level string values are touched, and only when the schema does not allow a string:
``"3"`` becomes ``3`` for an ``integer`` parameter, ``"next tuesday"`` stays a string (the client
validates; we never raise and never drop a call). Nothing here knows any dialect.
"""

from __future__ import annotations

import math
import re
from typing import Any

from omlx.tool_parsers._json import loads_lenient

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_INTEGER = re.compile(r"[-+]?\d+")
_ORDER = ("integer", "number", "boolean", "null", "object", "array")
_MISSING = object()


def tool_properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any] | None:
    """Returns the ``parameters.properties`` of the tool called ``name``, or None if unknown.

    Accepts OpenAI tools (``{"type": "function", "function": {...}}``) and bare function dicts.
    """
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        func = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if func.get("name") != name:
            continue
        params = func.get("parameters") or func.get("input_schema") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        return props if isinstance(props, dict) else None
    return None


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= _schema_types(sub)
    if not types and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            types.add("string" if isinstance(v, str) else "other")
    return types


def _convert(value: str, kind: str) -> Any:
    text = value.strip()
    if kind == "integer":
        if _INTEGER.fullmatch(text):
            return int(text)
        if _NUMBER.fullmatch(text):
            f = float(text)
            if math.isfinite(f) and f.is_integer():
                return int(f)
    elif kind == "number":
        if _INTEGER.fullmatch(text):
            return int(text)
        if _NUMBER.fullmatch(text):
            f = float(text)
            if math.isfinite(f):
                return f
    elif kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
    elif kind == "null":
        if text == "null":
            return None
    elif kind in ("object", "array"):
        try:
            parsed = loads_lenient(text)
        except ValueError:
            return _MISSING
        if isinstance(parsed, dict if kind == "object" else list):
            return parsed
    return _MISSING


def coerce_value(value: Any, schema: Any) -> Any:
    """Converts one string ``value`` to ``schema``'s type if that is unambiguous.

    Returns:
        The converted value, or ``value`` unchanged (non-strings, string-typed or untyped
        parameters, and strings that do not convert).
    """
    if not isinstance(value, str):
        return value
    types = _schema_types(schema)
    if not types or "string" in types:
        return value
    for kind in _ORDER:
        if kind in types:
            converted = _convert(value, kind)
            if converted is not _MISSING:
                return converted
    return value


def coerce_arguments(
    name: str, arguments: dict[str, Any], tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """Returns ``arguments`` with each top-level string coerced to its declared type.

    Parameters the schema does not declare, and calls to unknown tools, pass through.
    """
    props = tool_properties(tools, name)
    if not props:
        return arguments
    return {k: coerce_value(v, props.get(k)) for k, v in arguments.items()}

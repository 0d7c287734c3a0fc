"""JSON helpers shared by the JSON-bodied dialects: find where a value ends, parse it leniently,
and read the common ``{"name": ..., "arguments": ...}`` call shape.

It owns no dialect markers. Everything here is pure and never raises on model text except
``loads_lenient``, which raises ``ValueError`` as ``json.loads`` does.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omlx.tool_parsers.base import FAIL, NEED_MORE, RawCall, Scan, is_name, skip_ws

_SPECIAL = re.compile(r'[{}\[\]"]')
# One escape inside a JSON string: valid ones are kept, any other backslash is doubled.
_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|["\\/bfnrt]|.)', re.DOTALL)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def find_json_end(buf: str, start: int, memo: dict[Any, Any] | None = None) -> int | Scan:
    """Finds the end of the JSON object or array that opens at ``buf[start]``.

    Only brackets and strings are tracked (any backslash escape is skipped, valid or not), so
    the answer depends only on the text up to the closing bracket. With a ``memo`` (see
    ``ScanContext``), a call on a longer ``buf`` resumes where the last one stopped.

    Returns:
        The index just past the closing bracket, or ``NEED_MORE`` if it has not arrived.
    """
    key = ("json", start)
    state = memo.get(key) if memo is not None else None
    i, depth, string_start = state if state is not None else (start, 0, -1)
    if depth < 0:  # already found: i is the end
        return i
    while True:
        if string_start >= 0:
            q = buf.find('"', i)
            if q < 0:
                i = len(buf)
                break
            k = q - 1
            while k > string_start and buf[k] == "\\":
                k -= 1
            i = q + 1
            if (q - 1 - k) % 2 == 0:  # an even run of backslashes: the quote is not escaped
                string_start = -1
            continue
        m = _SPECIAL.search(buf, i)
        if m is None:
            i = len(buf)
            break
        i = m.end()
        c = m.group()
        if c == '"':
            string_start = m.start()
            continue
        depth += 1 if c in "{[" else -1
        if depth <= 0:
            if memo is not None:
                memo[key] = (i, -1, -1)
            return i
    if memo is not None:
        memo[key] = (i, depth, string_start)
    return NEED_MORE


def _fix_escapes(text: str) -> str:
    def fix_string(m: re.Match[str]) -> str:
        def fix_escape(e: re.Match[str]) -> str:
            g = e.group(1)
            return e.group() if len(g) == 5 or g in '"\\/bfnrt' else "\\\\" + g

        return _ESCAPE.sub(fix_escape, m.group())

    return _STRING.sub(fix_string, text)


def loads_lenient(text: str) -> Any:
    """``json.loads`` that also accepts raw control characters and invalid escapes in strings.

    An invalid escape such as ``\\d`` (common in regex arguments) is read as a literal backslash
    followed by the character, which is what the model meant.

    Raises:
        ValueError: the text is not JSON even after those repairs.
    """
    try:
        try:
            return json.loads(text, strict=False)
        except json.JSONDecodeError:
            pass
        return json.loads(_fix_escapes(text), strict=False)
    except RecursionError as e:  # absurdly deep nesting
        raise ValueError("JSON nested too deeply") from e


def loads_span(buf: str, start: int, end: int, memo: dict[Any, Any]) -> Any:
    """``loads_lenient(buf[start:end])``, remembered in the region's memo (a scan that waits for
    a later call must not re-parse the earlier ones on every chunk).

    Raises:
        ValueError: the span is not JSON.
    """
    key = ("loads", start, end)
    if key not in memo:
        try:
            memo[key] = (True, loads_lenient(buf[start:end]))
        except ValueError as e:
            memo[key] = (False, str(e))
    ok, value = memo[key]
    if not ok:
        raise ValueError(value)
    return value


def json_object_at(buf: str, i: int, memo: dict[Any, Any]) -> tuple[dict[str, Any], int] | Scan:
    """The JSON object starting at ``buf[i]`` (after whitespace) and the index after it;
    NEED_MORE while it may still be arriving, FAIL when it is not a JSON object."""
    i = skip_ws(buf, i)
    if i == len(buf):
        return NEED_MORE
    if buf[i] != "{":
        return FAIL
    end = find_json_end(buf, i, memo)
    if isinstance(end, Scan):
        return end
    try:
        args = loads_span(buf, i, end, memo)
    except ValueError:
        return FAIL
    return (args, end) if isinstance(args, dict) else FAIL


def arguments_object(value: Any) -> dict[str, Any] | None:
    """Returns ``value`` as an arguments dict: a dict, a JSON string of one, or None -> ``{}``."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = loads_lenient(value) if value.strip() else {}
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def call_from_obj(obj: Any) -> RawCall | None:
    """Reads ``{"name", "arguments"|"parameters"[, "id"]}`` (or ``{"function": {...}}``).

    Returns:
        The call, or None when ``obj`` has no usable name or its arguments are not an object.
    """
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = {**obj["function"], "id": obj.get("id")}
    name = obj.get("name")
    if not isinstance(name, str) or not is_name(name.strip()):
        return None
    raw_args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    args = arguments_object(raw_args)
    if args is None:
        return None
    call_id = obj.get("id")
    return RawCall(name.strip(), args, call_id if isinstance(call_id, str) and call_id else None)

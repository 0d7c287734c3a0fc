"""Pythonic tool calls: Llama 3.2 / Llama 4 (pythonic templates) and LFM2.

    [get_weather(city="Oslo", days=3), list_files()]
    <|tool_call_start|>[get_weather(city="Oslo")]<|tool_call_end|>
    <|python_start|>[get_weather(city="Oslo")]<|python_end|>

A Python list of calls with keyword arguments whose values are Python literals; nested
containers may hold JSON's ``true``/``false``/``null`` (templates render them with ``tojson``).
The bare list counts only as the whole response, each call naming an offered tool (the
Llama 3.2 pythonic template tells the model to write nothing else): a list in an answer, or
``[1, 2]``, stays text. The wrapped forms may come after text.

Own code, following ``mlx_lm.tool_parsers.pythonic``'s reading (``ast`` plus the JSON literal
names), with these departures: the list is found by bracket matching that skips strings, so a
``]`` in text after the call does not move its end (mlx-lm takes ``rfind("]")``); mlx-lm's regex
fallback for text that is not Python is dropped (it half-parses broken calls: a malformed call
is text here); positional arguments make the call text, as in mlx-lm.

LFM2.5's chat template writes a string value between single quotes with nothing escaped (a
value's newline is a raw newline) and a function or argument name verbatim (``save-snippet(``),
so before ``ast`` reads the list, a raw newline inside a string becomes ``\n`` and a name with a
``-`` before ``(`` or ``=`` stands in for a placeholder (put back afterwards). Neither changes text
that Python already reads.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any

from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    RawCall,
    Scan,
    ScanContext,
    ScanResult,
    expect,
    skip_ws,
)

# start marker -> end marker ("" for the bare list)
WRAPPERS = {
    "<|tool_call_start|>": "<|tool_call_end|>",
    "<|python_start|>": "<|python_end|>",
}
_JSON_NAMES = {"true": True, "false": False, "null": None}
_HYPHEN_NAME = re.compile(r"(?<![\w.-])([A-Za-z_][\w.]*(?:-[\w.]+)+)(?=\s*[(=])")
_RAW_IN_STRING = {"\n": "\\n", "\r": "\\r"}


def _pythonize(text: str) -> tuple[str, dict[str, str]]:
    """Returns ``text`` with raw newlines in strings escaped and hyphenated names replaced,
    and the placeholder -> name map."""
    names: dict[str, str] = {}

    def placeholder(m: re.Match[str]) -> str:
        key = f"_omlx_name_{len(names)}"
        names[key] = m.group(1)
        return key

    out: list[str] = []
    i, n, quote, plain = 0, len(text), "", 0
    while i < n:
        c = text[i]
        if quote:
            if c == "\\" and i + 1 < n:
                out.append(text[i : i + 2])
                i += 2
                continue
            if c == quote:
                quote, plain = "", i + 1
            out.append(_RAW_IN_STRING.get(c, c))
        elif c in "'\"":
            out[len(out) - (i - plain) :] = [_HYPHEN_NAME.sub(placeholder, text[plain:i])]
            quote = c
            out.append(c)
        else:
            out.append(c)
        i += 1
    if not quote:
        out[len(out) - (n - plain) :] = [_HYPHEN_NAME.sub(placeholder, text[plain:n])]
    return "".join(out), names


def find_list_end(buf: str, start: int, memo: dict[Any, Any]) -> int | Scan:
    """Finds the end of the Python list opening at ``buf[start]`` (a ``[``).

    Tracks brackets and ``'``/``"`` strings with backslash escapes; resumes from the memo.

    Returns:
        The index just past the closing ``]``, ``NEED_MORE`` if it has not come, ``FAIL`` on a
        closing bracket that does not match.
    """
    key = ("pylist", start)
    i, stack, quote = memo.get(key, (start, "", ""))
    if quote == "end":  # found on an earlier scan
        return i
    n = len(buf)
    pairs = {")": "(", "]": "[", "}": "{"}
    while i < n:
        c = buf[i]
        if quote:
            if c == "\\":
                if i + 1 >= n:
                    break
                i += 2
                continue
            if c == quote:
                quote = ""
            i += 1
            continue
        if c in "'\"":
            quote = c
        elif c in "([{":
            stack += c
        elif c in ")]}":
            if not stack or stack[-1] != pairs[c]:
                return FAIL
            stack = stack[:-1]
            if not stack:
                memo[key] = (i + 1, "", "end")
                return i + 1
        i += 1
    memo[key] = (i, stack, quote)
    return NEED_MORE


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        parent = _name(func.value)
        return f"{parent}.{func.attr}" if parent else None
    return None


def _literal(node: ast.expr) -> Any:
    """``ast.literal_eval`` that also reads ``true``/``false``/``null``; raises ValueError."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def parse_call_list(text: str) -> list[RawCall] | None:
    """Reads ``[f(a=1), g()]``; None if it is not a non-empty list of keyword-only calls."""
    text, names = _pythonize(text)
    try:
        with warnings.catch_warnings():  # "\d" in a string warns (invalid escape); it means \d
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _name(node.func)
        if name is None:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[names.get(kw.arg, kw.arg)] = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        calls.append(RawCall(names.get(name, name), args))
    return calls


class Pythonic(Dialect):
    name = "pythonic"
    start_markers = tuple(WRAPPERS)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, int] | None:
        found = super().find_start(text, at_message_start)
        if at_message_start:
            i = skip_ws(text, 0)
            if i < len(text) and text[i] == "[" and (found is None or i < found[0]):
                return (i, 1)  # a bare list: on FAIL the "[" becomes text
        return found

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        start = next((m for m in WRAPPERS if buf.startswith(m)), "")
        i = skip_ws(buf, len(start))
        if i == len(buf):
            return NEED_MORE
        if buf[i] != "[":
            return FAIL
        end = find_list_end(buf, i, ctx.memo)
        if isinstance(end, Scan):
            return end
        calls = parse_call_list(buf[i:end])
        if calls is None:
            return FAIL
        if start:
            close = expect(buf, skip_ws(buf, end), WRAPPERS[start])
            return close if isinstance(close, Scan) else Match(close, calls)
        # The bare list: the whole response, calling offered tools only.
        offered = {t.get("function", t).get("name") for t in ctx.tools or () if isinstance(t, dict)}
        if any(c.name not in offered for c in calls):
            return FAIL
        rest = skip_ws(buf, end)
        if rest < len(buf):
            return FAIL
        return Match(end, calls) if ctx.final else NEED_MORE


DIALECT = Pythonic()

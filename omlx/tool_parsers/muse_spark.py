"""Muse Spark tool calls (XML_ATEM).

    <atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Oslo</atem:parameter>
    <atem:parameter name="days">3</atem:parameter>
    </atem:invoke>
    </atem:function_calls>

Several ``<atem:invoke>`` in one block are parallel calls; tags may carry other attributes
besides ``name``. A value is stripped; a parameter the tool's schema declares stays text for the
shared schema coercion, any other value is read as JSON when it is JSON (``3``, ``true``,
``{"k": 1}``), as mlx-lm does.

Own code, with mlx-lm's markers (``mlx_lm.tool_parsers.muse_spark``). Departures: mlx-lm
accepts an ``<atem:invoke>`` without its closing tag (regex ``</atem:invoke>|$``), half-parsing a
truncated call, and cuts a value at the first literal ``</atem:parameter>``; here an unclosed
call is text and ``</atem:parameter>`` closes a value only before another parameter or
``</atem:invoke>``. mlx-lm json-decodes a string-typed value such as ``"3"`` to a number; here
the schema's type wins.
"""

from __future__ import annotations

import re
from typing import Any

from omlx.tool_parsers._json import loads_lenient
from omlx.tool_parsers._schema import tool_properties
from omlx.tool_parsers._xml import find_close, read_until
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
    is_name,
    is_partial,
    skip_ws,
)

START = "<atem:function_calls>"
END = "</atem:function_calls>"
INVOKE, INVOKE_END = "<atem:invoke", "</atem:invoke>"
PARAM, PARAM_END = "<atem:parameter", "</atem:parameter>"
_NAME_ATTR = re.compile(r'(?:^|\s)name\s*=\s*"([^"]*)"')
_ATTRS = re.compile(r'(?:\s+[\w:-]+\s*=\s*"[^"]*")*\s*')


def _name_attr(text: str) -> str | None:
    """The ``name="..."`` of a tag's attribute text; None if it is not ``k="v"`` pairs."""
    if not _ATTRS.fullmatch(text):
        return None
    m = _NAME_ATTR.search(text)
    return m.group(1).strip() if m else None


def _tag(buf: str, i: int, tag: str) -> tuple[str, int] | Scan:
    """Reads ``<TAG attrs>`` at ``i``; returns (name attribute, index after ``>``)."""
    r = expect(buf, i, tag)
    if isinstance(r, Scan):
        return r
    if r < len(buf) and not buf[r].isspace():
        return FAIL  # e.g. "<atem:invokes"
    head = read_until(buf, r, ">", banned="<")
    if isinstance(head, Scan):
        return head
    name = _name_attr(head[0])
    return FAIL if not name else (name, head[1])


def _value(raw: str, declared: bool) -> Any:
    text = raw.strip()
    if declared:
        return text
    try:
        return loads_lenient(text)
    except ValueError:
        return text


def _scan(buf: str, ctx: ScanContext) -> ScanResult:
    memo = ctx.memo
    calls: list[RawCall] = []
    i = len(START)
    while True:
        i = skip_ws(buf, i)
        if calls:
            end = expect(buf, i, END)
            if isinstance(end, int):
                return Match(end, calls)
            if end is NEED_MORE:
                return NEED_MORE
        head = _tag(buf, i, INVOKE)
        if isinstance(head, Scan):
            return head
        name, i = head
        if not is_name(name):
            return FAIL
        props = tool_properties(ctx.tools, name) or {}
        args: dict[str, Any] = {}
        while True:
            i = skip_ws(buf, i)
            close = expect(buf, i, INVOKE_END)
            if isinstance(close, int):
                calls.append(RawCall(name, args))
                i = close
                break
            p = _tag(buf, i, PARAM)
            if isinstance(p, Scan):
                return NEED_MORE if NEED_MORE in (p, close) or is_partial(buf, i, PARAM) else FAIL
            key, v = p
            stop = find_close(buf, v, PARAM_END, (PARAM, INVOKE_END), memo)
            if isinstance(stop, Scan):
                return stop
            args[key] = _value(buf[v:stop], key in props)
            i = stop + len(PARAM_END)


class MuseSpark(Dialect):
    name = "muse_spark"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return _scan(buf, ctx)


DIALECT = MuseSpark()

"""Kimi K3 tool calls (the "XTML" format).

    <|open|>tools<|sep|>
      <|open|>call tool="get_weather" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
        <|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>
      <|close|>call<|sep|>
    <|close|>tools<|sep|>

A call's arguments are typed per key (``type="string"`` keeps the text as is; any other type
is read as JSON, falling back to the text), or one raw JSON object block:
``<|open|>json type="object"<|sep|>{"city": "Tokyo"}<|close|>json<|sep|>``. Attribute values
unescape ``&quot;`` and ``&amp;``. Several calls in one section are parallel calls.

The real template (Kimi-K3's chat_template.jinja) writes an assistant turn as channels:
``<|open|>think<|sep|>…<|close|>think<|sep|>`` (the reasoning markers), then
``<|open|>response<|sep|>CONTENT<|close|>response<|sep|>``, then the tools section, then
``<|close|>message<|sep|>``; the generation prompt opens ``think`` (or ``response``). So the
response channel's tags and the message close are markup this dialect drops
(``drops_markup``): they never reach the content. The template writes every tag flush (no
newlines) and types an integer ``number``.

Own code, with mlx-lm's markers and value rules (``mlx_lm.tool_parsers.kimi_k3``). Departures:
mlx-lm silently skips a call it cannot read (a missing name, bad JSON) and keeps the others;
here the whole section then stays text, so nothing is dropped without a trace. JSON is read
leniently (an invalid ``\\d`` escape is a backslash and a ``d``).
"""

from __future__ import annotations

import re
from typing import Any

from omlx.tool_parsers._json import loads_lenient
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
    find_from,
    is_name,
    is_partial,
    partial_suffix,
    skip_ws,
)

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
START = OPEN + "tools" + SEP
END = CLOSE + "tools" + SEP
THINK_MARKERS = (OPEN + "think" + SEP, CLOSE + "think" + SEP)
# Channel and message tags around the content: removed, not content.
MARKUP = (OPEN + "response" + SEP, CLOSE + "response" + SEP, CLOSE + "message" + SEP, "<|end_of_msg|>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_ATTRS = re.compile(r'(?:\s+\w+="[^"]*")*\s*')


def _attrs(text: str) -> dict[str, str] | None:
    """Reads ``k="v" ...``; None if the text has anything else."""
    if not _ATTRS.fullmatch(text):
        return None
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _head(buf: str, i: int, tag: str) -> tuple[dict[str, str], int] | Scan:
    """Reads ``<|open|>TAG attrs<|sep|>`` at ``i``; returns (attrs, index after it)."""
    r = expect(buf, i, OPEN + tag)
    if isinstance(r, Scan):
        return r
    sep = buf.find(SEP, r)
    if sep < 0:
        return FAIL if "<|" in buf[r : len(buf) - partial_suffix(buf, SEP)] else NEED_MORE
    attrs = _attrs(buf[r:sep])
    return FAIL if attrs is None else (attrs, sep + len(SEP))


def _value(text: str, kind: str) -> Any:
    if kind == "string":
        return text
    try:
        return loads_lenient(text)
    except ValueError:
        return text


def _scan(buf: str, memo: dict[Any, Any]) -> ScanResult:
    calls: list[RawCall] = []
    i = skip_ws(buf, len(START))
    while True:
        if calls:
            end = expect(buf, i, END)
            if isinstance(end, int):
                return Match(end, calls)
            if end is NEED_MORE:
                return NEED_MORE
        head = _head(buf, i, "call")
        if isinstance(head, Scan):
            return head
        attrs, i = head
        name = attrs.get("tool", "").strip()
        if not is_name(name):
            return FAIL
        args: dict[str, Any] = {}
        i = skip_ws(buf, i)
        if is_partial(buf, i, OPEN + "json"):
            return NEED_MORE
        if buf.startswith(OPEN + "json", i):
            head = _head(buf, i, "json")
            if isinstance(head, Scan):
                return head
            close = find_from(buf, CLOSE + "json" + SEP, head[1], memo)
            if close < 0:
                return NEED_MORE
            try:
                obj = loads_lenient(buf[head[1] : close])
            except ValueError:
                return FAIL
            if not isinstance(obj, dict):
                return FAIL
            args = obj
            i = skip_ws(buf, close + len(CLOSE + "json" + SEP))
        while True:
            close_call = expect(buf, i, CLOSE + "call" + SEP)
            if isinstance(close_call, int):
                i = skip_ws(buf, close_call)
                break
            if close_call is NEED_MORE:
                return NEED_MORE
            head = _head(buf, i, "argument")
            if isinstance(head, Scan):
                return head
            a_attrs, vstart = head
            key = a_attrs.get("key")
            if not key:
                return FAIL
            close = find_from(buf, CLOSE + "argument" + SEP, vstart, memo)
            if close < 0:
                return NEED_MORE
            args[key] = _value(buf[vstart:close], a_attrs.get("type", "string"))
            i = skip_ws(buf, close + len(CLOSE + "argument" + SEP))
        calls.append(RawCall(name, args))


class KimiK3(Dialect):
    name = "kimi_k3"
    start_markers = (START, *MARKUP)
    drops_markup = True
    think_markers = THINK_MARKERS

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        for tag in MARKUP:
            if buf.startswith(tag):
                return Match(len(tag), [])
        return _scan(buf, ctx.memo)


DIALECT = KimiK3()

"""DeepSeek V3 / R1 and V3.1 tool calls (the markers use U+FF5C '｜' and U+2581 '▁').

    V3, R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
            ```json
            {...}
            ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1:   <｜tool▁calls▁begin｜>
            <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
            <｜tool▁calls▁end｜>

Several ``<｜tool▁call▁begin｜>`` blocks in one section are parallel calls. JSON bodies are found
by bracket matching, so marker text inside a string does not end a call. mlx-lm has no parser
for this format.
"""

from __future__ import annotations

from typing import Any

from omlx.tool_parsers._json import json_object_at
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
    skip_ws,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


def _v3_body(buf: str, i: int, memo: dict[Any, Any]) -> tuple[str, dict[str, Any], int] | Scan:
    """``NAME\\n```json\\n{...}\\n```"`` after the separator; returns name, args, index after."""
    newline = find_from(buf, "\n", i, memo)
    if newline < 0:
        return NEED_MORE
    name = buf[i:newline].strip()
    if not is_name(name):
        return FAIL
    j = expect(buf, skip_ws(buf, newline), FENCE)
    if isinstance(j, Scan):
        return j
    lang = expect(buf, j, "json")
    if lang is NEED_MORE:
        return NEED_MORE
    parsed = json_object_at(buf, lang if isinstance(lang, int) else j, memo)
    if isinstance(parsed, Scan):
        return parsed
    close = expect(buf, skip_ws(buf, parsed[1]), FENCE)
    return close if isinstance(close, Scan) else (name, parsed[0], close)


class DeepSeek(Dialect):
    name = "deepseek"
    start_markers = (CALLS_BEGIN,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        # Calls already read stay in the memo with the index after them.
        calls, i = ctx.memo.setdefault("deepseek", ([], len(CALLS_BEGIN)))
        while True:
            i = skip_ws(buf, i)
            if calls:
                end = expect(buf, i, CALLS_END)
                if isinstance(end, int):
                    return Match(end, calls)
                if end is NEED_MORE:
                    return NEED_MORE
            r = expect(buf, i, CALL_BEGIN)
            if isinstance(r, Scan):
                return r
            sep = find_from(buf, SEP, r, ctx.memo)
            if sep < 0:
                return NEED_MORE
            head = buf[r:sep].strip()
            k = skip_ws(buf, sep + len(SEP))
            if k == len(buf):
                return NEED_MORE
            if head == "function" and buf[k] != "{":  # V3: the type, then the name
                body = _v3_body(buf, k, ctx.memo)
            else:  # V3.1: the name, then the JSON arguments
                parsed = json_object_at(buf, k, ctx.memo)
                body = parsed if isinstance(parsed, Scan) else (head, parsed[0], parsed[1])
            if isinstance(body, Scan):
                return body
            name, args, j = body
            if not is_name(name):
                return FAIL
            end = expect(buf, skip_ws(buf, j), CALL_END)
            if isinstance(end, Scan):
                return end
            calls.append(RawCall(name, args))
            i = end
            ctx.memo["deepseek"] = (calls, i)


DIALECT = DeepSeek()

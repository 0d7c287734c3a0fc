"""Llama 3.1 / 3.2 / 3.3 JSON tool calls.

    <|python_tag|>{"name": "f", "parameters": {...}}
    {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}

The JSON form without ``<|python_tag|>`` counts only at the very start of the response (after
whitespace), since JSON later in prose is an answer, not a call. Objects separated by ``;`` are
parallel calls; ``"arguments"`` is accepted for ``"parameters"``. A JSON value that is not a
call stays text. mlx-lm has no parser for this format.
"""

from __future__ import annotations

from omlx.tool_parsers._json import call_from_obj, find_json_end, loads_span
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    RawCall,
    Scan,
    ScanContext,
    ScanResult,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(Dialect):
    name = "llama3_json"
    start_markers = (PYTHON_TAG,)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, int] | None:
        found = super().find_start(text, at_message_start)
        if at_message_start:
            i = skip_ws(text, 0)
            if i < len(text) and text[i] == "{" and (found is None or i < found[0]):
                return (i, 1)  # the "{" is the marker: on FAIL it becomes text
        return found

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        i = len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0
        calls: list[RawCall] = []
        last_end = 0
        while True:
            i = skip_ws(buf, i)
            if i == len(buf):
                return Match(last_end, calls) if ctx.final and calls else NEED_MORE
            if buf[i] != "{":
                return Match(last_end, calls) if calls else FAIL
            end = find_json_end(buf, i, ctx.memo)
            if isinstance(end, Scan):
                return end
            try:
                call = call_from_obj(loads_span(buf, i, end, ctx.memo))
            except ValueError:
                call = None
            if call is None:  # what follows a valid call stays text
                return Match(last_end, calls) if calls else FAIL
            calls.append(call)
            last_end = end
            j = skip_ws(buf, end)
            if j == len(buf):
                return Match(end, calls) if ctx.final else NEED_MORE
            if buf[j] != ";":
                return Match(end, calls)
            i = j + 1


DIALECT = Llama3Json()

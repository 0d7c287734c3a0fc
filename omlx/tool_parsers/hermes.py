"""Hermes / Qwen 2.5 / Qwen 3 JSON tool calls.

    <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

Own code rather than ``mlx_lm.tool_parsers.json_tools``: that parser is ``json.loads`` on the
body, which raises on invalid escapes such as ``\\d`` in a regex argument (case
hermes-json-invalid-escape-in-args). Here the body is found by bracket matching (so a
``</tool_call>`` inside a JSON string does not end it) and parsed leniently.
"""

from __future__ import annotations

from omlx.tool_parsers._json import call_from_obj, find_json_end, loads_lenient
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    Scan,
    ScanContext,
    ScanResult,
    expect,
    skip_ws,
)

START = "<tool_call>"
END = "</tool_call>"


class Hermes(Dialect):
    name = "hermes"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        i = skip_ws(buf, len(START))
        if i == len(buf):
            return NEED_MORE
        if buf[i] != "{":
            return FAIL
        end = find_json_end(buf, i, ctx.memo)
        if isinstance(end, Scan):
            return end
        close = expect(buf, skip_ws(buf, end), END)
        if isinstance(close, Scan):
            return close
        try:
            call = call_from_obj(loads_lenient(buf[i:end]))
        except ValueError:
            return FAIL
        return FAIL if call is None else Match(close, [call])


DIALECT = Hermes()

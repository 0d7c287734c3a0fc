"""Hermes / Qwen 2.5 / Qwen 3 JSON tool calls.

    <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

Own code rather than ``mlx_lm.tool_parsers.json_tools``: that parser is ``json.loads`` on the
body, which raises on invalid escapes such as ``\\d`` in a regex argument (case
hermes-json-invalid-escape-in-args). Here the body is found by bracket matching (so a
``</tool_call>`` inside a JSON string does not end it) and parsed leniently.

Small Qwen 2.5 models often drop the tags and answer with the bare object
(``{"name": "get_weather", "arguments": {"city": "Paris"}}``; Qwen2.5-Coder-0.5B does so for
its first call). That form counts only when it is the whole response (one or more objects and
nothing else), each naming a tool the request offered: JSON inside an answer stays text.
"""

from __future__ import annotations

from omlx.tool_parsers._json import call_from_obj, find_json_end, loads_lenient
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

START = "<tool_call>"
END = "</tool_call>"


class Hermes(Dialect):
    name = "hermes"
    start_markers = (START,)

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, int] | None:
        found = super().find_start(text, at_message_start)
        if at_message_start:
            i = skip_ws(text, 0)
            if i < len(text) and text[i] == "{" and (found is None or i < found[0]):
                return (i, 1)  # a bare object: on FAIL the "{" becomes text
        return found

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        if not buf.startswith(START):
            return self._scan_bare(buf, ctx)
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

    def _scan_bare(self, buf: str, ctx: ScanContext) -> ScanResult:
        offered = {t.get("function", t).get("name") for t in ctx.tools or () if isinstance(t, dict)}
        calls: list[RawCall] = []
        i = 0
        while True:
            i = skip_ws(buf, i)
            if i == len(buf):
                if not ctx.final:
                    return NEED_MORE
                return Match(i, calls) if calls else FAIL
            if buf[i] != "{":
                return FAIL
            end = find_json_end(buf, i, ctx.memo)
            if isinstance(end, Scan):
                return end
            try:
                call = call_from_obj(loads_lenient(buf[i:end]))
            except ValueError:
                return FAIL
            if call is None or call.name not in offered:
                return FAIL
            calls.append(call)
            i = end


DIALECT = Hermes()

"""DeepSeek-V3.2 tool calls (DSML).

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

The format of DeepSeek's own V3.2 encoder (shipped as ``mlx_lm.chat_templates.deepseek_v32``,
and as llama.cpp's DeepSeek-V3.2.jinja): ``string="true"`` marks a value written as is,
``string="false"`` one written as JSON (numbers, booleans, arrays, objects). A value is kept
verbatim (the encoder adds nothing around it); ``</｜DSML｜parameter>`` closes it only before
the next ``<｜DSML｜parameter`` or ``</｜DSML｜invoke>``, so a value may hold it as text. Several
invokes in one block are parallel calls. A JSON value that does not parse stays text.

V3 / V3.1 / R1's ``<｜tool▁calls▁begin｜>`` format is ``deepseek.py``; mlx-lm 0.32.2 ships the
V3.2 encoder but no parser for its output.
"""

from __future__ import annotations

import re
from typing import Any

from omlx.tool_parsers._json import loads_lenient
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

T = "｜DSML｜"
START, END = f"<{T}function_calls>", f"</{T}function_calls>"
INVOKE, INVOKE_END = f"<{T}invoke", f"</{T}invoke>"
PARAM, PARAM_END = f"<{T}parameter", f"</{T}parameter>"
_INVOKE_ATTRS = re.compile(r'\s+name="([^"]*)"\s*')
_PARAM_ATTRS = re.compile(r'\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*')


def _value(text: str, is_string: bool) -> Any:
    if is_string:
        return text
    try:
        return loads_lenient(text.strip())
    except ValueError:
        return text


def _scan(buf: str, memo: dict[Any, Any]) -> ScanResult:
    # Decided progress (next index, calls, open invoke's name and arguments) lives in the memo.
    i, calls, name, args = memo.get("dsml", (len(START), [], None, None))
    while True:
        i = skip_ws(buf, i)
        if name is None:  # between invokes
            if calls:
                end = expect(buf, i, END)
                if isinstance(end, int):
                    return Match(end, calls)
                if end is NEED_MORE:
                    return NEED_MORE
            r = expect(buf, i, INVOKE)
            if isinstance(r, Scan):
                return r
            head = read_until(buf, r, ">", banned="<\n")
            if isinstance(head, Scan):
                return head
            m = _INVOKE_ATTRS.fullmatch(head[0])
            if m is None or not is_name(m.group(1)):
                return FAIL
            i, name, args = head[1], m.group(1), {}
        elif buf.startswith(INVOKE_END, i):
            i, calls, name, args = i + len(INVOKE_END), [*calls, RawCall(name, args)], None, None
        elif buf.startswith(PARAM, i):
            head = read_until(buf, i + len(PARAM), ">", banned="<\n")
            if isinstance(head, Scan):
                return head
            m = _PARAM_ATTRS.fullmatch(head[0])
            if m is None or not m.group(1):
                return FAIL
            close = find_close(buf, head[1], PARAM_END, (PARAM, INVOKE_END), memo)
            if isinstance(close, Scan):
                return close
            args = {**args, m.group(1): _value(buf[head[1] : close], m.group(2) != "false")}
            i = close + len(PARAM_END)
        elif is_partial(buf, i, PARAM) or is_partial(buf, i, INVOKE_END):
            return NEED_MORE
        else:
            return FAIL
        memo["dsml"] = (i, calls, name, args)


class Dsml(Dialect):
    name = "dsml"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return _scan(buf, ctx.memo)


DIALECT = Dsml()

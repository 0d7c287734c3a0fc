"""LongCat tool calls, parsed by ``mlx_lm.tool_parsers.longcat`` with a lenient-JSON fallback.

    <longcat_tool_call>{"name": "f", "arguments": {...}}</longcat_tool_call>
    <longcat_tool_call>f
    <longcat_arg_key>k</longcat_arg_key>
    <longcat_arg_value>v</longcat_arg_value>
    </longcat_tool_call>

omlx finds the block (a JSON body by bracket matching, so ``</longcat_tool_call>`` inside a JSON
string does not end it) and mlx-lm reads it. mlx-lm uses strict ``json.loads`` and then raises
(AttributeError) on a JSON body with an invalid escape, so such bodies are read leniently here.
"""

from __future__ import annotations

import warnings

from typing import Any

from mlx_lm.tool_parsers import longcat

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
    find_from,
    skip_ws,
)

START = "<longcat_tool_call>"
END = "</longcat_tool_call>"


def parse_body(body: str, tools: list[dict[str, Any]] | None) -> RawCall | None:
    """Reads one call body: mlx-lm first, then lenient JSON. None if neither can."""
    try:
        with warnings.catch_warnings():  # its ast.literal_eval fallback warns on model text
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            call = call_from_obj(longcat.parse_tool_call(body, tools))
    except Exception:  # noqa: BLE001 - a third-party parser on model text: any error = no call
        call = None
    if call is None and body.lstrip().startswith("{"):
        try:
            call = call_from_obj(loads_lenient(body))
        except ValueError:
            call = None
    return call


class LongCat(Dialect):
    name = "longcat"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        i = skip_ws(buf, len(START))
        if i == len(buf):
            return NEED_MORE
        if buf[i] == "{":
            json_end = find_json_end(buf, i, ctx.memo)
            if isinstance(json_end, Scan):
                return json_end
            close = expect(buf, skip_ws(buf, json_end), END)
            if isinstance(close, Scan):
                return close
            end = close - len(END)
        else:
            end = find_from(buf, END, i, ctx.memo)
            if end < 0:
                return NEED_MORE
        call = parse_body(buf[len(START) : end], ctx.tools)
        return FAIL if call is None else Match(end + len(END), [call])


DIALECT = LongCat()

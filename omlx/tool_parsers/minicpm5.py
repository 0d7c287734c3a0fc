"""OpenBMB MiniCPM5 tool calls.

    <function name="get_weather"><param name="city">Oslo</param><param name="days">3</param></function>
    <function name="write_file"><param name="content"><![CDATA[a < b && c
    ]]></param></function>

No outer wrapper: each ``<function>`` block is one call, consecutive blocks are parallel calls.
Values holding ``<``, ``&`` or newlines come in a CDATA block (kept exactly); other values are
stripped. Values are text until the shared schema coercion (``"3"`` -> ``3`` for an integer).

Own code, with mlx-lm's markers and value rules (``mlx_lm.tool_parsers.minicpm5``). Departures:
mlx-lm accepts a block without ``</function>`` (its regex ends at ``</function>|$``), so a
truncated call is half-parsed; here it stays text. mlx-lm cuts a value at the first
``</param>`` even inside CDATA; here CDATA is read to ``]]>``, and a bare ``</param>`` closes a
value only before ``<param name=`` or ``</function>`` (as in the other XML dialects).
"""

from __future__ import annotations

from typing import Any

from omlx.tool_parsers._xml import find_close, read_until, unquote
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
    skip_ws,
)

START = "<function name="
END = "</function>"
PARAM = "<param name="
PARAM_END = "</param>"
CDATA, CDATA_END = "<![CDATA[", "]]>"


def _scan(buf: str, memo: dict[Any, Any]) -> ScanResult:
    head = read_until(buf, len(START), ">")
    if isinstance(head, Scan):
        return head
    name, i = unquote(head[0]), head[1]
    if not is_name(name):
        return FAIL
    args: dict[str, Any] = {}
    while True:
        i = skip_ws(buf, i)
        end = expect(buf, i, END)
        if isinstance(end, int):
            return Match(end, [RawCall(name, args)])
        if end is NEED_MORE and is_partial(buf, i, PARAM):
            return NEED_MORE
        r = expect(buf, i, PARAM)
        if isinstance(r, Scan):
            return NEED_MORE if end is NEED_MORE else r
        phead = read_until(buf, r, ">")
        if isinstance(phead, Scan):
            return phead
        key, v = unquote(phead[0]), phead[1]
        if not key:
            return FAIL
        c = skip_ws(buf, v)
        if is_partial(buf, c, CDATA):
            return NEED_MORE
        if buf.startswith(CDATA, c):
            close = find_from(buf, CDATA_END, c + len(CDATA), memo)
            if close < 0:
                return NEED_MORE
            after = expect(buf, skip_ws(buf, close + len(CDATA_END)), PARAM_END)
            if isinstance(after, Scan):
                return after
            args[key] = buf[c + len(CDATA) : close]
            i = after
            continue
        close = find_close(buf, v, PARAM_END, (PARAM, END), memo)
        if isinstance(close, Scan):
            return close
        args[key] = buf[v:close].strip()
        i = close + len(PARAM_END)


class MiniCPM5(Dialect):
    name = "minicpm5"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return _scan(buf, ctx.memo)


DIALECT = MiniCPM5()

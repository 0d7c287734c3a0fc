"""GLM 4.5 / 4.6 / 4.7 (and Laguna) tool calls.

    <tool_call>NAME
    <arg_key>k</arg_key>
    <arg_value>v</arg_value>
    </tool_call>

Own code rather than ``mlx_lm.tool_parsers.glm47``, whose regex needs the opening
``<arg_value>`` and so returns ``{}`` when a model leaves it out (case
glm47-missing-open-arg-value). Here a missing ``<arg_value>`` is tolerated (the value then
starts at the first non-space character), ``</arg_value>`` closes a value only before
``<arg_key>`` or ``</tool_call>``, and a ``NAME {json}`` body is also read.
"""

from __future__ import annotations

from typing import Any

from omlx.tool_parsers._json import find_json_end, loads_lenient
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

START = "<tool_call>"
END = "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


def _read_name(buf: str, i: int) -> tuple[str, int] | Scan:
    """The name runs to the first whitespace, ``<`` or ``{``."""
    j = i
    while j < len(buf) and not buf[j].isspace() and buf[j] not in "<{":
        j += 1
    if j == len(buf):
        return NEED_MORE
    return (buf[i:j], j) if is_name(buf[i:j]) else FAIL


def _json_body(buf: str, i: int, name: str, memo: dict[Any, Any]) -> ScanResult:
    end = find_json_end(buf, i, memo)
    if isinstance(end, Scan):
        return end
    close = expect(buf, skip_ws(buf, end), END)
    if isinstance(close, Scan):
        return close
    try:
        args = loads_lenient(buf[i:end])
    except ValueError:
        return FAIL
    return Match(close, [RawCall(name, args)]) if isinstance(args, dict) else FAIL


class Glm(Dialect):
    name = "glm"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        # Progress (name, arguments so far, next index) is kept in the memo: decided values
        # are not read again when more text arrives.
        if "glm" not in ctx.memo:
            head = _read_name(buf, skip_ws(buf, len(START)))
            if isinstance(head, Scan):
                return head
            ctx.memo["glm"] = (head[0], {}, head[1])
        name, args, i = ctx.memo["glm"]
        while True:
            i = skip_ws(buf, i)
            if buf.startswith(END, i):
                return Match(i + len(END), [RawCall(name, args)])
            if buf.startswith("{", i) and not args:
                return _json_body(buf, i, name, ctx.memo)
            if not buf.startswith(KEY_OPEN, i):
                tags = (END, KEY_OPEN)
                return NEED_MORE if any(is_partial(buf, i, t) for t in tags) else FAIL
            key = read_until(buf, i + len(KEY_OPEN), KEY_CLOSE)
            if isinstance(key, Scan):
                return key
            i = skip_ws(buf, key[1])
            opened = expect(buf, i, VALUE_OPEN)
            if opened is NEED_MORE:
                return NEED_MORE
            vstart = opened if isinstance(opened, int) else i  # a missing <arg_value> is tolerated
            close = find_close(buf, vstart, VALUE_CLOSE, (KEY_OPEN, END), ctx.memo)
            if isinstance(close, Scan):
                return close
            if not key[0].strip():
                return FAIL
            args[key[0].strip()] = buf[vstart:close]
            i = close + len(VALUE_CLOSE)
            ctx.memo["glm"] = (name, args, i)


DIALECT = Glm()

"""Kimi K2 tool calls, parsed by ``mlx_lm.tool_parsers.kimi_k2``.

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

omlx finds the section (for streaming) and mlx-lm reads the calls in it: it gets every case we
test right. Two additions: arguments mlx-lm leaves as a string (JSON it could not read, e.g.
an invalid ``\\d`` escape) are parsed leniently here, and the model's own id
(``functions.NAME:0``) is kept, because Kimi's chat template renders it back into history.
"""

from __future__ import annotations

import warnings

from mlx_lm.tool_parsers import kimi_k2

from omlx.tool_parsers._json import arguments_object
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    RawCall,
    ScanContext,
    ScanResult,
    find_from,
    is_name,
)

START = "<|tool_calls_section_begin|>"
END = "<|tool_calls_section_end|>"


def parse_section(body: str) -> list[RawCall] | None:
    """Reads the calls in a section body with mlx-lm; None if any call is unreadable."""
    try:
        with warnings.catch_warnings():  # its ast.literal_eval fallback warns on model text
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            parsed = kimi_k2.parse_tool_call(body)
    except Exception:  # noqa: BLE001 - a third-party parser on model text: any error = no call
        return None
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        name = item.get("name", "").strip() if isinstance(item, dict) else ""
        args = arguments_object(item.get("arguments")) if isinstance(item, dict) else None
        if not is_name(name) or args is None:
            return None
        call_id = item.get("id")
        calls.append(RawCall(name, args, call_id if isinstance(call_id, str) else None))
    return calls or None


class KimiK2(Dialect):
    name = "kimi_k2"
    start_markers = (START,)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        end = find_from(buf, END, len(START), ctx.memo)
        if end < 0:
            return NEED_MORE
        calls = parse_section(buf[len(START) : end])
        return FAIL if calls is None else Match(end + len(END), calls)


DIALECT = KimiK2()

"""Mistral tool calls, every tokenizer generation.

    before v11:  [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abc123xyz"}, ...]
    v11:         [TOOL_CALLS]f[CALL_ID]abc123xyz[ARGS]{...}   (or [TOOL_CALLS]f{...})
    v13:         [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}   (Devstral, Magistral)

There is no end marker: a call ends where its one JSON value ends, and any text after it is
content (case mistral-parallel-calls-and-trailing-text). ``name[ARGS]{...}`` may repeat after
one ``[TOOL_CALLS]``. Own code rather than ``mlx_lm.tool_parsers.mistral``, which needs the whole
rest of the output (so it cannot say where a call ends while streaming), reads the
``[CALL_ID]`` value as the function name and raises on invalid JSON escapes (see
test_mlx_lm_upstream.py). Ids default to 9 alphanumerics, the only shape Mistral templates accept.
"""

from __future__ import annotations

from typing import Any

from omlx.tool_parsers._json import call_from_obj, find_json_end, loads_lenient, loads_span
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
    new_mistral_call_id,
    skip_ws,
)

START = "[TOOL_CALLS]"
CALL_ID = "[CALL_ID]"
ARGS = "[ARGS]"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _header(buf: str, i: int, need_args: bool) -> tuple[str, str | None, int] | Scan:
    """Reads ``name[CALL_ID]id[ARGS]`` up to the ``{`` of the arguments.

    Returns:
        ``(name, call id or None, index of "{")``, ``NEED_MORE`` or ``FAIL``.
    """
    j = i
    while j < len(buf) and buf[j] in _NAME_CHARS:
        j += 1
    if j == len(buf):
        return NEED_MORE
    name = buf[i:j]
    if not is_name(name):
        return FAIL
    call_id = None
    r = expect(buf, j, CALL_ID)
    if r is NEED_MORE:
        return NEED_MORE
    if isinstance(r, int):
        k = r
        while k < len(buf) and (buf[k].isalnum() or buf[k] in "_-"):
            k += 1
        if k == len(buf):
            return NEED_MORE
        call_id, j = buf[r:k] or None, k
    r = expect(buf, j, ARGS)
    if r is NEED_MORE:
        return NEED_MORE
    if isinstance(r, int):
        j = r
    elif need_args:
        return FAIL
    j = skip_ws(buf, j)
    if j == len(buf):
        return NEED_MORE
    return (name, call_id, j) if buf[j] == "{" else FAIL


def _old_format(buf: str, i: int, memo: dict[Any, Any]) -> ScanResult:
    end = find_json_end(buf, i, memo)
    if isinstance(end, Scan):
        return end
    try:
        payload = loads_lenient(buf[i:end])
    except ValueError:
        return FAIL
    if not isinstance(payload, list) or not payload:
        return FAIL
    calls = [call_from_obj(obj) for obj in payload]
    if any(c is None for c in calls):
        return FAIL
    return Match(end, [c for c in calls if c is not None])


class Mistral(Dialect):
    name = "mistral"
    start_markers = (START,)
    default_id_factory = staticmethod(new_mistral_call_id)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        i = skip_ws(buf, len(START))
        if i == len(buf):
            return NEED_MORE
        if buf[i] == "[":
            return _old_format(buf, i, ctx.memo)
        calls: list[RawCall] = []
        head = _header(buf, i, need_args=False)
        while True:
            if isinstance(head, Scan):
                return head
            name, call_id, j = head
            end = find_json_end(buf, j, ctx.memo)
            if isinstance(end, Scan):
                return end
            try:
                args = loads_span(buf, j, end, ctx.memo)
            except ValueError:
                return FAIL
            if not isinstance(args, dict):
                return FAIL
            calls.append(RawCall(name, args, call_id))
            # Another "name[ARGS]{" may follow without [TOOL_CALLS]; anything else is content.
            head = _header(buf, skip_ws(buf, end), need_args=True)
            if head is FAIL or (head is NEED_MORE and ctx.final):
                return Match(end, calls)


DIALECT = Mistral()

"""Gemma tool calls: FunctionGemma and Gemma 4.

    <start_function_call>call:NAME{k:<escape>text<escape>,n:3}<end_function_call>
    <|tool_call>call:NAME{k:<|"|>text<|"|>,o:{a:[1,2]}}<tool_call|>

Keys are bare, strings sit between the quote token (``<escape>`` or ``<|"|>``) and may hold
braces, commas and quotes; other values are JSON literals (and ``None``, as Gemma 4's template
writes a null). Several calls are several blocks.

Own code rather than mlx-lm: ``function_gemma`` stops at the first ``}`` and splits on the first
``,`` even inside ``<escape>`` strings, and reads only one call (case
functiongemma-escape-and-two-calls); ``gemma4`` handles the case gemma4-braces-and-hyphen-in-call
but raises on hyphenated keys and on a space after a comma (see test_mlx_lm_upstream.py). One
recursive-descent reader serves both quote styles; running out of text is ``NEED_MORE``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    NAME_CHARS,
    Dialect,
    Match,
    RawCall,
    Scan,
    ScanContext,
    ScanResult,
    expect,
    find_from,
    is_partial,
    skip_ws,
)

# start marker -> (end marker, string quote token)
FORMATS = {
    "<start_function_call>": ("<end_function_call>", "<escape>"),
    "<|tool_call>": ("<tool_call|>", '<|"|>'),
}
# "None": Gemma 4's chat template prints a null argument with Jinja's plain {{ value }}
_LITERALS = {"true": True, "false": False, "null": None, "None": None}
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class _Incomplete(Exception):
    pass


class _Invalid(Exception):
    pass


class _Reader:
    """Reads one Gemma value from ``buf`` at ``i``; raises _Incomplete at the end of the text."""

    def __init__(self, buf: str, quote: str, memo: dict[Any, Any]) -> None:
        self.buf = buf
        self.quote = quote
        self.memo = memo

    def ws(self, i: int) -> int:
        i = skip_ws(self.buf, i)
        if i >= len(self.buf):
            raise _Incomplete
        return i

    def value(self, i: int, depth: int = 0) -> tuple[Any, int]:
        if depth > 64:
            raise _Invalid
        i = self.ws(i)
        buf = self.buf
        if buf.startswith(self.quote, i):
            end = find_from(buf, self.quote, i + len(self.quote), self.memo)
            if end < 0:
                raise _Incomplete
            return buf[i + len(self.quote) : end], end + len(self.quote)
        if is_partial(buf, i, self.quote):
            raise _Incomplete
        if buf[i] == "{":
            return self.mapping(i + 1, depth)
        if buf[i] == "[":
            return self.sequence(i + 1, depth)
        if buf[i] == '"':
            m = _JSON_STRING.match(buf, i)
            if m is None:
                raise _Incomplete
            try:
                return json.loads(m.group()), m.end()
            except ValueError:
                return m.group()[1:-1], m.end()
        j = i
        while j < len(buf) and buf[j] not in ",}]":
            j += 1
        if j == len(buf):
            raise _Incomplete
        token = buf[i:j].strip()
        if token in _LITERALS:
            return _LITERALS[token], j
        if _NUMBER.fullmatch(token):
            return json.loads(token), j
        if not token or "<" in token or "{" in token or "[" in token:
            raise _Invalid
        return token, j  # a bare word: keep the text

    def mapping(self, i: int, depth: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        i = self.ws(i)
        if self.buf[i] == "}":
            return out, i + 1
        while True:
            i = self.ws(i)
            if self.buf.startswith(self.quote, i):
                key, i = self.value(i, depth + 1)
            else:
                j = i
                while j < len(self.buf) and self.buf[j] != ":":
                    if self.buf[j] in ",{}[]<\n":
                        raise _Invalid
                    j += 1
                if j == len(self.buf):
                    raise _Incomplete
                key, i = self.buf[i:j].strip().strip('"'), j
            i = self.ws(i)
            if self.buf[i] != ":" or not key:
                raise _Invalid
            out[key], i = self.value(i + 1, depth + 1)
            i = self.ws(i)
            if self.buf[i] == "}":
                return out, i + 1
            if self.buf[i] != ",":
                raise _Invalid
            i += 1

    def sequence(self, i: int, depth: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        i = self.ws(i)
        if self.buf[i] == "]":
            return out, i + 1
        while True:
            item, i = self.value(i, depth + 1)
            out.append(item)
            i = self.ws(i)
            if self.buf[i] == "]":
                return out, i + 1
            if self.buf[i] != ",":
                raise _Invalid
            i += 1


class Gemma(Dialect):
    name = "gemma"
    start_markers = tuple(FORMATS)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        start = next(m for m in FORMATS if buf.startswith(m))
        end_marker, quote = FORMATS[start]
        # A match ends with end_marker: parse again only when a new one has arrived, the text
        # has doubled (to notice a malformed call early) or it is the end, so a long call is
        # parsed O(log n) times, not once per chunk. Deferring is safe: NEED_MORE is always so.
        seen = ctx.memo.get("gemma_end_from", len(start))
        found = find_from(buf, end_marker, seen, ctx.memo)
        grown = len(buf) >= 2 * ctx.memo.get("gemma_parsed_len", 0)
        if found < 0 and not grown and not ctx.final:
            return NEED_MORE
        ctx.memo["gemma_parsed_len"] = len(buf)
        result = self._parse(buf, start, end_marker, quote, ctx.memo)
        if result is NEED_MORE and found >= 0:
            ctx.memo["gemma_end_from"] = found + 1
        return result

    def _parse(
        self, buf: str, start: str, end_marker: str, quote: str, memo: dict[Any, Any]
    ) -> ScanResult:
        i = skip_ws(buf, len(start))
        calls: list[RawCall] = []
        while True:
            r = expect(buf, i, "call:")
            if isinstance(r, Scan):
                return r
            j = r
            while j < len(buf) and buf[j] in NAME_CHARS and buf[j] != ":":
                j += 1
            if j == len(buf):
                return NEED_MORE
            if j == r or buf[j] != "{":
                return FAIL
            try:
                args, i = _Reader(buf, quote, memo).mapping(j + 1, 0)
            except _Incomplete:
                return NEED_MORE
            except _Invalid:
                return FAIL
            calls.append(RawCall(buf[r:j], args))
            i = skip_ws(buf, i)
            end = expect(buf, i, end_marker)
            if isinstance(end, int):
                return Match(end, calls)
            more = expect(buf, i, "call:")
            if end is NEED_MORE or more is NEED_MORE:
                return NEED_MORE
            if more is FAIL:
                return FAIL


DIALECT = Gemma()

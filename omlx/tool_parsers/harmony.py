"""GPT-OSS Harmony: tool calls, and the channel markup around answers.

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is 3 °C in Oslo.<|return|>

A message is ``[<|start|>ROLE] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json | json]
<|message|>BODY`` ended by ``<|call|>``, ``<|end|>`` or ``<|return|>``; the recipient may also sit
before ``<|channel|>`` (``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>``).
gpt-oss's chat template renders a call exactly that second way and its generation prompt ends
with ``<|start|>assistant``, so a reply that calls a tool at once begins with the recipient,
a space first (``" to=functions.f<|channel|>commentary json<|message|>{...}<|call|>"``); at the
start of the output that is read as a header too. A message to ``functions.NAME`` (or any other recipient, e.g.
``browser.search``) whose body is a JSON object is a tool call named NAME (the recipient without
``functions.``). ``<|call|>`` and ``<|return|>`` are stop tokens that the engine may not pass
on, so a complete JSON body at the end of the output is a call too. Headers of other messages
(``final``, a ``commentary`` preamble) and the end tokens are dropped and their bodies are
content. An ``analysis`` message is reasoning, never content: it is dropped here, and
``THINK_MARKERS`` are the reasoning markers a caller's think splitter can take out of the text
before it reaches this parser (as ``<think>``/``</think>`` for other families).

Own code: mlx-lm 0.32.2 has no Harmony parser and the ``openai-harmony`` package parses tokens,
not the streamed text that omlx's parsers see. Markers from the Harmony format spec
(https://cookbook.openai.com/articles/openai-harmony).
"""

from __future__ import annotations

import re
from typing import Any

from omlx.tool_parsers._json import json_object_at
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    RawCall,
    Scan,
    ScanContext,
    ScanResult,
    find_from,
    is_name,
    skip_ws,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|call|>", "<|end|>", "<|return|>")
THINK_MARKERS = (CHANNEL + "analysis" + MESSAGE, "<|end|>")
# A header's recipient written first, right after the generation prompt's "<|start|>assistant".
_LEAD_RECIPIENTS = (" to=", "to=")
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
_HEADER_TEXT = re.compile(r"[\w .=:/@<>|-]*")


def _header(text: str) -> tuple[str, str | None] | None:
    """Reads the header text between the marker and ``<|message|>``.

    Returns:
        (channel, recipient or None), or None when it is not a header.
    """
    if not _HEADER_TEXT.fullmatch(text):
        return None
    if text.count(CHANNEL) > 1 or text.count(CONSTRAIN) > 1:
        return None
    if "<|" in text.replace(CHANNEL, "").replace(CONSTRAIN, ""):
        return None
    channel = ""
    if CHANNEL in text:
        after = text.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
        channel = after[0] if after else ""
    m = _RECIPIENT.search(text.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
    return channel, (m.group(1) if m else None)


def _tool_name(recipient: str) -> str:
    return recipient.removeprefix("functions.")


def _skip_message(buf: str, start: int, memo: dict[Any, Any], final: bool) -> ScanResult:
    """Drops an analysis message: its body up to ``<|end|>`` (or the end of the output)."""
    end = find_from(buf, "<|end|>", start, memo)
    if end >= 0:
        return Match(end + len("<|end|>"), [])
    return Match(len(buf), []) if final else NEED_MORE


class Harmony(Dialect):
    name = "harmony"
    start_markers = (START, CHANNEL, *ENDS)
    drops_markup = True
    think_markers = THINK_MARKERS

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, int] | None:
        if at_message_start:
            for lead in _LEAD_RECIPIENTS:
                if text.startswith(lead):
                    return (0, len(lead))
        return super().find_start(text, at_message_start)

    def hold_len(self, text: str, at_message_start: bool) -> int:
        held = super().hold_len(text, at_message_start)
        if at_message_start and any(lead.startswith(text) for lead in _LEAD_RECIPIENTS):
            return max(held, len(text))
        return held

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        for end in ENDS:
            if buf.startswith(end):
                return Match(len(end), [])  # a message end: markup, not content
        # The header text: after <|start|>, or from <|channel|> on (it names the channel).
        skip = len(START) if buf.startswith(START) else 0
        msg = find_from(buf, MESSAGE, 1, ctx.memo)
        if msg < 0:
            # A header is short and holds no other marker; anything else is text.
            seen = buf[skip:]
            k = seen.rfind("<|")
            if k >= 0 and "|>" not in seen[k:]:
                seen = seen[:k]  # a marker still arriving
            if len(seen) > 256 or _header(seen) is None:
                return FAIL
            return NEED_MORE
        head = _header(buf[skip:msg])
        if head is None:
            return FAIL
        channel, recipient = head
        body = msg + len(MESSAGE)
        if recipient is None:
            if channel == "analysis":
                return _skip_message(buf, body, ctx.memo, ctx.final)
            return Match(body, [])  # final / preamble: the body is content
        name = _tool_name(recipient)
        if not is_name(name):
            return FAIL
        obj = json_object_at(buf, body, ctx.memo)
        if isinstance(obj, Scan):
            return obj
        args, end = obj
        call = [RawCall(name, args)]
        j = skip_ws(buf, end)
        for stop in ENDS:
            if buf.startswith(stop, j):
                return Match(j + len(stop), call)
            if stop.startswith(buf[j:]) and j < len(buf):
                return NEED_MORE
        if j == len(buf):
            return Match(end, call) if ctx.final else NEED_MORE
        return FAIL


DIALECT = Harmony()

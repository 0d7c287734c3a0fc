"""Anthropic Messages framing: content events -> a Message object and its stream events.

`MessageBuilder` owns the Message of one request and the order of its stream events
(Anthropic API reference, Messages, "Streaming Messages"):

    message_start
    per content block: content_block_start, content_block_delta*, content_block_stop
        text      -> text_delta
        thinking  -> thinking_delta*, then one signature_delta just before content_block_stop
        tool_use  -> input_json_delta*
    message_delta (stop_reason, stop_sequence, cumulative usage), message_stop
    on a failure after message_start: one ``error`` event instead of message_delta/message_stop.

``ping`` may appear anywhere after message_start. A block opens only when it has content, so a
turn that is only a tool call starts with the tool_use block at index 0 (no empty text block:
Anthropic rejects empty text blocks when a client replays them). The one exception is
`idle_text`, the keep-alive of a long silence: an empty ``text_delta`` in an open text block
(Claude Code's stream idle watchdog counts those, not pings), which may leave an empty text
block before a tool call; omlx accepts such a block when it is replayed.

The builder is pure: no HTTP, no engine, no clock. It returns ``(event name, data)`` pairs; the
route writes them as SSE (`to_sse`) or drops them and returns ``builder.message`` (both modes
build the same Message). Thinking signatures are an HMAC of the thinking text under a per-process key: they let
a client send the block back, and nothing here rejects a signature it did not make.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import uuid
from typing import Any

from omlx.api.sse import json_compact
from omlx.errors import OmlxError
from omlx.request import Finished, Usage
from omlx.tool_parsers.base import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

SseEvent = tuple[str, dict[str, Any]]

_SIGNING_KEY = secrets.token_bytes(32)


def new_message_id() -> str:
    """``msg_`` + 24 hex characters, the shape of Anthropic's message ids."""
    return "msg_" + uuid.uuid4().hex[:24]


def sign_thinking(text: str) -> str:
    """Signature of a thinking block: base64 HMAC-SHA256 of its UTF-8 text, per-process key."""
    return base64.b64encode(hmac.new(_SIGNING_KEY, text.encode(), hashlib.sha256).digest()).decode()


def scale_tokens(n: int, scale: float) -> int:
    """A token count as reported to the client: ``ceil(n * scale)`` (``n`` itself when scale is 1)."""
    return n if scale == 1.0 else int(math.ceil(n * scale))


def usage_json(u: Usage, scale: float = 1.0) -> dict[str, Any]:
    """Anthropic ``usage``: ``input_tokens`` excludes the prefix read from the KV cache
    (``cache_read_input_tokens``), as in Anthropic's accounting; counts scaled by ``scale``."""
    cached = min(u.num_cached_tokens, u.num_prompt_tokens)
    return {
        "input_tokens": scale_tokens(u.num_prompt_tokens - cached, scale),
        "output_tokens": scale_tokens(u.num_completion_tokens, scale),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": scale_tokens(cached, scale),
    }


def error_event(err: OmlxError) -> SseEvent:
    """The in-stream ``error`` event (what would have been the HTTP error body)."""
    return "error", err.anthropic_body()


def stop_reason(finished: Finished, num_tool_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished turn.

    A turn with a tool call ends in ``tool_use``; a matched stop string in ``stop_sequence``;
    max_tokens (or the context) in ``max_tokens``; anything else (EOS) in ``end_turn``.
    """
    if num_tool_calls:
        return "tool_use", None
    if finished.stop_string is not None:
        return "stop_sequence", finished.stop_string
    if finished.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


class MessageBuilder:
    """Builds one Anthropic Message and its stream events from content events.

    Args:
        model: the model name to report (the one the client asked for).
        num_input_tokens: prompt tokens, reported in message_start before the cache hit is known.
        scale: factor applied to every reported token count (context scaling; 1 = off).
        max_tool_calls: keep at most this many tool calls (1 for ``disable_parallel_tool_use``).
        message_id: the Message id (default: a new one).

    Input: `text` (answer text), `thinking` (reasoning text, think markers removed) and `feed`
    (``ToolCallStart``, ``ToolCallArgsDelta``, ``ToolCallEnd`` and plain ``TextDelta`` of
    ``omlx.tool_parsers.base``); then `finish` or `fail`. Every method returns the stream events
    it decided, in order.
    """

    def __init__(self, model: str, num_input_tokens: int, *, scale: float = 1.0,
                 max_tool_calls: int | None = None, message_id: str | None = None):
        self.scale = scale
        self.max_tool_calls = max_tool_calls
        self.num_input_tokens = num_input_tokens
        self.message: dict[str, Any] = {
            "id": message_id or new_message_id(),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": scale_tokens(num_input_tokens, scale),
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        self.num_tool_calls = 0
        self._open: dict[str, Any] | None = None  # the content block being streamed
        self._open_kind = ""  # "text" | "thinking" | "tool_use"
        self._tool_index: dict[int, int] = {}  # parser call index -> content block index
        self._dropped: set[int] = set()  # parser call indexes beyond max_tool_calls
        self._args: dict[int, str] = {}  # content block index -> arguments JSON so far
        self.done = False

    @property
    def content(self) -> list[dict[str, Any]]:
        return self.message["content"]

    def start(self, num_cached_tokens: int = 0) -> list[SseEvent]:
        """``message_start`` (a copy of the empty Message).

        Args:
            num_cached_tokens: the prompt tokens read from the KV cache (the engine's `Admitted`
                event); its usage then splits input and cache-read tokens exactly as the final
                ``message_delta`` and the non-streaming Message do.
        """
        cached = min(num_cached_tokens, self.num_input_tokens)
        self.message["usage"].update(input_tokens=scale_tokens(self.num_input_tokens - cached, self.scale),
                                     cache_read_input_tokens=scale_tokens(cached, self.scale))
        msg = {**self.message, "content": [], "usage": dict(self.message["usage"])}
        return [("message_start", {"type": "message_start", "message": msg})]

    def text(self, text: str) -> list[SseEvent]:
        """Answer text: appended to the open text block, or a new one (never an empty block)."""
        return self._text("text", text) if text else []

    def thinking(self, text: str) -> list[SseEvent]:
        """Reasoning text: appended to the open thinking block, or a new one."""
        return self._text("thinking", text) if text else []

    def feed(self, event: Any) -> list[SseEvent]:
        """One tool-parser event -> the stream events it completes (possibly none).

        Raises:
            TypeError: an event type this builder does not know (a programming error).
        """
        if isinstance(event, TextDelta):
            return self.text(event.text)
        if isinstance(event, ToolCallStart):
            return self._tool_start(event)
        if isinstance(event, ToolCallArgsDelta):
            return self._tool_args(event)
        if isinstance(event, ToolCallEnd):
            if event.index in self._tool_index and self._open_kind == "tool_use":
                return self._close()
            return []
        raise TypeError(f"MessageBuilder cannot frame {type(event).__name__}")

    def finish(self, finished: Finished) -> list[SseEvent]:
        """Close the open block, set stop_reason and usage: ``message_delta``, ``message_stop``."""
        out = self._close()
        reason, sequence = stop_reason(finished, self.num_tool_calls)
        usage = usage_json(finished.usage, self.scale)
        self.message.update(stop_reason=reason, stop_sequence=sequence, usage=usage)
        self.done = True
        out.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": dict(usage),
        }))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def fail(self, err: OmlxError) -> list[SseEvent]:
        """A failure after message_start: one ``error`` event; the stream ends there."""
        self.done = True
        return [error_event(err)]

    @staticmethod
    def ping() -> SseEvent:
        return "ping", {"type": "ping"}

    def idle_text(self) -> list[SseEvent]:
        """A keep-alive that resets a client's stream idle watchdog: an empty ``text_delta``.

        In the open text block, or in a new one when no block has opened yet; a ``ping`` while
        a thinking or tool_use block is open (an empty delta of those would change nothing).
        """
        if self._open_kind != "text" and self.content:
            return [self.ping()]
        out = [] if self._open_kind == "text" else self._begin("text", {"type": "text", "text": ""})
        out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                            "delta": {"type": "text_delta", "text": ""}}))
        return out

    # ---- blocks -----------------------------------------------------------------------

    def _begin(self, kind: str, block: dict[str, Any]) -> list[SseEvent]:
        self.content.append(block)
        self._open, self._open_kind = block, kind
        start = dict(block)
        if kind == "tool_use":
            start["input"] = {}
        elif kind == "thinking":
            start["signature"] = ""
        return [("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                         "content_block": start})]

    def _close(self) -> list[SseEvent]:
        if self._open is None:
            return []
        idx = len(self.content) - 1
        out: list[SseEvent] = []
        if self._open_kind == "thinking":
            sig = sign_thinking(self._open["thinking"])
            self._open["signature"] = sig
            out.append(("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                "delta": {"type": "signature_delta", "signature": sig}}))
        elif self._open_kind == "tool_use":
            self._open["input"] = _parse_input(self._args.pop(idx, ""))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": idx}))
        self._open, self._open_kind = None, ""
        return out

    def _text(self, kind: str, text: str) -> list[SseEvent]:
        out: list[SseEvent] = []
        if self._open_kind != kind:
            out += self._close()
            out += self._begin(kind, {"type": "text", "text": ""} if kind == "text"
                               else {"type": "thinking", "thinking": ""})
        assert self._open is not None
        self._open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                            "delta": delta}))
        return out

    def _tool_start(self, ev: ToolCallStart) -> list[SseEvent]:
        if self.max_tool_calls is not None and self.num_tool_calls >= self.max_tool_calls:
            self._dropped.add(ev.index)
            return []
        out = self._close()
        self.num_tool_calls += 1
        out += self._begin("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        self._tool_index[ev.index] = len(self.content) - 1
        self._args[len(self.content) - 1] = ""
        return out

    def _tool_args(self, ev: ToolCallArgsDelta) -> list[SseEvent]:
        idx = self._tool_index.get(ev.index)
        if idx is None or ev.index in self._dropped or not ev.fragment:
            return []
        if idx != len(self.content) - 1 or self._open_kind != "tool_use":
            return []  # the parser emits a call's arguments before its end; never after another block
        self._args[idx] += ev.fragment
        return [("content_block_delta", {"type": "content_block_delta", "index": idx,
                                         "delta": {"type": "input_json_delta", "partial_json": ev.fragment}})]


def _parse_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as the ``input`` object ({} when empty or not an object)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def to_sse(events: list[SseEvent]) -> str:
    """Named SSE events (``event:`` then ``data:``), the framing Anthropic clients require."""
    return "".join([f"event: {name}\ndata: {json_compact(data)}\n\n" for name, data in events])


def frame_events(builder: MessageBuilder, events: list[Any], finished: Finished | None = None,
                 error: OmlxError | None = None) -> list[SseEvent]:
    """The whole stream for a list of content events: start, the events, then finish or fail."""
    out = builder.start()
    for ev in events:
        out += builder.feed(ev)
    if error is not None:
        out += builder.fail(error)
    elif finished is not None:
        out += builder.finish(finished)
    return out

"""One model turn as all three APIs see it: content text, reasoning text and tool calls.

`ModelTurn` wraps an `EventStream` and splits the engine's text into
- reasoning (between the model's think markers, e.g. ``<think>``/``</think>``),
- tool calls (through `omlx.tool_parsers.StreamingToolParser` in the model's dialect, only
  when the request offers tools), and
- plain content,
so the OpenAI chat, Anthropic messages and OpenAI responses adapters only frame events. The
same splitting serves streaming and non-streaming responses, so both always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from omlx.api.sse import KEEPALIVE, EventStream
from omlx.request import Admitted, Failed, Finished, TextDelta, TokenLogprob
from omlx.tool_parsers import StreamingToolParser, ToolCall, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from omlx.tool_parsers import TextDelta as ToolText

__all__ = [
    "KEEPALIVE", "ContentDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd",
    "TurnResult", "ModelTurn", "ThinkSplitter",
]


@dataclass(slots=True)
class ContentDelta:
    """Answer text (never a tool-call marker or reasoning)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class ReasoningDelta:
    """Reasoning ("thinking") text, markers removed."""

    text: str


@dataclass(slots=True)
class TurnResult:
    """A whole turn, folded from its events (non-streaming responses)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ThinkSplitter:
    """Splits streamed text at think markers; holds back a marker split across chunks.

    Args:
        start, end: the markers (e.g. ``<think>``, ``</think>``).
        in_reasoning: True when the prompt already opened the reasoning block.
    """

    def __init__(self, start: str, end: str, *, in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """Returns (is_reasoning, text) pieces decided so far."""
        self._buf += text
        out: list[tuple[bool, str]] = []
        while True:
            marker = self.end if self.in_reasoning else self.start
            i = self._buf.find(marker)
            if i < 0:
                keep = _partial_suffix(self._buf, marker)
                piece, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if piece:
                    out.append((self.in_reasoning, piece))
                return out
            if i:
                out.append((self.in_reasoning, self._buf[:i]))
            self._buf = self._buf[i + len(marker):]
            self.in_reasoning = not self.in_reasoning

    def finish(self) -> list[tuple[bool, str]]:
        piece, self._buf = self._buf, ""
        return [(self.in_reasoning, piece)] if piece else []


class ModelTurn:
    """Events of one generation, split into content, reasoning and tool-call events.

    Args:
        stream: the request's EventStream (not yet started).
        tool_dialect: the model's tool dialect, or None (no tool parsing).
        tools: the request's tools (OpenAI function-tool dicts); parsing happens only with tools.
        think: (start, end) markers when the model reasons and reasoning is on, else None.
        in_reasoning: the prompt ends inside an open reasoning block.
    """

    def __init__(self, stream: EventStream, *, tool_dialect: str | None = None,
                 tools: list[dict[str, Any]] | None = None, think: tuple[str, str] | None = None,
                 in_reasoning: bool = False):
        self.stream = stream
        self.parser = StreamingToolParser(tool_dialect, tools) if (tool_dialect and tools) else None
        self.splitter = ThinkSplitter(*think, in_reasoning=in_reasoning) if think else None
        self.num_tool_calls = 0

    def start(self) -> None:
        self.stream.start()

    def close(self) -> None:
        self.stream.close()

    def _content(self, text: str, logprobs: list[TokenLogprob] | None) -> list[Any]:
        if self.parser is None:
            return [ContentDelta(text, logprobs)] if (text or logprobs) else []
        return self._map_tool_events(self.parser.feed(text) if text else [])

    def _map_tool_events(self, events: list[Any]) -> list[Any]:
        out: list[Any] = []
        for ev in events:
            if isinstance(ev, ToolText):
                if ev.text:
                    out.append(ContentDelta(ev.text))
            else:
                if isinstance(ev, ToolCallStart):
                    self.num_tool_calls += 1
                out.append(ev)
        return out

    def _split(self, text: str, logprobs: list[TokenLogprob] | None, final: bool) -> list[Any]:
        if self.splitter is None:
            out = self._content(text, logprobs)
        else:
            out = []
            pieces = self.splitter.feed(text) + (self.splitter.finish() if final else [])
            for is_reasoning, piece in pieces:
                out += [ReasoningDelta(piece)] if is_reasoning else self._content(piece, None)
        if final and self.parser is not None:
            out += self._map_tool_events(self.parser.finish())
        return out

    async def batches(self, *, keepalive: bool = True, admitted: bool = False) -> AsyncIterator[Any]:
        """Yield KEEPALIVE markers and non-empty lists of turn events (ContentDelta,
        ReasoningDelta, ToolCall*, then Finished or Failed last), one list per batch of engine
        events (`EventStream.batches`), so a protocol can write a whole list with one send.

        With ``admitted``, the engine's `Admitted` event (the prefix-cache hit) is passed on too.
        """
        plain = self.parser is None and self.splitter is None
        async for batch in self.stream.batches(keepalive=keepalive):
            if batch is KEEPALIVE:
                yield KEEPALIVE
                continue
            out: list[Any] = []
            for ev in batch:
                if isinstance(ev, TextDelta):
                    if not plain:
                        out += self._split(ev.text, ev.logprobs, final=False)
                    elif ev.text or ev.logprobs:
                        out.append(ContentDelta(ev.text, ev.logprobs))
                elif isinstance(ev, Finished):
                    out += self._split("", None, final=True)
                    out.append(ev)
                elif isinstance(ev, Failed):
                    out.append(ev)
                elif admitted and isinstance(ev, Admitted):
                    out.append(ev)
            if out:
                yield out

    async def events(self, *, keepalive: bool = True, admitted: bool = False) -> AsyncIterator[Any]:
        """Yield KEEPALIVE, ContentDelta, ReasoningDelta, ToolCall* events, then Finished or Failed
        (`batches`, one event at a time).

        With ``admitted``, the engine's `Admitted` event (the prefix-cache hit) is passed on too.
        """
        async for batch in self.batches(keepalive=keepalive, admitted=admitted):
            if batch is KEEPALIVE:
                yield KEEPALIVE
            else:
                for ev in batch:
                    yield ev

    async def collect(self) -> TurnResult:
        """Run the turn to the end (non-streaming)."""
        res = TurnResult()
        calls: dict[int, ToolCall] = {}
        content: list[str] = []  # joined once at the end (+= on a str copies it every token)
        reasoning: list[str] = []
        args: dict[int, list[str]] = {}
        async for batch in self.batches(keepalive=False):
            for ev in batch:
                if isinstance(ev, ContentDelta):
                    content.append(ev.text)
                    if ev.logprobs:
                        res.logprobs.extend(ev.logprobs)
                elif isinstance(ev, ReasoningDelta):
                    reasoning.append(ev.text)
                elif isinstance(ev, ToolCallStart):
                    calls[ev.index] = ToolCall(ev.id, ev.name, "")
                    args[ev.index] = []
                elif isinstance(ev, ToolCallArgsDelta):
                    args[ev.index].append(ev.fragment)
                elif isinstance(ev, Finished):
                    res.finished = ev
                elif isinstance(ev, Failed):
                    raise ev.error
        res.content, res.reasoning = "".join(content), "".join(reasoning)
        for i, call in calls.items():
            call.arguments = "".join(args[i])
        res.tool_calls = [calls[i] for i in sorted(calls)]
        return res

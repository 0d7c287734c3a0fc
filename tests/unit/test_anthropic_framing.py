"""Anthropic Messages framing (omlx/api/anthropic_framing.py): content events -> Message + SSE.

No model: fake event sequences go in, and what comes out is checked against Anthropic's event
order, against the official SDK's own stream accumulator, and against the error shapes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from omlx.api.anthropic import frame
from omlx.api.anthropic_framing import (
    MessageBuilder,
    frame_events,
    sign_thinking,
    stop_reason,
    to_sse,
    usage_json,
)
from omlx.api.errors import error_response
from omlx.errors import EngineError, OverloadedError, PayloadTooLargeError, RateLimitError
from omlx.api.turn import ContentDelta, ModelTurn, ReasoningDelta
from omlx.request import Finished, Usage
from omlx.request import TextDelta as EngineText
from omlx.tool_parsers.base import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

STOP = Finished("stop", Usage(10, 5))
EVENT = TypeAdapter(RawMessageStreamEvent)


def names(events):
    return [name for name, _ in events]


def sdk_final(events) -> Message:
    """Feed our events through the official SDK's accumulator; returns its final Message."""
    snapshot, bufs = None, {}
    for name, data in events:
        assert data["type"] == name
        if name in ("ping", "error"):
            continue
        snapshot = accumulate_event(event=EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
    return Message.model_validate(snapshot.model_dump())


def parse_sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = chunk.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_text_only_turn_order_and_sdk_agree():
    b = MessageBuilder("m", 10, message_id="msg_1")
    ev = frame_events(b, [TextDelta("Hel"), TextDelta(""), TextDelta("lo")], STOP)
    assert names(ev) == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]
    assert ev[1][1]["content_block"] == {"type": "text", "text": ""}
    assert ev[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert b.message["content"] == [{"type": "text", "text": "Hello"}]
    assert sdk_final(ev).model_dump(exclude_none=True) == Message.model_validate(b.message).model_dump(exclude_none=True)
    assert parse_sse(to_sse(ev)) == ev


def test_tool_only_turn_has_no_empty_text_block_and_stops_for_tool_use():
    """The failure case 'anthropic-stream-tool-only-turn-framing'."""
    b = MessageBuilder("m", 10)
    ev = frame_events(b, [
        ToolCallStart(0, "call_1", "write"),
        ToolCallArgsDelta(0, '{"file_path": "test.txt", '),
        ToolCallArgsDelta(0, '"content": "hello"}'),
        ToolCallEnd(0),
    ], STOP)
    assert names(ev) == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]
    assert ev[1][1] == {"type": "content_block_start", "index": 0,
                        "content_block": {"type": "tool_use", "id": "call_1", "name": "write", "input": {}}}
    assert [d["delta"]["type"] for n, d in ev if n == "content_block_delta"] == ["input_json_delta"] * 2
    assert ev[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert b.message["stop_reason"] == "tool_use"
    assert b.message["content"] == [{"type": "tool_use", "id": "call_1", "name": "write",
                                     "input": {"file_path": "test.txt", "content": "hello"}}]
    final = sdk_final(ev)
    assert final.content[0].input == {"file_path": "test.txt", "content": "hello"}
    assert final.stop_reason == "tool_use"


def test_text_then_two_tools_indexes_and_parallel_limit():
    events = [TextDelta("Running."), ToolCallStart(0, "a", "Bash"), ToolCallArgsDelta(0, '{"command": "ls"}'),
              ToolCallEnd(0), ToolCallStart(1, "b", "Bash"), ToolCallArgsDelta(1, '{"command": "pwd"}'), ToolCallEnd(1)]
    b = MessageBuilder("m", 10)
    ev = frame_events(b, events, STOP)
    starts = [(d["index"], d["content_block"]["type"]) for n, d in ev if n == "content_block_start"]
    stops = [d["index"] for n, d in ev if n == "content_block_stop"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use")] and stops == [0, 1, 2]
    assert [c.get("input") for c in b.message["content"]] == [None, {"command": "ls"}, {"command": "pwd"}]
    # disable_parallel_tool_use: the second call is dropped entirely
    b1 = MessageBuilder("m", 10, max_tool_calls=1)
    ev1 = frame_events(b1, events, STOP)
    assert [c["type"] for c in b1.message["content"]] == ["text", "tool_use"]
    assert max(d["index"] for n, d in ev1 if "index" in d) == 1
    assert sdk_final(ev1).content[1].input == {"command": "ls"}


def test_idle_text_opens_a_text_block_that_the_answer_continues():
    b = MessageBuilder("m", 10, message_id="msg_1")
    ev = b.start() + b.idle_text() + b.idle_text() + b.text("Hi") + b.finish(STOP)
    assert names(ev) == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                         "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert [d["delta"] for n, d in ev if n == "content_block_delta"] == [
        {"type": "text_delta", "text": ""}, {"type": "text_delta", "text": ""}, {"type": "text_delta", "text": "Hi"}]
    assert b.message["content"] == [{"type": "text", "text": "Hi"}]
    assert sdk_final(ev).content[0].text == "Hi"


def test_idle_text_before_a_tool_call_leaves_one_empty_text_block_and_pings_inside_other_blocks():
    b = MessageBuilder("m", 10)
    ev = b.start() + b.idle_text()
    ev += b.feed(ToolCallStart(0, "call_1", "Bash")) + b.feed(ToolCallArgsDelta(0, '{"command": "ls"}'))
    assert b.idle_text() == [MessageBuilder.ping()]  # inside the tool_use block
    ev += b.feed(ToolCallEnd(0))
    assert b.idle_text() == [MessageBuilder.ping()]  # after content: no new empty block
    b2 = MessageBuilder("m", 10)
    b2.start(), b2.thinking("hmm")
    assert b2.idle_text() == [MessageBuilder.ping()]
    final = sdk_final(ev + b.finish(STOP))
    assert [c.type for c in final.content] == ["text", "tool_use"] and final.content[0].text == ""
    assert final.content[1].input == {"command": "ls"} and final.stop_reason == "tool_use"


def test_thinking_block_gets_signature_delta_before_stop():
    b = MessageBuilder("m", 10)
    ev = b.start() + b.thinking("Let me ") + b.thinking("think.") + b.text("4") + b.finish(STOP)
    assert names(ev)[1:8] == ["content_block_start", "content_block_delta", "content_block_delta",
                              "content_block_delta", "content_block_stop", "content_block_start", "content_block_delta"]
    assert ev[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert ev[2][1]["delta"] == {"type": "thinking_delta", "thinking": "Let me "}
    sig = sign_thinking("Let me think.")
    assert ev[4][1]["delta"] == {"type": "signature_delta", "signature": sig}
    assert b.message["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": sig},
                                    {"type": "text", "text": "4"}]
    final = sdk_final(ev)
    assert final.content[0].type == "thinking" and final.content[0].signature == sig
    assert sign_thinking("other") != sig and sign_thinking("Let me think.") == sig


def test_no_content_at_all_is_an_empty_message():
    b = MessageBuilder("m", 3)
    ev = frame_events(b, [TextDelta("")], STOP)
    assert names(ev) == ["message_start", "message_delta", "message_stop"]
    assert b.message["content"] == []


@pytest.mark.parametrize("finished,calls,expected", [
    (Finished("stop", Usage(1, 1)), 0, ("end_turn", None)),
    (Finished("length", Usage(1, 1)), 0, ("max_tokens", None)),
    (Finished("stop", Usage(1, 1), stop_string="STOP"), 0, ("stop_sequence", "STOP")),
    (Finished("stop", Usage(1, 1)), 1, ("tool_use", None)),
    (Finished("length", Usage(1, 1)), 2, ("tool_use", None)),
])
def test_stop_reason_mapping(finished, calls, expected):
    assert stop_reason(finished, calls) == expected


def test_stop_sequence_reaches_message_delta():
    b = MessageBuilder("m", 10)
    ev = frame_events(b, [TextDelta("A B C ")], Finished("stop", Usage(10, 4), stop_string="STOP"))
    assert ev[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert b.message["stop_sequence"] == "STOP"


def test_usage_reports_cache_reads_and_scales():
    u = Usage(num_prompt_tokens=1000, num_completion_tokens=7, num_cached_tokens=768)
    assert usage_json(u) == {"input_tokens": 232, "output_tokens": 7, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 768}
    assert usage_json(u, 2.5) == {"input_tokens": 580, "output_tokens": 18, "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 1920}
    b = MessageBuilder("m", 1000, scale=2.5)
    ev = frame_events(b, [TextDelta("x")], Finished("stop", u))
    assert ev[0][1]["message"]["usage"]["input_tokens"] == 2500
    assert ev[-2][1]["usage"]["cache_read_input_tokens"] == 1920


def test_mid_stream_failure_is_one_error_event():
    """The failure case 'anthropic-midstream-error-event'."""
    b = MessageBuilder("m", 10)
    ev = frame_events(b, [TextDelta("partial")], error=EngineError("generation failed: boom"))
    assert names(ev)[-1] == "error" and "message_stop" not in names(ev)
    assert ev[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}}
    ev2 = MessageBuilder("m", 1).fail(OverloadedError("busy"))
    assert ev2 == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]
    text = to_sse(ev)
    assert text.endswith('event: error\ndata: {"type":"error","error":{"type":"api_error","message":"generation failed: boom"}}\n\n')
    assert "[DONE]" not in text and "data: {\"error\"" not in text


@pytest.mark.parametrize("err,status,etype", [
    (RateLimitError("queue full", retry_after_s=3), 429, "rate_limit_error"),
    (OverloadedError("overloaded"), 529, "overloaded_error"),
    (EngineError("boom"), 500, "api_error"),
    (PayloadTooLargeError("too big"), 413, "request_too_large"),
])
def test_error_statuses_in_anthropic_shape(err, status, etype):
    r = error_response("/v1/messages", err)
    assert r.status == status
    assert json.loads(r.body) == {"type": "error", "error": {"type": etype, "message": err.message}}
    if status == 429:
        assert r.headers["retry-after"] == "3"


class FakeStream:
    """Stands in for EventStream: replays engine events (text in fixed-size chunks, then Finished)."""

    def __init__(self, text: str, step: int):
        self.evs = [EngineText(text[i:i + step], []) for i in range(0, len(text), step)] + [STOP]

    def start(self):
        pass

    def close(self):
        pass

    async def batches(self, *, keepalive: bool = True):
        for ev in self.evs:  # one engine event per batch
            yield [ev]


def run_turn(turn: ModelTurn, builder: MessageBuilder) -> list:
    """What the streaming route does with a turn's events, minus HTTP."""

    async def go():
        out = builder.start()
        async for ev in turn.events():
            out += builder.finish(ev) if isinstance(ev, Finished) else frame(builder, ev)
        return out

    return asyncio.run(go())


TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}}}}}]


def test_model_turn_tool_calls_become_tool_use_blocks_across_chunkings():
    """The route's path: engine text -> ModelTurn (hermes parser) -> frame -> builder."""
    text = 'Sure.\n<tool_call>\n{"name": "write", "arguments": {"file_path": "t.txt", "content": "hello"}}\n</tool_call>'
    for step in (1, 7, len(text)):
        b = MessageBuilder("m", 10)
        ev = run_turn(ModelTurn(FakeStream(text, step), tool_dialect="hermes", tools=TOOLS), b)
        assert [c["type"] for c in b.message["content"]] == ["text", "tool_use"], step
        assert b.message["content"][0]["text"] == "Sure."
        assert b.message["content"][1]["input"] == {"file_path": "t.txt", "content": "hello"}
        assert b.message["stop_reason"] == "tool_use"
        assert sdk_final(ev).content[1].input == {"file_path": "t.txt", "content": "hello"}
    # without tools in the request, the same text is one text block
    b = MessageBuilder("m", 10)
    run_turn(ModelTurn(FakeStream(text, 5), tool_dialect="hermes", tools=None), b)
    assert b.message["content"] == [{"type": "text", "text": text}] and b.message["stop_reason"] == "end_turn"


def test_model_turn_calls_to_a_tool_not_offered_or_a_bad_strict_call_are_one_text_block():
    """The tool-call check (omlx/tool_parsers/check.py) on the Anthropic route: such a call is
    the text the model wrote, stop_reason end_turn, however the text is chunked."""
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
        **TOOLS[0]["function"]["parameters"], "required": ["file_path", "content"]}}}]
    cases = [('<tool_call>\n{"name": "rm", "arguments": {"path": "/"}}\n</tool_call>', TOOLS),
             ('<tool_call>\n{"name": "write", "arguments": {"file_path": "t.txt"}}\n</tool_call>', strict)]
    for text, tools in cases:
        for step in (1, 7, len(text)):
            b = MessageBuilder("m", 10)
            run_turn(ModelTurn(FakeStream(text, step), tool_dialect="hermes", tools=tools), b)
            assert b.message["content"] == [{"type": "text", "text": text}], (text, step)
            assert b.message["stop_reason"] == "end_turn"


def test_model_turn_reasoning_becomes_a_signed_thinking_block():
    text = "<think>\nTwo and two.\n</think>\n\n4"
    b = MessageBuilder("m", 10)
    ev = run_turn(ModelTurn(FakeStream(text, 3), think=("<think>", "</think>")), b)
    kinds = [c["type"] for c in b.message["content"]]
    assert kinds == ["thinking", "text"]
    th = b.message["content"][0]
    assert th["signature"] == sign_thinking(th["thinking"]) and "Two and two." in th["thinking"]
    assert b.message["content"][1]["text"].strip() == "4"
    assert sdk_final(ev).content[0].signature == th["signature"]
    assert frame(MessageBuilder("m", 1), ContentDelta("")) == [] and frame(MessageBuilder("m", 1), ReasoningDelta("")) == []


ACCEPTED = Path(__file__).resolve().parents[1] / "fixtures" / "accepted_responses"


@pytest.mark.parametrize("name", ["anthropic_messages_stream_text.sse", "anthropic_messages_stream_tool_use.sse"])
def test_same_stream_as_one_claude_code_accepted(name):
    """Replaying the content of a stream Claude Code accepted gives the same events, in the same order
    (ids, usage numbers and the recording's ping aside)."""
    theirs = [(n, d) for n, d in parse_sse((ACCEPTED / name).read_text()) if n != "ping"]
    b = MessageBuilder(theirs[0][1]["message"]["model"], theirs[0][1]["message"]["usage"]["input_tokens"])
    ours = b.start()
    for n, d in theirs:
        if n == "content_block_start" and d["content_block"]["type"] == "tool_use":
            ours += b.feed(ToolCallStart(0, d["content_block"]["id"], d["content_block"]["name"]))
        elif n == "content_block_delta" and d["delta"]["type"] == "text_delta":
            ours += b.text(d["delta"]["text"])
        elif n == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            ours += b.feed(ToolCallArgsDelta(0, d["delta"]["partial_json"]))
        elif n == "content_block_stop" and d["index"] > 0:
            ours += b.feed(ToolCallEnd(0))
    ours += b.finish(Finished("stop", Usage(0, theirs[-2][1]["usage"]["output_tokens"])))
    assert names(ours) == names(theirs)
    for (_, a), (_, t) in zip(ours[1:-2], theirs[1:-2]):
        assert a == t
    assert ours[-2][1]["delta"] == theirs[-2][1]["delta"] and ours[-1] == theirs[-1]
    assert set(ours[0][1]["message"]) == set(theirs[0][1]["message"])


def test_message_has_the_accepted_non_streaming_shape():
    theirs = json.loads((ACCEPTED / "anthropic_messages_nonstream_text.json").read_text())
    b = MessageBuilder(theirs["model"], 22)
    frame_events(b, [TextDelta(theirs["content"][0]["text"])], Finished("stop", Usage(22, 5)))
    assert {k: v for k, v in b.message.items() if k != "id"} == {k: v for k, v in theirs.items() if k != "id"}

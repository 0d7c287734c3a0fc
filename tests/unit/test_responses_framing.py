"""Responses API framing and input mapping, without a model.

The test model (SmolLM2) has no tool-call format, so function_call output is tested here: event
sequences -> SSE strings and output items, checked against the accepted client fixtures and
replayed through the official openai SDK's own stream accumulator.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from omlx.api.responses import ResponseStore, _render, flatten_tools, frame_turn, input_to_messages
from omlx.api.responses_framing import ResponseBuilder
from omlx.api.sse import KEEPALIVE, sse_event
from omlx.api.turn import ModelTurn, ReasoningDelta
from omlx.errors import EngineError, InvalidRequestError
from omlx.request import Failed, Finished, TokenLogprob, Usage
from omlx.request import TextDelta as EngineText
from omlx.tool_parsers import StreamingToolParser
from omlx.tool_parsers.base import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "accepted_responses"
USAGE = Usage(num_prompt_tokens=13, num_completion_tokens=5, num_cached_tokens=8)


def new_response() -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "m",
            "output": [], "error": None, "incomplete_details": None, "instructions": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": None, "top_p": None,
            "metadata": {}, "usage": None}


def run(events, *, finish="stop", **kw) -> tuple[ResponseBuilder, list[dict]]:
    b = ResponseBuilder(new_response(), **kw)
    out = b.start()
    for ev in events:
        out += b.feed(ev)
    out += b.finish(USAGE, finish)
    return b, out


def fixture_events(name: str) -> list[dict]:
    text = (FIXTURES / name).read_text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def shape(events: list[dict]) -> list[tuple[str, list[str]]]:
    return [(e["type"], sorted(e)) for e in events]


def sdk_replay(events: list[dict]):
    """Feed our events through the openai SDK's stream state, as `responses.stream` does."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return state._completed_response


def test_text_stream_order_and_shape_match_accepted_fixture():
    b, events = run([TextDelta("hi"), TextDelta(" from"), TextDelta(" local")])
    want = fixture_events("openai_responses_stream_text.sse")
    assert shape(events) == shape(want)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e for e in events if e["type"] == "response.output_item.done"][0]
    assert done["item"]["content"][0]["text"] == "hi from local"
    assert done["item"]["status"] == "completed"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [done["item"]]
    assert final["usage"] == {"input_tokens": 13, "input_tokens_details": {"cached_tokens": 8, "cached_tokens_cold": 0}, "output_tokens": 5,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18}
    # lifecycle snapshots are copies: response.created still shows an empty, in-progress response
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    assert sdk_replay(events).output_text == "hi from local"


def test_sse_framing_has_event_line_and_typed_data():
    _, events = run([TextDelta("hi")])
    for e in events:
        frame = sse_event(e["type"], e)
        head, data, blank = frame.split("\n", 2)
        assert head == f"event: {e['type']}" and blank == "\n"
        assert json.loads(data.removeprefix("data: ")) == e


def test_function_call_stream_matches_accepted_fixture():
    args = '{"cmd": "echo hello-from-tool > tool_out.txt; cat tool_out.txt"}'
    b, events = run([ToolCallStart(0, "call_1", "exec_command"), ToolCallArgsDelta(0, args[:30]),
                     ToolCallArgsDelta(0, args[30:]), ToolCallEnd(0)])
    want = fixture_events("openai_responses_stream_function_call.sse")
    assert shape(events) == shape(want)
    item = b.response["output"][0]
    assert item["type"] == "function_call" and item["call_id"] == "call_1" and item["name"] == "exec_command"
    assert item["arguments"] == args and item["status"] == "completed"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"][0]
    assert done["arguments"] == args and done["name"] == "exec_command"
    final = sdk_replay(events)
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments)["cmd"].startswith("echo")


def test_text_then_calls_closes_the_message_first():
    b, events = run([TextDelta("Let me look."), ToolCallStart(0, "call_a", "read"), ToolCallArgsDelta(0, '{"p": 1}'),
                     ToolCallEnd(0), ToolCallStart(1, "call_b", "grep"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1)])
    types = [e["type"] for e in events]
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    assert [i["type"] for i in b.response["output"]] == ["message", "function_call", "function_call"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]
    final = sdk_replay(events)
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.output[2].call_id == "call_b"


def test_text_after_a_call_opens_a_new_message():
    b, _ = run([ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0), TextDelta("done")])
    assert [i["type"] for i in b.response["output"]] == ["function_call", "message"]


def test_namespace_tool_call_carries_namespace_and_original_name():
    names = {"spawn_agent": ("multi_agent_v1", "spawn_agent"), "collab__send": ("collab", "send")}
    b, _ = run([ToolCallStart(0, "c1", "collab__send"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0)], tool_names=names)
    item = b.response["output"][0]
    assert item["name"] == "send" and item["namespace"] == "collab"


def test_parallel_tool_calls_false_keeps_the_first_call():
    b, events = run([ToolCallStart(0, "c1", "f"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0),
                     ToolCallStart(1, "c2", "g"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1)], parallel_tool_calls=False)
    assert [i["call_id"] for i in b.response["output"]] == ["c1"]
    assert all(e.get("item", {}).get("call_id") != "c2" for e in events)


def test_length_finish_is_incomplete():
    b, events = run([TextDelta("abc")], finish="length")
    assert events[-1]["type"] == "response.incomplete"
    r = events[-1]["response"]
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"


def test_empty_output_is_one_empty_message():
    b, events = run([])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert b.response["output"][0]["content"][0]["text"] == ""


def test_failure_is_response_failed():
    b = ResponseBuilder(new_response())
    events = b.start() + b.feed(TextDelta("par")) + b.fail(EngineError("batch step failed"))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "batch step failed"}
    assert events[-1]["response"]["status"] == "failed" and b.finished


def test_logprobs_ride_on_text_deltas():
    lp = [{"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": []}]
    b = ResponseBuilder(new_response())
    events = b.start() + b.text("hi", lp) + b.finish(USAGE, "stop")
    delta = [e for e in events if e["type"] == "response.output_text.delta"][0]
    assert delta["logprobs"] == lp
    assert b.response["output"][0]["content"][0]["logprobs"] == lp


def test_real_parser_events_frame_as_function_call():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    parser = StreamingToolParser("hermes", tools)
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    b = ResponseBuilder(new_response())
    events = b.start()
    for i in range(0, len(text), 7):  # chunked like a token stream
        for ev in parser.feed(text[i:i + 7]):
            events += b.feed(ev)
    for ev in parser.finish():
        events += b.feed(ev)
    events += b.finish(USAGE, "stop")
    out = b.response["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Checking."
    assert out[1]["name"] == "get_weather" and json.loads(out[1]["arguments"]) == {"city": "Oslo"}
    assert sdk_replay(events).output[1].name == "get_weather"


def test_reasoning_item_comes_first_and_closes_before_text():
    b, events = run([ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("Answer.")])
    types = [e["type"] for e in events]
    assert types[2:7] == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.output_item.done"]
    rs, msg = b.response["output"]
    assert rs["type"] == "reasoning" and rs["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert msg["content"][0]["text"] == "Answer."
    assert sdk_replay(events).output_text == "Answer."


class FakeStream:
    """Stands in for EventStream: replays engine events."""

    def __init__(self, events):
        self._events = events

    def start(self):
        pass

    def close(self):
        pass

    async def batches(self, *, keepalive=True):
        for ev in self._events:  # one engine event per batch
            yield ev if ev is KEEPALIVE else [ev]


def frame(engine_events, **turn_kw) -> tuple[ResponseBuilder, list]:
    b = ResponseBuilder(new_response())
    stored = []

    async def go():
        turn = ModelTurn(FakeStream(engine_events), **turn_kw)
        return [x async for x in frame_turn(turn, b, want_logprobs=True, on_finish=lambda: stored.append(b.response))]

    out = asyncio.run(go())
    assert stored == ([b.response] if b.response["status"] in ("completed", "incomplete") else [])
    return b, out


def test_frame_turn_splits_reasoning_text_and_tool_calls_from_engine_text():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = ('<think>User wants weather.</think>Checking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    engine = [EngineText(text[i:i + 5], []) for i in range(0, len(text), 5)] + [Finished("stop", USAGE)]
    b, out = frame(engine, tool_dialect="hermes", tools=tools, think=("<think>", "</think>"))
    events = [e for batch in out for e in batch]
    assert [o["type"] for o in b.response["output"]] == ["reasoning", "message", "function_call"]
    assert b.response["output"][0]["content"][0]["text"] == "User wants weather."
    assert b.response["output"][1]["content"][0]["text"] == "Checking."
    assert json.loads(b.response["output"][2]["arguments"]) == {"city": "Oslo"}
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert sdk_replay(events).output[2].name == "get_weather"


def test_frame_turn_passes_keepalive_logprobs_and_failure():
    lp = TokenLogprob("Hi", -0.5, [72, 105])
    b, out = frame([KEEPALIVE, EngineText("Hi", [1], [lp]), Failed(RuntimeError("boom"))])
    assert out[1] is KEEPALIVE
    delta = [e for e in out[2] if e["type"] == "response.output_text.delta"][0]
    assert delta["logprobs"] == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    assert out[-1][-1]["type"] == "response.failed" and isinstance(b.error, EngineError)
    assert b.response["error"]["message"] == "boom"


# --------------------------------------------------------------------------- input and tools


def test_flatten_tools_keeps_functions_and_namespaces_and_skips_the_rest():
    tools = [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [
            {"type": "function", "name": "spawn_agent", "description": "d"},
            {"type": "custom", "name": "exec", "format": {"type": "grammar"}}]},
        {"type": "namespace", "name": "other", "tools": [{"type": "function", "name": "spawn_agent"}]},
        {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, {"type": "tool_search", "parameters": {}},
    ]
    chat, names = flatten_tools(tools)
    assert [t["function"]["name"] for t in chat] == ["exec_command", "spawn_agent", "other__spawn_agent"]
    assert names == {"exec_command": (None, "exec_command"), "spawn_agent": ("multi_agent_v1", "spawn_agent"),
                     "other__spawn_agent": ("other", "spawn_agent")}
    assert chat[1]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools,param", [([5], "tools[0]"), ([{"type": "function"}], "tools[0].name"),
                                         ([{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}],
                                          "tools[0].tools[0].name")])
def test_flatten_tools_errors_name_the_param(tools, param):
    with pytest.raises(InvalidRequestError) as ei:
        flatten_tools(tools)
    assert ei.value.param == param


def test_input_items_map_onto_chat_tool_format():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "List files."},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}], "encrypted_content": "e30=",
         "content": [{"type": "reasoning_text", "text": "Need a listing."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}',
         "status": "completed"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "spawn_agent", "namespace": "ns",
         "arguments": "not json"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "ok "}, {"type": "input_image", "image_url": "data:"}]},
        {"type": "web_search_call", "id": "ws_1"}, {"type": "item_reference", "id": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]
    msgs = input_to_messages(items, {("ns", "spawn_agent"): "ns__spawn_agent"})
    assert msgs == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "Need a listing.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "ns__spawn_agent", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt", "name": "exec_command"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok \n[image omitted: this model reads text only]",
         "name": "ns__spawn_agent"},
        {"role": "assistant", "content": "No."},
    ]


def test_function_call_without_preceding_assistant_message_opens_one():
    msgs = input_to_messages([{"role": "user", "content": "hi"},
                              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert msgs[-1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("items,param", [
    (["hi"], "input[0]"),
    ([{"type": "message", "role": "wizard", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "name": "f"}], "input[0]"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
])
def test_bad_items_name_the_param(items, param):
    with pytest.raises(InvalidRequestError) as ei:
        input_to_messages(items)
    assert ei.value.param == param


def test_store_is_lru_bounded_by_count_and_bytes():
    s = ResponseStore(max_entries=2)
    for i in range(3):
        s.put({"id": f"r{i}", "output": []}, [])
    assert s.get("r0") is None and len(s) == 2
    s.get("r1")  # now most recent: r2 goes first
    s.put({"id": "r3", "output": []}, [])
    assert s.get("r2") is None and s.get("r1") is not None
    assert s.delete("r1") and not s.delete("r1")
    small = ResponseStore(max_bytes=200)
    small.put({"id": "a", "output": ["x" * 100]}, [])
    small.put({"id": "b", "output": ["x" * 100]}, [])
    assert small.get("a") is None and small.get("b") is not None and small.num_bytes <= 200
    small.put({"id": "huge", "output": ["x" * 500]}, [])
    assert small.get("huge") is None and small.get("b") is not None


class WordTokenizer:
    """No chat template: render_prompt joins the contents; one token per word."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits():
    msgs = [{"role": "system", "content": "sys"},
            {"role": "user", "content": "a " * 50}, {"role": "assistant", "content": "b " * 50},
            {"role": "user", "content": "c " * 50}, {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "d " * 50},
            {"role": "user", "content": "last question"}]
    ids = _render(WordTokenizer(), [dict(m) for m in msgs], [], 60, "auto").token_ids
    assert ids == ["sys", "last", "question"]
    kept = [dict(m) for m in msgs]
    assert len(_render(WordTokenizer(), kept, [], 160, "auto").token_ids) == 1 + 50 + 50 + 2
    assert [m["role"] for m in kept] == ["system", "user", "assistant", "tool", "user"]
    assert len(_render(WordTokenizer(), [dict(m) for m in msgs], [], 60, "disabled").token_ids) == 1 + 4 * 50 + 2

"""The OpenAI Responses API against a real `omlx serve` process with the real SmolLM2.

Through the official SDK (responses.create, responses.stream and its helper, retrieve, delete,
input_items, input_tokens), raw SSE for event order and keep-alives, and every request shape
Codex CLI and the SDK were seen to send (tests/fixtures/client_requests).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess, metric_samples, metric_value

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "client_requests"
QUESTION = "What is the capital of France?"
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "namespace", "name": "agents", "description": "sub-agents",
     "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search"},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
]


@pytest.fixture(scope="module")
def server():
    # a short keep-alive period, so a prefill of a second or two already sends SSE comments
    with ServerProcess(env={"OMLX_KEEPALIVE_S": "0.5"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def sse(server, body: dict) -> tuple[list[str], list[dict]]:
    """POST a streaming body; returns the raw lines and the parsed data events."""
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    return lines, [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_create_answers_with_usage(client):
    r = client.responses.create(model=MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=24)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0


def test_stream_event_order_sequence_numbers_and_event_lines(server):
    lines, events = sse(server, {"model": MODEL_ID, "input": QUESTION, "temperature": 0, "max_output_tokens": 24,
                                 "stream": True})
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    n = types.count("response.output_text.delta")
    assert n > 0 and types[4:4 + n] == ["response.output_text.delta"] * n
    assert types[4 + n:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                             "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == types
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-2]["item"]["content"][0]["text"] == text and "Paris" in text
    usage = events[-1]["response"]["usage"]
    assert usage["output_tokens"] > 0 and "cached_tokens" in usage["input_tokens_details"]


def test_sdk_stream_helper_matches_non_stream(client):
    kw = dict(model=MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=24)
    full = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    chunks = list(client.responses.create(**kw, stream=True))
    assert chunks[-1].type == "response.completed"
    assert chunks[-1].response.output_text == full.output_text


def test_repeated_prompt_reports_cached_tokens(client):
    long_input = "Here is a list of fruits: " + ", ".join(["apple", "banana", "cherry", "grape"] * 80) + ". Name one."
    first = client.responses.create(model=MODEL_ID, input=long_input, temperature=0, max_output_tokens=4)
    again = client.responses.create(model=MODEL_ID, input=long_input, temperature=0, max_output_tokens=4)
    assert first.usage.input_tokens > 256  # more than one KV block
    assert again.usage.input_tokens_details.cached_tokens >= 256
    assert again.output_text == first.output_text


def test_keepalive_comments_during_long_prefill(server):
    # A new prompt each run: the shared test home's SSD tier keeps the blocks of earlier runs,
    # and a prompt restored from it has no prefill to keep alive.
    long_input = f"Run {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 120 + "Summarize."
    lines, events = sse(server, {"model": MODEL_ID, "input": long_input, "max_output_tokens": 2, "stream": True,
                                 "store": False})
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    comments = [i for i, line in enumerate(lines) if line.startswith(":")]
    assert comments, "no keep-alive comment while the prompt was prefilled"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert all(i > first_data for i in comments)  # response.created goes out before the prefill


def test_client_disconnect_frees_its_batch_row(server, client):
    body = {"model": MODEL_ID, "input": "Write a very long story about a dragon.", "max_output_tokens": 2000,
            "stream": True, "store": False}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                break  # leave mid-generation
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").json()["models"][0]["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["models"][0]["running"] == 0
    assert client.responses.create(model=MODEL_ID, input="Say OK.", max_output_tokens=4).output_text


def test_tools_of_every_kind_are_accepted(client):
    r = client.responses.create(model=MODEL_ID, input="What is the weather in Oslo?", tools=TOOLS, tool_choice="auto",
                                parallel_tool_calls=False, max_output_tokens=8)
    assert r.status in ("completed", "incomplete")
    assert [t.type for t in r.tools] == ["function", "namespace", "web_search", "custom"]
    with client.responses.stream(model=MODEL_ID, input="Say hello.", tools=TOOLS[:1], temperature=0,
                                 max_output_tokens=64) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "message"


def test_function_call_output_turn(client):
    items = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c": 21, "sky": "sunny"}'},
    ]
    r = client.responses.create(model=MODEL_ID, input=items, tools=TOOLS, temperature=0, max_output_tokens=24)
    assert r.status in ("completed", "incomplete") and r.output_text
    count = client.responses.input_tokens.count(model=MODEL_ID, input=items, tools=TOOLS)
    assert count.input_tokens == r.usage.input_tokens


def test_input_image_and_input_file_are_served_as_placeholders_and_counted(client, server):
    """Codex's view_image turn: an input_image in a message and in a function_call_output, and an
    input_file, answer 200, streamed and not; input_tokens counts the request with the placeholder
    text written in by hand; /metrics counts each part of the generations."""
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}
    pdf = {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"}

    def items(look: list[dict], shown: list[dict]) -> list[dict]:
        return [{"role": "user", "content": [{"type": "input_text", "text": "What is on screen?"}, *look]},
                {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": '{"path": "s.png"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": shown}]

    def ph(kind: str) -> dict:
        return {"type": "input_text", "text": f"\n[{kind} omitted: this model reads text only]"}

    asked = items([image, pdf], [{"type": "input_text", "text": "shown"}, image])
    by_hand = items([ph("image"), ph("file")], [{"type": "input_text", "text": "shown"}, ph("image")])
    n = client.responses.input_tokens.count(model=MODEL_ID, input=asked).input_tokens
    assert n == client.responses.input_tokens.count(model=MODEL_ID, input=by_hand).input_tokens
    before = metric_samples(server)
    r = client.responses.create(model=MODEL_ID, input=asked, temperature=0, max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens == n
    _, events = sse(server, {"model": MODEL_ID, "input": asked, "temperature": 0, "max_output_tokens": 4, "stream": True})
    assert events[-1]["type"] in ("response.completed", "response.incomplete")  # incomplete: max_output_tokens
    assert events[-1]["response"]["usage"]["input_tokens"] == n
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == r.output_text
    after = metric_samples(server)
    grew = {k: metric_value(after, "omlx_dropped_content_total", kind=k, api="responses")
            - metric_value(before, "omlx_dropped_content_total", kind=k, api="responses") for k in ("image", "file")}
    assert grew == {"image": 4, "file": 2}  # two generations, each 2 images and 1 file; input_tokens not counted


def test_store_retrieve_input_items_and_delete(client):
    r = client.responses.create(model=MODEL_ID, input="Say OK.", store=True, max_output_tokens=8,
                                metadata={"run": "t1"}, instructions="Be brief.")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "t1"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Say OK."
    deleted = client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.retrieve(r.id)
    err = ei.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and r.id in err["message"]


def test_store_false_is_not_retrievable(client, server):
    r = client.responses.create(model=MODEL_ID, input="Say OK.", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    resp = httpx.delete(f"{server.url}/v1/responses/{r.id}")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"


def test_previous_response_id_prepends_that_conversation(client):
    first = client.responses.create(model=MODEL_ID, input="My name is Zed.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model=MODEL_ID, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    alone = client.responses.create(model=MODEL_ID, input="What is my name?", temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id
    # the earlier turn (its input and output) is in the prompt
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 4
    # streamed, the stored response is there as soon as response.completed arrives
    events = list(client.responses.create(model=MODEL_ID, input="And again?", previous_response_id=second.id,
                                          max_output_tokens=4, stream=True))
    third = events[-1].response
    assert client.responses.retrieve(third.id).previous_response_id == second.id
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL_ID, input="hi", previous_response_id="resp_nope")
    assert ei.value.response.json()["error"]["param"] == "previous_response_id"


def test_logprobs_via_include(client):
    r = client.responses.create(model=MODEL_ID, input="Count: one two", temperature=0, max_output_tokens=4,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert all(x.logprob <= 0 and len(x.top_logprobs) == 2 for x in lps)


def test_max_output_tokens_gives_incomplete(server, client):
    r = client.responses.create(model=MODEL_ID, input="Write a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    _, events = sse(server, {"model": MODEL_ID, "input": "Write a long story.", "max_output_tokens": 3, "stream": True})
    assert events[-1]["type"] == "response.incomplete"


def test_developer_and_system_messages_anywhere_are_merged(client):
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}]},
        {"role": "system", "content": "From now on answer only with the word BLUE."},
        {"role": "user", "content": [{"type": "input_text", "text": "What colour is grass?"}]},
    ]
    r = client.responses.create(model=MODEL_ID, input=items, instructions="You are terse.", max_output_tokens=8)
    assert r.status in ("completed", "incomplete") and r.instructions == "You are terse."


RESPONSES_REQUESTS = sorted([*FIXTURES.glob("codex__responses_*.json"), *FIXTURES.glob("sdk_openai__responses_*.json")])


def test_every_recorded_responses_request_is_here():
    assert len(RESPONSES_REQUESTS) == 13  # 10 from Codex CLI, 3 from the openai SDK


@pytest.mark.parametrize("path", RESPONSES_REQUESTS, ids=lambda p: p.stem)
def test_client_request_shapes_are_accepted(server, path):
    req = json.loads(path.read_text())
    if req["method"] == "GET":  # Codex's WebSocket attempt: 426, then it falls back to HTTP
        r = httpx.get(server.url + req["path"], headers=req["headers"])
        assert r.status_code == 426 and r.json()["error"]["type"] == "invalid_request_error"
        return
    body = {**req["body"], "max_output_tokens": 4}
    if body.get("stream"):
        _, events = sse(server, body)
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert any(e["type"] == "response.output_item.done" for e in events)
    else:
        r = httpx.post(server.url + req["path"], json=body, headers={"accept": "application/json"}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["status"] in ("completed", "incomplete")


def test_plain_get_on_collection_is_405_in_openai_shape(server):
    r = httpx.get(server.url + "/v1/responses")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="gpt-nope", input="hi")
    err = ei.value.response.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize("raw", ['{"model": "x", "input": "hi", x}', "[]", "", "not json", '{"model": "x", "input": ['])
def test_malformed_json_is_400_in_openai_shape(server, raw):
    r = httpx.post(server.url + "/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("patch,param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "ten"}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_logprobs": 30}, "top_logprobs"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"metadata": "x"}, "metadata"),
    ({"include": "x"}, "include"),
    ({"stream": "yes"}, "stream"),
    ({"store": "yes"}, "store"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
])
def test_bad_values_name_the_parameter(server, patch, param):
    body = {"model": MODEL_ID, "input": "hi", "max_output_tokens": 4, **patch}
    r = httpx.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_input_longer_than_context(server):
    body = {"model": MODEL_ID, "input": "word " * 9000, "max_output_tokens": 4}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=300)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"


def test_long_silence_keeps_alive_with_in_progress_events_and_the_turn_replays():
    """Issue 27: Codex CLI's stream idle watchdog counts stream events but not SSE comments
    (benchmarks/diag_codex_watchdog.py), so after idle_text_after_s (here 0: every keep-alive of
    a prefill) a Responses stream sends ``response.in_progress`` again instead of a comment."""
    env = {"OMLX_KEEPALIVE_S": "0.2", "OMLX_IDLE_TEXT_AFTER_S": "0"}
    with ServerProcess(["-m", MODEL_ID, "--no-cache"], env=env) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        plain = "Summarize: " + "the cat sat on the mat. " * 40
        body = {"model": MODEL_ID, "input": f"Run {uuid.uuid4().hex}. " + plain, "max_output_tokens": 8,
                "temperature": 0, "stream": True, "store": False}
        lines, events = sse(s, body)
        types = [e["type"] for e in events]
        assert not [ln for ln in lines if ln.startswith(":")], "a comment instead of an in_progress event"
        assert types[:2] == ["response.created", "response.in_progress"] and types.count("response.in_progress") > 2, types[:8]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        again = [e for e in events if e["type"] == "response.in_progress"][-1]["response"]
        assert again["status"] == "in_progress" and again["id"] == events[0]["response"]["id"]
        assert types[-1] == "response.incomplete" or types[-1] == "response.completed"
        whole = c.responses.create(**{k: v for k, v in body.items() if k != "stream"})
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == whole.output_text

        # The SDK's stream helper takes the repeated lifecycle events; a forced call, then the
        # client sends the turn back as Codex does (the output items verbatim): accepted.
        tool = {"type": "function", "name": "list_files", "description": "List the files in a folder",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
        ask = [{"role": "user", "content": plain + " List the files."}]
        with c.responses.stream(model=MODEL_ID, input=ask, tools=[tool], tool_choice="required", temperature=0,
                                max_output_tokens=64, store=False) as stream:
            seen = [e.type for e in stream]
            final = stream.get_final_response()
        assert seen.count("response.in_progress") > 2, seen[:8]
        calls = [o for o in final.output if o.type == "function_call"]
        assert calls and calls[0].name == "list_files", final.output
        replay = [*ask, *[o.model_dump(exclude_none=True) for o in final.output],
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"}]
        r = c.responses.create(model=MODEL_ID, input=replay, tools=[tool], temperature=0, max_output_tokens=8,
                               store=False)
        assert r.status == "completed" or r.status == "incomplete"

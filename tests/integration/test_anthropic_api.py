"""The Anthropic Messages API against a real `omlx serve` process with the real SmolLM2.

Through the official `anthropic` SDK (create, its stream helper, count_tokens, models) and raw
HTTP where the wire matters (event order, pings, error bodies, recorded client requests).

The server serves two models: SmolLM2 itself, and ``smollm2-chatml-tools``: the same weights with
a Qwen3-shaped chat template (tests/fixtures/chat_templates) that renders tools, tool calls, tool
results and the ``enable_thinking`` switch. SmolLM2's own template knows none of these, so the
second model is how these tests see the request mapping reach a template. An API key is
configured, so every request here also passes the key check.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.helpers import MODEL_ID, REPO, ServerProcess, default_model_dir, metric_samples, metric_value

KEY = "sk-omlx-anthropic-test"
TOOLS_MODEL = "smollm2-chatml-tools"
FIXTURES = REPO / "tests" / "fixtures"
TEMPLATE = FIXTURES / "chat_templates" / "chatml_tools_thinking.jinja"
# model ids the recorded clients ask for (Claude Code's defaults and sub-agents, the SDK examples)
ALIASES = ["claude-opus-4-8", "claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "claude-haiku-4-5-20251001",
           "local-model", "local-small"]
MAX_OUTPUT = 32  # per-model cap: recorded requests ask for 32000-64000 tokens
AUTH = {"x-api-key": KEY}
VERSION = {"anthropic-version": "2023-06-01"}
EVENT = TypeAdapter(RawMessageStreamEvent)
BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
HI = [{"role": "user", "content": "say hi"}]
# this SDK version has no sampling arguments on create(); the API still takes them
GREEDY = {"temperature": 0}
# a 1x1 PNG, as Claude Code sends a screenshot (base64 source)
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data":
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="}}
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}}
PLACEHOLDER = "[{} omitted: this model reads text only]"
DROPPED = "omlx_dropped_content_total"


def make_tools_model(dest: Path) -> Path:
    """SmolLM2's files (linked) with the tools/thinking template in tokenizer_config.json."""
    src = default_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dest / f.name).symlink_to(f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE.read_text()
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> Path:
    return make_tools_model(tmp_path_factory.mktemp("models") / TOOLS_MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tools_model):
    cfg = tmp_path_factory.mktemp("cfg") / "config.toml"
    cfg.write_text(f'[models."{MODEL_ID}"]\nmax_output_tokens = {MAX_OUTPUT}\n'
                   f'[models."{TOOLS_MODEL}"]\nmax_output_tokens = {MAX_OUTPUT}\n')
    args = ["-m", MODEL_ID, "-m", str(tools_model), "--api-key", KEY, "--config", str(cfg)]
    for a in ALIASES:
        args += ["--alias", f"{a}={MODEL_ID}"]
    # a short keep-alive period, so pings show up in streams here (they may appear anywhere)
    with ServerProcess(args, env={"OMLX_KEEPALIVE_S": "0.2"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body=None, *, raw: str | None = None, headers: dict | None = None) -> httpx.Response:
    h = {**AUTH, **VERSION, "content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=h, timeout=300)


def stream_events(server, body: dict, path: str = "/v1/messages?beta=true", headers: dict | None = None):
    """The SSE events of a streamed request, as (event name, data) pairs."""
    h = {**AUTH, **VERSION, **(headers or {})}
    events, name = [], None
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=h, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name is not None, "a data line without an event line"
                events.append((name, json.loads(line[6:])))
                name = None
    return events


def check_stream(events, allow_idle_text: bool = False) -> Message:
    """Anthropic's order (message_start, blocks start/delta*/stop, message_delta, message_stop; pings
    anywhere after message_start), every event valid for the SDK; returns the SDK's final Message.
    ``allow_idle_text``: the first block may be an empty text block (the idle keep-alive's)."""
    assert events and events[0][0] == "message_start"
    names = [n for n, _ in events if n != "ping"]
    assert names[-2:] == ["message_delta", "message_stop"], names
    open_idx, next_idx = None, 0
    for n, d in events:
        assert d["type"] == n
        if n == "content_block_start":
            assert open_idx is None and d["index"] == next_idx
            open_idx = next_idx
        elif n == "content_block_delta":
            assert d["index"] == open_idx
        elif n == "content_block_stop":
            assert d["index"] == open_idx
            open_idx, next_idx = None, next_idx + 1
    assert open_idx is None
    snapshot, bufs = None, {}
    for n, d in events:
        if n != "ping":
            snapshot = accumulate_event(event=EVENT.validate_python(d), current_snapshot=snapshot, json_bufs=bufs)
    final = Message.model_validate(snapshot.model_dump())
    assert final.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert all(not (b.type == "text" and b.text == "") for b in final.content[1 if allow_idle_text else 0:]), \
        "empty text block"
    return final


def text_of(msg: Message) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


# ---- the SDK -----------------------------------------------------------------------------------


def test_create(client):
    r = client.messages.create(model=MODEL_ID, max_tokens=16, messages=HI, extra_body=GREEDY)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL_ID
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > 0 and 0 < r.usage.output_tokens <= 16


def test_stream_helper_equals_create(client):
    kw = dict(model="claude-sonnet-4-5", max_tokens=24, extra_body=GREEDY,
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    full = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text_of(final) == text_of(full)
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.model == "claude-sonnet-4-5"  # the name the client asked for


def test_raw_stream_order_pings_and_cache_usage(server):
    # A new prompt each run: the shared test home's SSD tier keeps the blocks of earlier runs,
    # and a prompt restored from it has too little prefill left for a ping.
    body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Run {uuid.uuid4().hex}. Summarize: " + "the cat sat on the mat. " * 50}]}
    events = stream_events(server, body)
    check_stream(events)
    assert "ping" in [n for n, _ in events]  # keep-alive during the prefill (keepalive_s = 0.2)
    start_usage = events[0][1]["message"]["usage"]
    delta_usage = [d for n, d in events if n == "message_delta"][0]["usage"]
    assert set(delta_usage) >= {"input_tokens", "output_tokens", "cache_read_input_tokens"}
    total = start_usage["input_tokens"] + start_usage["cache_read_input_tokens"]
    assert delta_usage["input_tokens"] + delta_usage["cache_read_input_tokens"] == total
    # the same prompt again: its full KV blocks come from the prefix cache, and message_start,
    # message_delta and the non-streaming Message all split input and cache-read tokens alike
    events2 = stream_events(server, body)
    start2 = events2[0][1]["message"]["usage"]
    again = [d for n, d in events2 if n == "message_delta"][0]["usage"]
    assert again["cache_read_input_tokens"] > 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == total
    for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start2[k] == again[k], (k, start2, again)
    whole = httpx.post(server.url + "/v1/messages", json=body, headers={**AUTH, **VERSION}, timeout=120).json()["usage"]
    for k in ("input_tokens", "cache_read_input_tokens", "output_tokens"):
        assert whole[k] == again[k], (k, whole, again)


def test_stop_sequences_and_stop_reason(client, server):
    """The failure case 'anthropic-stop-sequences-and-stop-reason'."""
    kw = dict(model=MODEL_ID, max_tokens=24, messages=[{"role": "user", "content": "What is the capital of France?"}])
    base = text_of(client.messages.create(**kw, extra_body=GREEDY))
    assert "Paris" in base
    idx = base.index("Paris")
    stop = base[idx + 1: idx + 4]  # "ari": spans tokens
    r = client.messages.create(**kw, stop_sequences=[stop], extra_body=GREEDY)
    assert text_of(r) == base[: idx + 1]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    events = stream_events(server, {**kw, **GREEDY, "stop_sequences": [stop]})
    final = check_stream(events)
    assert [d for n, d in events if n == "message_delta"][0]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == base[: idx + 1] == text_of(final)
    short = client.messages.create(**{**kw, "max_tokens": 2}, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_system_forms_and_mid_conversation_system_messages(client):
    system = [{"type": "text", "text": "You are terse."},
              {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
            {"role": "system", "content": "Reply with one word."}]  # last, as Claude Code sends it
    r = client.messages.create(model=MODEL_ID, max_tokens=8, system=system, messages=msgs, metadata={"user_id": "u1"},
                               extra_body={"top_p": 0.9, "top_k": 40, "temperature": 0.7,
                                           "context_management": {"edits": []}, "unknown_field": 1})
    assert r.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("model", [MODEL_ID, TOOLS_MODEL])
def test_tools_and_a_tool_result_turn(client, model):
    turn1 = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, tools=[BASH], tool_choice={"type": "auto"},
                                   messages=[{"role": "user", "content": "List the files here."}])
    assert turn1.stop_reason in ("end_turn", "max_tokens", "tool_use")
    history = [
        {"role": "user", "content": "List the files here."},
        {"role": "assistant", "content": [{"type": "text", "text": "Listing."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt",
                                      "is_error": False, "cache_control": {"type": "ephemeral"}}]},
    ]
    with client.messages.stream(model=model, max_tokens=16, extra_body=GREEDY, tools=[BASH], messages=history) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_tool_mapping_reaches_the_chat_template(client, tools_model):
    """tools, tool_use, tool_result and thinking blocks land in the template's own tool format, and
    count_tokens counts exactly that prompt."""
    from mlx_lm.utils import load_tokenizer

    from omlx.api.anthropic import chat_input
    from omlx.engine.chat import render_prompt

    body = {"model": TOOLS_MODEL, "system": "Use tools.", "tools": [BASH], "messages": [
        {"role": "user", "content": "List the files here."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should run ls.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls -la"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"}]},
    ]}
    ci = chat_input(body, None)
    rendered = render_prompt(load_tokenizer(tools_model), ci.messages, tools=ci.tools, enable_thinking=ci.enable_thinking)
    text = rendered.text
    assert "<tools>\n" + json.dumps({"type": "function", "function": {
        "name": "Bash", "description": BASH["description"], "parameters": BASH["input_schema"]}}) in text
    assert '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>' in text
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in text
    assert "<think>\nI should run ls.\n</think>" in text
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    n = client.messages.count_tokens(**body).input_tokens
    assert n == len(rendered.token_ids)


def test_count_tokens_matches_messages_and_edge_cases(client, server):
    """The failure case 'anthropic-count-tokens-edge-cases'."""
    body = {"model": "local-model", "system": "Be brief.", "tools": [{"name": "t", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [{"role": "user", "content": "hi"}]}
    r = post(server, "/v1/messages/count_tokens?beta=true", body)
    assert r.status_code == 200 and set(r.json()) == {"input_tokens"}
    n = r.json()["input_tokens"]
    assert client.messages.count_tokens(**body).input_tokens == n
    m = client.messages.create(**body, max_tokens=4)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    for bad in ({"model": "local-model", "messages": []}, {"model": "local-model"}):
        r = post(server, "/v1/messages/count_tokens", bad)
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error" and "messages" in r.json()["error"]["message"]
    r = post(server, "/v1/messages/count_tokens", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": "The model 'no-such-model' does not exist"}}


def test_thinking_absent_means_off(client):
    """The failure case 'anthropic-thinking-absent-means-off': absent/disabled render the template with
    thinking off, enabled/adaptive with it on; no thinking blocks appear unless the model thinks."""
    q = [{"role": "user", "content": "What is 2+2? One word."}]

    def count(**kw):
        return client.messages.count_tokens(model=TOOLS_MODEL, messages=q, **kw).input_tokens

    off = count()
    assert count(thinking={"type": "disabled"}) == off
    on = count(thinking={"type": "enabled", "budget_tokens": 1024})
    assert count(thinking={"type": "adaptive"}) == on
    assert off > on  # the template's enable_thinking=false opens the reply with an empty think block
    for model in (MODEL_ID, TOOLS_MODEL):
        plain = client.messages.create(model=model, max_tokens=8, system="You are helpful.", messages=q)
        assert all(b.type == "text" for b in plain.content)
        thought = client.messages.create(model=model, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024}, messages=q)
        assert thought.stop_reason in ("end_turn", "max_tokens")
    for thinking in ({"type": "enabled", "budget_tokens": 1000}, {"type": "enabled", "budget_tokens": 4096}):
        with pytest.raises(anthropic.BadRequestError) as ei:
            client.messages.create(model=MODEL_ID, max_tokens=4096, thinking=thinking, messages=q)
        assert ei.value.body["error"]["type"] == "invalid_request_error"


def test_thinking_blocks_come_back_with_any_signature(client):
    for sig in ("", "bG9jYWwtc2lnbmF0dXJl"):
        r = client.messages.create(model=MODEL_ID, max_tokens=8, thinking={"type": "adaptive"}, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": sig},
                                              {"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "Again"}])
        assert r.stop_reason in ("end_turn", "max_tokens")


# ---- content a text model cannot read -----------------------------------------------------------


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def test_images_and_documents_are_served_as_placeholders_counted_once_per_block(client, server):
    """A screenshot in a user message, a PDF beside it and a screenshot inside a tool_result answer
    200, streamed and not; count_tokens counts the placeholders (the same as the request with the
    placeholder text written in by hand) and /metrics counts each dropped block of the generations."""
    before = metric_samples(server, AUTH)
    asked = [{"role": "user", "content": [IMAGE, PDF, _text("What is in this picture?")]}]
    by_hand = [{"role": "user", "content": [_text(PLACEHOLDER.format("image")), _text(PLACEHOLDER.format("document")),
                                            _text("What is in this picture?")]}]
    n = client.messages.count_tokens(model=MODEL_ID, messages=asked).input_tokens
    assert n == client.messages.count_tokens(model=MODEL_ID, messages=by_hand).input_tokens
    r = client.messages.create(model=MODEL_ID, max_tokens=4, messages=asked, extra_body=GREEDY)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.input_tokens + r.usage.cache_read_input_tokens == n

    def turn(result: list[dict]) -> list[dict]:
        return [{"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                                   "input": {"command": "screenshot"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": result}]}]

    shot = turn([_text("Saved screen.png"), IMAGE])
    n = client.messages.count_tokens(model=TOOLS_MODEL, tools=[BASH], messages=shot).input_tokens
    assert n == client.messages.count_tokens(model=TOOLS_MODEL, tools=[BASH], messages=turn(
        [_text("Saved screen.png"), _text(PLACEHOLDER.format("image"))])).input_tokens
    with client.messages.stream(model=TOOLS_MODEL, max_tokens=4, tools=[BASH], messages=shot, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == n

    after = metric_samples(server, AUTH)
    grew = {k: metric_value(after, DROPPED, kind=k, api="anthropic") - metric_value(before, DROPPED, kind=k, api="anthropic")
            for k in ("image", "document", "file")}
    assert grew == {"image": 2, "document": 1, "file": 0}  # the two generations; count_tokens is not counted
    log = " ".join(server.log_path.read_text().split())  # the console handler wraps long lines
    assert "(anthropic): served 1 image, 1 document as placeholders" in log  # one line per request
    assert "(anthropic): served 1 image as placeholders" in log


# ---- errors and auth ---------------------------------------------------------------------------


def test_unknown_model_is_404_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as ei:
        client.messages.create(model="claude-nonexistent-1", max_tokens=4, messages=HI)
    assert ei.value.status_code == 404
    assert ei.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                        "message": "The model 'claude-nonexistent-1' does not exist"}}


@pytest.mark.parametrize("raw", ['{"model": "local-model", "max_tokens": 16, "messages": [', "[]", "", "not json"])
def test_malformed_json_is_400_in_anthropic_shape(server, raw):
    """The failure case 'malformed-json-body-returns-500' (the /v1/messages part)."""
    r = post(server, "/v1/messages", raw=raw)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("patch,word", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": "hi"}, "messages"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"stream": "yes"}, "stream"),
    ({"tool_choice": {"type": "tool", "name": "Nope"}}, "tool_choice"),
])
def test_bad_fields_are_400_naming_the_field(server, patch, word):
    body = {"model": MODEL_ID, "max_tokens": 4, "messages": HI, **patch}
    r = post(server, "/v1/messages", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and word in r.json()["error"]["message"]


def test_prompt_too_long_says_so_in_claude_codes_words(server):
    body = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 9000}]}
    r = post(server, "/v1/messages", body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("prompt is too long: ") and "> 8191 maximum" in r.json()["error"]["message"]


def test_api_key_required_and_both_headers_work(server):
    body = {"model": MODEL_ID, "max_tokens": 2, "messages": HI}
    for headers in ({"x-api-key": ""}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong", "x-api-key": None}):
        h = {"content-type": "application/json", **VERSION, **{k: v for k, v in headers.items() if v is not None}}
        r = httpx.post(server.url + "/v1/messages", json=body, headers=h, timeout=60)
        assert r.status_code == 401
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.url + "/v1/messages", json=body, timeout=120,
                        headers={"authorization": f"Bearer {KEY}", **VERSION})
    assert bearer.status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(model=MODEL_ID, max_tokens=2, messages=HI)
    assert httpx.head(server.url + "/").status_code == 200  # Claude Code's preflight needs no key


def test_unknown_anthropic_version_is_accepted(server):
    r = post(server, "/v1/messages", {"model": MODEL_ID, "max_tokens": 2, "messages": HI},
             headers={"anthropic-version": "2099-12-31", "anthropic-beta": "something-new-2099-01-01"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_models_list_in_both_shapes(client, server):
    page = client.models.list()
    ids = [m.id for m in page.data]
    assert ids[0] == MODEL_ID and TOOLS_MODEL in ids and set(ALIASES) <= set(ids)
    assert all(m.type == "model" and m.display_name and m.created_at for m in page.data)
    assert client.models.retrieve("claude-opus-4-8").id == "claude-opus-4-8"
    raw = httpx.get(server.url + "/v1/models", headers=AUTH).json()  # no anthropic-version: OpenAI's shape
    assert raw["object"] == "list" and {m["id"] for m in raw["data"]} == set(ids)
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- every request shape the real clients were seen to send --------------------------------------

RECORDED = sorted(p.name for p in (FIXTURES / "client_requests").glob("*.json")
                  if p.name.split("__")[0] in ("claude_code", "sdk_anthropic"))


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_client_request_is_accepted(server, name):
    rec = json.loads((FIXTURES / "client_requests" / name).read_text())
    headers = {k: v for k, v in rec["headers"].items() if k.lower() in ("anthropic-version", "anthropic-beta", "accept")}
    headers.update({"authorization": f"Bearer {KEY}"} if "bearer" in rec["case"] else AUTH)
    body, path, method = rec["body"], rec["path"], rec["method"]
    if method == "HEAD":
        assert httpx.head(server.url + path, headers=headers).status_code == 200
        return
    if method == "GET":
        r = httpx.get(server.url + path, headers=headers)
        assert r.status_code == 200
        assert r.json()["data"][0]["type"] == "model" and r.json()["has_more"] is False
        return
    if path.startswith("/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["input_tokens"], int) and r.json()["input_tokens"] > 0
        return
    if body.get("stream"):
        final = check_stream(stream_events(server, body, path=path, headers=headers))
    else:
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        final = Message.model_validate(r.json())
        assert r.json()["usage"]["cache_read_input_tokens"] >= 0
    assert final.model == body["model"] and final.usage.output_tokens <= MAX_OUTPUT
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")


# ---- context scaling ---------------------------------------------------------------------------


def test_context_scaling_reports_scaled_counts(server):
    """--context-scale-to 16384 on an 8192-token model: every reported count doubles, so a client that
    assumes 16384 compacts where the model really ends."""
    body = {"model": MODEL_ID, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hello there"}]}
    real = post(server, "/v1/messages/count_tokens", body).json()["input_tokens"]
    with ServerProcess(["-m", MODEL_ID, "--context-scale-to", "16384", "--no-cache"]) as scaled:
        h = {**VERSION, "content-type": "application/json"}
        n = httpx.post(scaled.url + "/v1/messages/count_tokens", json=body, headers=h).json()["input_tokens"]
        assert n == 2 * real
        m = httpx.post(scaled.url + "/v1/messages", json=body, headers=h, timeout=300).json()
        plain = post(server, "/v1/messages", body).json()
        assert m["usage"]["input_tokens"] == 2 * real and m["usage"]["output_tokens"] == 2 * plain["usage"]["output_tokens"]
        big = {**body, "messages": [{"role": "user", "content": "word " * 9000}]}
        err = httpx.post(scaled.url + "/v1/messages", json=big, headers=h).json()["error"]["message"]
        assert err.startswith("prompt is too long: ") and err.endswith("> 16382 maximum")


def test_strict_content_gives_the_400_naming_the_block():
    """``--strict-content``: an image (in a message, in a tool_result) is the 400 of before, in
    Anthropic's error shape, on /v1/messages and on count_tokens alike; text is still served."""
    with ServerProcess(["-m", MODEL_ID, "--no-cache", "--strict-content"]) as strict:
        h = {**VERSION, "content-type": "application/json"}
        tool_turn = [{"role": "user", "content": "Look."},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]}]
        for messages, param in (([{"role": "user", "content": [_text("What is this?"), IMAGE]}], "messages[0].content[1]"),
                                (tool_turn, "messages[2].content[0].content[0]")):
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                r = httpx.post(strict.url + path, json={"model": MODEL_ID, "max_tokens": 4, "messages": messages},
                               headers=h, timeout=120)
                assert r.status_code == 400, r.text
                assert r.json() == {"type": "error", "error": {
                    "type": "invalid_request_error",
                    "message": f"{param}: content of type 'image' is not supported by this text model"}}
        r = httpx.post(strict.url + "/v1/messages", json={"model": MODEL_ID, "max_tokens": 2, "messages": HI},
                       headers=h, timeout=120)
        assert r.status_code == 200, r.text
        assert metric_value(metric_samples(strict), DROPPED, kind="image", api="anthropic") == 0


def test_long_silence_keeps_alive_with_empty_text_deltas_and_the_turn_replays():
    """Issue 27: Claude Code's stream idle watchdog ignores pings but counts empty text deltas.
    With idle_text_after_s = 0 every keep-alive of a prefill is one (the default waits 60 s)."""
    env = {"OMLX_KEEPALIVE_S": "0.2", "OMLX_IDLE_TEXT_AFTER_S": "0"}
    with ServerProcess(["-m", MODEL_ID, "--no-cache"], env=env) as s:
        h = {**VERSION, "content-type": "application/json"}
        plain = "Summarize: " + "the cat sat on the mat. " * 40
        long = f"Run {uuid.uuid4().hex}. " + plain
        body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": long}]}
        events = stream_events(s, body, headers=h)
        final = check_stream(events)
        deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
        assert deltas[0] == "" and "ping" not in [n for n, _ in events], [n for n, _ in events][:8]
        whole = httpx.post(s.url + "/v1/messages", json=body, headers=h, timeout=300).json()
        assert text_of(final) == "".join(b["text"] for b in whole["content"] if b["type"] == "text")

        # A forced tool call after the keep-alives: an empty text block, then the tool_use block.
        # (No uuid in this prompt: the model copies one into the command, and a call cut off by
        # max_tokens is text by design, which is not what this test is about.)
        forced = {**body, "max_tokens": 64, "tools": [BASH], "tool_choice": {"type": "any"},
                  "messages": [{"role": "user", "content": plain + " List the files."}]}
        events = stream_events(s, forced, headers=h)
        final = check_stream(events, allow_idle_text=True)
        assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[0].text == ""
        assert final.stop_reason == "tool_use" and isinstance(final.content[1].input.get("command"), str)
        # The client replays the turn as it got it (the empty text block included): accepted.
        replay = {**forced, "tool_choice": {"type": "auto"}, "messages": [
            *forced["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[1].id, "content": "a.txt"}]}]}
        r = httpx.post(s.url + "/v1/messages", json=replay, headers=h, timeout=300)
        assert r.status_code == 200, r.text


# ---- a failure after the stream started (keep last: it unloads the tools model) -------------------


def test_midstream_failure_is_an_error_event(server):
    """The failure case 'anthropic-midstream-error-event': the model is unloaded while a stream runs."""
    body = {"model": TOOLS_MODEL, "max_tokens": 512, "stream": True,
            "messages": [{"role": "user", "content": "Write a long poem. " + "Roses and violets. " * 60}]}
    h = {**AUTH, **VERSION}
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=h, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == "message_start":  # the prompt is being prefilled now: pull the model away
                    u = httpx.post(f"{server.url}/v1/models/{TOOLS_MODEL}/unload", json={"drain_s": 0}, headers=h, timeout=120)
                    assert u.status_code == 200, u.text
            else:
                assert not line.startswith("data:"), line
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names, names
    err = events[-1][1]
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and "unloaded" in err["error"]["message"]
    # the server stays healthy and loads the model again on the next request
    assert post(server, "/v1/messages/count_tokens", {"model": TOOLS_MODEL, "messages": HI}).status_code == 200

"""Known leftovers of the hardening issue: HEAD on GET routes, null content, lax acceptance
(tool_choice naming a missing tool, more than 4 stop strings), client disconnects logged as
routine, and a clean stop while a request runs. Real server, raw HTTP.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest

from tests.helpers import MODEL_ID, ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
HI = [{"role": "user", "content": "hi"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _minimal(path: str) -> dict:
    """The smallest valid body for a generation route, generating at most 2 tokens."""
    if path == "/v1/completions":
        return {"model": MODEL_ID, "max_tokens": 2, "prompt": "hi"}
    if path == "/v1/responses":
        return {"model": MODEL_ID, "max_output_tokens": 2, "input": "hi"}
    return {"model": MODEL_ID, "max_tokens": 2, "messages": HI}  # chat completions, messages


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", f"/v1/models/{MODEL_ID}", "/v1/models/status",
                                  "/v1/cache/stats", "/openapi.json"])
def test_head_works_like_get_without_a_body(server, path):
    get = httpx.get(server.url + path, timeout=10)
    head = httpx.head(server.url + path, timeout=10)
    assert head.status_code == get.status_code == 200, (head.status_code, get.text)
    assert head.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")


def test_head_on_a_missing_model_is_404(server):
    assert httpx.head(server.url + "/v1/models/no-such-model", timeout=10).status_code == 404


@pytest.mark.parametrize("role", ["user", "system", "tool", "assistant"])
def test_null_content_is_400_naming_the_field(server, role):
    msgs = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
    r = _post(server, "/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].content"


def test_null_content_with_tool_calls_renders_as_empty(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _post(server, "/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "max_tokens": 2, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    # the same conversation with "" for the null: the same prompt, so "None" never reached it
    msgs[1] = {**msgs[1], "content": ""}
    r2 = _post(server, "/v1/chat/completions", {"model": MODEL_ID, "messages": msgs, "max_tokens": 2, "tools": [WEATHER]})
    assert r.json()["usage"]["prompt_tokens"] == r2.json()["usage"]["prompt_tokens"]


def test_null_content_is_empty_in_the_template():
    from omlx.engine.chat import normalize_messages

    out = normalize_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []}])
    assert out[1]["content"] == ""


def test_anthropic_null_content_is_400(server):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL_ID, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": None}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
                       "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
], ids=["chat-unknown-tool", "chat-required-without-tools", "chat-named-without-tools", "chat-no-name",
        "chat-5-stops", "completions-5-stops", "responses-unknown-tool"])
def test_lax_acceptance_is_now_400(server, path, body, param):
    base = _minimal(path)
    r = _post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("path,choice", [
    ("/v1/chat/completions", "auto"), ("/v1/chat/completions", "required"),
    ("/v1/messages", {"type": "any"}), ("/v1/messages", {"type": "tool", "name": "get_weather"}),
    ("/v1/messages/count_tokens", {"type": "any"}),
    ("/v1/responses", "required"), ("/v1/responses", {"type": "function", "name": "get_weather"}),
    ("/v1/responses", {"type": "allowed_tools", "mode": "required", "tools": []}),
])
def test_a_tool_choice_forcing_a_call_without_tools_is_400_in_every_api(server, path, choice):
    base = _minimal(path) if path != "/v1/messages/count_tokens" else {"model": MODEL_ID, "messages": HI}
    r = _post(server, path, {**base, "tool_choice": choice})
    assert r.status_code == 400, r.text
    j = r.json()
    if path.startswith("/v1/messages"):
        assert j["type"] == "error" and "'tool_choice'" in j["error"]["message"], j
    else:
        assert j["error"]["param"] == "tool_choice", j


@pytest.mark.parametrize("path,choice", [("/v1/messages", {"type": "auto"}), ("/v1/messages", {"type": "none"}),
                                         ("/v1/responses", "auto"), ("/v1/responses", "none")])
def test_a_tool_choice_that_forces_nothing_is_fine_without_tools(server, path, choice):
    r = _post(server, path, {**_minimal(path), "tool_choice": choice})  # Codex sends "auto" with no tools
    assert r.status_code == 200, r.text


def test_a_responses_request_without_input_names_input(server):
    r = _post(server, "/v1/responses", {"model": MODEL_ID, "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "'input'" in r.json()["error"]["message"], r.text


def test_anthropic_tool_choice_naming_a_missing_tool_is_400(server):
    tool = {"name": "Bash", "input_schema": {"type": "object"}}
    r = _post(server, "/v1/messages", {"model": MODEL_ID, "max_tokens": 2, "messages": HI, "tools": [tool],
                                       "tool_choice": {"type": "tool", "name": "Nope"}})
    assert r.status_code == 400 and r.json()["type"] == "error"


_RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
_ANTH_TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


_UNENFORCEABLE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "tag", "parameters": _UNENFORCEABLE}}],
                              "tool_choice": "required"}),
    ("/v1/responses", {"tools": [{"type": "function", "name": "tag", "parameters": _UNENFORCEABLE}], "tool_choice": "required"}),
    ("/v1/messages", {"tools": [{"name": "tag", "input_schema": _UNENFORCEABLE}], "tool_choice": {"type": "any"}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": _UNENFORCEABLE}}}),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": _UNENFORCEABLE}}}),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "t", "schema": _UNENFORCEABLE}}}),
], ids=["chat-forced", "responses-forced", "messages-any", "chat-schema", "completions-schema", "responses-schema"])
def test_a_schema_constrained_decoding_cannot_enforce_is_400_naming_the_keyword(server, path, body):
    """Never silently unconstrained: the 400 names the keyword llguidance does not implement."""
    r = _post(server, path, {**_minimal(path), **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "uniqueItems" in err["message"], err
    assert _post(server, path, _minimal(path)).status_code == 200  # the server goes on


@pytest.mark.parametrize("body,param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
], ids=["not-object", "unknown-type", "no-json-schema", "no-schema", "schema-not-object"])
def test_a_malformed_response_format_is_400_naming_it(server, body, param):
    r = _post(server, "/v1/chat/completions", {**_minimal("/v1/chat/completions"), **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"best_of": 0}, "best_of"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"reasoning_effort": 5}, "reasoning_effort"),
    ("/v1/chat/completions", {"reasoning_effort": "max"}, "reasoning_effort"),
    ("/v1/responses", {"reasoning": {"effort": 5}}, "reasoning.effort"),
], ids=["best_of-0", "best_of-3", "chat-effort-5", "chat-effort-max", "responses-effort-5"])
def test_out_of_range_choices_are_400_naming_the_field(server, path, body, param):
    base = _minimal(path)
    r = _post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_four_stop_strings_are_fine(server):
    r = _post(server, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 2, "messages": HI, "stop": ["a", "b", "c", "d"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_top_k_past_the_vocabulary_keeps_every_token_and_the_next_sampled_request_still_works(server, path):
    # SmolLM2's vocabulary is 49,152 tokens: top_k 60000 used to be a 500 that broke every later
    # sampled request of the process (mlx-lm's apply_top_k raised inside its compiled function)
    for top_k in (60000, None):
        body = {**_minimal(path), "temperature": 1.0, **({"top_k": top_k} if top_k else {})}
        r = _post(server, path, body)
        assert r.status_code == 200, (top_k, r.text)


def _disconnect_after(server, body: dict, after_s: float) -> None:
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        time.sleep(after_s)


def _wait_idle(server, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = httpx.get(server.url + "/health", timeout=10).json()["models"][0]
        if (m["active"], m["running"], m["waiting"]) == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_non_streaming_disconnect_is_an_info_line_and_frees_its_batch_row(server):
    body = {"model": MODEL_ID, "max_tokens": 400, "messages": [{"role": "user", "content": "Write a long story."}]}
    _disconnect_after(server, body, 1.0)
    m = _wait_idle(server)
    assert (m["active"], m["running"], m["waiting"]) == (0, 0, 0), m
    log = server.log()
    assert "client disconnected from POST /v1/chat/completions" in log
    assert not [ln for ln in log.splitlines() if "RequestCancelled" in ln or ("ERROR" in ln and "cancel" in ln.lower())]
    assert _post(server, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 2, "messages": HI}).status_code == 200


def test_stop_with_a_request_running_is_clean(tmp_path):
    with ServerProcess(base_path=tmp_path / "home") as s:
        body = {"model": MODEL_ID, "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": "Write a very long story."}]}
        with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            s.stop(signal.SIGINT)
            rest = "\n".join(lines)
        assert s.proc.returncode == 0, s.log()
        log = s.log()
        assert "Event loop is closed" not in log and "Traceback" not in log, log
        assert "stopping" in rest  # the stream ended with a clear error event, not a cut


@pytest.mark.parametrize("number", ["99999999999999999999999", "1e400", "2147483648"])
@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "max_tokens"),
                                         ("/v1/chat/completions", "max_completion_tokens"),
                                         ("/v1/completions", "max_tokens"), ("/v1/responses", "max_output_tokens"),
                                         ("/v1/messages", "max_tokens")])
def test_a_token_limit_past_any_context_is_a_400_naming_it(server, path: str, field: str, number: str):
    """``max_tokens: 99999999999999999999999`` was taken and clamped to the context: the request
    then generated to the end of the context (minutes on a CPU) and answered 200. Each API now
    answers 400 in its own error shape, naming the field."""
    body = {k: v for k, v in _minimal(path).items() if k not in ("max_tokens", "max_output_tokens")}
    raw = json.dumps(body)[:-1] + f', "{field}": {number}}}'  # a JSON number Python's json cannot write
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and f"'{field}' must be" in err["message"], err
    if path == "/v1/messages":
        assert r.json()["type"] == "error"
    else:
        assert err["param"] == field

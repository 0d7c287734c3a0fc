"""The tool-call rules (omlx/tool_parsers/check.py) through a real `omlx serve` with the real SmolLM2.

A 135M model will not write a bad call on request, so the output is forced by constrained
decoding instead (no mock, no hook): the model is served with the ``llama3_json`` tool dialect
(``tool_dialect`` in its config), in which a call is a bare ``{"name": ..., "parameters": {...}}``
object at the start of the answer, and ``response_format`` / ``text.format`` constrain the
answer to exactly such an object. The engine, the parser and the routes are the real ones.
A control request naming an offered tool comes back as a call, so the text answers of the other
requests are the rules at work, not a setup that never parses calls.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def call_schema(name: str, parameters: dict) -> dict:
    """A schema whose only answers are llama3_json calls of ``name`` with ``parameters``."""
    return {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
CITY_AS_NUMBER = {"type": "object", "properties": {"city": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["city"], "additionalProperties": False}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "call", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "config.toml"
    cfg.write_text(f'[models."{MODEL_ID}"]\ntool_dialect = "llama3_json"\n')
    with ServerProcess(["--model", MODEL_ID, "--no-ssd-cache", "--config", str(cfg)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def logged(server, text: str) -> bool:
    """Whether the server log holds ``text`` (the log's console wraps lines: whitespace is folded)."""
    return " ".join(text.split()) in " ".join(server.log_path.read_text().split())


def chat(client, schema: dict, tools: list, **kw):
    return client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=tools, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 60),
                                          response_format=response_format(schema), **kw)


def streamed(client, schema: dict, tools: list, **kw) -> tuple[str, list, list]:
    """(joined content, tool-call deltas, finish reasons) of the same request, streamed."""
    chunks = list(chat(client, schema, tools, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, calls, reasons


def test_a_call_to_an_offered_tool_is_a_tool_call(client):
    """The control: the same setup, naming an offered tool, parses to a call."""
    r = chat(client, call_schema("get_weather", WEATHER_PARAMS), [WEATHER])
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_call_to_a_tool_not_offered_comes_back_as_text(client, server):
    r = chat(client, call_schema("launch_rockets", NO_ARGS), [WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert not msg.tool_calls
    assert json.loads(msg.content)["name"] == "launch_rockets"
    assert logged(server, "'launch_rockets', which the request did not offer")
    content, calls, reasons = streamed(client, call_schema("launch_rockets", NO_ARGS), [WEATHER])
    assert (content, calls, reasons) == (msg.content, [], ["stop"])


def test_responses_route_gives_the_same_text(server):
    body = {"model": MODEL_ID, "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 60,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "text": {"format": {"type": "json_schema", "name": "call", "strict": True,
                                "schema": call_schema("launch_rockets", NO_ARGS)}}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["message"], out
    assert json.loads(out[0]["content"][0]["text"])["name"] == "launch_rockets"


def test_a_strict_tool_call_whose_arguments_do_not_match_is_text(client, server):
    schema = call_schema("get_weather", CITY_AS_NUMBER)
    r = chat(client, schema, [STRICT_WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert json.loads(msg.content)["name"] == "get_weather"
    assert logged(server, "arguments of strict tool 'get_weather' do not match its schema")
    assert streamed(client, schema, [STRICT_WEATHER]) == (msg.content, [], ["stop"])


def test_a_non_strict_tool_call_whose_arguments_do_not_match_is_a_call_with_a_warning(client, server):
    r = chat(client, call_schema("get_weather", CITY_AS_NUMBER), [WEATHER])
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(json.loads(call.function.arguments)["city"], int)
    assert logged(server, "passed on, the tool is not strict")


def test_a_call_cut_off_by_max_tokens_is_text(client):
    r = chat(client, call_schema("get_weather", WEATHER_PARAMS), [WEATHER], max_tokens=6)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert not msg.tool_calls and msg.content and msg.content.startswith("{")
    content, calls, reasons = streamed(client, call_schema("get_weather", WEATHER_PARAMS), [WEATHER], max_tokens=6)
    assert (content, calls, reasons) == (msg.content, [], ["length"])

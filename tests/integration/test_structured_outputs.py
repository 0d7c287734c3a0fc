"""Structured outputs and forced tool calls (issue 21) against a real `omlx serve` with the real
SmolLM2, through the official openai and anthropic SDKs.

SmolLM2 has no tool-call format of its own, so a forced call is written as a JSON call by
constrained decoding; without the constraint this 135M model rarely writes valid JSON at all
(the first test shows it). Schemas here bound their strings, arrays and numbers so that a valid
answer fits in ``max_tokens``: llguidance enforces the shape, not the length.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.helpers import MODEL_ID

ASK = [{"role": "user", "content": "Describe a person (name, age, city) as JSON."}]

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested-array": {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "bounded-numbers": {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                         "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}},
                        "required": ["ratio", "count"], "additionalProperties": False},
    "pattern-and-format": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "day": {"type": "string", "format": "date"},
        "ok": {"type": "boolean"}}, "required": ["code", "day", "ok"], "additionalProperties": False},
    "optional-fields": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                                         "note": {"type": ["string", "null"], "maxLength": 12}},
                        "required": ["title"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL_ID, messages=kw.pop("messages", ASK), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 120), **kw)


def test_every_schema_gives_valid_json_eight_at_a_time(client):
    """Each schema's answer parses and validates; they run concurrently (constrained rows in one batch)."""
    unconstrained = _chat(client, max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):  # what the model writes on its own: prose, not JSON
        json.loads(unconstrained)
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futs = {name: pool.submit(_chat, client, response_format=_schema_format(name, s)) for name, s in SCHEMAS.items()}
        results = {name: f.result() for name, f in futs.items()}
    for name, r in results.items():
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_mode_gives_an_object_streamed_as_not(client):
    kw = {"response_format": {"type": "json_object"}, "max_tokens": 60,
          "messages": [{"role": "user", "content": "Give a JSON object with your name."}]}
    full = _chat(client, **kw)
    chunks = list(_chat(client, stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    if full.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(streamed), dict)
    else:  # cut by max_tokens inside the object: it says so
        assert full.choices[0].finish_reason == "length"
        assert streamed.startswith("{")


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


def test_the_sdks_parse_helper_works_end_to_end(client):
    r = client.chat.completions.parse(model=MODEL_ID, messages=[{"role": "user", "content": "Facts about Paris as JSON."}],
                                      response_format=City, temperature=0, max_tokens=80)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    assert r.choices[0].finish_reason == "stop"


def test_completions_and_responses_take_the_same_schema(client):
    schema = SCHEMAS["enum"]
    r = client.completions.create(model=MODEL_ID, prompt="A shirt as JSON:", temperature=0, max_tokens=40,
                                  extra_body={"response_format": _schema_format("shirt", schema)})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    resp = client.responses.create(model=MODEL_ID, input="A shirt as JSON.", temperature=0, max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "shirt", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    resp = client.responses.create(model=MODEL_ID, input="A shirt as JSON.", temperature=0, max_output_tokens=40,
                                   text={"format": {"type": "json_object"}})
    assert resp.output_text.startswith("{")


def test_max_tokens_inside_the_value_ends_with_length_and_the_log_says_so(client, server):
    r = _chat(client, max_tokens=4, response_format=_schema_format("o", SCHEMAS["object"]))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    assert "inside its constrained output" in server.log_path.read_text()


def test_an_unconstrained_request_beside_constrained_ones_gives_the_same_tokens(client):
    kw = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24}
    alone = _chat(client, **kw).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(_chat, client, response_format=_schema_format(n, SCHEMAS[n]))
                       for n in ("object", "enum", "nested-array")]
        beside = pool.submit(_chat, client, **kw)
        assert beside.result().choices[0].message.content == alone
        for f in constrained:
            assert f.result().choices[0].finish_reason == "stop"


# ---- hypothesis: schemas within the supported subset always give valid output -------------

_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10)),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
)
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
    st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, min_size=1, max_size=2).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}),
), max_leaves=4)
_schemas = st.dictionaries(st.sampled_from(["id", "kind", "data"]), _value, min_size=1, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas)
def test_generated_schemas_always_give_valid_output(client, schema):
    r = _chat(client, max_tokens=200, response_format=_schema_format("gen", schema),
              messages=[{"role": "user", "content": "Fill in this JSON."}])
    assert r.choices[0].finish_reason == "stop", (schema, r.choices[0].message.content)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# ---- forced tool calls on a model without a tool-call format --------------------------------

def _check_weather_call(name: str, arguments: dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_chat_forced_call_is_a_valid_call_streamed_as_not(client, choice):
    kw = {"messages": WEATHER_Q, "tools": [TIME, WEATHER] if choice != "required" else [WEATHER], "tool_choice": choice,
          "max_tokens": 60}
    r = _chat(client, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    _check_weather_call(call.function.name, json.loads(call.function.arguments))
    chunks = list(_chat(client, stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_responses_forced_call_is_a_valid_call_streamed_as_not(client):
    tool = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
            "parameters": WEATHER["function"]["parameters"]}
    kw = {"model": MODEL_ID, "input": "What is the weather in Paris?", "tools": [tool], "tool_choice": "required",
          "temperature": 0, "max_output_tokens": 60}
    resp = client.responses.create(**kw)
    (call,) = [o for o in resp.output if o.type == "function_call"]
    _check_weather_call(call.name, json.loads(call.arguments))
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    (scall,) = [o for o in final.output if o.type == "function_call"]
    assert (scall.name, scall.arguments) == (call.name, call.arguments)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_anthropic_forced_tool_use_is_valid_streamed_as_not(claude, choice):
    tools = [{"name": f["function"]["name"], "description": f["function"]["description"],
              "input_schema": f["function"]["parameters"]} for f in (TIME, WEATHER)]
    if choice["type"] == "any":
        tools = tools[1:]
    kw = {"model": MODEL_ID, "max_tokens": 60, "extra_body": {"temperature": 0}, "messages": WEATHER_Q, "tools": tools,
          "tool_choice": choice}
    msg = claude.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    _check_weather_call(use.name, use.input)
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    (suse,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (suse.name, suse.input) == (use.name, use.input)

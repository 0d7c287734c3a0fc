"""A real tool call from a real tool-calling model (Qwen2.5-Coder-0.5B) through the OpenAI chat,
Anthropic messages and OpenAI responses routes, streamed and not. Marked slow: a 478 MB download
and a 2.4 GB model; run with ./scripts/test.sh -m slow."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.helpers import QWEN_ID, ServerProcess, qwen_model_dir

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]


@pytest.fixture(scope="module")
def qwen():
    qwen_model_dir()
    with ServerProcess(["--model", QWEN_ID, "--no-ssd-cache"]) as s:
        yield s


def test_chat_completions_tool_call(qwen):
    c = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=600)
    r = c.chat.completions.create(model=QWEN_ID, messages=ASK, tools=[TOOL], temperature=0, max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    chunks = list(c.chat.completions.create(model=QWEN_ID, messages=ASK, tools=[TOOL], temperature=0, max_tokens=64, stream=True))
    names = [tc.function.name for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or []) if tc.function and tc.function.name]
    args = "".join(tc.function.arguments or "" for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or []) if tc.function)
    assert names == ["get_weather"]
    assert json.loads(args) == json.loads(call.function.arguments)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "<tool_call>" not in text


def test_anthropic_messages_tool_use(qwen):
    c = anthropic.Anthropic(base_url=qwen.url, api_key="x", max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": TOOL["function"]["description"], "input_schema": TOOL["function"]["parameters"]}]
    m = c.messages.create(model=QWEN_ID, max_tokens=64, messages=ASK, tools=tools, extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    block = next(b for b in m.content if b.type == "tool_use")
    assert block.name == "get_weather" and "paris" in block.input["city"].lower()
    with c.messages.stream(model=QWEN_ID, max_tokens=64, messages=ASK, tools=tools, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert next(b for b in final.content if b.type == "tool_use").input == block.input


def test_responses_function_call(qwen):
    c = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=600)
    tools = [{"type": "function", **TOOL["function"]}]
    r = c.responses.create(model=QWEN_ID, input=ASK[0]["content"], tools=tools, temperature=0, max_output_tokens=64)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert "paris" in json.loads(calls[0].arguments)["city"].lower()


# ---- constrained decoding in the model's own format (issue 21) ----------------------------

STRICT_TOOL = {"type": "function", "function": {**TOOL["function"], "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CHAT_ONLY = [{"role": "user", "content": "Say hello."}]


def test_a_forced_call_is_written_in_hermes_format_and_parsed_back(qwen):
    """A prompt that would not call on its own, with tool_choice required: the call comes back as
    a tool call (written as <tool_call> JSON, parsed by the hermes dialect), streamed as not."""
    c = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=600)
    kw = {"model": QWEN_ID, "messages": CHAT_ONLY, "tools": [STRICT_TOOL], "temperature": 0, "max_tokens": 64}
    free = c.chat.completions.create(**kw)
    assert not free.choices[0].message.tool_calls  # on its own it answers in text
    r = c.chat.completions.create(**kw, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    chunks = list(c.chat.completions.create(**kw, tool_choice="required", stream=True))
    streamed = "".join(tc.function.arguments or "" for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or []))
    assert json.loads(streamed) == args
    assert "<tool_call>" not in "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_strict_tools_in_auto_mode_get_schema_valid_arguments(qwen):
    """strict: true with tool_choice auto: text stays free, a call's arguments follow the schema
    (here the enum 'unit', which the model would not add on its own)."""
    c = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=600)
    r = c.chat.completions.create(model=QWEN_ID, messages=ASK, tools=[STRICT_TOOL], temperature=0, max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args
    hello = c.chat.completions.create(model=QWEN_ID, messages=CHAT_ONLY, tools=[STRICT_TOOL], temperature=0, max_tokens=16)
    assert hello.choices[0].message.content and not hello.choices[0].message.tool_calls

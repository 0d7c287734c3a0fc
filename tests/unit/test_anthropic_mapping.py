"""Anthropic request -> chat-template messages (omlx/api/anthropic.py), without a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.api.anthropic import chat_input, messages_from_anthropic, system_text, thinking_enabled, tools_from_anthropic
from omlx.errors import ConfigError, InvalidRequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "client_requests"


def fixture_body(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


def test_tool_turn_from_claude_code_maps_to_openai_style_messages():
    body = fixture_body("claude_code__messages_stream_thinking_echo_with_signature")
    # the recording hides texts; Claude Code's first system block is this per-request header
    body["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli;"
    msgs = messages_from_anthropic(body["messages"], body["system"])
    assert [m["role"] for m in msgs] == ["system", "user", "system", "assistant", "tool"]
    # the billing header block is dropped; the other system blocks are joined
    assert not msgs[0]["content"].startswith("x-anthropic-billing-header")
    assert msgs[0]["content"] == "\n\n".join(b["text"] for b in body["system"][1:])
    asst = msgs[3]
    assert asst["content"] == "Running a command."
    assert asst["reasoning_content"] == "Local reasoning trace."
    call = asst["tool_calls"][0]
    assert call["id"] == "toolu_b90ee204a2f14c5291d84efc" and call["type"] == "function"
    assert call["function"]["name"] == "Bash"
    assert call["function"]["arguments"] == body["messages"][2]["content"][2]["input"]  # an object, not a string
    assert msgs[4] == {"role": "tool", "tool_call_id": "toolu_b90ee204a2f14c5291d84efc", "name": "Bash",
                       "content": body["messages"][3]["content"][0]["content"]}


def test_user_blocks_text_and_tool_results_keep_order():
    msgs = messages_from_anthropic([
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": "a"}},
                                          {"type": "tool_use", "id": "t2", "name": "Grep", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "oops", "is_error": True},
            {"type": "text", "text": "now summarize"},
        ]},
    ])
    assert msgs[0]["content"] == "" and len(msgs[0]["tool_calls"]) == 2  # never None: templates concatenate it
    assert msgs[1:] == [
        {"role": "tool", "tool_call_id": "t1", "name": "Read", "content": "line1\nline2"},
        {"role": "tool", "tool_call_id": "t2", "name": "Grep", "content": "oops"},
        {"role": "user", "content": "now summarize"},
    ]


def test_system_forms_and_mid_conversation_system_messages():
    assert system_text("Be brief.") == "Be brief."
    assert system_text([{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B"}]) == "A\n\nB"
    msgs = messages_from_anthropic(
        [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "late"}]}], "early")
    assert [(m["role"], m["content"]) for m in msgs] == [("system", "early"), ("user", "hi"), ("system", "late")]


def test_thinking_blocks_with_any_signature_are_accepted():
    for sig in ("", "bG9jYWwtc2lnbmF0dXJl", "not base64 at all"):
        msgs = messages_from_anthropic([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": sig},
                                              {"type": "redacted_thinking", "data": "xyz"},
                                              {"type": "text", "text": "a"}]},
            {"role": "user", "content": "next"},
        ])
        assert msgs[1] == {"role": "assistant", "content": "a", "reasoning_content": "hmm"}


@pytest.mark.parametrize("messages,param", [
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "x", "input": {}}]}], "messages[0].content[0]"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "x", "input": "ls"}]}], "messages[0].content[0].input"),
    ([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}], "messages[0].content[0].tool_use_id"),
])
def test_malformed_messages_name_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as ei:
        messages_from_anthropic(messages)
    assert ei.value.param == param


def test_tools_map_to_function_tools_and_server_tools_are_left_out():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"command": {"type": "string"}}, "additionalProperties": False}
    out = tools_from_anthropic([
        {"name": "Bash", "description": "run", "input_schema": schema, "cache_control": {"type": "ephemeral"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
    ])
    assert out == [{"type": "function", "function": {"name": "Bash", "description": "run", "parameters": schema}}]
    with pytest.raises(InvalidRequestError):
        tools_from_anthropic([{"name": "x"}])


def test_a_strict_tool_stays_strict():
    """``strict: true`` is kept, so the tool-call check (omlx/tool_parsers/check.py) keeps its calls exact."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    out = tools_from_anthropic([{"name": "Read", "input_schema": schema, "strict": True},
                                {"name": "Glob", "input_schema": schema, "strict": False}])
    assert out[0]["function"]["strict"] is True
    assert "strict" not in out[1]["function"]


def test_tool_choice():
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}
    assert chat_input({**body, "tool_choice": {"type": "none"}}, 10).tools is None
    assert chat_input({**body, "tool_choice": {"type": "any"}}, 10).tools
    assert chat_input({**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, 10).max_tool_calls == 1
    assert chat_input({**body, "tool_choice": {"type": "tool", "name": "Bash"}}, 10).tools
    for bad in ({"type": "tool", "name": "Nope"}, {"type": "sometimes"}, "auto"):
        with pytest.raises(InvalidRequestError):
            chat_input({**body, "tool_choice": bad}, 10)


def test_thinking_switch_and_validation():
    """The failure case 'anthropic-thinking-absent-means-off' (request side)."""
    assert thinking_enabled({}, 100) is False
    assert thinking_enabled({"thinking": {"type": "disabled"}}, 100) is False
    assert thinking_enabled({"thinking": {"type": "adaptive"}}, 100) is True
    assert thinking_enabled({"thinking": {"type": "enabled", "budget_tokens": 31999}}, 32000) is True
    assert thinking_enabled({"thinking": {"type": "enabled", "budget_tokens": 5000}}, None) is True  # count_tokens
    for bad, mt in (({"type": "enabled", "budget_tokens": 1023}, 4096), ({"type": "enabled", "budget_tokens": 4096}, 4096),
                    ({"type": "enabled"}, 4096), ({"type": "sometimes"}, 4096), ("on", 4096)):
        with pytest.raises(InvalidRequestError) as ei:
            thinking_enabled({"thinking": bad}, mt)
        assert ei.value.param.startswith("thinking")


MESSAGE_BODIES = sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem.split("__")[0] in ("claude_code", "sdk_anthropic")
                        and "messages" in (json.loads(p.read_text())["body"] or {}))


@pytest.mark.parametrize("name", MESSAGE_BODIES)
def test_every_recorded_client_body_maps(name):
    body = fixture_body(name)
    ci = chat_input(body, body.get("max_tokens"))
    assert ci.messages and all(isinstance(m["content"], str) for m in ci.messages)
    assert ci.enable_thinking is ((body.get("thinking") or {}).get("type") in ("enabled", "adaptive"))


def test_aliases_merge_across_sources_and_context_scale_setting(tmp_path):
    from omlx.config import load_config

    f = tmp_path / "config.toml"
    f.write_text('context_scale_to = 200000\n[aliases]\n"claude-haiku-4-5" = "smol"\n"claude-opus-4-8" = "big"\n')
    cfg = load_config({"aliases": {"claude-opus-4-8": "smol", "local-model": "smol"}}, env={}, config_file=f)
    assert cfg.aliases == {"claude-haiku-4-5": "smol", "claude-opus-4-8": "smol", "local-model": "smol"}
    assert cfg.context_scale_to == 200000
    assert load_config({}, env={"OMLX_CONTEXT_SCALE_TO": "65536"}).context_scale_to == 65536
    assert load_config({}, env={}).context_scale_to is None
    with pytest.raises(ConfigError, match=r"--context-scale-to: -5 \(expected an integer >= 1\)"):
        load_config({"context_scale_to": -5}, env={})


def test_alias_flag_parsing():
    import typer

    from omlx.cli.serve import parse_aliases

    assert parse_aliases(["claude-sonnet-4-5=SmolLM2-135M-Instruct", " a = b "]) == {
        "claude-sonnet-4-5": "SmolLM2-135M-Instruct", "a": "b"}
    for bad in ("noequals", "=target", "name="):
        with pytest.raises(typer.Exit):
            parse_aliases([bad])

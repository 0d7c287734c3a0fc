"""Harmony's analysis channel reaches reasoning, not content: the engine takes the dialect's
think markers when the tokenizer has none, and the API's think splitter then removes the
analysis text before the tool parser sees the rest."""

from __future__ import annotations

from types import SimpleNamespace

from omlx.api.turn import ThinkSplitter
from omlx.engine.factory import dialect_think_markers, model_formats
from omlx.tool_parsers import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
OUTPUT = ("<|channel|>analysis<|message|>User wants Oslo weather.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
          '<|message|>{"city": "Oslo"}<|call|>')


def _loaded(template: str, has_thinking: bool = False):
    tok = SimpleNamespace(chat_template=template, get_vocab=lambda: {}, has_thinking=has_thinking,
                          think_start="<think>", think_end="</think>")
    return SimpleNamespace(tokenizer=tok, model_id="m")


def test_gpt_oss_template_gets_harmony_and_its_analysis_markers() -> None:
    config = SimpleNamespace(model_settings={})
    dialect, think = model_formats(_loaded("tools <|start|>assistant<|channel|>commentary<|call|>"), config)
    assert dialect == "harmony"
    assert think == ("<|channel|>analysis<|message|>", "<|end|>")


def test_tokenizer_markers_win_and_other_dialects_have_none() -> None:
    config = SimpleNamespace(model_settings={})
    assert model_formats(_loaded("tools <tool_call>", has_thinking=True), config) == ("hermes", ("<think>", "</think>"))
    assert dialect_think_markers("hermes") is None
    assert dialect_think_markers("no-such-dialect") is None


def test_analysis_is_reasoning_and_the_call_is_parsed() -> None:
    splitter = ThinkSplitter(*dialect_think_markers("harmony"))
    pieces = []
    for ch in OUTPUT:
        pieces += splitter.feed(ch)
    pieces += splitter.finish()
    reasoning = "".join(t for is_r, t in pieces if is_r)
    content = "".join(t for is_r, t in pieces if not is_r)
    assert reasoning == "User wants Oslo weather."
    r = parse_tool_calls(content, "harmony", TOOLS)
    assert r.content is None and [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_without_the_splitter_analysis_is_never_content() -> None:
    r = parse_tool_calls(OUTPUT.replace("<|call|>", ""), "harmony", TOOLS)
    assert r.content is None and len(r.tool_calls) == 1

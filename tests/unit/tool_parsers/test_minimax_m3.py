"""MiniMax-M3 specifics beyond the shared table (dialect_cases.MINIMAX_M3): nested values typed by
the tool's schema at every depth, the reasoning markers, and detection from M3's markup."""

from __future__ import annotations

import json

from omlx.tool_parsers import detect_dialect, get_dialect, parse_tool_calls

NS = "]<]minimax[>["
TOOLS = [{"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "n": {"type": "integer"}, "label": {"type": "string"}, "done": {"type": "boolean"}}}},
    "tags": {"type": "array", "items": {"type": "string"}},
    "meta": {"type": "object"}}}}}]


def el(key: str, value: str) -> str:
    return f"{NS}<{key}>{value}{NS}</{key}>"


def call(body: str) -> str:
    return f'{NS}<tool_call>\n{NS}<invoke name="plan">\n{body}\n{NS}</invoke>\n{NS}</tool_call>'


def test_nested_leaves_are_typed_by_the_schema() -> None:
    step = el("item", el("n", "1") + el("label", "007") + el("done", "false"))
    r = parse_tool_calls(call(el("steps", step) + el("tags", el("item", "42")) + el("meta", "")), "minimax_m3", TOOLS)
    assert [json.loads(c.arguments) for c in r.tool_calls] == [
        {"steps": [{"n": 1, "label": "007", "done": False}], "tags": ["42"], "meta": {}}]
    assert r.content is None


def test_without_a_schema_leaves_stay_text() -> None:
    r = parse_tool_calls(call(el("n", "1")), "minimax_m3", None)
    assert json.loads(r.tool_calls[0].arguments) == {"n": "1"}


def test_reasoning_markers_and_names() -> None:
    assert get_dialect("minimax_m3").think_markers == ("<mm:think>", "</mm:think>")
    assert get_dialect("minimax-m3").name == "minimax_m3"


def test_detected_from_the_template_before_hermes_and_minimax_m2() -> None:
    template = ('{%- if tools %}{{ "]<]minimax[>[<tool_call>" }}\\n{{ "]<]minimax[>[<invoke name=" }}'
                "{%- endif %}<tool_call>")
    assert detect_dialect(template, None) == "minimax_m3"
    assert detect_dialect("tools <minimax:tool_call>", None) == "minimax"

"""The offered-tool rules (omlx/tool_parsers/check.py) as every dialect applies them, whole and
streamed: a call to a tool the request did not offer stays text with a warning naming the tool;
a strict tool's call whose arguments do not match its schema stays text; a non-strict tool's
mismatching call stays a call, with a warning; a call cut off by the end of the output stays
text. Streamed one character at a time and whole, the result is the same.
"""

from __future__ import annotations

import json
import logging

import pytest

from omlx.tool_parsers import ParseResult, StreamingToolParser, parse_tool_calls
from omlx.tool_parsers.check import CallCheck
from tests.unit.tool_parsers.dialect_cases import TABLE


def _tool(name: str, params: dict, *, strict: bool | None = None) -> dict:
    func = {"name": name, "parameters": params}
    if strict is not None:
        func["strict"] = strict
    return {"type": "function", "function": func}


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = _tool("get_weather", WEATHER_SCHEMA)
STRICT_WEATHER = _tool("get_weather", WEATHER_SCHEMA, strict=True)

# One call in each dialect's own markup: @N is the name, @A the arguments (JSON).
CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "@N", "arguments": @A}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "@N", "parameters": @A}',
    "mistral": "[TOOL_CALLS]@N[ARGS]@A",
    "harmony": "<|channel|>commentary to=functions.@N <|constrain|>json<|message|>@A<|call|>",
}


def call_text(dialect: str, name: str, args: dict) -> str:
    return CALL_TEXT[dialect].replace("@N", name).replace("@A", json.dumps(args))


def both(text: str, dialect: str, tools) -> ParseResult:
    """The whole parse, after checking that a one-character-at-a-time stream gives the same."""
    whole = parse_tool_calls(text, dialect, tools, id_factory=lambda: "call_x")
    parser = StreamingToolParser(dialect, tools, id_factory=lambda: "call_x")
    events = [ev for ch in text for ev in parser.feed(ch)] + parser.finish()
    streamed = ParseResult.from_events(events)
    assert streamed.content == whole.content
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    return whole


def assert_text(r: ParseResult, text: str) -> None:
    """No call, and the call's text is the content (Harmony drops its end token as markup)."""
    assert r.tool_calls == []
    assert r.content == text or r.content == text.replace("<|call|>", ""), (r.content, text)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- unknown tool

@pytest.mark.parametrize("dialect", sorted(CALL_TEXT))
def test_a_call_to_a_tool_not_offered_is_text_with_a_warning(dialect: str, caplog) -> None:
    text = call_text(dialect, "launch_rockets", {"count": 3})
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        r = both(text, dialect, [WEATHER])
    assert_text(r, text)
    assert any("'launch_rockets'" in m and "did not offer" in m for m in warnings(caplog)), warnings(caplog)


def test_the_same_call_to_an_offered_tool_is_a_call() -> None:
    r = both(call_text("hermes", "get_weather", {"city": "Oslo"}), "hermes", [WEATHER])
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert r.content is None


@pytest.mark.parametrize("dialect", ["qwen3_coder_xml", "minimax", "minimax_m3", "glm", "kimi_k2", "deepseek", "gemma"])
def test_every_table_call_renamed_to_an_unknown_tool_is_text(dialect: str) -> None:
    """The first single-call case of the XML and special-token dialects, with the name replaced."""
    case = next(c for c in TABLE[dialect] if len(c.calls) == 1 and c.calls[0][0] == "get_weather")
    text = case.text.replace("get_weather", "launch_rockets")
    r = both(text, dialect, case.tools)
    assert r.tool_calls == []
    assert "launch_rockets" in (r.content or "")


def test_one_unknown_call_in_a_parallel_block_keeps_the_block_as_text() -> None:
    """Parallel calls of one block share its markup: one call to an unknown tool keeps it all."""
    text = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n</invoke>\n'
            '<invoke name="launch_rockets">\n</invoke>\n</minimax:tool_call>')
    r = both(text, "minimax", [WEATHER])
    assert r.tool_calls == [] and r.content == text


def test_a_later_call_still_parses_after_an_unknown_one() -> None:
    bad = call_text("hermes", "launch_rockets", {})
    good = call_text("hermes", "get_weather", {"city": "Lyon"})
    r = both(bad + "\n" + good, "hermes", [WEATHER])
    assert r.content == bad
    assert [c.name for c in r.tool_calls] == ["get_weather"]


def test_a_harmony_builtin_recipient_not_offered_is_text() -> None:
    text = '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>'
    r = both(text, "harmony", [WEATHER])
    assert r.tool_calls == []


def test_without_tools_nothing_is_checked() -> None:
    r = both(call_text("hermes", "launch_rockets", {}), "hermes", None)
    assert [c.name for c in r.tool_calls] == ["launch_rockets"]


# ----------------------------------------------------------------------------- schema

@pytest.mark.parametrize("dialect", sorted(CALL_TEXT))
@pytest.mark.parametrize("args", [{"city": 5}, {"days": 2}, {"city": "Oslo", "extra": True}],
                         ids=["wrong-type", "missing-required", "extra-property"])
def test_a_strict_tool_call_that_does_not_match_its_schema_is_text(dialect: str, args: dict, caplog) -> None:
    text = call_text(dialect, "get_weather", args)
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        r = both(text, dialect, [STRICT_WEATHER])
    assert_text(r, text)
    assert any("strict tool 'get_weather'" in m for m in warnings(caplog)), warnings(caplog)


@pytest.mark.parametrize("dialect", sorted(CALL_TEXT))
def test_a_non_strict_tool_call_that_does_not_match_is_a_call_with_a_warning(dialect: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        r = both(call_text(dialect, "get_weather", {"city": 5}), dialect, [WEATHER])
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("get_weather", {"city": 5})]
    assert any("'get_weather'" in m and "do not match its schema" in m for m in warnings(caplog)), warnings(caplog)


def test_a_strict_call_that_matches_is_a_call_without_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        r = both(call_text("hermes", "get_weather", {"city": "Oslo", "days": 2}), "hermes", [STRICT_WEATHER])
    assert [c.name for c in r.tool_calls] == ["get_weather"]
    assert warnings(caplog) == []


def test_the_schema_sees_coerced_values() -> None:
    """XML dialects give strings; a strict integer parameter accepts "3" after coercion, not "x"."""
    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
           "<parameter=days>\nDAYS\n</parameter>\n</function>\n</tool_call>")
    ok = both(xml.replace("DAYS", "3"), "qwen3_coder_xml", [STRICT_WEATHER])
    assert json.loads(ok.tool_calls[0].arguments) == {"city": "Oslo", "days": 3}
    bad = both(xml.replace("DAYS", "next tuesday"), "qwen3_coder_xml", [STRICT_WEATHER])
    assert bad.tool_calls == []
    loose = both(xml.replace("DAYS", "next tuesday"), "qwen3_coder_xml", [WEATHER])
    assert json.loads(loose.tool_calls[0].arguments) == {"city": "Oslo", "days": "next tuesday"}


def test_anthropic_input_schema_and_an_invalid_schema() -> None:
    check = CallCheck([{"name": "f", "input_schema": {"type": "object", "required": ["a"]}, "strict": True},
                       _tool("g", {"type": "object", "properties": {"a": {"type": "nonsense"}}}, strict=True)])
    assert "strict tool 'f'" in check.rejects("hermes", "f", {})
    assert check.rejects("hermes", "f", {"a": 1}) is None
    assert check.rejects("hermes", "g", {"a": 1}) is None  # an unusable schema is not checked


# ----------------------------------------------------------------------------- truncated

def _single_call_cases():
    for dialect, cases in sorted(TABLE.items()):
        case = next((c for c in cases if len(c.calls) == 1 and c.content is None and c.text.strip() == c.text), None)
        if case is not None:
            yield dialect, case


@pytest.mark.parametrize(("dialect", "case"), list(_single_call_cases()), ids=lambda x: getattr(x, "id", x))
def test_a_call_cut_off_by_the_end_of_the_output_is_text(dialect: str, case, caplog) -> None:
    """max_tokens reached inside the call markup: the unfinished call is text, never a call."""
    for cut in (len(case.text) * 2 // 3, len(case.text) - 1):
        text = case.text[:cut]
        r = both(text, dialect, case.tools)
        assert r.tool_calls == [], (dialect, text)
        assert (r.content or "").strip() == text.strip()


def test_a_bare_json_call_to_a_tool_not_offered_is_warned_about(caplog) -> None:
    """llama3_json's bare form has no marker; a complete call the check rejects is still warned."""
    text = '{"name": "launch_rockets", "parameters": {}}'
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        r = both(text, "llama3_json", [WEATHER])
    assert_text(r, text)
    assert any("'launch_rockets'" in m for m in warnings(caplog))


def test_errors_at_mixed_paths_are_reported_not_passed() -> None:
    """Errors at an index and at a key in one call (paths of ints and strings) still reject."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                               "n": {"type": "integer"}}}
    check = CallCheck([_tool("f", schema, strict=True)])
    reason = check.rejects("hermes", "f", {"tags": [1, "a", 2], "n": "x"})
    assert reason is not None and "tags/0" in reason


def test_many_offered_tools_are_named_briefly() -> None:
    check = CallCheck([_tool(f"t{i:02d}", {}) for i in range(30)])
    reason = check.rejects("hermes", "nope", {})
    assert "'nope'" in reason and "(30 in all)" in reason and "t29" not in reason

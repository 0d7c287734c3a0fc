"""The registry, dialect detection, ids, schema coercion and the parser's API contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

import omlx.tool_parsers as tp
from omlx.tool_parsers import (
    StreamingToolParser,
    detect_dialect,
    get_dialect,
    parse_tool_calls,
)
from omlx.tool_parsers._schema import coerce_arguments, coerce_value
from omlx.tool_parsers.base import new_call_id, new_mistral_call_id
from tests.unit.tool_parsers.dialect_cases import TABLE


def test_every_registered_dialect_has_table_cases() -> None:
    assert sorted(TABLE) == tp.available_dialects()
    for name in tp.available_dialects():
        assert get_dialect(name).name == name
        assert len(TABLE[name]) >= 4


@pytest.mark.parametrize(
    ("alias", "name"),
    [("qwen3_coder", "qwen3_coder_xml"), ("json_tools", "hermes"), ("glm47", "glm"), ("laguna", "glm"),
     ("function_gemma", "gemma"), ("gemma4", "gemma"), ("minimax_m2", "minimax"), ("MISTRAL", "mistral"),
     ("deepseek_v32", "dsml")],
)
def test_mlx_lm_names_are_aliases(alias: str, name: str) -> None:
    assert get_dialect(alias).name == name


def test_unknown_dialect_is_a_value_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown tool dialect 'nope'.*hermes"):
        StreamingToolParser("nope")


def test_harmony_needs_no_optional_package() -> None:
    """omlx's own Harmony parser: no openai-harmony import, available everywhere."""
    assert get_dialect("gpt_oss").name == "harmony" and "harmony" in tp.available_dialects()
    assert get_dialect("harmony").think_markers == ("<|channel|>analysis<|message|>", "<|end|>")


def test_importing_the_package_loads_no_dialect_and_no_mlx() -> None:
    code = (
        "import sys, omlx.tool_parsers as tp\n"
        "assert not any(m.startswith('mlx') for m in sys.modules), sorted(sys.modules)\n"
        "assert 'omlx.tool_parsers.hermes' not in sys.modules\n"
        "tp.parse_tool_calls('<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>', 'hermes')\n"
        "assert not any(m.startswith('mlx') for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- detection

QWEN3_CODER_TEMPLATE = "{%- if tools %}...<tool_call>\n<function={{ tool_call.name }}>\n<parameter=..."
HERMES_TEMPLATE = '{%- if tools %}<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'


@pytest.mark.parametrize(
    ("template", "vocab", "expected"),
    [
        (QWEN3_CODER_TEMPLATE, None, "qwen3_coder_xml"),
        (HERMES_TEMPLATE, {"<tool_call>": 1}, "hermes"),
        ("{% if tools %}<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", None, "glm"),
        ("{% for tool_call in message.tool_calls %}[TOOL_CALLS]", None, "mistral"),
        ("{{- '<|python_tag|>' }} tools", None, "llama3_json"),
        ("tools <|start_header_id|> {\"name\": function name, \"parameters\": dict}", None, "llama3_json"),
        ("tools <|tool_call>call:{{ name }}<tool_call|>", None, "gemma"),
        ("tools <start_function_call>", None, "gemma"),
        ("tools <minimax:tool_call>\n<invoke name=", None, "minimax"),
        ("tools ]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=", None, "minimax_m3"),
        (None, {"]<]minimax[>[": 200058, "<tool_call>": 5}, "minimax_m3"),
        ("tools <|tool_calls_section_begin|>", None, "kimi_k2"),
        ("tools <longcat_tool_call>", None, "longcat"),
        ("tools <｜tool▁calls▁begin｜>", None, "deepseek"),
        # DeepSeek-V3.2 (llama.cpp's DeepSeek-V3.2.jinja): its vocabulary keeps V3's tokens
        ('{%- set dsml_token = "｜DSML｜" -%} tools <{{ dsml_token }}function_calls>', {"<｜tool▁calls▁begin｜>"}, "dsml"),
        ("{%- if tools %}<|tool_call_start|>[{{ name }}(...)]<|tool_call_end|>", None, "pythonic"),
        ("<|start_header_id|>system tools: [func_name1(params_name1=params_value1, params_name2=...), "
         "func_name2(params)]", None, "pythonic"),
        (None, {"<|tool_call_start|>", "<|tool_call_end|>"}, "pythonic"),
        ("{%- if tools %}<|open|>tools<|sep|><|open|>call tool=\"{{ name }}\"", None, "kimi_k3"),
        (None, {"<|open|>", "<|sep|>", "<|close|>"}, "kimi_k3"),
        ("{%- if tools %}<function name=\"fn\"><param name=\"p\">value</param></function> CDATA", None, "minicpm5"),
        ("{%- if tools %}<atem:function_calls>\n<atem:invoke name=", None, "muse_spark"),
        (None, {"<atem:function_calls>": 5}, "muse_spark"),
        ("{{ messages }} no tool support at all", {"<tool_call>"}, None),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", {"<tool_call>", "</tool_call>"}, None),
        ("tools are listed below, with custom markers", {"[TOOL_CALLS]"}, "mistral"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
        (None, {"<|tool_calls_section_begin|>": 7}, "kimi_k2"),
        (None, None, None),
    ],
)
def test_detect_dialect(template, vocab, expected) -> None:
    assert detect_dialect(template, vocab) == expected


def test_detect_gpt_oss() -> None:
    assert detect_dialect("tools <|start|>assistant<|channel|>commentary to=functions.f<|call|>", None) == "harmony"
    assert detect_dialect(None, {"<|channel|>", "<|constrain|>", "<|call|>", "<|message|>"}) == "harmony"


# ----------------------------------------------------------------------------- ids

def test_default_ids() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_mistral_call_id())
    r = parse_tool_calls(TABLE["hermes"][1].text, "hermes")
    assert len({c.id for c in r.tool_calls}) == 2
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in r.tool_calls)
    m = parse_tool_calls(TABLE["mistral"][0].text, "mistral")
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in m.tool_calls)


def test_duplicate_model_ids_get_fresh_ones() -> None:
    text = ('[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abc123xyz"}, '
            '{"name": "b", "arguments": {}, "id": "abc123xyz"}]')
    r = parse_tool_calls(text, "mistral", id_factory=lambda: "fresh0000")
    assert [c.id for c in r.tool_calls] == ["abc123xyz", "fresh0000"]


# ----------------------------------------------------------------------------- coercion

@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),
        ("next tuesday", {"type": "integer"}, "next tuesday"),
        ("-2.5", {"type": "number"}, -2.5),
        ("1e999", {"type": "number"}, "1e999"),
        ("True", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("3", {"type": ["string", "integer"]}, "3"),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("3", {}, "3"),
        ("3", None, "3"),
        (3, {"type": "string"}, 3),
    ],
)
def test_coerce_value(value, schema, expected) -> None:
    assert coerce_value(value, schema) == expected
    assert type(coerce_value(value, schema)) is type(expected)


def test_coerce_arguments_only_touches_declared_params_of_known_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    assert coerce_arguments("f", {"n": "2", "x": "3"}, tools) == {"n": 2, "x": "3"}
    assert coerce_arguments("g", {"n": "2"}, tools) == {"n": "2"}
    assert coerce_arguments("f", {"n": "2"}, None) == {"n": "2"}


# ----------------------------------------------------------------------------- API contract

def test_feed_after_finish_raises() -> None:
    p = StreamingToolParser("hermes")
    p.finish()
    with pytest.raises(ValueError):
        p.feed("x")
    with pytest.raises(ValueError):
        p.finish()


def test_content_none_and_empty_input() -> None:
    assert parse_tool_calls("", "hermes").content is None
    assert parse_tool_calls("", "hermes").tool_calls == []


@pytest.mark.parametrize(
    ("dialect", "text", "kind"),
    [("hermes", '<tool_call>{"name": get_weather}</tool_call>', "malformed"),
     ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ', "unfinished"),
     ("minicpm5", '<function name="f"><param name="a">1</function>', "unfinished"),
     ("kimi_k3", '<|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', "malformed"),
     ("harmony", "<|channel|>commentary to=functions.f<|message|>{oops}", "malformed")],
)
def test_a_malformed_call_is_text_with_a_warning(dialect: str, text: str, kind: str, caplog) -> None:
    with caplog.at_level("WARNING", logger="omlx.tool_parsers"):
        r = parse_tool_calls(text, dialect)
    assert r.tool_calls == [] and r.content == text
    assert [rec.levelname for rec in caplog.records] == ["WARNING"]
    assert f"{dialect}: {kind} tool call kept as text" in caplog.text


def test_a_json_answer_is_not_warned_about(caplog) -> None:
    with caplog.at_level("WARNING", logger="omlx.tool_parsers"):
        assert parse_tool_calls('{"city": "Oslo"}', "hermes", TABLE["hermes"][0].tools).tool_calls == []
        assert parse_tool_calls("[1, 2]", "pythonic", TABLE["pythonic"][0].tools).tool_calls == []
    assert caplog.records == []


def test_arguments_are_never_invalid_json() -> None:
    """Values JSON cannot carry (NaN) make the call text, not broken arguments."""
    text = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    r = parse_tool_calls(text, "hermes")
    assert r.tool_calls == [] and r.content == text


def _long_call(dialect: str, size: int) -> str:
    code = ('x = {"a": [1, 2]}  # </parameter> \\ "q"\n' * (size // 40))[:size]
    args = json.dumps({"path": "p", "content": code})
    return {
        "hermes": f'<tool_call>{{"name": "write_file", "arguments": {args}}}</tool_call>',
        "qwen3_coder_xml": f"<tool_call>\n<function=write_file>\n<parameter=content>\n{code}\n</parameter>\n</function>\n</tool_call>",
        "llama3_json": f'{{"name": "write_file", "parameters": {args}}}',
        "mistral": f"[TOOL_CALLS]write_file[ARGS]{args}",
        "gemma": f'<|tool_call>call:write_file{{content:<|"|>{code}<|"|>}}<tool_call|>',
        "glm": f"<tool_call>write_file<arg_key>content</arg_key><arg_value>{code}</arg_value></tool_call>",
        "minimax": f'<minimax:tool_call><invoke name="write_file"><parameter name="content">{code}</parameter></invoke></minimax:tool_call>',
        "kimi_k2": f"<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>",
        "longcat": f'<longcat_tool_call>{{"name": "write_file", "arguments": {args}}}</longcat_tool_call>',
        "pythonic": f"<|tool_call_start|>[write_file(path='p', content={code!r})]<|tool_call_end|>",
        "kimi_k3": f'<|open|>tools<|sep|><|open|>call tool="write_file"<|sep|><|open|>argument key="content" type="string"<|sep|>{code}<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
        "minicpm5": f'<function name="write_file"><param name="content"><![CDATA[{code}]]></param></function>',
        "minimax_m3": f"]<]minimax[>[<tool_call>]<]minimax[>[<invoke name=\"write_file\">]<]minimax[>[<content>{code}]<]minimax[>[</content>]<]minimax[>[</invoke>]<]minimax[>[</tool_call>",
        "muse_spark": f'<atem:function_calls><atem:invoke name="write_file"><atem:parameter name="content">{code}</atem:parameter></atem:invoke></atem:function_calls>',
        "harmony": f"<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>{args}<|call|>",
        "deepseek": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write_file<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "dsml": f'<｜DSML｜function_calls><｜DSML｜invoke name="write_file"><｜DSML｜parameter name="content" string="true">'
        f"{code}</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>",
    }[dialect]


@pytest.mark.parametrize("dialect", sorted(TABLE))
def test_a_long_call_streams_in_linear_time(dialect: str) -> None:
    """40 KB of arguments in 4-character chunks: rescans resume (memo), so this is fast.
    (Rescanning from the start on every chunk took tens of seconds.)"""
    get_dialect(dialect)  # import outside the timing
    text = _long_call(dialect, 40_000)
    p = StreamingToolParser(dialect)
    start = time.perf_counter()
    events = []
    for i in range(0, len(text), 4):
        events += p.feed(text[i : i + 4])
    events += p.finish()
    assert time.perf_counter() - start < 5.0
    assert p.num_tool_calls == 1


def test_pythonic_invalid_escape_is_read_even_when_warnings_are_errors() -> None:
    """Python warns on "\\d" in a string literal; under -W error that became a SyntaxError and
    the call was lost. The parser silences it: the value is the backslash and the d."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = parse_tool_calls('[search(regex="^v\\d+")]', "pythonic", TABLE["pythonic"][0].tools)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("search", '{"regex": "^v\\\\d+"}')]


def test_detect_a_python_chat_template_by_its_type() -> None:
    # DeepSeek-V3.2's mlx-lm conversion has no Jinja template (chat_template_type deepseek_v32,
    # mlx_lm.chat_templates.deepseek_v32) and its vocabulary still holds V3's call tokens.
    vocab = {"<｜tool▁calls▁begin｜>"}
    assert detect_dialect(None, vocab) == "deepseek"
    assert detect_dialect(None, vocab, "deepseek_v32") == "dsml"
    assert detect_dialect(None, None, "muse_spark") == "muse_spark"
    assert detect_dialect(None, vocab, "some_future_type") == "deepseek"  # unknown: the other rules decide


def test_the_doctor_reads_the_template_type_from_the_tokenizer_config(tmp_path) -> None:
    import json

    from omlx.engine.catalogue import tool_dialect_of

    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": "<｜tool▁calls▁begin｜>"}],
                                                         "model": {"vocab": {}}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert tool_dialect_of(tmp_path) == "deepseek"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template_type": "deepseek_v32"}))
    assert tool_dialect_of(tmp_path) == "dsml"

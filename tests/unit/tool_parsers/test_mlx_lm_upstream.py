"""Canaries on mlx-lm's own tool parsers (pinned mlx-lm==0.32.2).

omlx writes its own parser for a dialect only where mlx-lm's gets a case wrong. Each test here
shows that mistake; when one fails after an mlx-lm upgrade, upstream has fixed it, and the
dialect module named in the test can go back to mlx-lm's parser.
"""

from __future__ import annotations

import warnings

import pytest

from omlx.tool_parsers import parse_tool_calls

mlx_parsers = pytest.importorskip("mlx_lm.tool_parsers")


def upstream(module: str, text: str, tools=None):
    """mlx-lm's result, or the exception it raised."""
    mod = __import__(f"mlx_lm.tool_parsers.{module}", fromlist=["parse_tool_call"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mod.parse_tool_call(text, tools)
    except Exception as e:  # noqa: BLE001 - recording what upstream does
        return e


INT_TOOL = [{"type": "function", "function": {"name": "schedule", "parameters": {
    "type": "object", "properties": {"when": {"type": "integer"}}}}}]


def test_qwen3_coder_cuts_value_at_literal_closing_tag() -> None:
    """-> omlx/tool_parsers/qwen3_coder_xml.py"""
    body = "<function=w>\n<parameter=c>\na </parameter> b\n</parameter>\n</function>"
    assert upstream("qwen3_coder", body)["arguments"]["c"] != "a </parameter> b"
    ours = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", "qwen3_coder_xml")
    assert ours.tool_calls[0].arguments == '{"c": "a </parameter> b"}'


def test_qwen3_coder_raises_on_uncoercible_value() -> None:
    """-> omlx/tool_parsers/qwen3_coder_xml.py"""
    body = "<function=schedule>\n<parameter=when>\nnext tuesday\n</parameter>\n</function>"
    assert isinstance(upstream("qwen3_coder", body, INT_TOOL), ValueError)


def test_json_tools_raises_on_invalid_escape() -> None:
    """-> omlx/tool_parsers/hermes.py"""
    assert isinstance(upstream("json_tools", '{"name": "s", "arguments": {"r": "\\d"}}'), ValueError)


def test_glm47_drops_value_without_opening_tag() -> None:
    """-> omlx/tool_parsers/glm.py"""
    got = upstream("glm47", "lookup_order<arg_key>order_id</arg_key>A-1042</arg_value>")
    assert got["arguments"] == {}


def test_function_gemma_breaks_on_braces_in_escape_strings() -> None:
    """-> omlx/tool_parsers/gemma.py"""
    got = upstream("function_gemma", "call:add_note{title:<escape>Plan, v2 {draft}<escape>,pinned:true}")
    assert isinstance(got, Exception) or got["arguments"] != {"title": "Plan, v2 {draft}", "pinned": True}


def test_gemma4_raises_on_hyphenated_key_and_space_after_comma() -> None:
    """-> omlx/tool_parsers/gemma.py (mlx-lm does get case gemma4-braces-and-hyphen-in-call)"""
    assert isinstance(upstream("gemma4", 'call:f{file-path:<|"|>a<|"|>}'), ValueError)
    assert isinstance(upstream("gemma4", "call:f{a:1, b:2}"), ValueError)


def test_minimax_m2_cuts_value_at_literal_closing_tag() -> None:
    """-> omlx/tool_parsers/minimax.py"""
    got = upstream("minimax_m2", '<invoke name="w"><parameter name="c">a </parameter> b</parameter></invoke>')
    assert got["arguments"]["c"] != "a </parameter> b"


def test_mistral_reads_call_id_as_name_and_rejects_invalid_escape() -> None:
    """-> omlx/tool_parsers/mistral.py"""
    assert upstream("mistral", 'get_weather[CALL_ID]abc123xyz[ARGS]{"city": "Lyon"}')["name"] == "abc123xyz"
    assert isinstance(upstream("mistral", 'grep[ARGS]{"pattern": "\\d+"}'), ValueError)


def test_longcat_raises_on_invalid_escape_so_omlx_falls_back() -> None:
    """omlx/tool_parsers/longcat.py uses mlx-lm, then lenient JSON when mlx-lm fails."""
    body = '{"name": "g", "arguments": {"r": "^\\d"}}'
    assert isinstance(upstream("longcat", body), Exception)
    ours = parse_tool_calls(f"<longcat_tool_call>{body}</longcat_tool_call>", "longcat")
    assert ours.tool_calls[0].arguments == '{"r": "^\\\\d"}'


def test_kimi_k2_leaves_unreadable_json_as_a_string_so_omlx_parses_it() -> None:
    """omlx/tool_parsers/kimi_k2.py uses mlx-lm, then lenient JSON on string arguments."""
    text = '<|tool_call_begin|>functions.g:0<|tool_call_argument_begin|>{"r": "^\\d", "b": true}<|tool_call_end|>'
    assert isinstance(upstream("kimi_k2", text)[0]["arguments"], str)


def test_pythonic_cuts_a_value_holding_close_brackets_when_text_follows() -> None:
    """-> omlx/tool_parsers/pythonic.py: with a "]" in later text, ``ast`` fails on
    find("[")..rfind("]") and the regex fallback stops at the first ")]" inside the string."""
    call = '[write_file(content="f(a[1])] ok")]'
    got = upstream("pythonic", call + " see [1]")
    assert got["arguments"] != {"content": "f(a[1])] ok"}
    ours = parse_tool_calls(f"<|tool_call_start|>{call}<|tool_call_end|> see [1]", "pythonic")
    assert ours.tool_calls[0].arguments == '{"content": "f(a[1])] ok"}' and ours.content == "see [1]"


def test_minicpm5_half_parses_a_truncated_call_and_cuts_cdata() -> None:
    """-> omlx/tool_parsers/minicpm5.py"""
    got = upstream("minicpm5", '<function name="get_weather"><param name="city">Lyon</param>')
    assert got == {"name": "get_weather", "arguments": {"city": "Lyon"}}  # no </function>: still a call
    got = upstream("minicpm5", '<function name="w"><param name="c"><![CDATA[a </param> b]]></param></function>')
    assert got["arguments"]["c"] != "a </param> b"


def test_muse_spark_half_parses_unclosed_invoke_and_cuts_at_close_tag() -> None:
    """-> omlx/tool_parsers/muse_spark.py"""
    got = upstream("muse_spark", '<atem:invoke name="g"><atem:parameter name="c">Lyon</atem:parameter>')
    assert got == {"name": "g", "arguments": {"c": "Lyon"}}
    got = upstream("muse_spark", '<atem:invoke name="w"><atem:parameter name="c">a </atem:parameter> b'
                   "</atem:parameter></atem:invoke>")
    assert got["arguments"]["c"] != "a </atem:parameter> b"


@pytest.mark.parametrize(
    ("module", "dialect"),
    [("json_tools", "hermes"), ("qwen3_coder", "qwen3_coder_xml"), ("glm47", "glm"),
     ("function_gemma", "gemma"), ("gemma4", "gemma"), ("minimax_m2", "minimax"),
     ("kimi_k2", "kimi_k2"), ("longcat", "longcat"), ("mistral", "mistral"),
     ("pythonic", "pythonic"), ("kimi_k3", "kimi_k3"),
     ("minicpm5", "minicpm5"), ("muse_spark", "muse_spark"),
     ("laguna", "glm")],
)
def test_start_markers_agree_with_mlx_lm(module: str, dialect: str) -> None:
    """mlx-lm's tokenizer wrapper detects a call by ``tool_call_start``; ours must agree."""
    from omlx.tool_parsers import get_dialect

    mod = __import__(f"mlx_lm.tool_parsers.{module}", fromlist=["tool_call_start"])
    assert mod.tool_call_start in get_dialect(dialect).start_markers

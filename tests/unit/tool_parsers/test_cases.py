"""The tool_parse and tool_stream failure cases (copied from ../shared/cases into cases.jsonl):
each case's ``expected`` is checked at the parser level, whole and streamed.

The API-level halves of two stream cases (finish_reason after a swallowed end-of-turn token,
the delta shape after the first) belong to the OpenAI adapter; here we check what the adapter
relies on: one start event per call carrying the name, later events that cannot carry one,
and ``has_tool_calls`` once the stream is finished.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from omlx.tool_parsers import (
    ParseResult,
    StreamingToolParser,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    parse_tool_calls,
)

HERE = Path(__file__).parent
CASES = [json.loads(line) for line in (HERE / "cases.jsonl").read_text().splitlines() if line.strip()]
PARSE = [c for c in CASES if c["kind"] == "tool_parse"]
STREAM = [c for c in CASES if c["kind"] == "tool_stream"]
SHARED = HERE.parents[3] / "shared" / "cases" / "failure-cases.jsonl"


def dialect_of(case: dict[str, Any]) -> str:
    """The case's parser name (mlx-lm/vLLM spelling; our aliases accept it), else Hermes."""
    return case["repro"].get("parser", "hermes").split()[0]


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run_stream(dialect: str, tools, chunks: list[str]) -> tuple[list, StreamingToolParser]:
    parser = StreamingToolParser(dialect, tools, id_factory=ids())
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events, parser


def outputs(case: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(model output, its expected) pairs: one, or the a/b variants."""
    repro, expected = case["repro"], case["expected"]
    if "model_output" in repro:
        return [(repro["model_output"], expected)]
    return [(repro[f"model_output_{k}"], expected[k]) for k in ("a", "b") if f"model_output_{k}" in repro]


def test_copy_has_every_tool_case_of_shared() -> None:
    if not SHARED.exists():
        pytest.skip("../shared is not checked out next to the repo")
    shared = [json.loads(x) for x in SHARED.read_text().splitlines() if x.strip()]
    wanted = {c["id"]: c for c in shared if c["kind"] in ("tool_parse", "tool_stream")}
    assert {c["id"]: c for c in CASES} == wanted, "refresh tests/unit/tool_parsers/cases.jsonl"


@pytest.mark.parametrize("case", PARSE, ids=[c["id"] for c in PARSE])
def test_tool_parse_case(case: dict[str, Any]) -> None:
    dialect, tools = dialect_of(case), case["repro"]["tools"]
    for text, expected in outputs(case):
        result = parse_tool_calls(text, dialect, tools, id_factory=ids())
        want = expected.get("preferred", expected)
        assert [c.name for c in result.tool_calls] == [c["name"] for c in want["tool_calls"]]
        for got, call in zip(result.tool_calls, want["tool_calls"], strict=True):
            if "arguments_json_string" in call:
                assert got.arguments == call["arguments_json_string"]
            else:
                assert json.loads(got.arguments) == call["arguments"]
            assert "</arg_key>" not in got.arguments
        if "content" in want:
            assert result.content == want["content"]
        assert want["finish_reason"] == ("tool_calls" if result.tool_calls else "stop")
        # Same result streaming (one character at a time) and non-streaming.
        events, _ = run_stream(dialect, tools, list(text))
        assert ParseResult.from_events(events) == result


def test_mistral_trailing_text_becomes_content() -> None:
    case = next(c for c in PARSE if c["id"] == "mistral-parallel-calls-and-trailing-text")
    result = parse_tool_calls(case["repro"]["model_output_b"], "mistral", case["repro"]["tools"])
    assert result.content == "I will read the matches next."


def test_functiongemma_truncated_call_is_text_never_half_parsed() -> None:
    case = next(c for c in PARSE if c["id"] == "functiongemma-escape-and-two-calls")
    text = case["repro"]["model_output"].removesuffix("<end_function_call>")
    result = parse_tool_calls(text, "function_gemma", case["repro"]["tools"])
    assert [c.name for c in result.tool_calls] == ["add_note"]
    assert result.content == "<start_function_call>call:set-status{ready:false}"


def test_hermes_invalid_escape_streams_valid_json() -> None:
    case = next(c for c in PARSE if c["id"] == "hermes-json-invalid-escape-in-args")
    events, _ = run_stream("hermes", case["repro"]["tools"], list(case["repro"]["model_output"]))
    fragments = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert json.loads(fragments) == {"regex": "^v\\d+\\.\\d+$"}


def _check_stream_expected(case: dict[str, Any], events: list, parser: StreamingToolParser) -> None:
    expected = case["expected"]
    texts = [e.text for e in events if isinstance(e, TextDelta)]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    if "content_deltas_joined" in expected:
        assert "".join(texts) == expected["content_deltas_joined"]
    if "content_deltas" in expected:
        assert texts == expected["content_deltas"]
    assert not any("<tool" in t or "[ARGS]" in t for t in texts)
    for i, call in enumerate(expected.get("tool_calls", [])):
        assert starts[i].index == call["index"] and starts[i].name == call["name"]
        args = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta) and e.index == i)
        assert args == call["arguments_joined"]
    if "arguments_joined" in expected:
        args = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta))
        assert args == expected["arguments_joined"] and "[ARGS]" not in args
    # The name travels once, on the start event, and is never empty; later events have no name.
    assert len({e.index for e in starts}) == len(starts) and all(e.name and e.id for e in starts)
    assert not any(hasattr(e, "name") for e in events if not isinstance(e, ToolCallStart))
    if expected.get("final_finish_reason") == "tool_calls":
        assert parser.has_tool_calls


@pytest.mark.parametrize("case", STREAM, ids=[c["id"] for c in STREAM])
def test_tool_stream_case(case: dict[str, Any]) -> None:
    repro = case["repro"]
    dialect, tools = dialect_of(case), repro["tools"]
    if "stream_chunks" in repro:
        chunk_sets = [repro["stream_chunks"], list("".join(repro["stream_chunks"]))]
    elif "engine_outputs" in repro:
        # The engine's end-of-turn text is a stop token: the adapter does not feed it (see
        # test_eot_after_call_leaves_tool_calls_finish below), so the parser sees the rest.
        chunk_sets = [[o["text"] for o in repro["engine_outputs"] if not o.get("finished")]]
    else:
        chunk_sets = [[repro["model_output"]], list(repro["model_output"])]
    for chunks in chunk_sets:
        events, parser = run_stream(dialect, tools, chunks)
        _check_stream_expected(case, events, parser)
        assert ParseResult.from_events(events) == parse_tool_calls("".join(chunks), dialect, tools, id_factory=ids())


def test_eot_after_call_leaves_tool_calls_finish() -> None:
    """The call is complete as soon as its end tag arrives; finish() adds nothing, and the
    parser reports a call, so the adapter's single finish chunk says "tool_calls"."""
    case = next(c for c in STREAM if c["id"] == "stream-tool-call-then-eot-no-finish-reason")
    parser = StreamingToolParser("hermes", case["repro"]["tools"])
    events = parser.feed(case["repro"]["engine_outputs"][0]["text"])
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallArgsDelta", "ToolCallEnd"]
    assert parser.finish() == [] and parser.has_tool_calls and parser.num_tool_calls == 1

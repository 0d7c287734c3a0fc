"""The shared suite: every case of every dialect, parsed whole, streamed one character at a time,
and streamed in random chunkings; the three results must be identical and match the table.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omlx.tool_parsers import (
    ParseResult,
    StreamingToolParser,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    get_dialect,
    parse_tool_calls,
)
from tests.unit.tool_parsers.dialect_cases import TABLE, Case

CASES = [(dialect, case) for dialect, cases in TABLE.items() for case in cases]
IDS = [f"{dialect}-{case.id}" for dialect, case in CASES]
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n):024x}"


def whole(dialect: str, case: Case) -> ParseResult:
    return parse_tool_calls(case.text, dialect, case.tools, id_factory=counter_ids())


def stream(dialect: str, case: Case, chunks: list[str]) -> tuple[ParseResult, list]:
    parser = StreamingToolParser(dialect, case.tools, id_factory=counter_ids())
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    assert parser.num_tool_calls == len(ParseResult.from_events(events).tool_calls)
    return ParseResult.from_events(events), events


def split_at(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_events(events: list) -> None:
    """Name once, then argument fragments, then end; indexes in order; fragments join to JSON."""
    state: dict[int, str] = {}
    fragments: dict[int, str] = {}
    for ev in events:
        if isinstance(ev, ToolCallStart):
            assert ev.index == len(state) and ev.name and ev.id
            state[ev.index] = "open"
            fragments[ev.index] = ""
        elif isinstance(ev, ToolCallArgsDelta):
            assert state.get(ev.index) == "open"
            fragments[ev.index] += ev.fragment
        elif isinstance(ev, ToolCallEnd):
            assert state.get(ev.index) == "open"
            state[ev.index] = "closed"
        else:
            assert isinstance(ev, TextDelta) and ev.text
    assert all(s == "closed" for s in state.values())
    for text in fragments.values():
        assert isinstance(json.loads(text), dict)


def assert_same(a: ParseResult, b: ParseResult) -> None:
    assert a.content == b.content
    assert [(c.id, c.name, c.arguments) for c in a.tool_calls] == [
        (c.id, c.name, c.arguments) for c in b.tool_calls
    ]


@pytest.mark.parametrize(("dialect", "case"), CASES, ids=IDS)
def test_whole_text_matches_table(dialect: str, case: Case) -> None:
    result = whole(dialect, case)
    assert result.content == case.content
    got = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
    assert got == [(call[0], call[1]) for call in case.calls]
    for call, expected in zip(result.tool_calls, case.calls, strict=True):
        if len(expected) > 2:
            assert call.id == expected[2]


@pytest.mark.parametrize(("dialect", "case"), CASES, ids=IDS)
def test_one_char_at_a_time_is_identical(dialect: str, case: Case) -> None:
    result, events = stream(dialect, case, list(case.text))
    assert_same(result, whole(dialect, case))
    check_events(events)


@pytest.mark.parametrize(("dialect", "case"), CASES, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_random_chunkings_are_identical(dialect: str, case: Case, data: st.DataObject) -> None:
    cuts = data.draw(st.sets(st.integers(1, max(1, len(case.text) - 1)), max_size=40))
    result, events = stream(dialect, case, split_at(case.text, cuts))
    assert_same(result, whole(dialect, case))
    check_events(events)


@pytest.mark.parametrize(("dialect", "case"), CASES, ids=IDS)
def test_no_marker_fragment_leaks_into_text(dialect: str, case: Case) -> None:
    """No text delta holds a piece (>= 2 chars) of a start marker unless the content has it."""
    _, events = stream(dialect, case, list(case.text))
    for ev in events:
        if isinstance(ev, TextDelta):
            for marker in get_dialect(dialect).start_markers:
                for k in range(2, len(marker) + 1):
                    assert marker[:k] not in ev.text or marker[:k] in (case.content or "")


@pytest.mark.parametrize("dialect", sorted(TABLE))
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_spliced_and_truncated_outputs_never_raise_and_stream_identically(
    dialect: str, data: st.DataObject
) -> None:
    """Cut-and-spliced case texts: any text parses without raising, the same in any chunking."""
    texts = [c.text for c in TABLE[dialect]]
    a, b = data.draw(st.sampled_from(texts)), data.draw(st.sampled_from(texts))
    text = a[: data.draw(st.integers(0, len(a)))] + b[data.draw(st.integers(0, len(b))) :]
    case = Case("fuzz", text, None, [], TABLE[dialect][0].tools)
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=30))
    result, events = stream(dialect, case, split_at(text, cuts))
    assert_same(result, whole(dialect, case))
    check_events(events)
    # Without a call nothing is dropped or changed: the content is exactly the text (except
    # in a dialect that removes format markup around content, e.g. Harmony's channel headers).
    if not result.tool_calls and not get_dialect(dialect).drops_markup:
        assert result.content == (text or None)

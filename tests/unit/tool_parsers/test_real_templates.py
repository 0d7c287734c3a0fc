"""Detection from each real chat template (tests/fixtures/chat_templates/real/): the template
alone, with no vocabulary, picks the dialect whose parser reads that template's calls (the
renders themselves run in the shared suite, dialect_cases.TABLE ids ``real-*``)."""

from __future__ import annotations

import pytest

from omlx.tool_parsers import detect_dialect, get_dialect
from tests.unit.tool_parsers.real_templates import FIXTURES, SPECS, Spec, template_text


@pytest.mark.parametrize("spec", SPECS, ids=[s.file for s in SPECS])
def test_the_template_alone_picks_its_dialect(spec: Spec) -> None:
    assert detect_dialect(template_text(spec), None) == spec.dialect


def test_kimi_k2_instruct_template_has_no_call_markup_and_the_vocabulary_decides() -> None:
    """Kimi-K2-Instruct's first template renders no tool calls at all (llama.cpp's copy):
    detection falls back to the vocabulary, where the section tokens pick kimi_k2."""
    template = (FIXTURES / "kimi-k2-instruct.jinja").read_text(encoding="utf-8")
    assert detect_dialect(template, None) is None
    assert detect_dialect(template, {"<|tool_calls_section_begin|>": 163595}) == "kimi_k2"


def test_kimi_k3_reasoning_markers_are_its_think_channel() -> None:
    """The K3 template opens the think channel in the generation prompt (the engine then starts
    in reasoning) and closes it before the response channel."""
    assert get_dialect("kimi_k3").think_markers == ("<|open|>think<|sep|>", "<|close|>think<|sep|>")

"""Detection from each real chat template (tests/fixtures/chat_templates/real/): the template
alone, with no vocabulary, picks the dialect whose parser reads that template's calls (the
renders themselves run in the shared suite, dialect_cases.TABLE ids ``real-*``)."""

from __future__ import annotations

import pytest

from omlx.tool_parsers import detect_dialect
from tests.unit.tool_parsers.real_templates import SPECS, Spec, template_text


@pytest.mark.parametrize("spec", SPECS, ids=[s.file for s in SPECS])
def test_the_template_alone_picks_its_dialect(spec: Spec) -> None:
    assert detect_dialect(template_text(spec), None) == spec.dialect

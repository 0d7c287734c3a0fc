"""Every tool-parser test fails if a parser hit an internal error (logged, then kept as text)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def no_parser_errors(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="omlx.tool_parsers"):
        yield
    errors = [r for r in caplog.records if r.name.startswith("omlx.tool_parsers") and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]

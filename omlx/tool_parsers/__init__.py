"""Tool-call parsing: one module per model family behind a lazy registry.

Public API:
    parse_tool_calls(text, dialect, tools=None) -> ParseResult
    StreamingToolParser(dialect, tools=None).feed(delta) / .finish() -> list[Event]
    detect_dialect(chat_template, vocab) -> str | None
    available_dialects() -> list[str]; get_dialect(name) -> Dialect

A dialect module is imported only when first used (some import mlx-lm, which is slow to load).
This package must not import HTTP, scheduling or engine code; it depends on the standard
library, ``jsonschema`` (the offered-tool check, check.py) and, for two dialects, on
``mlx_lm.tool_parsers``.
"""

from __future__ import annotations

import importlib

from omlx.tool_parsers.base import (
    Dialect,
    Event,
    IdFactory,
    ParseResult,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from omlx.tool_parsers.detect import detect_dialect
from omlx.tool_parsers.stream import StreamingToolParser, parse_tool_calls

__all__ = [
    "ALIASES",
    "Dialect",
    "Event",
    "IdFactory",
    "ParseResult",
    "StreamingToolParser",
    "TextDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "available_dialects",
    "detect_dialect",
    "get_dialect",
    "new_call_id",
    "parse_tool_calls",
    "resolve_dialect_name",
]

# name -> module that defines ``DIALECT``
_MODULES = {
    "hermes": "omlx.tool_parsers.hermes",
    "qwen3_coder_xml": "omlx.tool_parsers.qwen3_coder_xml",
    "llama3_json": "omlx.tool_parsers.llama3_json",
    "mistral": "omlx.tool_parsers.mistral",
    "gemma": "omlx.tool_parsers.gemma",
    "glm": "omlx.tool_parsers.glm",
    "minimax": "omlx.tool_parsers.minimax",
    "minimax_m3": "omlx.tool_parsers.minimax_m3",
    "kimi_k2": "omlx.tool_parsers.kimi_k2",
    "longcat": "omlx.tool_parsers.longcat",
    "deepseek": "omlx.tool_parsers.deepseek",
    "dsml": "omlx.tool_parsers.dsml",
    "pythonic": "omlx.tool_parsers.pythonic",
    "kimi_k3": "omlx.tool_parsers.kimi_k3",
    "minicpm5": "omlx.tool_parsers.minicpm5",
    "muse_spark": "omlx.tool_parsers.muse_spark",
    "harmony": "omlx.tool_parsers.harmony",
}

# Other names for our dialects, including mlx-lm's ``tool_parser_type`` values.
ALIASES = {
    "json_tools": "hermes",
    "qwen": "hermes",
    "qwen3_coder": "qwen3_coder_xml",
    "llama3": "llama3_json",
    "llama": "llama3_json",
    "function_gemma": "gemma",
    "functiongemma": "gemma",
    "gemma4": "gemma",
    "glm47": "glm",
    "glm45": "glm",
    "laguna": "glm",
    "minimax_m2": "minimax",
    "minimax-m3": "minimax_m3",
    "kimi": "kimi_k2",
    "deepseek_v3": "deepseek",
    "deepseek_v31": "deepseek",
    "deepseek_v32": "dsml",
    "deepseek-v3.2": "dsml",
    "gpt_oss": "harmony",
    "gpt-oss": "harmony",
    "openai_harmony": "harmony",
    "llama3_pythonic": "pythonic",
    "llama4_pythonic": "pythonic",
    "lfm2": "pythonic",
}

_loaded: dict[str, Dialect] = {}


def resolve_dialect_name(name: str) -> str:
    """Maps an alias (e.g. mlx-lm's ``qwen3_coder``) to our dialect name.

    Raises:
        ValueError: the name is unknown.
    """
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in _MODULES:
        return key
    known = ", ".join(sorted(_MODULES))
    raise ValueError(f"unknown tool dialect {name!r}; use one of: {known}")


def get_dialect(name: str) -> Dialect:
    """Returns the dialect object for ``name`` (imported on first use).

    Raises:
        ValueError: see ``resolve_dialect_name``.
    """
    key = resolve_dialect_name(name)
    if key not in _loaded:
        _loaded[key] = importlib.import_module(_MODULES[key]).DIALECT
    return _loaded[key]


def available_dialects() -> list[str]:
    """Returns the dialect names that can be used in this environment, sorted."""
    return sorted(_MODULES)

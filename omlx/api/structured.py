"""Structured outputs and forced tool calls: request fields -> a `Constraint` for the engine.

- OpenAI chat completions and completions: ``response_format`` ``{"type": "text"}``,
  ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (API reference, Chat Completions, 2026).
- Responses: ``text.format`` with the same types, the ``json_schema`` fields flattened
  (``{"type": "json_schema", "name", "schema", "strict"}``).
- Forced tool calls (OpenAI ``tool_choice: "required"`` or a named function, Responses the same,
  Anthropic ``any`` / ``tool``): one call of an offered tool whose arguments match its schema,
  written in the model's own format where omlx has a grammar for it (`_CALL_FORMATS`) and as a
  JSON call ``{"name": ..., "arguments": {...}}`` otherwise, parsed back with the matching
  dialect, so a forced call works on every model.

The schema is always enforced (``strict: false`` too): the caller asked for that shape. A schema
that cannot be enforced is a 400 naming the keyword (`omlx.engine.grammar.Grammars`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omlx.pool import PoolEntry
from omlx.errors import InvalidRequestError
from omlx.request import Constraint

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a dialect writes one JSON tool call: ``prefix {name_key: .., args_key: {..}} suffix``.

    ``marker``: the text a call starts with when the model chooses to call (``auto``), after
    which ``strict`` tools' arguments are enforced; None: no such marker (no strict ``auto``).
    """

    prefix: str
    suffix: str
    name_key: str
    args_key: str
    dialect: str  # the dialect that parses it back
    marker: str | None = None


JSON_CALL = CallFormat("", "", "name", "arguments", "llama3_json")
"""The format of a forced call for a model whose own format has no grammar here."""

_CALL_FORMATS = {
    "hermes": CallFormat("<tool_call>\n", "\n</tool_call>", "name", "arguments", "hermes", marker="<tool_call>"),
    "llama3_json": CallFormat("", "", "name", "parameters", "llama3_json"),
}


def _require_engine(entry: PoolEntry, param: str) -> None:
    if not getattr(entry.engine, "supports_constraints", False):
        raise InvalidRequestError(f"'{param}' needs constrained decoding, which cluster mode does not run yet; "
                                  "serve the model on one node for structured outputs and forced tool calls", param=param)


def _start_after(entry: PoolEntry, think: tuple[str, str] | None, in_reasoning: bool) -> tuple[int, ...]:
    """The tokens that end a reasoning block the prompt opened: the constraint starts after them."""
    if not (think and in_reasoning):
        return ()
    return tuple(entry.loaded.tokenizer.encode(think[1], add_special_tokens=False))


def _with_start(c: Constraint, entry: PoolEntry, think: tuple[str, str] | None, in_reasoning: bool) -> Constraint:
    after = _start_after(entry, think, in_reasoning)
    return Constraint(c.grammar, c.label, after) if after else c


def _schema_constraint(entry: PoolEntry, kind: Any, schema: Any, name: Any, *, param: str, schema_param: str,
                       think: tuple[str, str] | None, in_reasoning: bool) -> Constraint | None:
    if kind in (None, "text"):
        return None
    _require_engine(entry, param)
    grammars = entry.engine.grammars
    if kind == "json_object":
        return _with_start(grammars.json_object(param=param), entry, think, in_reasoning)
    if kind == "json_schema":
        if schema is None:
            raise InvalidRequestError(f"'{schema_param}' is required for type json_schema", param=schema_param)
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"'{param}' name must be a string", param=param)
        c = grammars.json_schema(schema, label=f"json_schema {name!r}" if name else "json_schema", param=schema_param)
        return _with_start(c, entry, think, in_reasoning)
    raise InvalidRequestError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'; got {kind!r}", param=f"{param}.type")


def response_format(entry: PoolEntry, value: Any, *, think: tuple[str, str] | None = None,
                    in_reasoning: bool = False) -> Constraint | None:
    """OpenAI's ``response_format`` -> a constraint, or None for text.

    Raises:
        InvalidRequestError: a malformed value, or a schema that cannot be enforced.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("'response_format' must be an object such as {'type': 'json_object'}", param="response_format")
    js = value.get("json_schema")
    if value.get("type") == "json_schema" and not isinstance(js, dict):
        raise InvalidRequestError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                                  param="response_format.json_schema")
    js = js or {}
    return _schema_constraint(entry, value.get("type"), js.get("schema"), js.get("name"), param="response_format",
                              schema_param="response_format.json_schema.schema", think=think, in_reasoning=in_reasoning)


def text_format(entry: PoolEntry, text: Any, *, think: tuple[str, str] | None = None,
                in_reasoning: bool = False) -> Constraint | None:
    """The Responses API's ``text`` (``{"format": {...}}``) -> a constraint, or None for text.

    Raises:
        InvalidRequestError: a malformed value, or a schema that cannot be enforced.
    """
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object such as {'format': {'type': 'text'}}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("'text.format' must be an object such as {'type': 'json_object'}", param="text.format")
    return _schema_constraint(entry, fmt.get("type"), fmt.get("schema"), fmt.get("name"), param="text.format",
                              schema_param="text.format.schema", think=think, in_reasoning=in_reasoning)


def forced_tool_call(entry: PoolEntry, tools: list[dict[str, Any]], only: str | None, *, param: str,
                     think: tuple[str, str] | None = None, in_reasoning: bool = False) -> tuple[Constraint, str]:
    """A constraint to one call of ``tools`` (OpenAI function-tool dicts), or of the tool named
    ``only``; returns it with the dialect that parses the call back.

    Raises:
        InvalidRequestError: a tool's parameters schema cannot be enforced (names the tool).
    """
    _require_engine(entry, param)
    fmt = _CALL_FORMATS.get(entry.tool_dialect or "", JSON_CALL)
    calls = [(t["function"]["name"], t["function"].get("parameters") or {}) for t in tools
             if only is None or t["function"]["name"] == only]
    c = entry.engine.grammars.tool_call(calls, prefix=fmt.prefix, suffix=fmt.suffix, name_key=fmt.name_key,
                                        args_key=fmt.args_key, param=param)
    return _with_start(c, entry, think, in_reasoning), fmt.dialect


def strict_tool_calls(entry: PoolEntry, tools: list[dict[str, Any]] | None, *, request_id: str) -> Constraint | None:
    """``tool_choice: auto`` with ``strict: true`` functions: once the model starts a call (its
    format's marker), the call must be one of ``tools``, a strict tool's arguments valid against
    its schema (other tools' arguments any JSON object); text before it stays free. None when
    no tool is strict, or the model's format has no call marker (logged: not enforced).

    Raises:
        InvalidRequestError: a strict tool's schema cannot be enforced (names the tool).
    """
    strict = [t for t in tools or [] if t["function"].get("strict") is True]
    if not strict or not getattr(entry.engine, "supports_constraints", False):
        return None
    fmt = _CALL_FORMATS.get(entry.tool_dialect or "")
    if fmt is None or fmt.marker is None:
        logger.warning("request %s: strict tools %s are not enforced with tool_choice auto on %s (tool format %s has "
                       "no call marker to start the constraint at); tool_choice required enforces them",
                       request_id, [t["function"]["name"] for t in strict], entry.loaded.model_id, entry.tool_dialect)
        return None
    calls = [(t["function"]["name"], (t["function"].get("parameters") or {}) if t["function"].get("strict") is True
              else {"type": "object"}) for t in tools or []]
    marker = tuple(entry.loaded.tokenizer.encode(fmt.marker, add_special_tokens=False))
    return entry.engine.grammars.tool_call(calls, prefix=fmt.prefix[len(fmt.marker):], suffix=fmt.suffix,
                                           name_key=fmt.name_key, args_key=fmt.args_key, param="tools",
                                           more=fmt.prefix, start_after=marker)

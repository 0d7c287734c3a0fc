"""Checks a parsed tool call against the request's offered tools (the rules every route shares).

It owns the decision whether a complete, well-formed call stays a call: it must name a tool the
request offered, and its arguments are validated against that tool's JSON schema
(``function.parameters``; JSON Schema draft 2020-12 unless the schema names another ``$schema``)
with the ``jsonschema`` library. A call to a ``strict: true`` tool whose arguments do not match
stays text; a non-strict tool's mismatching call passes, with a warning (OpenAI passes model
arguments through for the client to validate). It must not know any dialect's markers and must
not raise on any call; a schema that cannot be used is logged once and not checked.

The streaming parser (`omlx.tool_parsers.stream`) runs this once per complete call, before any
event of that call is emitted, so streaming and non-streaming responses agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

logger = logging.getLogger(__name__)

_MAX_ERRORS = 3  # errors named in one warning
_MAX_NAMES = 12  # offered tools named in one warning (agents offer dozens)


@dataclass(slots=True)
class _Offered:
    """One offered function tool: its parameters schema, strictness, and the validator built
    from the schema on the tool's first call (None after that: nothing usable to check)."""

    schema: Any
    strict: bool
    validator: Any | None = None
    compiled: bool = False


def _function(tool: Any) -> dict[str, Any] | None:
    """The function dict of an OpenAI tool (``{"type": "function", "function": {...}}``) or a
    bare function dict; None for anything else."""
    if not isinstance(tool, dict):
        return None
    func = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return func if isinstance(func.get("name"), str) else None


class CallCheck:
    """The offered tools of one request, checked against each parsed call. A tool's schema is
    compiled on its first call (agents offer many tools and call few).

    Args:
        tools: the request's tools (OpenAI function-tool dicts, as the routes pass them to the
            parser). Parameters come from ``parameters`` (or Anthropic's ``input_schema``);
            ``strict`` is ``function.strict is True``.
    """

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self._offered: dict[str, _Offered] = {}
        for tool in tools:
            func = _function(tool)
            if func is None or func["name"] in self._offered:
                continue
            schema = func.get("parameters", func.get("input_schema"))
            self._offered[func["name"]] = _Offered(schema, func.get("strict") is True)

    def rejects(self, dialect: str, name: str, arguments: dict[str, Any]) -> str | None:
        """Decides one call (arguments already decoded and type-coerced).

        Args:
            dialect: the dialect name, for the log.
            name: the called function's name.
            arguments: the decoded argument object.

        Returns:
            None when the call stays a call (a non-strict schema mismatch is logged as a
            warning); otherwise why it is kept as text (the caller logs it).
        """
        offered = self._offered.get(name)
        if offered is None:
            names = sorted(self._offered)
            known = ", ".join(names[:_MAX_NAMES]) + (f", ... ({len(names)} in all)" if len(names) > _MAX_NAMES else "")
            return f"call to tool {name!r}, which the request did not offer (offered: {known})"
        if not offered.compiled:
            offered.validator, offered.compiled = _validator(name, offered.schema), True
        if offered.validator is None:
            return None
        try:
            errors = sorted(offered.validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
        except Exception:  # noqa: BLE001 - a validator bug (or a bad $ref) must not break the response
            logger.warning("%s: the schema of tool %r could not be checked; the call is passed on", dialect, name,
                           exc_info=True)
            return None
        if not errors:
            return None
        detail = "; ".join(_describe(e) for e in errors[:_MAX_ERRORS])
        if offered.strict:
            return f"arguments of strict tool {name!r} do not match its schema: {detail}"
        logger.warning("%s: arguments of tool %r do not match its schema (%s); passed on, the tool is not strict",
                       dialect, name, detail)
        return None


def _validator(name: str, schema: Any) -> Any | None:
    """A validator for ``schema``, or None when there is nothing (usable) to check."""
    if schema is None or schema == {}:
        return None
    if not isinstance(schema, dict):
        logger.warning("tool %r: parameters is not a JSON schema object; its calls are not checked", name)
        return None
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        logger.warning("tool %r: parameters is not a valid JSON schema (%s); its calls are not checked", name, e.message)
        return None
    return cls(schema)


def _describe(error: Any) -> str:
    path = "/".join(str(p) for p in error.absolute_path)
    return f"{path or '(root)'}: {error.message}"[:200]

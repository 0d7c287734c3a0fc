"""Request model of the OpenAI Responses API: ``POST /v1/responses`` (and ``/v1/responses/input_tokens``).

Fields follow the OpenAI API reference (Responses, 2026); the sampling fields are the chat
routes' (`omlx.api.bodies.openai.Sampling`). Lenient exactly where Codex CLI needs it (CLIENTS.md):
hosted tools (``web_search``, ``tool_search``, ...) and unknown tool types are accepted and left out
by the route, a ``namespace`` tool holds function tools, earlier output items come back verbatim in
``input`` (each item is checked where it is mapped, `omlx.api.responses.input_to_messages`, which
names it). ``tool_choice`` naming a function, or forcing a call (``required``) when there is no
function tool, is checked in the route, against the flattened tools (those of ``additional_tools``
input items included); ``auto`` without tools is fine (Codex sends it). Must not: import sanic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from omlx.api.bodies.base import IntIn, Model, NonEmpty, Part, Tokens, rule, shape
from omlx.api.bodies.openai import Effort, Sampling


class FunctionTool(Part):
    type: Literal["function"]
    name: NonEmpty
    description: str | None = None
    parameters: Annotated[Any, Field(json_schema_extra={"type": ["object", "null"]})] = None
    strict: bool | None = None


class HostedTool(Part):
    """Any other tool type (web_search, custom, mcp, ...): accepted, not served by a local model."""


class NamespaceTool(Part):
    """Codex's group of function tools (``{"type": "namespace", "name", "tools": [...]}``)."""

    type: Literal["namespace"]
    name: str | None = None
    tools: list[Annotated[Union[Annotated[FunctionTool, Tag("Function")], Annotated[HostedTool, Tag("Other")]],
                          Discriminator(lambda v: "Function" if isinstance(v, dict) and v.get("type") == "function"
                                        else "Other")]] | None = None


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else None
    return {"function": "Function", "namespace": "Namespace"}.get(kind, "Hosted")


ResponsesTool = Annotated[Union[Annotated[FunctionTool, Tag("Function")], Annotated[NamespaceTool, Tag("Namespace")],
                                Annotated[HostedTool, Tag("Hosted")]], Discriminator(_tool_kind)]


def _input_problem(v: Any) -> str | None:
    return None if v is None or isinstance(v, (str, list)) else "'{param}' must be a string or an array of items"


def _choice_problem(v: Any) -> str | None:
    ok = v is None or v in ("none", "auto", "required") or isinstance(v, dict)
    return None if ok else "'{param}' must be 'none', 'auto', 'required' or an object"


Items = shape(_input_problem, {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}},
                                         {"type": "null"}]})
ToolChoice = shape(_choice_problem, {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"},
                                               {"type": "null"}]})


class Reasoning(Part):
    effort: Effort | None = None
    summary: str | None = None


class ResponsesRequest(Sampling):
    """``POST /v1/responses``."""

    model: Model
    input: Items = None
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    top_logprobs: IntIn(ge=0, le=20) | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: NonEmpty | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None
    conversation: Any = None
    prompt_cache_key: str | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        if self.conversation is not None:
            raise rule("conversation", "'conversation' is not supported here; send previous_response_id or the full input")
        return self

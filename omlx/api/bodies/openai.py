"""Request models of the OpenAI routes: ``POST /v1/chat/completions`` and ``/v1/completions``,
and the sampling fields the Responses API shares with them.

Fields, ranges and the combinations refused follow the OpenAI API reference (Chat Completions,
Completions, 2026): ``n`` / ``best_of`` other than 1 (omlx returns one choice), ``top_logprobs``
without ``logprobs``, ``stream_options`` without ``stream``, ``tool_choice`` other than ``none``
without ``tools`` or naming a function that is not there. Extensions accepted as vLLM and
mlx-lm accept them: ``top_k``, ``min_p``, ``repetition_penalty``, ``chat_template_kwargs``.
Rules that need the model (``logit_bias`` ids inside its vocabulary, ``prompt`` token ids, a
schema constrained decoding can enforce) are checked in the route. Must not: import sanic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from omlx.api.bodies.base import Body, IntIn, Model, NonEmpty, Part, Tokens, rule, shape
from omlx.request import SEED_MAX, SEED_MIN

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's ``reasoning_effort`` / ``reasoning.effort`` values (API reference, 2026)."""
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def _stop_problem(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return None
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        return "'{param}' must be a string or an array of strings"
    return "'{param}' may hold at most 4 strings" if len(v) > 4 else None  # OpenAI: "Up to 4 sequences"


Stop = shape(_stop_problem, {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                       {"type": "null"}]})


def _bias_problem(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        return "'{param}' must be an object of token id -> bias"
    for k, b in v.items():
        if not k.lstrip("-").isdigit():
            return f"'{{param}}' key {k!r} is not a token id"
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            return "'{param}' values must be numbers in [-100, 100]"
    return None


LogitBias = shape(_bias_problem, {"anyOf": [{"type": "object", "additionalProperties": {
    "type": "number", "minimum": -100, "maximum": 100}}, {"type": "null"}]})


class Sampling(Body):
    """The sampling fields of every OpenAI-shaped generation route (chat, completions, responses)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: IntIn(ge=0) | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: IntIn(ge=SEED_MIN, le=SEED_MAX) | None = None  # OpenAI's range: a signed 64-bit integer
    stop: Stop = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    logit_bias: LogitBias = None

    def stop_strings(self) -> tuple[str, ...]:
        v = self.stop
        return tuple(s for s in ([v] if isinstance(v, str) else v or ()) if s)


class JsonSchemaFormat(Part):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Part):
    """Structured outputs, enforced by constrained decoding (a schema it cannot enforce is a 400
    naming the keyword)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise rule("json_schema", "'{param}' must be an object with 'name' and 'schema'")
        return self


class StreamOptions(Part):
    include_usage: bool | None = None


def _one(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v != 1:
        raise PydanticCustomError("shape", "'{param}' must be 1: this server returns one choice per request")
    return v


One = Annotated[IntIn(ge=1, le=1), BeforeValidator(_one)]
"""``n`` / ``best_of``: 1 (the schema says minimum = maximum = 1), refused in words that say why."""


class OneChoice(Sampling):
    """Fields of the routes that return choices: streaming, ``n`` and ``best_of``."""

    model: Model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: One | None = None
    best_of: One | None = None
    max_tokens: Tokens | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _one_choice(self) -> OneChoice:
        if self.stream_options is not None and not self.stream:
            raise rule("stream_options", "'stream_options' is only allowed when 'stream' is true")
        return self


class FunctionSpec(Part):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Part):
    type: str | None = "function"
    function: FunctionSpec


def _tool_choice_problem(v: Any) -> str | None:
    if v is None or v in ("none", "auto", "required"):
        return None
    if not isinstance(v, dict):
        return "'{param}' must be 'none', 'auto', 'required' or an object"
    fn = v.get("function")
    if v.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return "'{param}' object must be {'type': 'function', 'function': {'name': ...}}"
    return None


ChatToolChoice = shape(_tool_choice_problem, {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}]})


def _content_problem(v: Any) -> str | None:
    if v is None or isinstance(v, (str, list)):
        return None
    return "'{param}' must be a string or an array of parts"


ChatContent = shape(_content_problem, {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}},
                                                 {"type": "null"}],
                                       "description": "null only for an assistant message with tool_calls"})


_CONTENT_REQUIRED = {"anyOf": [  # the _content_required rule, as JSON Schema
    {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    {"required": ["role", "tool_calls"], "properties": {"role": {"const": "assistant"},
                                                        "tool_calls": {"type": "array", "minItems": 1}}}]}


class ChatMessage(Part):
    """``content`` is required (not null) unless the message is an assistant's with ``tool_calls``."""

    model_config = ConfigDict(json_schema_extra=_CONTENT_REQUIRED)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: ChatContent = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):  # OpenAI: required unless tool_calls
            raise rule("content", "'{param}' is required (null only for an assistant message with tool_calls)")
        return self


class ChatCompletionRequest(OneChoice):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Tokens | None = None
    logprobs: bool | None = None
    top_logprobs: IntIn(ge=0, le=20) | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ChatToolChoice = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Effort | None = None

    @model_validator(mode="after")
    def _combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise rule("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        choice = self.tool_choice
        if choice is not None and choice != "none":
            if not self.tools:
                raise rule("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
            if isinstance(choice, dict) and choice["function"]["name"] not in {t.function.name for t in self.tools}:
                raise rule("tool_choice.function.name",
                           f"'tool_choice' names function {choice['function']['name']!r}, which is not in 'tools'")
        return self


def _prompt_problem(v: Any) -> str | None:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if isinstance(v, str):
        return None if v else "'{param}' must not be empty"
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    return "'{param}' must be a non-empty string or an array of token ids (one prompt per request)"


Prompt = shape(_prompt_problem, {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]})


class CompletionRequest(OneChoice):
    """``POST /v1/completions`` (legacy): one prompt, ``logprobs`` an integer 0-5."""

    prompt: Prompt
    logprobs: IntIn(ge=0, le=5) | None = None

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) else p

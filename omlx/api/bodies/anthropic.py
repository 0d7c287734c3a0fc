"""Request models of the Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Fields and ranges follow the Anthropic API reference (Messages, Count tokens, Extended thinking).
Lenient exactly where Claude Code needs it (CLIENTS.md): ``role: "system"`` inside ``messages``,
content blocks of any ``type`` (the mapping ignores those it has no text for), server tools
(``web_search_20250305``: a ``type`` and no ``input_schema``), unknown top-level fields
(``context_management``, ``output_config``). What a block must hold (a text block's ``text``, a
``tool_use``'s ``id``) is checked where it is mapped (`omlx.api.anthropic`), which names the block.
Must not: import sanic or map anything onto a chat template.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from omlx.api.bodies.base import MAX_TOKENS, Body, IntIn, Model, NonEmpty, Part, Tokens, rule, shape


def _is_blocks(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in v))


_BLOCK = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
          "description": "a content block (text, image, document, tool_use, tool_result, thinking, ...)"}
Content = shape(lambda v: None if _is_blocks(v) else "'{param}' must be a string or an array of content blocks (objects with a 'type')",
                {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]})


class AnthropicMessage(Part):
    """One turn; ``role: "system"`` is accepted (Claude Code sends it) and merged into the system prompt."""

    role: Literal["user", "assistant", "system"]
    content: Content


class AnthropicTool(Part):
    """A custom tool (``input_schema`` required) or a server tool (another ``type``, left out)."""

    name: NonEmpty
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> AnthropicTool:
        if self.input_schema is None and self.type in (None, "custom"):
            raise rule("input_schema", "a custom tool needs 'input_schema' (a JSON schema object)")
        return self


class AnthropicToolChoice(Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Part):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: IntIn(ge=1024, le=MAX_TOKENS) | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise rule("budget_tokens", "'thinking.budget_tokens' is required when thinking is enabled")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


_SYSTEM_BLOCK = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}, "cache_control": {"type": "object"}}}
System = shape(lambda v: None if v is None or _is_blocks(v) else "'{param}' must be a string or an array of text blocks",
               {"anyOf": [{"type": "string"}, {"type": "array", "items": _SYSTEM_BLOCK}, {"type": "null"}]})


class CountTokensRequest(Body):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: Model
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: System = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    max_tokens: Tokens | None = None

    @model_validator(mode="after")
    def _combinations(self) -> CountTokensRequest:
        tc = self.tool_choice
        if tc is not None and tc.type in ("any", "tool") and not self.tools:  # as Anthropic's API refuses it
            raise rule("tool_choice", f"'tool_choice' {tc.type!r} forces a tool call, which needs 'tools'")
        if tc is not None and tc.type == "tool" and tc.name not in {t.name for t in self.tools or ()}:
            raise rule("tool_choice.name", "'tool_choice.name' must name one of the request's tools")
        t = self.thinking
        if t is not None and t.budget_tokens is not None and self.max_tokens is not None and t.budget_tokens >= self.max_tokens:
            raise rule("thinking.budget_tokens", "'max_tokens' must be greater than 'thinking.budget_tokens'")
        return self


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Tokens
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: IntIn(ge=0) | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _thinking_rules(self) -> MessagesRequest:
        # Extended thinking, "Feature compatibility": not with temperature or top_k changes or
        # forced tool use; top_p only between 0.95 and 1.
        t = self.thinking
        if t is None or not t.on:
            return self
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise rule("tool_choice", "thinking may not be enabled when 'tool_choice' forces tool use "
                       "(use 'auto' or 'none', or disable thinking)")
        if self.temperature is not None and self.temperature != 1.0:
            raise rule("temperature", "'temperature' may only be 1 when thinking is enabled")
        if self.top_k is not None:
            raise rule("top_k", "'top_k' may not be set when thinking is enabled")
        if self.top_p is not None and self.top_p < 0.95:
            raise rule("top_p", "'top_p' must be between 0.95 and 1 when thinking is enabled")
        return self


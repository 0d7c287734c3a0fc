"""Rendering a conversation into prompt tokens with the model's own chat template.

All three APIs (OpenAI chat, Anthropic messages, OpenAI responses) convert their input into the
neutral message list below and call `render_prompt`. Normalisation applied everywhere:

- every ``system``/``developer`` message, wherever it stands, is merged into one leading system
  message, in order, joined with blank lines (templates such as Qwen's reject a later one);
- content given as a list of text parts is joined into a string; a part the model cannot read (an
  image, a file) becomes a placeholder naming its kind (`omlx.engine.content`);
- a trailing ``assistant`` message is a prefill: the prompt ends right after its text, with no
  end-of-turn and no new assistant header (``continue_final_message``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from omlx.engine import token_cache
from omlx.engine.content import DroppedContent, unreadable_kind
from omlx.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """Attributes:
    token_ids: the prompt's token ids.
    text: the templated prompt text.
    prefill: True when the prompt continues a trailing assistant message.
    """

    token_ids: list[int]
    text: str
    prefill: bool


def content_text(content: Any, *, param: str = "messages", dropped: DroppedContent | None = None) -> str:
    """Join OpenAI/Anthropic content (a string or a list of text parts) into one string.

    A part this text model cannot read (``image_url``, ``input_image``, ``input_audio``,
    ``file``, ``input_file``, ...: `omlx.engine.content`) becomes its placeholder, on a line of
    its own between the text parts (which are joined as they are).

    Args:
        param: where ``content`` is in the request (``messages[2].content``), for errors.
        dropped: counts the parts served as placeholders, or raises for them when strict; None
            serves them without counting.

    Raises:
        InvalidRequestError: for a part that is neither a string nor has text, and for an
            unreadable part when ``dropped.strict`` (param ``<param>[i]``).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        dropped = DroppedContent() if dropped is None else dropped
        out: list[str] = []
        after_placeholder = False
        for i, part in enumerate(content):
            if isinstance(part, str):
                text, is_placeholder = part, False
            elif isinstance(part, dict):
                kind = unreadable_kind(part.get("type"))
                if part.get("type") in ("text", "input_text", "output_text") or "text" in part:
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise InvalidRequestError(f"{param}: content part {i} has no text string", param=param)
                    is_placeholder = False
                elif kind is not None:
                    text = dropped.drop(
                        kind, f"{param}: content part {i} of type {part.get('type')!r} is not supported by this text model",
                        f"{param}[{i}]")
                    is_placeholder = True
                else:
                    raise InvalidRequestError(f"{param}: content part {i} has unknown type {part.get('type')!r}", param=param)
            else:
                raise InvalidRequestError(f"{param}: content part {i} must be an object", param=param)
            if out and text and (is_placeholder or after_placeholder):
                out.append("\n")  # a placeholder is a line of its own
            if text:
                out.append(text)
                after_placeholder = is_placeholder
        return "".join(out)
    raise InvalidRequestError(f"{param}: content must be a string or a list of parts", param=param)


def _template_tool_call(call: Any) -> Any:
    """Chat templates index ``function.arguments`` as a mapping; OpenAI sends a JSON string."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        except ValueError:
            pass
    return {**call, "function": fn}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge system/developer messages into one leading system message (see module doc).

    Messages keep any extra keys (``tool_calls``, ``tool_call_id``, ``name``) for the template.
    """
    system_parts: list[str] = []
    rest: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            text = content_text(m.get("content"))
            if text:
                system_parts.append(text)
        else:
            mm = dict(m)
            if mm.get("content") is None:  # else a template prints "None" into the prompt
                mm["content"] = ""
            elif not isinstance(mm.get("content"), str):
                mm["content"] = content_text(mm.get("content"))
            if mm.get("tool_calls"):
                mm["tool_calls"] = [_template_tool_call(c) for c in mm["tool_calls"]]
            rest.append(mm)
    if system_parts:
        return [{"role": "system", "content": "\n\n".join(system_parts)}] + rest
    return rest


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template may read the ``tools`` it is given.

    False only where it provably cannot, so leaving the tools out renders the same text:
    mlx-lm renders through the Hugging Face tokenizer's own Jinja path (no Python chat template of
    its own, no tokenizer class with an ``apply_chat_template`` of its own), the template is one
    string (of a dict of templates, transformers picks ``tool_use`` when tools are given), and that
    string never contains ``tools``: a Jinja template reads a variable only by naming it. It
    matters because transformers rebuilds the tools as plain data on every call
    (``_plain_template_data``), ~0.25 ms for Claude Code's 24 tools on a 2-core CPU, also for a
    template that never reads them (SmolLM2's, the default model's).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" in template:
        return True
    if getattr(tokenizer, "_chat_template", None) is not None:  # mlx-lm's Python chat template (a test pins the name)
        return True
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    owner = next((c for c in type(hf).__mro__ if "apply_chat_template" in vars(c)), None)
    return owner is None or owner.__name__ != "PreTrainedTokenizerBase"


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    reads_tools: bool = True,
    enable_thinking: bool | None = None,
    template_kwargs: dict[str, Any] | None = None,
    param: str = "messages",
) -> RenderedPrompt:
    """Apply the model's chat template to normalized messages.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper (HF tokenizer inside).
        messages: role/content dicts (roles: system, user, assistant, tool).
        tools: OpenAI-style function tools for templates that take them.
        reads_tools: False leaves ``tools`` out of the template call, for a template that never
            reads them (the same text, without transformers' per-call copy of the tools): the
            model's `LoadedModel.template_reads_tools`, decided once at load.
        enable_thinking: passed to templates with a thinking switch (None: template default).
        param: the body field the messages came from (``messages``, Responses' ``input``), named
            when none is left to answer.

    Raises:
        InvalidRequestError: no messages, or the template rejects the conversation.
    """
    msgs = normalize_messages(messages)
    if not msgs:
        raise InvalidRequestError(f"'{param}' must contain at least one user or assistant message", param=param)
    prefill = msgs[-1].get("role") == "assistant" and not msgs[-1].get("tool_calls")
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools and reads_tools:
        kwargs["tools"] = tools
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if getattr(tokenizer, "has_chat_template", True) and getattr(tokenizer, "chat_template", None) is not None:
        try:
            text = tokenizer.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                **kwargs,
            )
        except Exception as e:  # jinja raise_exception() and template errors are client-visible
            raise InvalidRequestError(f"the model's chat template rejected the messages: {e}", param="messages") from e
        ids = token_cache.encode(tokenizer, text, add_special_tokens=False)  # the template wrote any BOS itself
    else:
        # No template (a base model): plain text, with the tokenizer's own special tokens (a
        # BOS, as /v1/completions adds it; Gemma without its BOS only repeats tokens).
        text = "\n".join(m.get("content") or "" for m in msgs)
        ids = token_cache.encode(tokenizer, text, add_special_tokens=True)
    return RenderedPrompt(token_ids=ids, text=text, prefill=prefill)

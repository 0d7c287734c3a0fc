"""Anthropic Messages API routes: POST /v1/messages (streaming and not), /v1/messages/count_tokens.

Request JSON (validated by `omlx.api.bodies.anthropic` before the model is leased) -> the neutral
chat messages of `omlx.engine.chat` and a `Turn` for `omlx.api.prepare` (which renders them with
the model's own chat template and lays its ``[models."<id>"]`` defaults under the request's
sampling); engine events -> `ModelTurn` (answer text, reasoning, tool calls in the model's dialect)
-> `MessageBuilder` (anthropic_framing.py), which orders the Message and its SSE events. Shapes follow
the Anthropic API reference (Messages, Count tokens, Streaming Messages, Errors). Errors answer in
Anthropic's shape because the route's path starts with /v1/messages (omlx.api.errors); query
strings such as ``?beta=true`` play no part in routing. Must not: touch mlx, build error JSON
itself, or know a tool-call dialect's markers.

Mapping onto the chat template (HF templates take OpenAI-style tool messages):
- ``system`` (a string or text blocks; ``cache_control`` ignored) and ``role: "system"`` messages
  anywhere in ``messages`` -> system messages, merged by `normalize_messages`;
- assistant ``tool_use`` -> ``tool_calls`` ``[{id, type: "function", function: {name, arguments}}]``
  (``arguments`` as an object, which is what HF templates expect); ``thinking`` ->
  ``reasoning_content`` (signatures are not checked); user ``tool_result`` -> ``role: "tool"``;
- ``image``, ``document`` (but one with a text source: its text), ``file`` and ``container_upload``
  blocks, in a message or inside a ``tool_result`` -> a placeholder naming the kind where the
  block was (`omlx.engine.content`); with ``strict_content`` a 400 naming the block;
- ``tools[].input_schema`` (and ``strict``) -> OpenAI function tools; ``tool_choice: none`` drops them;
- ``thinking`` enabled/adaptive -> the template's ``enable_thinking=True``; disabled -> False; absent
  -> the model's ``enable_thinking`` setting, else False; the model's reasoning becomes
  ``thinking`` blocks only when thinking is on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.anthropic_framing import MessageBuilder, SseEvent, scale_tokens, to_sse
from omlx.api.bodies.anthropic import CountTokensRequest, MessagesRequest
from omlx.api.holds import holding, holds_of
from omlx.api.params import get_list
from omlx.api.prepare import Ask, Think, Turn, prepare, render, thinking_of
from omlx.api.structured import forced_tool_call
from omlx.api.sse import KEEPALIVE, SSE_COMMENT_KEEPALIVE, SSE_HEADERS, EventStream
from omlx.api.turn import ContentDelta, ModelTurn, ReasoningDelta
from omlx.engine.content import KIND_OF_TYPE, DroppedContent
from omlx.errors import EngineError, InvalidRequestError, OmlxError
from omlx.pool import PoolEntry
from omlx.request import Admitted, Failed, Finished

logger = logging.getLogger(__name__)

bp = Blueprint("anthropic", url_prefix="/v1")

# Claude Code's first system block is per-request billing metadata, not instructions; keeping it
# would change the prompt's first tokens on every request and defeat the prefix cache.
_BILLING_PREFIX = "x-anthropic-billing-header:"
_MEDIA_TYPES = ("image", "document", "file", "container_upload")


@dataclass(slots=True)
class ChatInput:
    """An Anthropic request mapped onto the chat template's terms.

    Attributes:
        messages: role/content dicts for `render_prompt` (system merged later).
        tools: OpenAI-style function tools, or None.
        enable_thinking: the template's thinking switch.
        max_tool_calls: 1 when the client disabled parallel tool use, else None.
        dropped: the content this text model cannot read, served as placeholders.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool
    max_tool_calls: int | None
    dropped: DroppedContent = field(default_factory=DroppedContent)


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a string is one text block).

    Raises:
        InvalidRequestError: content is neither a string nor a list of objects with a ``type``.
    """
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or an array of content blocks", param=param)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise InvalidRequestError(f"{param}[{j}] must be an object with a 'type'", param=f"{param}[{j}]")
    return content


def _block_text(b: dict[str, Any], param: str, dropped: DroppedContent | None) -> str | None:
    """The text of a text-like block; None for a block type that carries no text for the model.

    An image, a document without a text source, a file or a container upload becomes its
    placeholder (`omlx.engine.content`), counted in ``dropped``.

    Raises:
        InvalidRequestError: a text block without a string, or (``dropped.strict``) content this
            text model cannot read.
    """
    kind = b["type"]
    if kind == "text":
        text = b.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param}.text must be a string", param=param)
        return text
    if kind == "document" and isinstance(b.get("source"), dict) and b["source"].get("type") == "text":
        data = b["source"].get("data")
        if isinstance(data, str):
            return data
    if kind in _MEDIA_TYPES:
        return (dropped or DroppedContent()).drop(
            KIND_OF_TYPE[kind], f"{param}: content of type {kind!r} is not supported by this text model", param)
    logger.debug("ignoring content block of type %r at %s", kind, param)
    return None


def _text_of(content: Any, param: str, dropped: DroppedContent | None, sep: str = "\n\n") -> str:
    """Join the text blocks of ``content`` (media become placeholders; other types are ignored)."""
    if content is None:
        return ""
    parts = []
    for j, b in enumerate(_blocks(content, param)):
        t = _block_text(b, f"{param}[{j}]", dropped)
        if t:
            parts.append(t)
    return sep.join(parts)


def system_text(system: Any, dropped: DroppedContent | None = None) -> str:
    """``system``: a string or a list of text blocks -> one string (billing metadata dropped).

    Raises:
        InvalidRequestError: not a string or an array of text blocks.
    """
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    parts = []
    for j, b in enumerate(_blocks(system, "system")):
        t = _block_text(b, f"system[{j}]", dropped)
        if t and not t.startswith(_BILLING_PREFIX):
            parts.append(t)
    return "\n\n".join(parts)


def _assistant(content: Any, param: str, tool_names: dict[str, str], dropped: DroppedContent | None) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(_blocks(content, param)):
        p = f"{param}[{j}]"
        kind = b["type"]
        if kind == "tool_use":
            cid, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not isinstance(cid, str) or not isinstance(name, str) or not name:
                raise InvalidRequestError(f"{p}: a tool_use block needs a string 'id' and 'name'", param=p)
            if not isinstance(args, dict):
                raise InvalidRequestError(f"{p}.input must be an object", param=f"{p}.input")
            tool_names[cid] = name
            calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "thinking":
            t = b.get("thinking")
            if not isinstance(t, str):
                raise InvalidRequestError(f"{p}.thinking must be a string", param=f"{p}.thinking")
            thinking.append(t)  # the signature may be any string, '' included: not checked
        elif kind == "redacted_thinking":
            continue
        else:
            t = _block_text(b, p, dropped)
            if t:
                texts.append(t)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    return msg


def _user(content: Any, param: str, tool_names: dict[str, str], dropped: DroppedContent | None) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(_blocks(content, param)):
        p = f"{param}[{j}]"
        if b["type"] == "tool_result":
            cid = b.get("tool_use_id")
            if not isinstance(cid, str):
                raise InvalidRequestError(f"{p}.tool_use_id must be a string", param=f"{p}.tool_use_id")
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            msg = {"role": "tool", "tool_call_id": cid, "content": _text_of(b.get("content"), f"{p}.content", dropped, "\n")}
            if cid in tool_names:
                msg["name"] = tool_names[cid]
            out.append(msg)
        else:
            t = _block_text(b, p, dropped)
            if t:
                texts.append(t)
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def messages_from_anthropic(messages: list[Any], system: Any = None,
                            dropped: DroppedContent | None = None) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` -> chat-template messages (see the module doc).

    Args:
        dropped: counts the images, documents and files served as placeholders (at the top level
            of a message and inside ``tool_result`` content), or raises for them when strict;
            None serves them without counting.

    Raises:
        InvalidRequestError: names the message or block at fault.
    """
    out: list[dict[str, Any]] = []
    sys_text = system_text(system, dropped)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    tool_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{param} must be an object", param=param)
        role = m.get("role")
        content = m.get("content")
        if role not in ("user", "assistant", "system"):
            raise InvalidRequestError(f"{param}.role must be 'user' or 'assistant'", param=f"{param}.role")
        if content is None:
            raise InvalidRequestError(f"{param}.content is required", param=f"{param}.content")
        if role == "system":
            out.append({"role": "system", "content": system_text(content, dropped) if not isinstance(content, str) else content})
        elif role == "assistant":
            out.append(_assistant(content, f"{param}.content", tool_names, dropped))
        else:
            out.extend(_user(content, f"{param}.content", tool_names, dropped))
    return out


def tools_from_anthropic(tools: list[Any]) -> list[dict[str, Any]]:
    """``tools`` (name, description, input_schema) -> OpenAI function tools for the template.

    Anthropic server tools (a ``type`` other than ``custom`` and no ``input_schema``, e.g.
    ``web_search_20250305``) cannot run here and are left out.

    Raises:
        InvalidRequestError: a tool without a name, or a custom tool without an input_schema.
    """
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise InvalidRequestError(f"{p} must be an object with a non-empty 'name'", param=p)
        schema = t.get("input_schema")
        if schema is None and t.get("type") not in (None, "custom"):
            logger.debug("leaving out server tool %s (%s)", t["name"], t.get("type"))
            continue
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{p}.input_schema must be a JSON schema object", param=f"{p}.input_schema")
        desc = t.get("description")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": desc if isinstance(desc, str) else "", "parameters": schema,
            **({"strict": True} if t.get("strict") is True else {})}})  # the call check keeps strict calls exact
    return out


def thinking_enabled(body: dict[str, Any], max_tokens: int | None) -> bool:
    """``thinking``: absent or disabled -> False; enabled (budget_tokens >= 1024 and < max_tokens)
    or adaptive -> True.

    Raises:
        InvalidRequestError: a malformed ``thinking`` object.
    """
    t = body.get("thinking")
    if t is None:
        return False
    if not isinstance(t, dict):
        raise InvalidRequestError("'thinking' must be an object", param="thinking")
    kind = t.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise InvalidRequestError("'thinking.budget_tokens' must be an integer", param="thinking.budget_tokens")
        if budget < 1024:
            raise InvalidRequestError("'thinking.budget_tokens' must be >= 1024", param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequestError("'max_tokens' must be greater than 'thinking.budget_tokens'", param="thinking.budget_tokens")
        return True
    raise InvalidRequestError("'thinking.type' must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type")


def chat_input(body: dict[str, Any], max_tokens: int | None, *, strict_content: bool = False) -> ChatInput:
    """Map the request body (messages, system, tools, tool_choice, thinking) onto the template.

    Args:
        strict_content: content this text model cannot read is a 400 (else a placeholder).

    Raises:
        InvalidRequestError: missing or malformed fields (the error names the field).
    """
    dropped = DroppedContent(strict=strict_content)
    messages = messages_from_anthropic(get_list(body, "messages", non_empty=True), body.get("system"), dropped)
    tools = tools_from_anthropic(get_list(body, "tools", [])) or None
    max_tool_calls = None
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
            raise InvalidRequestError("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
        if tc["type"] == "tool":
            names = {t["function"]["name"] for t in tools or []}
            if tc.get("name") not in names:
                raise InvalidRequestError("'tool_choice.name' must name one of the request's tools", param="tool_choice.name")
        if tc["type"] == "none":
            tools = None
        if tc.get("disable_parallel_tool_use") is True:
            max_tool_calls = 1
    return ChatInput(messages, tools, thinking_enabled(body, max_tokens), max_tool_calls, dropped)


def context_scale(http: HttpRequest, entry: PoolEntry) -> float:
    """Factor applied to reported token counts (``context_scale_to / model context``; 1 = off)."""
    to = http.app.ctx.config.context_scale_to
    return to / entry.loaded.context_length if to else 1.0


def _turn(body: CountTokensRequest, data: dict[str, Any], scale: float, *,
          strict_content: bool) -> tuple[Turn, ChatInput]:
    """A validated Messages (or count_tokens) body -> (the neutral turn, the mapped chat input,
    whose ``dropped`` counts the content served as placeholders)."""
    chat = chat_input(data, body.max_tokens, strict_content=strict_content)
    tc = body.tool_choice

    def constrain(entry: PoolEntry, think: Think, in_reasoning: bool):
        if chat.tools and tc is not None and tc.type in ("any", "tool"):
            return forced_tool_call(entry, chat.tools, tc.name if tc.type == "tool" else None, param="tool_choice",
                                    think=think, in_reasoning=in_reasoning)
        return None, None

    def too_long(num_prompt: int, ctx: int) -> str:
        # Claude Code recognizes this wording (and its numbers) and compacts the conversation.
        return f"prompt is too long: {scale_tokens(num_prompt, scale)} tokens > {scale_tokens(ctx - 1, scale)} maximum"

    ask = Ask()
    if isinstance(body, MessagesRequest):
        ask = Ask(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  stop=tuple(s for s in body.stop_sequences or () if s))
    # thinking absent: the model's enable_thinking setting, else off
    turn = Turn(messages=chat.messages, tools=chat.tools, thinking=chat.enable_thinking if body.thinking else None,
                thinking_default=False, ask=ask, max_tokens=body.max_tokens, constrain=constrain, too_long=too_long)
    return turn, chat


# ---- routes ----------------------------------------------------------------------------------


def frame(builder: MessageBuilder, ev: Any) -> list[SseEvent]:
    """One `ModelTurn` content event (answer text, reasoning, tool-call events) -> stream events."""
    if isinstance(ev, ContentDelta):
        return builder.text(ev.text)
    if isinstance(ev, ReasoningDelta):
        return builder.thinking(ev.text)
    return builder.feed(ev)


@bp.post("/messages")
@holding("chat", MessagesRequest)
async def create_message(http: HttpRequest):
    holds = holds_of(http)  # owns the lease and the engine request: released when the route ends
    body = holds.parsed.body
    entry = holds.chat_entry(body.model)
    scale = context_scale(http, entry)
    turn_in, chat = _turn(body, holds.parsed.data, scale, strict_content=http.app.ctx.config.strict_content)
    p = prepare(entry, turn_in, holds.request_id)
    http.app.ctx.metrics.dropped_content("anthropic", holds.request_id, chat.dropped)
    await holds.checkpoint("prepared")
    es = EventStream(entry.engine, p.request, http.app.ctx.config.keepalive_s,
                     observer=http.app.ctx.metrics.observe)
    # a full queue raises RateLimitError here: a 429 with retry-after, before any SSE
    turn = holds.start(ModelTurn(es, tool_dialect=p.tool_dialect, tools=chat.tools, think=p.think,
                                 in_reasoning=p.in_reasoning))
    await holds.checkpoint("submitted")
    builder = MessageBuilder(body.model, p.request.num_prompt_tokens, scale=scale, max_tool_calls=chat.max_tool_calls,
                             message_id="msg_" + holds.request_id)  # the request's one id, as in its log lines
    if body.stream:
        return await _stream(http, turn, builder)
    return await _collect(turn, builder)


async def _collect(turn: ModelTurn, builder: MessageBuilder):
    async for ev in turn.events(keepalive=False):
        if isinstance(ev, Failed):
            raise ev.error if isinstance(ev.error, OmlxError) else EngineError(str(ev.error))
        if isinstance(ev, Finished):
            builder.finish(ev)
            return json_response(builder.message)
        frame(builder, ev)
    raise EngineError("generation ended without a result")


async def _stream(http: HttpRequest, turn: ModelTurn, builder: MessageBuilder):
    resp = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
    await holds_of(http).checkpoint("responded")
    started = False  # message_start waits for Admitted, so its usage knows the cache hit
    out: list[SseEvent] = []  # the stream events of the batch being framed
    idle_text_after_s = http.app.ctx.config.idle_text_after_s
    t0 = time.monotonic()
    try:
        # One send per batch of engine events: all its stream events go out in one write.
        async for batch in turn.batches(admitted=True):
            if batch is KEEPALIVE:
                if idle_text_after_s is not None and time.monotonic() - t0 >= idle_text_after_s:
                    # a long silence: events Claude Code's idle watchdog counts (config.py)
                    if not started:
                        started = True
                        out += builder.start()  # the cache hit is not known yet: 0 cached here
                    events, out = out + builder.idle_text(), []
                    await resp.send(to_sse(events))
                    continue
                # still queued: a comment keeps the connection alive; then pings
                await resp.send(to_sse([builder.ping()]) if started else SSE_COMMENT_KEEPALIVE)
                continue
            for ev in batch:
                if not started:
                    started = True
                    out += builder.start(ev.num_cached_tokens if isinstance(ev, Admitted) else 0)
                if isinstance(ev, Admitted):
                    continue
                if isinstance(ev, Failed):
                    out += builder.fail(ev.error if isinstance(ev.error, OmlxError) else EngineError(str(ev.error)))
                elif isinstance(ev, Finished):
                    out += builder.finish(ev)
                else:
                    out += frame(builder, ev)
            if out:
                events, out = out, []
                await resp.send(to_sse(events))
    except Exception as e:  # after the 200 the only way to report is an in-stream error event
        if builder.done:
            raise
        logger.exception("stream of %s failed", builder.message["id"])
        err = e if isinstance(e, OmlxError) else EngineError(f"internal error: {type(e).__name__}: {e}")
        if not started:
            out += builder.start()
        await resp.send(to_sse(out + builder.fail(err)))  # what the batch decided before the fault, then the error
    await resp.eof()
    return None


@bp.post("/messages/count_tokens")
@holding("chat", CountTokensRequest)
async def count_tokens(http: HttpRequest):
    """``{"input_tokens": N}``: N is the prompt the same body would send to /v1/messages.

    Content the model cannot read counts as its placeholder (and is a 400 with
    ``strict_content``), as in /v1/messages. It is not logged or counted in
    ``omlx_dropped_content_total``: clients count tokens for the conversation they then send
    (Claude Code does, on every turn), so the metric counts only what a generation left out.
    """
    holds = holds_of(http)
    entry = holds.chat_entry(holds.parsed.body.model)
    scale = context_scale(http, entry)
    turn, _ = _turn(holds.parsed.body, holds.parsed.data, scale, strict_content=http.app.ctx.config.strict_content)
    n = len(render(entry, turn, thinking_of(entry, turn)).token_ids)
    await holds.checkpoint("prepared")
    return json_response({"input_tokens": scale_tokens(n, scale)})


# ---- /v1/models in Anthropic's shape (served by the OpenAI route when anthropic-version is sent)


def model_json(model_id: str, started_at: float) -> dict[str, Any]:
    """One model in the Anthropic Models API shape."""
    created = datetime.fromtimestamp(int(started_at), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": created}


def models_list_json(ids: list[str], started_at: float) -> dict[str, Any]:
    """``{data, has_more, first_id, last_id}`` as the Anthropic SDK's ``models.list`` expects."""
    return {
        "data": [model_json(i, started_at) for i in ids],
        "has_more": False,
        "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None,
    }


def wants_anthropic_shape(http: HttpRequest) -> bool:
    """Anthropic clients send ``anthropic-version`` on every request; OpenAI clients never do."""
    return "anthropic-version" in http.headers


"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Request JSON (validated by `omlx.api.bodies.openai`) -> a neutral `Turn` -> `prepare`, engine
events -> OpenAI's JSON or SSE chunks. Shapes follow the OpenAI API reference (Chat Completions,
Completions, Models). A streamed choice carries exactly one non-null ``finish_reason``; with
``stream_options.include_usage`` a last chunk with ``choices: []`` and the usage precedes
``data: [DONE]``.
"""

from __future__ import annotations

import time
from urllib.parse import unquote
from dataclasses import dataclass, field
from typing import Any

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api import anthropic as anthropic_routes
from omlx.api.bodies.openai import ChatCompletionRequest, CompletionRequest, Sampling
from omlx.api.holds import RequestHolds, holding, holds_of
from omlx.api.openai_framing import ChunkFramer, finish_reason, legacy_logprobs, logprob_json, usage_json
from omlx.api.prepare import Ask, Prepared, Think, Turn, prepare
from omlx.api.sse import KEEPALIVE, SSE_COMMENT_KEEPALIVE, SSE_HEADERS, EventStream
from omlx.api.structured import forced_tool_call, response_format, strict_tool_calls
from omlx.api.turn import ModelTurn
from omlx.engine.chat import content_text
from omlx.engine.content import DroppedContent
from omlx.errors import EngineError, OmlxError
from omlx.pool import PoolEntry

bp = Blueprint("openai", url_prefix="/v1")


def ask_of(body: Sampling, *, logprobs: bool = False, top_logprobs: int = 0) -> Ask:
    """The sampling fields every OpenAI-shaped route shares (chat, completions, responses)."""
    return Ask(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
               repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
               frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop_strings(),
               logit_bias=body.logit_bias, logprobs=logprobs, top_logprobs=top_logprobs)


def _messages(messages: list[dict[str, Any]], dropped: DroppedContent) -> list[dict[str, Any]]:
    """Content given as parts joined into its text here (`content_text`), so a part the model
    cannot read becomes its placeholder, counted in ``dropped`` (a 400 when it is strict)."""
    return [{**m, "content": content_text(m["content"], param=f"messages[{i}].content", dropped=dropped)}
            if isinstance(m.get("content"), list) else m for i, m in enumerate(messages)]


def _chat_turn(body: ChatCompletionRequest, data: dict[str, Any], request_id: str,
               dropped: DroppedContent) -> tuple[Turn, list[dict[str, Any]] | None]:
    """A chat completion -> (the neutral turn, the tools whose calls are parsed)."""
    tools = data.get("tools") or None
    choice = body.tool_choice
    ctk = dict(body.chat_template_kwargs or {})
    thinking = ctk.pop("enable_thinking", None)
    if thinking is None and body.reasoning_effort is not None:
        thinking = body.reasoning_effort != "none"
    parse_tools = tools if (tools and choice != "none") else None
    fmt = data.get("response_format")

    def constrain(entry: PoolEntry, think: Think, in_reasoning: bool):
        if tools and (choice == "required" or isinstance(choice, dict)):
            only = choice["function"]["name"] if isinstance(choice, dict) else None
            return forced_tool_call(entry, tools, only, param="tool_choice", think=think, in_reasoning=in_reasoning)
        c = response_format(entry, fmt, think=think, in_reasoning=in_reasoning)
        if c is None and parse_tools:
            c = strict_tool_calls(entry, parse_tools, request_id=request_id)
        return c, None

    ask = ask_of(body, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0)
    turn = Turn(messages=_messages(data["messages"], dropped), tools=tools, thinking=thinking, template_kwargs=ctk, ask=ask,
                max_tokens=body.max_completion_tokens or body.max_tokens, default_max_tokens=4096, constrain=constrain)
    return turn, parse_tools


def _completion_turn(body: CompletionRequest, data: dict[str, Any]) -> Turn:
    fmt = data.get("response_format")
    lp = body.logprobs
    return Turn(prompt=body.prompt_value(), ask=ask_of(body, logprobs=lp is not None, top_logprobs=lp or 0),
                max_tokens=body.max_tokens, default_max_tokens=16, param="prompt",
                constrain=lambda entry, think, in_reasoning: (response_format(entry, fmt), None))


@dataclass(slots=True)
class _Prepared:
    p: Prepared
    model_name: str
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] | None = None
    dropped: DroppedContent = field(default_factory=DroppedContent)  # content parts served as placeholders

    @property
    def request(self):
        return self.p.request


def _prepare(holds: RequestHolds, *, chat: bool, strict_content: bool) -> _Prepared:
    body, data = holds.parsed.body, holds.parsed.data
    entry = holds.chat_entry(body.model)
    dropped = DroppedContent(strict=strict_content)
    if chat:
        turn, parse_tools = _chat_turn(body, data, holds.request_id, dropped)
    else:
        turn, parse_tools = _completion_turn(body, data), None
    include_usage = bool(body.stream_options and body.stream_options.include_usage is True)
    return _Prepared(prepare(entry, turn, holds.request_id), body.model, body.stream, include_usage, parse_tools, dropped)


@bp.route("/models", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def list_models(http: HttpRequest):
    if anthropic_routes.wants_anthropic_shape(http):  # one route, both SDKs' shapes
        return json_response(anthropic_routes.models_list_json(http.app.ctx.pool.listed_ids(), http.app.ctx.started_at))
    created = int(http.app.ctx.started_at)
    data = [{"id": mid, "object": "model", "created": created, "owned_by": "omlx"} for mid in http.app.ctx.pool.listed_ids()]
    return json_response({"object": "list", "data": data})


@bp.route("/models/<model_id:path>", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def get_model(http: HttpRequest, model_id: str):
    model_id = unquote(model_id)  # SDKs percent-encode ids such as "org/model"
    http.app.ctx.pool.resolve_id(model_id)
    if anthropic_routes.wants_anthropic_shape(http):
        return json_response(anthropic_routes.model_json(model_id, http.app.ctx.started_at))
    return json_response({"id": model_id, "object": "model", "created": int(http.app.ctx.started_at), "owned_by": "omlx"})


@bp.post("/chat/completions")
@holding("chat", ChatCompletionRequest)
async def chat_completions(http: HttpRequest):
    return await _serve(http, chat=True)


@bp.post("/completions")
@holding("chat", CompletionRequest)
async def completions(http: HttpRequest):
    return await _serve(http, chat=False)


async def _serve(http: HttpRequest, *, chat: bool):
    holds = holds_of(http)  # owns the lease and the engine request: released when the route ends
    p = _prepare(holds, chat=chat, strict_content=http.app.ctx.config.strict_content)
    http.app.ctx.metrics.dropped_content("openai", holds.request_id, p.dropped)
    await holds.checkpoint("prepared")
    es = EventStream(p.p.entry.engine, p.request, http.app.ctx.config.keepalive_s,
                     observer=http.app.ctx.metrics.observe)
    turn = holds.start(ModelTurn(es, tool_dialect=p.p.tool_dialect, tools=p.tools, think=p.p.think,
                                 in_reasoning=p.p.in_reasoning))
    await holds.checkpoint("submitted")
    rid = ("chatcmpl-" if chat else "cmpl-") + holds.request_id  # the request's one id, as in its log lines
    created = int(time.time())
    if p.stream:
        return await _stream(http, turn, p, rid, created, chat)
    return await _collect(turn, p, rid, created, chat)


def tool_call_json(c: Any) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


async def _collect(turn: ModelTurn, p: _Prepared, rid: str, created: int, chat: bool):
    try:
        res = await turn.collect()
    except OmlxError:
        raise
    except Exception as e:
        raise EngineError(str(e)) from e
    fin = res.finished
    if fin is None:
        raise EngineError("generation ended without a result")
    want = p.request.sampling.logprobs
    reason = finish_reason(fin, len(res.tool_calls))
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": res.content if (res.content or not res.tool_calls) else None}
        if res.reasoning:
            message["reasoning_content"] = res.reasoning
        if res.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in res.tool_calls]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [logprob_json(x) for x in res.logprobs]} if want else None,
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": res.content, "logprobs": legacy_logprobs(res.logprobs) if want else None, "finish_reason": reason}
        obj = "text_completion"
    return json_response({
        "id": rid, "object": obj, "created": created, "model": p.model_name,
        "choices": [choice], "usage": usage_json(fin.usage),
    })


async def _stream(http: HttpRequest, turn: ModelTurn, p: _Prepared, rid: str, created: int, chat: bool):
    resp = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
    await holds_of(http).checkpoint("responded")
    framer = ChunkFramer(rid, created, p.model_name, chat=chat, include_usage=p.include_usage,
                         want_logprobs=p.request.sampling.logprobs)
    if chat:
        await resp.send(framer.role())
    # One send per batch of engine events: all its chunks go out in one write.
    async for batch in turn.batches():
        if batch is KEEPALIVE:
            await resp.send(SSE_COMMENT_KEEPALIVE)
            continue
        out = "".join([framer.frame(ev, turn.num_tool_calls) for ev in batch])
        if out:
            await resp.send(out)
    await resp.eof()
    return None

"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Request JSON -> `Request` (through the shared chat renderer and `SamplingParams`), engine events
-> OpenAI's JSON or SSE chunks. Shapes follow the OpenAI API reference (Chat Completions,
Completions, Models). A streamed choice carries exactly one non-null ``finish_reason``; with
``stream_options.include_usage`` a last chunk with ``choices: []`` and the usage precedes
``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from urllib.parse import unquote
from dataclasses import dataclass, field, replace
from typing import Any

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api import anthropic as anthropic_routes
from omlx.api.holds import holding, holds_of
from omlx.api.params import (
    get_bool,
    get_effort,
    get_float,
    get_int,
    get_list,
    get_logit_bias,
    get_stop,
    get_str,
    parse_json_object,
)
from omlx.api.openai_framing import ChunkFramer, finish_reason, legacy_logprobs, logprob_json, usage_json
from omlx.api.sse import KEEPALIVE, SSE_COMMENT_KEEPALIVE, SSE_HEADERS, EventStream
from omlx.api.structured import forced_tool_call, response_format, strict_tool_calls
from omlx.api.turn import ModelTurn
from omlx.engine.chat import content_text, render_prompt
from omlx.engine.content import DroppedContent
from omlx.errors import ContextLengthError, EngineError, InvalidRequestError, OmlxError
from omlx.pool import PoolEntry
from omlx.request import Request, SamplingParams

bp = Blueprint("openai", url_prefix="/v1")


def sampling_from_openai(body: dict[str, Any], entry: PoolEntry, num_prompt_tokens: int, *, chat: bool) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams, validated; max_tokens clamped to the context.

    Raises:
        InvalidRequestError: a field has the wrong type or range (names the field).
        ContextLengthError: the prompt alone fills the model's context.
    """
    ctx = entry.loaded.context_length
    if num_prompt_tokens >= ctx:
        raise ContextLengthError(
            f"the prompt is {num_prompt_tokens} tokens; this model's context is {ctx} tokens", param="messages" if chat else "prompt"
        )
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise InvalidRequestError("'n' must be 1: this server returns one choice per request", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != 1):
        raise InvalidRequestError("'best_of' must be 1: this server returns one choice per request", param="best_of")
    mt = get_int(body, "max_completion_tokens", None, lo=1)
    if mt is None:
        mt = get_int(body, "max_tokens", None, lo=1)
    room = ctx - num_prompt_tokens
    d = entry.settings  # the model's [models."<id>"] defaults, with the request's profile laid over them
    if d.max_output_tokens:
        room = min(room, d.max_output_tokens)
    max_tokens = min(mt, room) if mt is not None else min(room, d.default_max_tokens or (4096 if chat else 16))
    logprobs_flag = body.get("logprobs")
    top_logprobs = 0
    if chat:
        want_logprobs = get_bool(body, "logprobs", False)
        top_logprobs = get_int(body, "top_logprobs", 0, lo=0, hi=20)
        if top_logprobs and not want_logprobs:
            raise InvalidRequestError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    else:  # legacy completions: logprobs is an integer 0..5
        lp = get_int(body, "logprobs", None, lo=0, hi=5) if logprobs_flag is not None else None
        want_logprobs = lp is not None
        top_logprobs = lp or 0
    seed = get_int(body, "seed", None)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=get_float(body, "temperature", _or(d.default_temperature, 1.0), lo=0.0, hi=2.0),
        top_p=get_float(body, "top_p", _or(d.default_top_p, 1.0), lo=0.0, hi=1.0),
        top_k=get_int(body, "top_k", _or(d.default_top_k, 0), lo=0),
        min_p=get_float(body, "min_p", _or(d.default_min_p, 0.0), lo=0.0, hi=1.0),
        seed=seed,
        stop=get_stop(body, max_items=4),  # OpenAI: "Up to 4 sequences"
        presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=get_float(body, "repetition_penalty", _or(d.default_repetition_penalty, 1.0), lo=0.01, hi=10.0),
        logit_bias=get_logit_bias(body, len(entry.loaded.tokenizer)),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def validate_tools(tools: list[Any] | None, param: str = "tools") -> list[dict[str, Any]] | None:
    """OpenAI function tools: each ``{"type": "function", "function": {"name", ...}}``."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{param}[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"{param}[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"{param}[{i}].function.parameters must be a JSON schema object", param=f"{param}[{i}].function.parameters")
    return tools


def validate_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """OpenAI ``tool_choice``: ``none``/``auto``/``required`` or ``{"type": "function",
    "function": {"name": N}}`` where N is one of ``tools``; anything but ``none`` needs tools.

    Raises:
        InvalidRequestError: a bad value, a name not in ``tools``, or a choice without tools.
    """
    if choice is None:
        return None
    if not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
        raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or an object", param="tool_choice")
    if choice == "none":
        return choice
    if not tools:
        raise InvalidRequestError("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError("'tool_choice' object must be {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise InvalidRequestError(f"'tool_choice' names function {name!r}, which is not in 'tools'", param="tool_choice.function.name")
    return choice


def _validate_messages(messages: list[Any], dropped: DroppedContent) -> list[dict[str, Any]]:
    """Each message checked; content given as parts joined into its text here (`content_text`),
    so a part the model cannot read becomes its placeholder, counted in ``dropped``."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise InvalidRequestError(f"messages[{i}].role must be one of system, developer, user, assistant, tool", param=f"messages[{i}].role")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise InvalidRequestError(f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content")
        if c is None and not (role == "assistant" and m.get("tool_calls")):  # OpenAI: required unless tool_calls
            raise InvalidRequestError(f"messages[{i}].content is required (null only for an assistant message with tool_calls)",
                                      param=f"messages[{i}].content")
        if isinstance(c, list):
            m = {**m, "content": content_text(c, param=f"messages[{i}].content", dropped=dropped)}
        out.append(m)
    return out


@dataclass(slots=True)
class _Prepared:
    entry: PoolEntry
    request: Request
    model_name: str
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] | None = None
    think: tuple[str, str] | None = None
    in_reasoning: bool = False
    tool_dialect: str | None = None  # parses the tool calls: the model's, or a forced call's format
    dropped: DroppedContent = field(default_factory=DroppedContent)  # content parts served as placeholders


def _prepare(http: HttpRequest, *, chat: bool) -> _Prepared:
    ctx = http.app.ctx
    holds = holds_of(http)
    body = parse_json_object(http.body, ctx.config.max_body_bytes)
    model_name = get_str(body, "model")
    entry = holds.chat_entry(model_name)
    tok = entry.loaded.tokenizer
    dialect = entry.tool_dialect
    dropped = DroppedContent(strict=ctx.config.strict_content)
    if chat:
        messages = _validate_messages(get_list(body, "messages", non_empty=True), dropped)
        tools = validate_tools(get_list(body, "tools", None))
        tool_choice = validate_tool_choice(body.get("tool_choice"), tools)
        ctk = body.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise InvalidRequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        ctk = dict(ctk or {})
        thinking = ctk.pop("enable_thinking", None)
        effort = get_effort(body.get("reasoning_effort"), "reasoning_effort")
        if thinking is None and effort is not None:
            thinking = effort != "none"
        if thinking is None:
            thinking = entry.settings.enable_thinking
        rendered = render_prompt(tok, messages, tools=tools or None, enable_thinking=thinking, template_kwargs=ctk)
        prompt_ids = rendered.token_ids
        parse_tools = tools if (tools and tool_choice != "none") else None
        think = entry.think if thinking is not False else None
        in_reasoning = bool(think and rendered.text.rstrip().endswith(think[0]))
        if tools and (tool_choice == "required" or isinstance(tool_choice, dict)):
            only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
            constraint, dialect = forced_tool_call(entry, tools, only, param="tool_choice", think=think,
                                                   in_reasoning=in_reasoning)
        else:
            constraint = response_format(entry, body.get("response_format"), think=think, in_reasoning=in_reasoning)
            if constraint is None and parse_tools:
                constraint = strict_tool_calls(entry, parse_tools, request_id=holds.request_id)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("'prompt' must not be empty", param="prompt")
            prompt_ids = list(tok.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < len(tok) for t in prompt):
                raise InvalidRequestError("'prompt' holds a token id outside the vocabulary", param="prompt")
            prompt_ids = list(prompt)
        else:
            raise InvalidRequestError("'prompt' must be a non-empty string or an array of token ids (one prompt per request)", param="prompt")
        parse_tools, think, in_reasoning = None, None, False
        constraint = response_format(entry, body.get("response_format"))
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
    include_usage = bool(so and so.get("include_usage") is True)
    sampling = replace(sampling_from_openai(body, entry, len(prompt_ids), chat=chat), constraint=constraint)
    req = Request(model=entry.loaded.model_id, prompt_token_ids=prompt_ids, sampling=sampling, request_id=holds.request_id)
    return _Prepared(entry, req, model_name, stream, include_usage, parse_tools, think, in_reasoning, dialect, dropped)


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
@holding("chat")
async def chat_completions(http: HttpRequest):
    return await _serve(http, chat=True)


@bp.post("/completions")
@holding("chat")
async def completions(http: HttpRequest):
    return await _serve(http, chat=False)


async def _serve(http: HttpRequest, *, chat: bool):
    holds = holds_of(http)  # owns the lease and the engine request: released when the route ends
    p = _prepare(http, chat=chat)
    http.app.ctx.metrics.dropped_content("openai", p.request.request_id, p.dropped)
    await holds.checkpoint("prepared")
    es = EventStream(p.entry.engine, p.request, http.app.ctx.config.keepalive_s,
                     observer=http.app.ctx.metrics.observe)
    turn = holds.start(ModelTurn(es, tool_dialect=p.tool_dialect, tools=p.tools, think=p.think,
                                 in_reasoning=p.in_reasoning))
    await holds.checkpoint("submitted")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
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

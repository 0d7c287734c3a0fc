"""OpenAI Responses API routes: /v1/responses (create, stream, retrieve, delete, input items).

Request JSON -> `Request`: input items become the neutral chat messages of `omlx.engine.chat`
(function_call items -> assistant ``tool_calls``, function_call_output -> ``tool`` messages),
function and namespace tools become chat-template tools. Engine events -> output items and
stream events through `ResponseBuilder` (omlx.api.responses_framing). Shapes follow the OpenAI
API reference (Responses); what Codex CLI and the SDK send is in the project's CLIENTS.md.

Earlier output items sent back verbatim (messages with annotations, reasoning items with
``encrypted_content``, hosted tool calls) are accepted; what a local model cannot use is skipped.
An ``input_image`` or ``input_file`` part, in a message or a function_call_output, becomes a
placeholder naming its kind (`omlx.engine.content`; with ``strict_content`` a 400 naming it).
Stored responses (``store``, default true as in OpenAI's API) live in a bounded in-memory LRU
for ``previous_response_id``, GET and DELETE; they do not survive a restart.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.bodies.responses import ResponsesRequest
from omlx.api.holds import holding, holds_of
from omlx.api.openai import ask_of, logprob_json
from omlx.api.prepare import Prepared, Think, Turn, prepare, render_fitting
from omlx.api.structured import forced_tool_call, strict_tool_calls, text_format
from omlx.api.responses_framing import ResponseBuilder, new_id
from omlx.api.sse import KEEPALIVE, SSE_COMMENT_KEEPALIVE, SSE_HEADERS, EventStream, sse_event
from omlx.api.turn import ContentDelta, ModelTurn
from omlx.engine.chat import RenderedPrompt, content_text
from omlx.engine.content import DroppedContent, placeholder, unreadable_kind
from omlx.errors import EngineError, InvalidRequestError, NotFoundError, OmlxError
from omlx.pool import PoolEntry
from omlx.request import Failed, Finished

logger = logging.getLogger(__name__)

bp = Blueprint("responses", url_prefix="/v1")

_LOGPROBS_INCLUDE = "message.output_text.logprobs"


# --------------------------------------------------------------------------- stored responses


class ResponseStore:
    """Stored responses by id: an LRU bounded by count and by serialized size.

    Args:
        max_entries: most responses kept.
        max_bytes: most bytes of JSON (response + input items) kept.
    """

    def __init__(self, max_entries: int = 1000, max_bytes: int = 256 * 1024 * 1024):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self.num_bytes = 0

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep ``response`` and the full input it answered; evicts least recently used ones."""
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        self.delete(response["id"])
        if size > self.max_bytes:
            logger.warning("response %s is %d bytes, more than the store's %d: not stored", response["id"], size, self.max_bytes)
            return
        self._items[response["id"]] = (response, input_items, size)
        self.num_bytes += size
        while len(self._items) > self.max_entries or self.num_bytes > self.max_bytes:
            _, (_, _, old) = self._items.popitem(last=False)
            self.num_bytes -= old

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """The response and its input items, or None when unknown (never stored, evicted, deleted)."""
        hit = self._items.get(response_id)
        if hit is None:
            return None
        self._items.move_to_end(response_id)
        return hit[0], hit[1]

    def delete(self, response_id: str) -> bool:
        hit = self._items.pop(response_id, None)
        if hit is None:
            return False
        self.num_bytes -= hit[2]
        return True

    def __len__(self) -> int:
        return len(self._items)


def response_store(http: HttpRequest) -> ResponseStore:
    ctx = http.app.ctx
    store = getattr(ctx, "response_store", None)
    if store is None:
        store = ctx.response_store = ResponseStore()
    return store


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


def _stored(http: HttpRequest, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    hit = response_store(http).get(response_id)
    if hit is None:
        raise _not_found(response_id)
    return hit


# --------------------------------------------------------------------------- tools


ToolNames = dict[str, tuple[str | None, str]]


def flatten_tools(tools: list[Any], *, param: str = "tools") -> tuple[list[dict[str, Any]], ToolNames]:
    """Responses tools -> chat-template tools and the map back to the names the client knows.

    Function tools are kept; a ``namespace`` tool contributes the function tools it holds; every
    other type (web_search, custom, tool_search, mcp, ...) is skipped: a local model has no
    hosted tools, and free-form custom tools have no JSON arguments.

    Returns:
        (``[{"type": "function", "function": {name, description, parameters}}]``,
        flattened name -> (namespace or None, name)). A name already taken gets
        ``<namespace>__<name>``; a duplicate of that is dropped.

    Raises:
        InvalidRequestError: a tool is not an object, or a function tool has no name.
    """
    chat: list[dict[str, Any]] = []
    names: ToolNames = {}

    def add(fn: dict[str, Any], namespace: str | None, p: str) -> None:
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"'{p}.name' must be a non-empty string", param=f"{p}.name")
        flat = name if name not in names or not namespace else f"{namespace}__{name}"
        if flat in names:
            return
        names[flat] = (namespace, name)
        params = fn.get("parameters")
        chat.append({"type": "function", "function": {
            "name": flat,
            "description": fn.get("description") or "",
            "parameters": params if isinstance(params, dict) else {"type": "object", "properties": {}},
            **({"strict": True} if fn.get("strict") is True else {}),  # enforced by constrained decoding
        }})

    for i, tool in enumerate(tools):
        p = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"'{p}' must be an object", param=p)
        if tool.get("type") == "function":
            add(tool, None, p)
        elif tool.get("type") == "namespace":
            ns = tool.get("name") if isinstance(tool.get("name"), str) else None
            for j, sub in enumerate(tool.get("tools") or []):
                if isinstance(sub, dict) and sub.get("type") == "function":
                    add(sub, ns, f"{p}.tools[{j}]")
    return chat, names


def _forces_a_call(choice: Any) -> bool:
    """``required``, a named function, or ``allowed_tools`` in mode ``required``."""
    return choice == "required" or (isinstance(choice, dict) and (
        choice.get("type") == "function" or (choice.get("type") == "allowed_tools" and choice.get("mode") == "required")))


def _choice_words(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return f"naming function {choice.get('name')!r}"
    return repr(choice) if isinstance(choice, str) else f"{choice.get('type')!r} in mode 'required'"


def _choose_tools(chat_tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    """Apply ``tool_choice``: none -> no tools; a named function or ``allowed_tools`` -> those only.

    ``required`` keeps every tool (the call itself is forced by constrained decoding).
    """
    if choice is None or choice in ("auto", "required"):
        return chat_tools
    if choice == "none":
        return []
    if not isinstance(choice, dict):
        raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or an object", param="tool_choice")
    if choice.get("type") == "function":
        wanted = {choice.get("name")}
        if choice.get("name") not in {t["function"]["name"] for t in chat_tools}:
            raise InvalidRequestError(f"'tool_choice' names function {choice.get('name')!r}, which is not in 'tools'",
                                      param="tool_choice.name")
    elif choice.get("type") == "allowed_tools":
        wanted = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
    else:  # a hosted tool (web_search, ...) that is not here
        return chat_tools
    return [t for t in chat_tools if t["function"]["name"] in wanted]


# --------------------------------------------------------------------------- input items


def _output_text(output: Any, p: str, dropped: DroppedContent | None) -> str:
    """A function_call_output's ``output``: a string, or parts joined as message content is
    (`content_text`: an image or file becomes its placeholder); a part of a type that is
    neither text nor a known kind becomes ``[<type> omitted: ...]``, not counted; non-objects
    are skipped."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        parts = [c if isinstance(c.get("text"), str) or unreadable_kind(c.get("type"))
                 else {"type": "text", "text": placeholder(str(c.get("type", "part")))}
                 for c in output if isinstance(c, dict)]
        return content_text(parts, param=f"{p}.output", dropped=dropped)
    raise InvalidRequestError(f"'{p}.output' must be a string or an array of parts", param=f"{p}.output")


def _message_text(content: Any, p: str, dropped: DroppedContent | None) -> str:
    if isinstance(content, list):  # refusal parts are text too
        content = [{"type": "text", "text": c["refusal"]} if isinstance(c, dict) and c.get("type") == "refusal" else c
                   for c in content]
    return content_text(content, param=f"{p}.content", dropped=dropped)


def input_to_messages(items: list[Any], flat_names: dict[tuple[str | None, str], str] | None = None,
                      dropped: DroppedContent | None = None) -> list[dict[str, Any]]:
    """Responses input items -> chat messages for `render_prompt`.

    Messages keep their role (system/developer are merged later by `normalize_messages`);
    consecutive function_call items join the assistant message before them as ``tool_calls``;
    function_call_output becomes a ``tool`` message; a reasoning item's ``reasoning_text`` becomes
    the next assistant message's ``reasoning_content`` (templates decide whether to show it).
    Item references and hosted tool calls are skipped.

    Args:
        flat_names: (namespace, name) -> the flattened tool name the model sees.
        dropped: counts the ``input_image`` and ``input_file`` parts (of messages and of
            function_call_output) served as placeholders (`omlx.engine.content`), or raises for
            them when strict; None serves them without counting.

    Raises:
        InvalidRequestError: an item is not an object, or a message or call is malformed (names
            ``input[i]...``).
    """
    flat_names = flat_names or {}
    msgs: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    reasoning: list[str] = []  # reasoning_text of a reasoning item, for the next assistant message

    def assistant(msg: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return msg

    for i, item in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{p}' must be an object", param=p)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"'{p}.role' must be one of user, assistant, system, developer", param=f"{p}.role")
            msg = {"role": role, "content": _message_text(item.get("content"), p, dropped)}
            msgs.append(assistant(msg) if role == "assistant" else msg)
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise InvalidRequestError(f"'{p}' needs a string 'name' and 'call_id'", param=p)
            name = flat_names.get((item.get("namespace"), name), name)
            # a JSON string; normalize_messages turns it into the mapping templates index
            args = item.get("arguments", "{}") if kind == "function_call" else json.dumps({"input": item.get("input", "")})
            call_names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"'{p}.call_id' must be a string", param=f"{p}.call_id")
            msg = {"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output", ""), p, dropped)}
            if call_id in call_names:
                msg["name"] = call_names[call_id]
            msgs.append(msg)
        elif kind == "reasoning":  # summaries and encrypted_content cannot be used here
            reasoning += [c["text"] for c in item.get("content") or []
                          if isinstance(c, dict) and c.get("type") == "reasoning_text" and isinstance(c.get("text"), str)]
        else:  # additional_tools, item_reference, hosted tool calls: nothing to render
            logger.debug("responses: skipping input item of type %r", kind)
    return msgs


def _input_items(raw: Any) -> list[dict[str, Any]]:
    """``input`` as items (a string is one user message), each with an id for input_items."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    return [dict(it, id=it.get("id") or new_id("item")) if isinstance(it, dict) else it for it in raw]


# --------------------------------------------------------------------------- request


@dataclass(slots=True)
class _Prepared:
    p: Prepared
    stream: bool
    store: bool
    builder: ResponseBuilder
    parse_tools: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    want_logprobs: bool
    dropped: DroppedContent = field(default_factory=DroppedContent)  # content parts served as placeholders


def _render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context_length: int,
            truncation: str, enable_thinking: bool | None = None) -> RenderedPrompt:
    """Template and tokenize; with ``truncation: auto`` drop the oldest turns until the prompt fits."""
    return render_fitting(tok, messages, tools=tools, context_length=context_length, truncate=truncation == "auto",
                          thinking=enable_thinking, param="input")


def _prepare(http: HttpRequest) -> _Prepared:
    holds = holds_of(http)
    body: ResponsesRequest = holds.parsed.body
    data = holds.parsed.data
    entry = holds.chat_entry(body.model)
    items = _input_items(data.get("input"))
    previous_id = body.previous_response_id
    history: list[Any] = []
    if previous_id is not None:
        hit = response_store(http).get(previous_id)
        if hit is None:
            raise InvalidRequestError(f"Previous response with id '{previous_id}' not found.", param="previous_response_id")
        history = hit[1] + hit[0]["output"]
    all_items = history + items

    tools = data.get("tools") or []
    extra = [t for it in all_items if isinstance(it, dict) and it.get("type") == "additional_tools"
             for t in (it.get("tools") or [])]  # Codex sends some tools as an input item
    chat_tools, names = flatten_tools([*tools, *extra])
    choice = body.tool_choice
    if not chat_tools and _forces_a_call(choice):  # as chat refuses it; "auto" and "none" stay (Codex sends "auto")
        raise InvalidRequestError(f"'tool_choice' {_choice_words(choice)} forces a tool call, which needs function "
                                  "'tools'", param="tool_choice")
    chat_tools = _choose_tools(chat_tools, choice)
    forced = bool(chat_tools and (choice == "required" or (isinstance(choice, dict) and (
        choice.get("type") == "function" or choice.get("mode") == "required"))))
    truncation = body.truncation or "disabled"
    effort = body.reasoning.effort if body.reasoning is not None else None
    instructions = body.instructions
    messages = ([{"role": "system", "content": instructions}] if instructions else [])
    dropped = DroppedContent(strict=http.app.ctx.config.strict_content)
    messages += input_to_messages(all_items, {v: k for k, v in names.items()}, dropped)
    want_logprobs = _LOGPROBS_INCLUDE in (body.include or ()) or bool(body.top_logprobs)
    text = data.get("text")

    def constrain(entry: PoolEntry, think: Think, in_reasoning: bool):
        if forced:
            return forced_tool_call(entry, chat_tools, None, param="tool_choice", think=think, in_reasoning=in_reasoning)
        c = text_format(entry, text, think=think, in_reasoning=in_reasoning)
        if c is None and chat_tools:
            c = strict_tool_calls(entry, chat_tools, request_id=holds.request_id)
        return c, None

    turn = Turn(messages=messages, tools=chat_tools, thinking=None if effort is None else effort != "none",
                truncate=truncation == "auto", max_tokens=body.max_output_tokens, param="input", constrain=constrain,
                ask=ask_of(body, logprobs=want_logprobs, top_logprobs=body.top_logprobs or 0))
    p = prepare(entry, turn, holds.request_id)
    sampling = p.request.sampling
    reasoning = data.get("reasoning")
    response = {
        "id": "resp_" + holds.request_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": instructions,
        "max_output_tokens": body.max_output_tokens, "model": body.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": previous_id,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": reasoning or {"effort": None, "summary": None}, "store": body.store,
        "temperature": sampling.temperature, "text": text or {"format": {"type": "text"}},
        "tool_choice": choice or "auto", "tools": tools, "top_logprobs": sampling.top_logprobs,
        "top_p": sampling.top_p, "truncation": truncation, "usage": None, "user": body.user,
        "metadata": body.metadata or {},
    }
    builder = ResponseBuilder(response, tool_names=names, parallel_tool_calls=body.parallel_tool_calls)
    return _Prepared(p, body.stream, body.store, builder, chat_tools, all_items, want_logprobs, dropped)


# --------------------------------------------------------------------------- routes


@bp.post("/responses")
@holding("chat", ResponsesRequest)
async def create_response(http: HttpRequest):
    holds = holds_of(http)  # owns the lease and the engine request: released when the route ends
    p = _prepare(http)
    http.app.ctx.metrics.dropped_content("responses", holds.request_id, p.dropped)
    await holds.checkpoint("prepared")
    b = p.builder
    store = response_store(http) if p.store else None
    on_finish = (lambda: store.put(b.response, p.input_items)) if store is not None else None
    es = EventStream(p.p.entry.engine, p.p.request, http.app.ctx.config.keepalive_s,
                     observer=http.app.ctx.metrics.observe)
    # a full queue raises here, before any header: HTTP 429
    turn = holds.start(ModelTurn(es, tool_dialect=p.p.tool_dialect, tools=p.parse_tools, think=p.p.think,
                                 in_reasoning=p.p.in_reasoning))
    await holds.checkpoint("submitted")
    if p.stream:
        resp = await http.respond(content_type="text/event-stream", headers=SSE_HEADERS)
        await holds.checkpoint("responded")
        idle_after_s = http.app.ctx.config.idle_text_after_s
        t0 = time.monotonic()
        async for events in frame_turn(turn, b, want_logprobs=p.want_logprobs, on_finish=on_finish):
            if events is KEEPALIVE:
                if idle_after_s is not None and time.monotonic() - t0 >= idle_after_s:
                    # a long silence (a long prefill, a queue wait): an event Codex's stream idle
                    # watchdog counts, where a comment does not (config.py, idle_text_after_s)
                    await resp.send(sse_event("response.in_progress", b.in_progress()))
                else:
                    await resp.send(SSE_COMMENT_KEEPALIVE)
            elif events:  # one send per batch of engine events
                await resp.send("".join([sse_event(e["type"], e) for e in events]))
        await resp.eof()
        return None  # already sent; returning it again makes Sanic log an error
    async for _ in frame_turn(turn, b, want_logprobs=p.want_logprobs, on_finish=on_finish, keepalive=False):
        pass
    if b.error is not None:
        raise b.error
    return json_response(b.response)


async def frame_turn(turn: ModelTurn, b: ResponseBuilder, *, want_logprobs: bool = False,
                     on_finish: Callable[[], None] | None = None, keepalive: bool = True) -> AsyncIterator[Any]:
    """A model turn's events -> lists of Responses stream events (or KEEPALIVE markers): the
    start events, then one list per batch of engine events (`ModelTurn.batches`).

    Args:
        on_finish: called once the response is complete and before its last events are yielded
            (storing it there means a client that answers ``response.completed`` at once with
            ``previous_response_id`` finds it).
    """
    yield b.start()
    async for batch in turn.batches(keepalive=keepalive):
        if batch is KEEPALIVE:
            yield KEEPALIVE
            continue
        out: list[dict[str, Any]] = []
        for ev in batch:
            if isinstance(ev, Finished):
                out += b.finish(ev.usage, ev.finish_reason)
                if on_finish is not None:
                    on_finish()
            elif isinstance(ev, Failed):
                out += b.fail(ev.error if isinstance(ev.error, OmlxError) else EngineError(str(ev.error)))
            elif isinstance(ev, ContentDelta) and want_logprobs and ev.logprobs:
                out += b.feed(ev, [logprob_json(x) for x in ev.logprobs])
            else:
                out += b.feed(ev)
        yield out


@bp.post("/responses/input_tokens")
@holding("chat", ResponsesRequest)
async def count_input_tokens(http: HttpRequest):
    """The prompt's token count for a Responses body (nothing is generated or stored).

    Content the model cannot read counts as its placeholder, as in /v1/responses; it is not
    logged or counted in ``omlx_dropped_content_total`` (only what a generation left out is).
    """
    p = _prepare(http)
    await holds_of(http).checkpoint("prepared")
    return json_response({"object": "response.input_tokens", "input_tokens": p.p.request.num_prompt_tokens})


@bp.route("/responses", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def responses_get(http: HttpRequest):
    # Codex's built-in provider tries a WebSocket first; 426 makes it fall back to HTTP POST.
    if http.headers.get("upgrade", "").lower() == "websocket":
        err = InvalidRequestError("WebSocket mode is not supported by this server; use HTTP POST /v1/responses")
        err.status = 426
        raise err
    err = InvalidRequestError("use POST /v1/responses to create a response, GET /v1/responses/{id} to read one")
    err.status = 405
    raise err


@bp.route("/responses/<response_id>", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def retrieve_response(http: HttpRequest, response_id: str):
    return json_response(_stored(http, response_id)[0])


@bp.delete("/responses/<response_id>")
async def delete_response(http: HttpRequest, response_id: str):
    if not response_store(http).delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


@bp.route("/responses/<response_id>/input_items", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def list_input_items(http: HttpRequest, response_id: str):
    items = _stored(http, response_id)[1]
    order = http.args.get("order", "desc")
    data = list(reversed(items)) if order == "desc" else list(items)
    return json_response({"object": "list", "data": data, "first_id": data[0].get("id") if data else None,
                          "last_id": data[-1].get("id") if data else None, "has_more": False})

"""One `prepare` for all three protocols: a protocol-neutral `Turn` -> the engine's `Request`.

Each protocol module validates its body (its `omlx.api.bodies` model, in ``holding`` before the
lease is taken), maps its wire shape onto a `Turn` and nothing else; `prepare` then does, once and
in this order, for the entry the request's one lease holds: apply the model's settings and its
profile (``[models."<id>"]`` defaults where the request is silent), render the chat template and
tokenize (or take the completion prompt), clamp ``max_tokens`` to the context and to
``max_output_tokens``, build the output constraint, and build the `Request` with the request's one
id. A body that fails validation never gets here, so it never pays for a render.
Must not: import sanic, read a protocol's field names, or build error JSON.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from omlx.engine import token_cache
from omlx.engine.chat import RenderedPrompt, render_prompt
from omlx.errors import ContextLengthError, InvalidRequestError
from omlx.pool import PoolEntry
from omlx.request import Constraint, Request, SamplingParams

logger = logging.getLogger(__name__)

Think = tuple[str, str] | None
#: (entry, think markers, the prompt ends inside reasoning) -> (constraint or None, dialect or None: the model's)
Constrain = Callable[[PoolEntry, Think, bool], tuple[Constraint | None, str | None]]


@dataclass(slots=True)
class Ask:
    """The sampling a request asks for; None = the model's setting, else the API's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True)
class Turn:
    """One request in no protocol's words.

    Attributes:
        messages: chat-template messages (`omlx.engine.chat`); None with ``prompt``.
        prompt: a completion prompt (text, or token ids to check against the vocabulary) instead.
        tools: OpenAI-style function tools for the template, or None.
        thinking: the request's reasoning switch; None = the model's ``enable_thinking``, and when
            that is None too, ``thinking_default`` (None: the template's own default).
        template_kwargs: extra chat-template variables.
        truncate: drop the oldest turns until the prompt fits the context (Responses ``auto``).
        max_tokens: tokens asked for; None = the model's ``default_max_tokens``, else ``default_max_tokens``.
        constrain: builds the output constraint once the prompt is rendered (structured outputs,
            forced tool calls); None: none.
        param: the body field a context or template error names (``messages``, ``input``, ``prompt``).
        too_long: the message of the context error (number of prompt tokens, context) -> text.
    """

    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: bool | None = None
    thinking_default: bool | None = None
    template_kwargs: dict[str, Any] | None = None
    truncate: bool = False
    ask: Ask = field(default_factory=Ask)
    max_tokens: int | None = None
    default_max_tokens: int = 4096
    constrain: Constrain | None = None
    param: str = "messages"
    too_long: Callable[[int, int], str] | None = None


@dataclass(slots=True)
class Prepared:
    """What the protocol frames the answer with.

    Attributes:
        request: the engine request (its id is the HTTP request's).
        think: the model's think markers when its reasoning is split out, else None.
        in_reasoning: the prompt ends inside an open reasoning block.
        tool_dialect: the dialect that parses tool calls (the model's, or a forced call's).
    """

    entry: PoolEntry
    request: Request
    think: Think
    in_reasoning: bool
    tool_dialect: str | None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def thinking_of(entry: PoolEntry, turn: Turn) -> bool | None:
    """The reasoning switch: the request's, else the model's setting, else the turn's default."""
    return _or(turn.thinking, _or(entry.settings.enable_thinking, turn.thinking_default))


def render(entry: PoolEntry, turn: Turn, thinking: bool | None) -> RenderedPrompt:
    """Template and tokenize ``turn.messages`` (with ``truncate``, the oldest turns are dropped
    until the prompt fits), or tokenize ``turn.prompt``.

    Raises:
        InvalidRequestError: the template rejects the messages, or a prompt token id is outside
            the vocabulary (names ``turn.param``).
    """
    tok = entry.loaded.tokenizer
    if turn.messages is None:
        p = turn.prompt
        if isinstance(p, str):
            # Remembered, as a chat prompt's text is: a repeated completion prompt skips the tokenizer.
            return RenderedPrompt(token_cache.encode(tok, p, add_special_tokens=True), p, False)
        if any(not 0 <= t < len(tok) for t in p or ()):
            raise InvalidRequestError(f"'{turn.param}' holds a token id outside the vocabulary", param=turn.param)
        return RenderedPrompt(list(p or ()), "", False)
    return render_fitting(tok, turn.messages, tools=turn.tools, reads_tools=entry.loaded.template_reads_tools,
                          context_length=entry.loaded.context_length,
                          truncate=turn.truncate, thinking=thinking, template_kwargs=turn.template_kwargs, param=turn.param)


def render_fitting(tok: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None, context_length: int,
                   truncate: bool, thinking: bool | None, template_kwargs: dict[str, Any] | None = None,
                   param: str = "messages", reads_tools: bool = True) -> RenderedPrompt:
    """`render_prompt`; with ``truncate``, drop the oldest turns (from the first non-system
    message up to the next user message, in place) until the prompt fits ``context_length``.

    Raises:
        InvalidRequestError: the template rejects the messages (names ``param``).
    """
    while True:
        try:
            rendered = render_prompt(tok, messages, tools=tools or None, reads_tools=reads_tools, enable_thinking=thinking,
                                     template_kwargs=template_kwargs, param=param)
        except InvalidRequestError as e:
            if e.param == "messages":
                e.param = param
            raise
        if not truncate or len(rendered.token_ids) < context_length:
            return rendered
        first = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), None)
        nxt = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None) if first is not None else None
        if nxt is None:  # only the last user turn is left
            return rendered
        del messages[first:nxt]


def clamp(entry: PoolEntry, turn: Turn, num_prompt_tokens: int) -> int:
    """``max_tokens`` for the engine: what the turn asks (or the defaults), within the context
    left after the prompt and the model's ``max_output_tokens``.

    Raises:
        ContextLengthError: the prompt alone fills the context (names ``turn.param``).
    """
    ctx = entry.loaded.context_length
    if num_prompt_tokens >= ctx:
        msg = (turn.too_long(num_prompt_tokens, ctx) if turn.too_long is not None
               else f"the prompt is {num_prompt_tokens} tokens; this model's context is {ctx} tokens")
        raise ContextLengthError(msg, param=turn.param)
    room = ctx - num_prompt_tokens
    d = entry.settings
    if d.max_output_tokens:
        room = min(room, d.max_output_tokens)
    asked = turn.max_tokens if turn.max_tokens is not None else (d.default_max_tokens or turn.default_max_tokens)
    return min(asked, room)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for k, b in (bias or {}).items():
        tid = int(k)
        if not 0 <= tid < vocab_size:
            raise InvalidRequestError(f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})",
                                      param="logit_bias")
        out.append((tid, float(b)))
    return tuple(out)


def sampling(entry: PoolEntry, ask: Ask, max_tokens: int, constraint: Constraint | None) -> SamplingParams:
    """The request's sampling over the model's ``default_*`` settings (its profile's included)."""
    d = entry.settings
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(ask.temperature, _or(d.default_temperature, 1.0)),
        top_p=_or(ask.top_p, _or(d.default_top_p, 1.0)),
        top_k=_or(ask.top_k, _or(d.default_top_k, 0)),
        min_p=_or(ask.min_p, _or(d.default_min_p, 0.0)),
        repetition_penalty=_or(ask.repetition_penalty, _or(d.default_repetition_penalty, 1.0)),
        presence_penalty=_or(ask.presence_penalty, 0.0),
        frequency_penalty=_or(ask.frequency_penalty, 0.0),
        seed=ask.seed,
        stop=ask.stop,
        logit_bias=_logit_bias(ask.logit_bias, len(entry.loaded.tokenizer)) if ask.logit_bias else (),
        logprobs=ask.logprobs,
        top_logprobs=ask.top_logprobs,
        constraint=constraint,
    )


def prepare(entry: PoolEntry, turn: Turn, request_id: str) -> Prepared:
    """A validated turn -> the engine `Request` for ``entry`` (see the module doc for the order).

    Raises:
        InvalidRequestError: the template rejects the messages, a token id or ``logit_bias`` id is
            outside the vocabulary, or the constraint cannot be built (names the field).
        ContextLengthError: the prompt alone fills the context.
    """
    thinking = thinking_of(entry, turn)
    rendered = render(entry, turn, thinking)
    ids = rendered.token_ids
    max_tokens = clamp(entry, turn, len(ids))
    think = entry.think if (turn.messages is not None and thinking is not False) else None
    in_reasoning = bool(think and rendered.text.rstrip().endswith(think[0]))
    constraint, dialect = turn.constrain(entry, think, in_reasoning) if turn.constrain is not None else (None, None)
    req = Request(model=entry.loaded.model_id, prompt_token_ids=ids,
                  sampling=sampling(entry, turn.ask, max_tokens, constraint), request_id=request_id)
    logger.debug("request %s: model %s, %d prompt tokens, max_tokens %d", request_id, entry.loaded.model_id,
                 len(ids), max_tokens)
    return Prepared(entry, req, think, in_reasoning, dialect or entry.tool_dialect)

"""OpenAI Chat Completions and Completions framing: turn events -> JSON pieces and SSE chunks.

`ChunkFramer` writes the ``data:`` chunks of one streamed response (OpenAI API reference,
"The chat completion chunk object" and legacy Completions streaming). The part every chunk shares
(``id``, ``object``, ``created``, ``model`` and, with ``include_usage``, ``"usage": null``) is
serialized once per response, so a text delta costs one string escape; the bytes are those of
`omlx.api.sse.sse_data` applied to the whole chunk dict (test_openai_framing checks that).
Pure: no HTTP, no engine, no clock.
"""

from __future__ import annotations

from typing import Any

from omlx.api.sse import json_compact, sse_data
from omlx.api.turn import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from omlx.errors import EngineError, OmlxError
from omlx.request import Failed, Finished, TokenLogprob, Usage

SSE_DONE = "data: [DONE]\n\n"


def usage_json(u: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.num_prompt_tokens,
        "completion_tokens": u.num_completion_tokens,
        "total_tokens": u.num_prompt_tokens + u.num_completion_tokens,
        # cached_tokens counts both tiers (OpenAI's meaning); the SSD tier's share is extra.
        "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens,
                                  "cached_tokens_cold": u.num_cached_tokens_cold},
    }
    if u.num_draft_tokens:
        # OpenAI's Predicted Outputs fields: draft tokens the model agreed with / did not.
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": u.num_accepted_draft_tokens,
            "rejected_prediction_tokens": u.num_draft_tokens - u.num_accepted_draft_tokens}
    return out


def logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top],
    }


def legacy_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """Legacy Completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets, pos = [], 0
    for x in lps:
        offsets.append(pos)
        pos += len(x.token)
    return {
        "tokens": [x.token for x in lps],
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{t.token: t.logprob for t in x.top} for x in lps],
        "text_offset": offsets,
    }


def finish_reason(f: Finished, num_tool_calls: int = 0) -> str:
    if num_tool_calls:
        return "tool_calls"
    return "length" if f.finish_reason == "length" else "stop"


class ChunkFramer:
    """The SSE chunks of one streamed chat completion (``chat``) or legacy completion.

    Args:
        rid: the response id (``chatcmpl-...`` / ``cmpl-...``).
        created: Unix seconds, as in every chunk.
        model: the model name the client asked for.
        chat: chat completion chunks (``delta``) rather than completion chunks (``text``).
        include_usage: ``stream_options.include_usage``: every chunk carries ``usage`` (null
            until the last chunk, which has ``choices: []``).
        want_logprobs: the request asked for logprobs.
    """

    def __init__(self, rid: str, created: int, model: str, *, chat: bool, include_usage: bool,
                 want_logprobs: bool):
        self.rid, self.created, self.model = rid, created, model
        self.chat, self.include_usage, self.want_logprobs = chat, include_usage, want_logprobs
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # The chunk dict is {id, object, created, model, choices: [...], usage?}: head and tail
        # of its JSON around the choices.
        self._head = (f'data: {{"id":{json_compact(rid)},"object":{json_compact(self.object)},'
                      f'"created":{json_compact(created)},"model":{json_compact(model)},"choices":[')
        self._tail = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    # ---- the general path: a chunk dict, serialized whole (rare chunks) ------------------------

    def chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> str:
        c: dict[str, Any] = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                             "choices": [] if choice is None else [choice]}
        if self.include_usage:
            c["usage"] = usage
        return sse_data(c)

    def delta(self, delta: dict[str, Any], lps: list[TokenLogprob] | None = None, finish: str | None = None) -> str:
        """One choice chunk; completions take ``delta["content"]`` as their ``text``."""
        if self.chat:
            ch: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": {"content": [logprob_json(x) for x in lps]} if (self.want_logprobs and lps) else None}
        else:
            ch = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                  "logprobs": legacy_logprobs(lps) if (self.want_logprobs and lps) else None}
        return self.chunk(ch)

    # ---- per-token chunks: the constant parts pre-serialized ------------------------------------

    def content(self, text: str, lps: list[TokenLogprob] | None = None) -> str:
        """The chunk of answer text (``delta.content`` / ``text``), with its logprobs if asked."""
        lp = "null"
        if self.want_logprobs and lps:
            lp = json_compact({"content": [logprob_json(x) for x in lps]} if self.chat else legacy_logprobs(lps))
        if self.chat:
            return f'{self._head}{{"index":0,"delta":{{"content":{json_compact(text)}}},"finish_reason":null,"logprobs":{lp}}}{self._tail}'
        return f'{self._head}{{"index":0,"text":{json_compact(text)},"finish_reason":null,"logprobs":{lp}}}{self._tail}'

    def reasoning(self, text: str) -> str:
        """``delta.reasoning_content`` (chat only; completions have no reasoning field: "")."""
        if not self.chat:
            return ""
        return f'{self._head}{{"index":0,"delta":{{"reasoning_content":{json_compact(text)}}},"finish_reason":null,"logprobs":null}}{self._tail}'

    # ---- whole stream ---------------------------------------------------------------------------

    def role(self) -> str:
        """The first chat chunk (``role: assistant``), sent before any token."""
        return self.delta({"role": "assistant", "content": ""})

    def frame(self, ev: Any, num_tool_calls: int = 0) -> str:
        """One `omlx.api.turn.ModelTurn` event -> its chunks ("" for an event with none).

        Finished -> the finish_reason chunk, the usage chunk (with include_usage), ``[DONE]``;
        Failed -> the error chunk (OpenAI's error body), ``[DONE]``.
        """
        if isinstance(ev, ContentDelta):
            return self.content(ev.text, ev.logprobs)
        if isinstance(ev, ReasoningDelta):
            return self.reasoning(ev.text)
        if isinstance(ev, ToolCallStart):
            # OpenAI: the first delta of a call carries index, id, type and name; later ones only
            # index and argument fragments (no empty name).
            return self.delta({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
        if isinstance(ev, ToolCallArgsDelta):
            if not ev.fragment:
                return ""
            return self.delta({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
        if isinstance(ev, Finished):
            out = self.delta({} if self.chat else {"content": ""}, None, finish_reason(ev, num_tool_calls))
            if self.include_usage:
                out += self.chunk(None, usage_json(ev.usage))
            return out + SSE_DONE
        if isinstance(ev, Failed):
            err = ev.error if isinstance(ev.error, OmlxError) else EngineError(str(ev.error))
            return sse_data(err.openai_body()) + SSE_DONE
        return ""  # ToolCallEnd, Admitted: nothing on the wire

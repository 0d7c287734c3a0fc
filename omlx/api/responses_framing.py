"""OpenAI Responses API framing: content and tool-call events -> output items and stream events.

`ResponseBuilder` owns the Response object of one request and the order of its stream events
(OpenAI API reference, Responses, "Streaming events"):

    response.created, response.in_progress (sent again as a keep-alive during a long silence),
    per reasoning item: response.output_item.added, response.reasoning_text.delta*,
                       response.reasoning_text.done, response.output_item.done
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta*, response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta*,
                       response.function_call_arguments.done, response.output_item.done
    then one of response.completed | response.incomplete | response.failed.

Every event carries ``type`` and a ``sequence_number`` counting from 0. The builder is pure: no
HTTP, no engine, no clock; the route sends the events it returns as SSE (or drops them and returns
``builder.response`` when not streaming), so both modes produce the same Response object.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from omlx.api.turn import ContentDelta, ReasoningDelta
from omlx.errors import OmlxError
from omlx.request import Usage
from omlx.tool_parsers.base import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``resp_`` + 32 hex characters."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(u: Usage) -> dict[str, Any]:
    """Responses ``usage``; ``cached_tokens`` is the prompt prefix reused from the KV cache."""
    return {
        "input_tokens": u.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.num_cached_tokens,
                                 "cached_tokens_cold": u.num_cached_tokens_cold},
        "output_tokens": u.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.num_prompt_tokens + u.num_completion_tokens,
    }


class ResponseBuilder:
    """Builds one Response object and its stream events from a model turn's events.

    Args:
        response: the Response object with status ``in_progress`` and empty ``output``; it is
            updated in place (output items, status, usage, error).
        tool_names: flattened tool name (as the model sees it) -> (namespace or None, name);
            function_call items carry the original name and, for namespace tools, ``namespace``.
        parallel_tool_calls: False keeps only the first call the model makes.

    Every method returns the stream events it decided, in order (dicts ready for JSON).
    """

    def __init__(self, response: dict[str, Any], *, tool_names: dict[str, tuple[str | None, str]] | None = None,
                 parallel_tool_calls: bool = True):
        self.response = response
        self._tool_names = tool_names or {}
        self._parallel = parallel_tool_calls
        self._seq = 0
        self._text_item: dict[str, Any] | None = None  # the open message item
        self._text_index = -1
        self._reasoning_item: dict[str, Any] | None = None  # the open reasoning item
        self._reasoning_index = -1
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}  # parser index -> (output_index, item)
        self._dropped: set[int] = set()
        self.finished = False
        self.error: OmlxError | None = None

    # ------------------------------------------------------------------ events

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _lifecycle(self, type_: str) -> dict[str, Any]:
        return self._event(type_, response=copy.deepcopy(self.response))

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def in_progress(self) -> dict[str, Any]:
        """``response.in_progress`` again, with the Response as it stands: sent as a keep-alive
        while nothing else is (a long prefill), because clients' stream idle watchdogs count
        events, not SSE comments (Codex CLI 0.171.0, `benchmarks/diag_codex_watchdog.py`)."""
        return self._lifecycle("response.in_progress")

    def feed(self, event: Any, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """One event of `omlx.api.turn.ModelTurn` (content, reasoning, a tool call's start/args/end);
        a tool parser's ``TextDelta`` counts as content.

        Args:
            logprobs: Responses logprob entries for a content event (attached to its delta).
        """
        if isinstance(event, (ContentDelta, TextDelta)):
            return self.text(event.text, logprobs)
        if isinstance(event, ReasoningDelta):
            return self.reasoning(event.text)
        if isinstance(event, ToolCallStart):
            return self.call_start(event.index, event.id, event.name)
        if isinstance(event, ToolCallArgsDelta):
            return self.call_args(event.index, event.fragment)
        if isinstance(event, ToolCallEnd):
            return self.call_end(event.index)
        raise TypeError(f"not a turn event: {event!r}")

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text: a ``reasoning`` item whose content is one ``reasoning_text`` part."""
        if not text:
            return []
        out = self._close_message("completed")
        if self._reasoning_item is None:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            self._reasoning_index = len(self.response["output"])
            self.response["output"].append(item)
            self._reasoning_item = item
            out.append(self._event("response.output_item.added", output_index=self._reasoning_index,
                                   item=copy.deepcopy(item)))
            item["content"].append({"type": "reasoning_text", "text": ""})
        self._reasoning_item["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self._reasoning_item["id"],
                               output_index=self._reasoning_index, content_index=0, delta=text))
        return out

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item, idx = self._reasoning_item, self._reasoning_index
        if item is None:
            return []
        self._reasoning_item = None
        item["status"] = "completed"
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                        text=item["content"][0]["text"]),
            self._event("response.output_item.done", output_index=idx, item=copy.deepcopy(item)),
        ]

    def text(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Output text: opens a message item (and its output_text part) when none is open."""
        if not text and not logprobs:
            return []
        out = self._close_reasoning()
        if self._text_item is None:
            out += self._open_message()
        part = self._text_item["content"][0]
        part["text"] += text
        if logprobs:
            part["logprobs"].extend(logprobs)
        out.append(self._event("response.output_text.delta", item_id=self._text_item["id"], output_index=self._text_index,
                               content_index=0, delta=text, logprobs=logprobs or []))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self._text_index = len(self.response["output"])
        self.response["output"].append(item)
        self._text_item = item
        added = self._event("response.output_item.added", output_index=self._text_index, item=copy.deepcopy(item))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        part_added = self._event("response.content_part.added", item_id=item["id"], output_index=self._text_index,
                                 content_index=0, part=copy.deepcopy(part))
        return [added, part_added]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        item, idx = self._text_item, self._text_index
        if item is None:
            return []
        self._text_item = None
        part = item["content"][0]
        item["status"] = status
        common = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        return [
            self._event("response.output_text.done", **common, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", **common, part=copy.deepcopy(part)),
            self._event("response.output_item.done", output_index=idx, item=copy.deepcopy(item)),
        ]

    def call_start(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        """A function call begins: the open message (if any) is closed first."""
        if not self._parallel and (self._calls or self._dropped):
            self._dropped.add(index)
            return []
        out = self._close_reasoning() + self._close_message("completed")
        namespace, original = self._tool_names.get(name, (None, name))
        item: dict[str, Any] = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                "call_id": call_id, "name": original, "arguments": ""}
        if namespace:
            item["namespace"] = namespace
        out_index = len(self.response["output"])
        self.response["output"].append(item)
        self._calls[index] = (out_index, item)
        out.append(self._event("response.output_item.added", output_index=out_index, item=copy.deepcopy(item)))
        return out

    def call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        if index in self._dropped or not fragment:
            return []
        out_index, item = self._calls[index]
        item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=out_index,
                            delta=fragment)]

    def call_end(self, index: int) -> list[dict[str, Any]]:
        if index in self._dropped:
            return []
        out_index, item = self._calls[index]
        item["status"] = "completed"
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=out_index,
                        name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=out_index, item=copy.deepcopy(item)),
        ]

    def finish(self, usage: Usage, finish_reason: str) -> list[dict[str, Any]]:
        """Close open items; ``response.completed``, or ``response.incomplete`` when the output hit
        ``max_output_tokens`` (finish_reason ``length``)."""
        incomplete = finish_reason == "length"
        out = self._close_reasoning()
        if not any(o["type"] != "reasoning" for o in self.response["output"]):  # always answer, even if empty
            out += self._open_message()
        out += self._close_message("incomplete" if incomplete else "completed")
        for _, item in self._calls.values():
            if item["status"] == "in_progress":  # the parser always ends its calls; kept for safety
                item["status"] = "incomplete"
        self.response["usage"] = usage_json(usage)
        if incomplete:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.response["status"] = "completed"
        self.finished = True
        return out + [self._lifecycle("response.incomplete" if incomplete else "response.completed")]

    def fail(self, error: OmlxError) -> list[dict[str, Any]]:
        """``response.failed`` with ``error: {code, message}``; open items stay as they are."""
        self.error = error
        self.response["status"] = "failed"
        self.response["error"] = {"code": error.code or "server_error", "message": error.message}
        self.finished = True
        return [self._lifecycle("response.failed")]

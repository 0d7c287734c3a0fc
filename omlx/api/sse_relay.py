"""Relaying an upstream Server-Sent Events stream event by event, for the cluster front.

Owns knowing where each protocol's stream properly ends and writing that protocol's own error
event when the upstream (rank 0's worker) stops before it, so an SDK client can tell a cut
stream from a finished one. Pure: bytes in, bytes out; no sockets, no sanic, no mlx. The relay
splits the stream into events itself, keeping each one's bytes (forwarded unchanged, comments
included); httpx-sse's decoder reads each event's fields.

Proper ends (what omlx's own stream handlers send last, omlx.api.openai / anthropic / responses):

- OpenAI chat and completions: ``data: [DONE]`` (after a ``data: {"error": ...}`` chunk on a
  failure).
- Anthropic Messages: ``event: message_stop``, or ``event: error`` on a failure.
- OpenAI Responses: ``response.completed``, ``response.incomplete``, ``response.failed`` or
  ``error``.

The error written at a cut is the one the single-node server writes for a request that fails
mid-stream: OpenAI ``data: {"error": {...}}`` then ``data: [DONE]``; Anthropic ``event: error``
with ``{"type": "error", "error": {"type", "message"}}``; Responses ``response.failed`` carrying
the last response object seen (status ``failed``, ``error: {code, message}``), or an ``error``
event when no response object has been seen yet.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

# Not re-exported by httpx-sse (its public EventSource reads an httpx.Response and yields no raw
# bytes); tests/unit/test_sse_relay.py runs it, so an upgrade that moves it fails there.
from httpx_sse._decoders import SSEDecoder

from omlx.errors import OmlxError

OPENAI, ANTHROPIC, RESPONSES = "openai", "anthropic", "responses"

_ANTHROPIC_ENDS = {"message_stop", "error"}
_RESPONSES_ENDS = {"response.completed", "response.incomplete", "response.failed", "error"}


def protocol_of(path: str) -> str:
    """The protocol of a request path: ``anthropic`` (/v1/messages...), ``responses``
    (/v1/responses...), else ``openai`` (chat completions, completions)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith("/v1/responses"):
        return RESPONSES
    return OPENAI


@dataclass(slots=True)
class SseEvent:
    """One complete SSE event.

    Attributes:
        raw: Its bytes as received, the blank line that ends it included.
        name: Its ``event:`` field, or None (none, or ``message``: the default type).
        data: Its ``data:`` lines joined by ``\\n`` (the SSE rule; ``""`` without one), or None
            (a comment).
    """

    raw: bytes
    name: str | None
    data: str | None

    def json(self) -> Any:
        """``data`` as JSON, or None when it is absent or not JSON (``[DONE]``)."""
        if self.data is None:
            return None
        try:
            return json.loads(self.data)
        except ValueError:
            return None


def _frame(name: str | None, obj: Any) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "").encode() + f"data: {data}\n\n".encode()


def _error_dict(protocol: str, obj: Any) -> dict[str, Any] | None:
    """The error object inside an event's JSON, where that protocol puts it, else None."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if protocol == RESPONSES and isinstance(obj.get("response"), dict):
        err = obj["response"].get("error")
    return err if isinstance(err, dict) else None


class SseRelay:
    """Splits an upstream SSE byte stream into events and remembers whether it ended properly.

    Args:
        protocol: ``openai``, ``anthropic`` or ``responses`` (``protocol_of(path)``).

    Attributes:
        ended: The proper last event has been seen.
        num_events: Complete events seen.
    """

    def __init__(self, protocol: str) -> None:
        if protocol not in (OPENAI, ANTHROPIC, RESPONSES):
            raise ValueError(f"unknown SSE protocol {protocol!r}")
        self.protocol = protocol
        self.ended = False
        self.num_events = 0
        self._buf = b""
        self._response: dict[str, Any] | None = None  # Responses: the last response object seen
        self._seq = -1  # Responses: the last sequence_number seen

    @property
    def num_pending_bytes(self) -> int:
        """Bytes of an incomplete event held back (dropped at a cut: half an event is no event)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The complete events ``chunk`` finishes, in order (partial ones wait for more bytes)."""
        self._buf += chunk.replace(b"\r\n", b"\n")
        out = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return out
            raw, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
            out.append(self._see(raw))

    def _see(self, raw: bytes) -> SseEvent:
        # httpx-sse reads the fields (its EventSource would drop the raw bytes and the comments,
        # which the front must forward as they are: keep-alives during a long prefill). A decoder
        # per event: one that has seen an ``id:`` would make the next comment an empty event.
        decoder = SSEDecoder()
        for line in raw[:-2].decode("utf-8", errors="replace").split("\n"):
            decoder.decode(line)
        sse = decoder.decode("")  # the blank line that ends the event dispatches it
        if sse is None:  # a comment, such as a keep-alive
            ev = SseEvent(raw, None, None)
        else:  # no event field and "message" are one type (the SSE spec's default)
            ev = SseEvent(raw, None if sse.event == "message" else sse.event, sse.data)
        self.num_events += 1
        if self.protocol == OPENAI:
            self.ended = self.ended or ev.data == "[DONE]"
        elif self.protocol == ANTHROPIC:
            self.ended = self.ended or ev.name in _ANTHROPIC_ENDS
        else:
            obj = ev.json()
            if isinstance(obj, dict):
                if isinstance(obj.get("response"), dict):
                    self._response = obj["response"]
                if isinstance(obj.get("sequence_number"), int):
                    self._seq = max(self._seq, obj["sequence_number"])
            self.ended = self.ended or ev.name in _RESPONSES_ENDS
        return ev

    def cluster_error(self, ev: SseEvent) -> str | None:
        """The message of ``ev`` when it is the upstream's own ``cluster_unavailable`` error event
        (the worker lost its pipeline mid-stream), else None."""
        err = _error_dict(self.protocol, ev.json())
        if err is None:
            return None
        message = str(err.get("message", ""))
        if err.get("code") == "cluster_unavailable" or "cluster rank" in message:
            return message
        return None

    def with_message(self, ev: SseEvent, message: str) -> bytes:
        """``ev`` (an error event, see ``cluster_error``) with its error message replaced."""
        obj = ev.json()
        err = _error_dict(self.protocol, obj)
        if err is None:
            return ev.raw
        err["message"] = message
        return _frame(ev.name, obj)

    def error_event(self, error: OmlxError) -> bytes:
        """The protocol's in-stream error for a stream cut before its end (see the module doc)."""
        if self.protocol == OPENAI:
            return _frame(None, error.openai_body()) + b"data: [DONE]\n\n"
        if self.protocol == ANTHROPIC:
            return _frame("error", error.anthropic_body())
        code = error.code or "server_error"
        self._seq += 1
        if self._response is None:
            return _frame("error", {"type": "error", "sequence_number": self._seq, "code": code,
                                    "message": error.message, "param": None})
        response = copy.deepcopy(self._response)
        response["status"] = "failed"
        response["error"] = {"code": code, "message": error.message}
        return _frame("response.failed", {"type": "response.failed", "sequence_number": self._seq,
                                          "response": response})

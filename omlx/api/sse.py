"""Bridging engine events into asyncio and framing Server-Sent Events.

`EventStream` submits a request to an engine and receives its events on the event loop. While
nothing arrives for ``keepalive_s`` (a long prefill), the caller gets a `KEEPALIVE` marker so it
can send an SSE comment or ping and clients with read timeouts do not give up. When the client
goes away, `close()` aborts the request so its slot is freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

from omlx.engine.engine import Engine
from omlx.request import Failed, Finished, GenerationEvent, Request

logger = logging.getLogger(__name__)

KEEPALIVE = object()


class EventStream:
    """Events of one request, on the asyncio side.

    Raises (from ``start``): RateLimitError when the engine's queue is full.
    """

    def __init__(self, engine: Engine, request: Request, keepalive_s: float = 5.0,
                 observer: Callable[[str, Request, GenerationEvent], None] | None = None):
        self.engine = engine
        self.observer = observer  # sees the last event (metrics, recent requests), on the engine thread
        self.request = request
        self.keepalive_s = keepalive_s
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.done = False

    def start(self) -> None:
        self.engine.submit(self.request, self._sink)

    def _sink(self, event: GenerationEvent) -> None:
        if self.observer is not None and isinstance(event, (Finished, Failed)):
            try:
                self.observer(self.engine.model_id, self.request, event)
            except Exception:  # a metrics fault must never cost the request its answer
                logger.exception("metrics observer failed for %s", self.request.request_id)
        # Runs on the engine thread. Once the server's loop has closed nobody is listening: the
        # event has nowhere to go (the server stops engines before that, see api.app).
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # closed between the check and the call
            pass

    async def events(self, *, keepalive: bool = True) -> AsyncIterator[Any]:
        """Yield engine events (and KEEPALIVE markers) until Finished or Failed."""
        while not self.done:
            try:
                ev = await asyncio.wait_for(self._queue.get(), self.keepalive_s if keepalive else None)
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
            if isinstance(ev, (Finished, Failed)):
                self.done = True
            yield ev

    def close(self) -> None:
        """Abort the request if it has not finished (client disconnect, handler error)."""
        if not self.done:
            self.done = True
            self.engine.abort(self.request.request_id)


def sse_data(obj: Any) -> str:
    """One ``data:`` SSE event (OpenAI framing)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(event: str, obj: Any) -> str:
    """One named SSE event (Anthropic and Responses framing: ``event:`` then ``data:``)."""
    return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_COMMENT_KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

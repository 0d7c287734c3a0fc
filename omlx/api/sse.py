"""Bridging engine events into asyncio and framing Server-Sent Events.

`EventStream` submits a request to an engine and receives its events on the event loop. All
streams of one event loop share one `_Bridge`: engine threads append ``(stream, event)`` to its
deque and wake the loop with one ``call_soon_threadsafe`` only when some stream is parked and no
wake-up is pending, so the events of one engine step, for every request in the batch (or of
several steps while the loop was busy), cross threads in one hand-off; while events keep coming
for several requests, the loop looks for them every `_REPASS_S` and needs none.
`EventStream.batches` hands the consumer everything that has arrived at once, so a protocol
frames a batch and writes it with one ``send``. While nothing but prefill progress arrives for
``keepalive_s`` (a long prefill), the caller gets a `KEEPALIVE` marker so it can send an SSE
comment or ping and clients with read timeouts do not give up. When the client goes away,
`close()` aborts the request so its batch row is freed.

Must not: touch mlx, or block an engine thread (a sink only appends and maybe schedules).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from omlx.request import Failed, Finished, GenerationEvent, PrefillProgress, Request

if TYPE_CHECKING:  # the engine is duck-typed here: submit(request, sink), abort(request_id), model_id
    from omlx.engine.engine import Engine

logger = logging.getLogger(__name__)

KEEPALIVE = object()

_TIMED_OUT = object()

_REPASS_S = 0.0005
"""With several streams open, after a pass that found events the next one comes this much later
(adds at most this much latency to events that arrive meanwhile; a decode step takes ms)."""


class _Bridge:
    """Engine threads -> one event loop, for all of that loop's streams.

    The engine side appends to ``buf`` and then reads ``num_parked``; a consumer increments
    ``num_parked`` and then drains ``buf`` (`distribute`) before it waits. So either the consumer
    finds the event, or the engine thread sees it parked and schedules a wake-up (unless one is
    pending: then the loop is in a series of passes that looks at ``buf`` again before it ends,
    see `_pass`). deque.append/popleft are atomic.

    Attributes:
        num_wakeups: ``call_soon_threadsafe`` hand-offs scheduled so far (a statistic: two engine
            threads may both schedule one, or lose an increment of each other's).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # the loop's entry in _BRIDGES must not keep it alive
        self.buf: collections.deque[tuple[EventStream, GenerationEvent]] = collections.deque()
        self.num_parked = 0  # streams waiting in _park (loop thread writes, engine threads read)
        self.num_streams = 0  # streams started and not yet ended (loop thread only)
        self.wake_pending = False  # a hand-off or a later pass is scheduled
        self.num_wakeups = 0

    def put(self, stream: EventStream, event: GenerationEvent) -> None:
        """Engine thread: queue ``event`` for ``stream``; wake the loop only if someone waits."""
        loop = self._loop()
        # Once the server's loop has closed nobody is listening: the event has nowhere to go
        # (the server stops engines before that, see api.app).
        if loop is None or loop.is_closed():
            return
        self.buf.append((stream, event))
        if not self.num_parked or self.wake_pending:
            return
        self.wake_pending = True
        try:
            loop.call_soon_threadsafe(self._pass)
        except RuntimeError:  # closed between the check and the call
            return
        self.num_wakeups += 1

    def _pass(self) -> None:
        """Loop thread: distribute; while several streams are open, look again `_REPASS_S` later
        until a pass finds nothing, and only then let engine threads wake the loop again. So
        while events keep coming the loop collects them without hand-offs, and a hand-off's
        write, which lets the loop thread take the GIL in the middle of an engine step, is not
        repeated for each other request's event of that step. One stream gets no later pass: its
        step brings one event (two at its start and end), and a pass is a wake-up of its own."""
        found = bool(self.buf)
        self.distribute()
        loop = self._loop()
        if loop is None:
            return
        if found and self.num_streams > 1:
            loop.call_later(_REPASS_S, self._pass)
            return
        self.wake_pending = False
        if self.buf:  # came before the flag fell: its put saw it up and scheduled nothing
            self.wake_pending = True
            loop.call_soon(self._pass)

    def distribute(self) -> None:
        """Loop thread: move queued events to their streams and release the parked ones."""
        buf = self.buf
        for _ in range(len(buf)):
            stream, ev = buf.popleft()
            stream._buf.append(ev)
            if stream._waiter is not None:
                self.release(stream, None)

    def release(self, stream: EventStream, result: Any) -> None:
        """Loop thread: un-park ``stream`` now (not when its task resumes), so events that come
        before it runs schedule no wake-up of their own: it will look anyway."""
        waiter = stream._waiter
        if waiter is None:
            return
        stream._waiter = None
        self.num_parked -= 1
        if not waiter.done():
            waiter.set_result(result)


_BRIDGES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Bridge] = weakref.WeakKeyDictionary()


def _bridge(loop: asyncio.AbstractEventLoop) -> _Bridge:
    b = _BRIDGES.get(loop)
    if b is None:
        b = _BRIDGES[loop] = _Bridge(loop)
    return b


class EventStream:
    """Events of one request, on the asyncio side.

    Attributes:
        done: Finished or Failed was taken from the stream, or ``close()`` was called.

    Raises (from ``start``): RateLimitError when the engine's queue is full.
    """

    def __init__(self, engine: Engine, request: Request, keepalive_s: float = 5.0,
                 observer: Callable[[str, Request, GenerationEvent], None] | None = None):
        self.engine = engine
        self.observer = observer  # sees the last event (metrics, recent requests), on the engine thread
        self.request = request
        self.keepalive_s = keepalive_s
        self._loop = asyncio.get_running_loop()
        self._bridge = _bridge(self._loop)
        self._buf: collections.deque[GenerationEvent] = collections.deque()  # loop thread only
        self._waiter: asyncio.Future[Any] | None = None  # set while the consumer is parked
        self._open = False  # counted in the bridge's num_streams
        self.done = False

    @property
    def num_wakeups(self) -> int:
        """Hand-offs (``call_soon_threadsafe``) into this stream's loop so far, all its streams'."""
        return self._bridge.num_wakeups

    def start(self) -> None:
        self.engine.submit(self.request, self._sink)
        self._bridge.num_streams += 1
        self._open = True

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._bridge.num_streams -= 1

    def _sink(self, event: GenerationEvent) -> None:
        """Runs on the engine thread."""
        if self.observer is not None and isinstance(event, (Finished, Failed)):
            try:
                self.observer(self.engine.model_id, self.request, event)
            except Exception:  # a metrics fault must never cost the request its answer
                logger.exception("metrics observer failed for %s", self.request.request_id)
        self._bridge.put(self, event)

    async def _park(self, timeout_s: float | None) -> bool:
        """Wait until this stream may have events; False when ``timeout_s`` passed first."""
        bridge = self._bridge
        waiter = self._loop.create_future()
        self._waiter = waiter
        bridge.num_parked += 1
        timer = None
        try:
            bridge.distribute()  # events queued while nobody was parked scheduled no wake-up
            if self._buf:
                return True
            if timeout_s is not None:
                timer = self._loop.call_later(timeout_s, bridge.release, self, _TIMED_OUT)
            return (await waiter) is not _TIMED_OUT
        finally:
            if self._waiter is waiter:  # not released: it returned at once, or was cancelled
                bridge.release(self, None)
            if timer is not None:
                timer.cancel()

    async def batches(self, *, keepalive: bool = True) -> AsyncIterator[Any]:
        """Yield lists of engine events (everything that arrived, in order) and KEEPALIVE markers,
        until a batch ending in Finished or Failed. A batch is never empty.

        A KEEPALIVE comes ``keepalive_s`` after the last event other than `PrefillProgress` (or
        the last KEEPALIVE): progress events reach no client, so they must not put it off.
        """
        buf = self._buf
        loop = self._loop
        last_s = loop.time()
        while not self.done:
            self._bridge.distribute()
            if not buf:
                timeout_s = max(0.0, last_s + self.keepalive_s - loop.time()) if keepalive else None
                woken = await self._park(timeout_s)
                if not buf:  # timed out (no other wake-up can leave it empty)
                    if not woken:
                        last_s = loop.time()
                        yield KEEPALIVE
                    continue
            batch: list[GenerationEvent] = []
            visible = False
            for _ in range(len(buf)):
                ev = buf.popleft()
                batch.append(ev)
                if type(ev) is not PrefillProgress:
                    visible = True
                    if isinstance(ev, (Finished, Failed)):
                        self.done = True
                        self._end()
                        break
            if visible:
                last_s = loop.time()
            yield batch

    async def events(self, *, keepalive: bool = True) -> AsyncIterator[Any]:
        """Yield engine events (and KEEPALIVE markers) one by one until Finished or Failed."""
        async for batch in self.batches(keepalive=keepalive):
            if batch is KEEPALIVE:
                yield KEEPALIVE
            else:
                for ev in batch:
                    yield ev

    def close(self) -> None:
        """Abort the request if it has not finished (client disconnect, handler error)."""
        self._end()
        if not self.done:
            self.done = True
            self.engine.abort(self.request.request_id)


json_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` without building an encoder
per call (json.dumps does that whenever it is given options)."""


def sse_data(obj: Any) -> str:
    """One ``data:`` SSE event (OpenAI framing)."""
    return f"data: {json_compact(obj)}\n\n"


def sse_event(event: str, obj: Any) -> str:
    """One named SSE event (Anthropic and Responses framing: ``event:`` then ``data:``)."""
    return f"event: {event}\ndata: {json_compact(obj)}\n\n"


SSE_COMMENT_KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

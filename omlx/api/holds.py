"""What one HTTP request holds on the server, and the one place that gives all of it back.

A request to a model route takes, in this order: a `ModelLease` on its model (the pool's promise not
to evict it, loading it first if needed), then, for a generation, its place in the engine (the
`EventStream` of its `ModelTurn`: a queue place, then a batch row, prefix-cache blocks and any
SSD restore in flight, all of which the engine frees when the request finishes or is aborted).
`RequestHolds` owns both for the request, and `holding` runs the route inside
``try: ... finally: holds.release()``: every way out of a request releases them at once, in
one place — its answer, an error, or its client leaving at any moment (before the lease is
taken, while the model loads, during count_tokens, while queued, prefilling or decoding): Sanic
cancels the route's task when the connection is lost, the cancel lands in whichever await the
route is in, and the ``finally`` runs. A cancel while the pool's thread is taking the lease is
the pool's to settle (`EnginePool.acquire_async` releases what the thread then gets). The body
is read before the route starts, so a client that leaves while sending it holds nothing yet; it
is parsed and validated (`omlx.api.bodies`) once, before the lease, and the route reads it from
``holds.parsed``.

Watching the client: Sanic stops reading a socket once its buffered input reaches its
``REQUEST_BUFFER_SIZE`` (64 KiB) and reads again only for the next request, so the FIN or reset
of a client whose body was larger (every real Claude Code body is) went unseen while its route
worked, and a non-streaming request, which writes nothing until it ends, ran to its end.
`holding` reads the socket again for the whole route (`watch_client`), so any departure reaches
Sanic's ``connection_lost`` at once, streaming or not, on every API.

Must not: touch mlx, decide anything about models (the pool does), or release anything from a
timer (the pool's lease expiry is a safety net, not a way out).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from sanic import Request as HttpRequest

from omlx.api.park import Park
from omlx.api.bodies.base import Body, Parsed, parse_body
from omlx.api.turn import ModelTurn
from omlx.errors import ModelNotFoundError
from omlx.pool import EncoderEntry, EnginePool, ModelLease, PoolEntry, chat_entry, encoder_entry
from omlx.request import new_request_id

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestHolds:
    """Everything one HTTP request holds; `release` gives it back (once, in `holding`'s finally).

    Attributes:
        request_id: the request's id: its engine `Request` carries it and its lease names it.
        owner: how its lease names it in the log (``request <id> (<method> <path>)``).
        lease: the model lease, once taken.
        turns: the generations submitted to an engine (each aborted on release unless finished).
        park: TEST ONLY: where the request parks (``omlx.api.park``); None in production.
        parsed: the request's body, parsed and validated once (before the lease is taken).
    """

    pool: EnginePool
    request_id: str
    owner: str
    lease: ModelLease | None = None
    turns: list[ModelTurn] = field(default_factory=list)
    park: Park | None = None
    parsed: Parsed[Any] | None = None

    async def take_lease(self, model: str, task: str) -> None:
        """Lease ``model`` for this request (loading it if needed; on the pool's threads).

        Raises:
            What `EnginePool.acquire` raises: ModelNotFoundError 404, InvalidRequestError 400
            (wrong kind of model), InsufficientMemoryError 507, OverloadedError 529,
            ModelImportError 500.
        """
        then = self.park.on_pool_thread() if self.park is not None else None
        self.lease = await self.pool.acquire_async(model, task=task, owner=self.owner, then=then)

    def chat_entry(self, model: str) -> PoolEntry:
        """The chat entry this request's lease holds (``model`` as the body named it).

        Raises:
            ModelNotFoundError: the body named no model the lease could be taken for.
            InvalidRequestError: it is an embeddings or rerank model.
        """
        if self.lease is None:
            raise ModelNotFoundError(model)
        return chat_entry(self.lease, model)

    def encoder_entry(self, model: str, task: str) -> EncoderEntry:
        """The embeddings or rerank entry this request's lease holds (see `chat_entry`)."""
        if self.lease is None:
            raise ModelNotFoundError(model)
        return encoder_entry(self.lease, model, task)

    def start(self, turn: ModelTurn) -> ModelTurn:
        """Submit ``turn``'s request to its engine; from here this request owns it until release.

        Raises:
            RateLimitError: the engine's queue is full (nothing was submitted).
        """
        turn.start()
        self.turns.append(turn)
        return turn

    async def checkpoint(self, point: str) -> None:
        """An await point of the route (``omlx.api.park.POINTS``); returns at once in production."""
        if self.park is not None:
            await self.park.at(point)

    def release(self) -> None:
        """Abort every generation not finished, then end the lease. Idempotent; never raises."""
        turns, self.turns = self.turns, []
        for turn in turns:
            try:
                turn.close()  # aborts the engine request unless it finished
            except Exception:
                logger.exception("could not abort request %s", self.request_id)
        lease, self.lease = self.lease, None
        if lease is not None:
            self.pool.release(lease)


def holds_of(http: HttpRequest) -> RequestHolds:
    """The `RequestHolds` of a request whose route runs under `holding`."""
    return http.ctx.omlx_holds


def watch_client(http: HttpRequest) -> None:
    """Read the client's socket while the route works (see the module doc), so that its FIN or
    reset reaches Sanic's ``connection_lost``, which cancels the route, as soon as it comes.

    Bytes the client sends meanwhile (a pipelined next request) wait in Sanic's buffer as before.
    """
    transport = getattr(http, "transport", None)
    try:
        if transport is not None and not transport.is_closing():
            transport.resume_reading()
    except (AttributeError, NotImplementedError, RuntimeError):  # a transport that cannot (ASGI, tests)
        pass


Route = Callable[..., Awaitable[Any]]


def holding(task: str, body: type[Body]) -> Callable[[Route], Route]:
    """Route decorator: the route runs with its `RequestHolds` (``holds_of(http)``), its body
    parsed and validated once as ``body`` (``holds.parsed``), then the model it names leased
    (``task``: "chat", "embeddings" or "rerank", the kind of model the route needs), and
    everything released in one ``finally``.

    A body that fails validation is a 400 naming the field, before any lease (no model is loaded
    or rendered for it). Lease errors (unknown model 404, wrong kind 400, 507, 529) are the
    route's response.
    """
    def wrap(route: Route) -> Route:
        @functools.wraps(route)
        async def handler(http: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            rid = new_request_id()
            holds = RequestHolds(http.app.ctx.pool, rid, f"request {rid} ({http.method} {http.path})",
                                 park=Park.of(http))
            http.ctx.omlx_holds = holds
            watch_client(http)
            try:
                await holds.checkpoint("before_lease")
                holds.parsed = parse_body(body, http.body, http.app.ctx.config.max_body_bytes)
                await holds.take_lease(holds.parsed.body.model, task)
                await holds.checkpoint("leased")
                return await route(http, *args, **kwargs)
            finally:
                holds.release()

        return handler

    return wrap

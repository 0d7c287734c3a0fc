"""The public HTTP front of `omlx serve --cluster`: forwards every API request to rank 0's worker.

Design: the node agent (omlx.cluster) starts this node's rank-0 worker (`omlx cluster worker`)
for each epoch's plan on a loopback port; the worker runs the normal omlx API over the pipeline.
This front listens on the public ``--host/--port`` for the whole life of the process and passes
each request through unchanged (method, path, query, headers, body; the response is streamed back
chunk by chunk, so SSE works), so clients never see a port change when the cluster re-plans. While
no worker is ready (planning, a new epoch's workers starting, a lost pipeline) it answers 503 with
``Retry-After`` and the protocol's error shape (OpenAI, or Anthropic under ``/v1/messages``),
code ``cluster_unavailable``, naming the reason. When the worker itself reports its pipeline lost
(503 ``cluster_unavailable``), the front waits up to ``serving.loss_wait_s`` for the agent to name
the node that left and says so. An event stream is relayed event by event
(``omlx.api.sse_relay``): a stream that stops before its proper end (``[DONE]``, ``message_stop``,
``response.completed``...) because the worker died or was replaced mid-response gets the
protocol's own error event from the front, naming the lost node when the agent knows it, so a
client can tell a cut stream from a finished one; the worker's own ``cluster_unavailable`` error
event gets the lost node's name too. ``/health`` shows the agent's view (epoch, plan, worker state).

The front loads no model and never serves one itself: no silent single-node fallback.
``serving`` is duck-typed (``omlx.cluster.serving.ClusterServing``; api and cluster never import
each other): ``upstream() -> (url | None, reason)``, ``snapshot()``, ``lost_peers(snapshot)``,
``health()``, ``retry_after_s``, ``loss_wait_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
from sanic import Request as HttpRequest
from sanic import Sanic
from sanic import json as json_response
from sanic import raw as raw_response

from omlx.api.app import require_api_key
from omlx.api.errors import OmlxErrorHandler
from omlx.api.sse_relay import SseRelay, protocol_of
from omlx.config import ServerConfig
from omlx.errors import ClusterUnavailableError, OmlxError

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx/Sanic set themselves.
_DROP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
         "transfer-encoding", "upgrade", "host", "content-length"}
_METHODS = ["GET", "POST", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS"]


def create_front(config: ServerConfig, serving: Any, status: dict[str, Any]) -> Sanic:
    """Build the forwarding app.

    Args:
        config: the server config (host, port, api_key, max_body_bytes).
        serving: the cluster's serving view (see the module docstring).
        status: startup facts shown in ``/health`` (version).
    """
    app = Sanic("omlx_cluster_front", error_handler=OmlxErrorHandler(), configure_logging=False)
    app.config.REQUEST_MAX_SIZE = config.max_body_bytes
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.REQUEST_TIMEOUT = 300
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.config.NOISY_EXCEPTIONS = False

    @app.before_server_start
    async def _client(app: Sanic) -> None:
        # No read timeout: a long generation streams for minutes; the workers' own step
        # watchdog turns a stuck pipeline into an error.
        app.ctx.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    @app.after_server_stop
    async def _close(app: Sanic) -> None:
        await app.ctx.client.aclose()

    require_api_key(app, config.api_key)

    @app.route("/health", methods=["GET", "HEAD"])
    async def health(http: HttpRequest):
        cluster = serving.health()
        ok = cluster["status"] == "ready"
        return json_response({"status": "ok" if ok else "unavailable", **status, "cluster": cluster},
                             status=200 if ok else 503)

    @app.route("/", methods=["GET", "HEAD"])
    async def root(http: HttpRequest):
        return json_response({"name": "omlx", "status": "ok", "mode": "cluster front", "docs": "/health"})

    @app.route("/<path:path>", methods=_METHODS)
    async def forward(http: HttpRequest, path: str):
        return await _forward(http, serving)

    return app


def _unavailable(serving: Any, message: str) -> ClusterUnavailableError:
    return ClusterUnavailableError(message, retry_after_s=serving.retry_after_s)


async def _forward(http: HttpRequest, serving: Any) -> Any:
    snapshot = serving.snapshot()
    url, reason = serving.upstream()
    if url is None:
        raise _unavailable(serving, reason)
    client: httpx.AsyncClient = http.app.ctx.client
    headers = [(k, v) for k, v in http.headers.items() if k.lower() not in _DROP]
    target = url + http.path + (f"?{http.query_string}" if http.query_string else "")
    request = client.build_request(http.method, target, headers=headers, content=http.body or b"")
    try:
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        _, reason = serving.upstream()
        raise _unavailable(serving, f"cluster: rank 0's worker did not answer ({type(e).__name__}: {e})"
                                    f"{'; ' + reason if reason else ''}") from e
    try:
        if upstream.status_code == 503:
            body = await upstream.aread()
            message = _cluster_error_message(body)
            if message is not None:
                raise await _name_the_loss(serving, snapshot, message)
            return raw_response(body, status=503, headers=_headers(upstream),
                                content_type=upstream.headers.get("content-type"))
        response = await http.respond(status=upstream.status_code, headers=_headers(upstream),
                                      content_type=upstream.headers.get("content-type"))
        if _is_sse(upstream):
            await _relay_sse(http.path, upstream, response, serving, snapshot)
            return None
        try:
            async for chunk in upstream.aiter_raw():
                await response.send(chunk)
        except httpx.HTTPError as e:
            # Not a stream of events: no error shape fits after the status line; the body is short.
            logger.error("rank 0's worker stopped mid-response on %s (%s: %s); the response is cut short",
                         http.path, type(e).__name__, e)
            return None
        await response.eof()
        return None
    finally:
        await upstream.aclose()


_LOSS_POLL_S = 0.25
"""While a stream waits for its next bytes, how often the front checks the pipeline's nodes."""


class _PipelineLeft(OmlxError):
    """A node of the streaming request's pipeline left the membership, or a new epoch's launch
    replaced it."""


def _pipeline_gone(serving: Any, snapshot: Any) -> bool:
    if snapshot is None:
        return False
    now = serving.snapshot()
    return bool(serving.lost_peers(snapshot)) or now is None or now["epoch"] != snapshot["epoch"]


def _is_sse(upstream: httpx.Response) -> bool:
    return (upstream.headers.get("content-type", "").startswith("text/event-stream")
            and "content-encoding" not in upstream.headers)


async def _relay_sse(path: str, upstream: httpx.Response, response: Any, serving: Any, snapshot: Any) -> None:
    """Pass an event stream through event by event. The worker's own ``cluster_unavailable``
    error event gets the lost node's name; a stream that stops before its proper end (the worker
    died, or its agent stopped it for a new epoch) gets the protocol's error event from here. A
    node of the stream's pipeline leaving the membership, or a new epoch replacing the pipeline,
    ends it at once: the worker may sit in a collective until its step timeout, and stopping it
    takes up to its SIGTERM grace."""
    relay = SseRelay(protocol_of(path))
    cut: str | None = None
    chunks = upstream.aiter_raw().__aiter__()
    try:
        while True:
            read = asyncio.ensure_future(chunks.__anext__())
            while not read.done():
                await asyncio.wait({read}, timeout=_LOSS_POLL_S)
                if not read.done() and _pipeline_gone(serving, snapshot):
                    read.cancel()
                    await asyncio.gather(read, return_exceptions=True)
                    raise _PipelineLeft("a node of the pipeline left")
            try:
                chunk = read.result()
            except StopAsyncIteration:
                break
            for ev in relay.feed(chunk):
                message = relay.cluster_error(ev)
                if message is None:
                    await response.send(ev.raw)
                else:
                    err = await _name_the_loss(serving, snapshot, message)
                    await response.send(relay.with_message(ev, err.message))
    except httpx.HTTPError as e:
        cut = f"{type(e).__name__}: {e}"
    except _PipelineLeft:
        cut = "a node of its pipeline left the cluster, or a new epoch replaced the pipeline"
    if cut is None and not relay.ended:
        cut = "the stream ended before its last event"
    if cut is not None:
        err = await _name_the_cut(serving, snapshot, cut)
        logger.error("%s: %s (after %d events; %d bytes of a partial event dropped)", path, err.message,
                     relay.num_events, relay.num_pending_bytes)
        await response.send(relay.error_event(err))
    await response.eof()


async def _name_the_cut(serving: Any, snapshot: Any, detail: str) -> ClusterUnavailableError:
    """The stream from rank 0's worker stopped early: wait (briefly) for the agent to see why: a
    node that left, or the worker no longer ready (it exited, or a new epoch replaced it)."""
    deadline = time.monotonic() + serving.loss_wait_s
    while True:
        lost = serving.lost_peers(snapshot)
        now = serving.snapshot()
        # The launcher marks an exited worker lost within its poll period (0.25 s); a new epoch
        # replaces the launch at once.
        changed = now is None or snapshot is None or now["state"] != "ready" or now["epoch"] != snapshot["epoch"]
        if lost or changed or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    head = "the cluster pipeline was lost mid-response, the response is incomplete"
    if lost:
        why = "; ".join(lost)
    elif now is not None and now["error"]:
        why = str(now["error"])
    else:
        why = f"rank 0's worker stopped sending ({detail})"
    return _unavailable(serving, f"{head}: {why}. Retry once the cluster has re-planned (see /health).")


def _headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP | {"content-type"}}


def _cluster_error_message(body: bytes) -> str | None:
    """The message of a worker's ``cluster_unavailable`` error body (either shape), else None."""
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return None
    if err.get("code") == "cluster_unavailable" or "cluster rank" in str(err.get("message", "")):
        return str(err.get("message"))
    return None


async def _name_the_loss(serving: Any, snapshot: Any, message: str) -> ClusterUnavailableError:
    """The worker lost its pipeline: wait (briefly) for the agent to see which node left."""
    deadline = time.monotonic() + serving.loss_wait_s
    lost = serving.lost_peers(snapshot)
    while not lost and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        lost = serving.lost_peers(snapshot)
    if lost:
        return _unavailable(serving, f"{'; '.join(lost)}. {message}")
    return _unavailable(serving, f"{message} (no node has left the cluster's membership within "
                                 f"{serving.loss_wait_s:.0f} s: a worker process failed on a live node; "
                                 "see the nodes' logs)")


def run_front(cfg: ServerConfig, serving: Any, status: dict[str, Any]) -> int:
    """Serve the front until interrupted; returns 0 (2 for a refused bind)."""
    from omlx.api.server import check_bind

    reason = check_bind(cfg)
    if reason:
        logger.error("%s", reason)
        return 2
    app = create_front(cfg, serving, status)
    logger.info("omlx cluster front ready on http://%s:%d (requests go to rank 0's worker once the "
                "cluster has planned and started it)", cfg.host, cfg.port)
    app.run(host=cfg.host, port=cfg.port, single_process=True, motd=False, access_log=False,
            debug=False, auto_reload=False)
    return 0

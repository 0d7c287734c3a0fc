"""The Sanic application: blueprints, error handling, access control and health.

`create_app` receives everything already built (config, pool, startup report); it loads
nothing itself, so the server only listens once every model is loaded and warmed up.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from sanic import Request as HttpRequest
from sanic import Sanic
from sanic import json as json_response

from omlx.api import admin as admin_routes
from omlx.api import anthropic as anthropic_routes
from omlx.api import dashboard as dashboard_routes
from omlx.api import embeddings as embeddings_routes
from omlx.api import openai as openai_routes
from omlx.api import responses as responses_routes
from omlx.api.errors import OmlxErrorHandler, error_response
from omlx.api.metrics import Metrics
from omlx.api.openapi import openapi_document
from omlx.config import ServerConfig
from omlx.errors import AuthenticationError
from omlx.pool import EnginePool

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/")
MAX_HEADER_BYTES = 16 * 1024  # Sanic's ceiling for REQUEST_MAX_HEADER_SIZE


def check_api_key(http: HttpRequest, api_key: str) -> None:
    """Accept ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (constant-time compare); on the
    dashboard page (`dashboard.KEY_IN_QUERY_PATHS`) also ``?key=KEY``, since a browser opening it
    cannot send a header.

    Raises:
        AuthenticationError: missing or wrong key.
    """
    given = http.headers.get("x-api-key")
    if given is None:
        auth = http.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
    if given is None and http.path in dashboard_routes.KEY_IN_QUERY_PATHS:
        given = http.args.get("key")
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
        raise AuthenticationError("invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")


def require_api_key(app: Sanic, api_key: str | None) -> None:
    """With a key, answer every request outside ``OPEN_PATHS`` that lacks it with a 401 in the
    route's error shape (`check_api_key`). Used by the server and the cluster front."""
    if not api_key:
        return

    @app.on_request
    async def _auth(http: HttpRequest):
        # method NONE: Sanic's stand-in for a request it could not read (headers too large);
        # its error response holds nothing to protect and the key could not be read anyway.
        if http.path not in OPEN_PATHS and http.method != "NONE":
            try:
                check_api_key(http, api_key)
            except AuthenticationError as e:
                return error_response(http.path, e)
        return None


def health_report(pool: EnginePool, status: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``/health`` body and status: 503 when an engine thread is dead."""
    models = []
    ok = True
    for e in pool.entries():
        alive = e.engine.alive
        ok = ok and alive
        st = e.engine.scheduler.stats()
        models.append({
            "id": e.loaded.model_id,
            "alive": alive,
            "running": st.num_running,
            "aborting": st.num_aborting,  # of the running: aborted, out of the batch after the engine's step
            "waiting": st.num_waiting,
            "active": e.engine.num_active(),  # requests holding a batch row on the engine thread
            "batch_failures": e.engine.num_batch_failures,
            "request_failures": e.engine.num_request_failures,
            "retried_requests": e.engine.num_retried_requests,
            "prefix_cache": e.cache_note or "on",
            "cache_layout": _cache_layout(e),
        })
    body = {"status": "ok" if ok else "unhealthy", "models": models, **status}
    return body, 200 if ok else 503


def _cache_layout(entry: Any) -> str:
    """The model's per-layer cache kinds (``omlx.engine.cache_spec.describe``, e.g. ``A*6,W512k0*20``)
    when its prefix cache is on, else the names of its cache classes."""
    spec = getattr(entry.engine.prefix_cache, "spec", None)
    return spec.describe() if spec is not None else ",".join(sorted(set(entry.loaded.cache_classes)))


def create_app(config: ServerConfig, pool: EnginePool, status: dict[str, Any], name: str = "omlx") -> Sanic:
    """Build the Sanic app.

    Args:
        config: the server config.
        pool: loaded engines.
        status: startup report (BLAS, slow paths, versions) shown in ``/health``.
    """
    app = Sanic(name, error_handler=OmlxErrorHandler(), configure_logging=False)
    app.config.REQUEST_MAX_SIZE = config.max_body_bytes
    app.config.REQUEST_MAX_HEADER_SIZE = MAX_HEADER_BYTES  # larger headers: 431 (api.errors)
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.REQUEST_TIMEOUT = 300
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.config.NOISY_EXCEPTIONS = False
    app.ctx.config = config
    app.ctx.pool = pool
    app.ctx.status = status
    app.ctx.started_at = time.time()
    app.ctx.metrics = Metrics(pool)

    require_api_key(app, config.api_key)
    if config.test_park:
        logger.warning("TEST PARK is on (OMLX_TEST_PARK): requests may wait at their route's await points on purpose")

    @app.route("/", methods=["GET", "HEAD"])
    async def root(http: HttpRequest):
        return json_response({"name": "omlx", "status": "ok", "docs": "/health, /v1/models"})

    @app.route("/openapi.json", methods=["GET", "HEAD"])
    async def openapi(http: HttpRequest):
        return json_response(openapi_document(f"{http.scheme}://{http.host}"))

    @app.route("/health", methods=["GET", "HEAD"])
    async def health(http: HttpRequest):
        body, code = health_report(pool, app.ctx.status)
        return json_response(body, status=code)

    @app.route("/v1/cache/stats", methods=["GET", "HEAD"])
    async def cache_stats(http: HttpRequest):
        out = {}
        for e in pool.entries():
            pc = e.engine.prefix_cache
            out[e.loaded.model_id] = {"enabled": pc is not None, "note": e.cache_note, **({"hot": pc.stats()} if pc else {})}
            cold = pc.cold_stats() if pc is not None and hasattr(pc, "cold_stats") else None
            out[e.loaded.model_id]["cold"] = cold if cold is not None else {"enabled": False}
            rank_stats = getattr(pc, "rank_stats", None)  # cluster mode: every rank's own tiers
            if rank_stats is not None:
                out[e.loaded.model_id]["cluster"] = rank_stats()
        return json_response({"models": out})

    @app.before_server_stop
    async def _stop_engines(app: Sanic) -> None:
        # Engines stop while the loop still runs: their last events (a clear "server is
        # stopping" failure) reach the handlers, and no engine thread calls into a closed loop.
        await asyncio.get_running_loop().run_in_executor(None, pool.stop)

    app.blueprint(openai_routes.bp)
    app.blueprint(anthropic_routes.bp)
    app.blueprint(responses_routes.bp)
    app.blueprint(embeddings_routes.bp)
    app.blueprint(dashboard_routes.bp)  # /admin, /v1/admin/recent, /metrics
    admin_routes.install(app)  # /v1/models/{status,<id>/load,<id>/unload}, /v1/admin/{models,pulls}
    return app

"""Model management routes and the request middleware that loads models on demand.

Routes: ``GET /v1/models/status``, ``POST /v1/models/{id}/load``, ``POST /v1/models/{id}/unload``.
Middleware: before any ``POST /v1/...`` whose JSON body names a ``model``, a `Lease` on that
model is taken on the pool's threads (loading it if needed, without blocking the event loop);
it is released when the response starts. Routes of every protocol then find the model loaded
through ``pool.get(...)``, and the pool never evicts it under them.
Must not: decide anything about memory or eviction (the pool does) or touch mlx.
"""

from __future__ import annotations

import json
import logging
from urllib.parse import unquote

from sanic import Blueprint, Sanic
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.params import get_float, parse_json_object
from omlx.pool import EnginePool

logger = logging.getLogger(__name__)

bp = Blueprint("admin", url_prefix="/v1")


def install(app: Sanic) -> None:
    """Register the admin routes and the load-on-demand middleware on ``app``."""
    app.blueprint(bp)
    app.register_middleware(hold_model, "request")
    app.register_middleware(release_model, "response")


def _pool(http: HttpRequest) -> EnginePool:
    return http.app.ctx.pool


@bp.route("/models/status", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def models_status(http: HttpRequest):
    """Memory figures (ceiling, watermarks, measured use), every known model, recent events."""
    return json_response(_pool(http).status())


@bp.post("/models/<model_id>/load")
async def load_model(http: HttpRequest, model_id: str):
    """Load a model now (200 with its status row; 507 with the numbers when it cannot fit)."""
    model_id = unquote(model_id)  # ids such as "org/model" arrive percent-encoded
    row = await _pool(http).call_async(_pool(http).load, model_id)
    return json_response({"id": row["id"], "status": row["state"], "model": row})


@bp.post("/models/<model_id>/unload")
async def unload_model(http: HttpRequest, model_id: str):
    """Unload a model: running requests get ``drain_s`` (body, default 30) to finish, the rest
    fail with a clear error. 400 for a pinned model."""
    model_id = unquote(model_id)
    body = parse_json_object(http.body, http.app.ctx.config.max_body_bytes) if http.body else {}
    drain_s = get_float(body, "drain_s", 30.0, lo=0.0, hi=3600.0)
    pool = _pool(http)
    ev = await pool.call_async(pool.unload, model_id, drain_s=drain_s)
    mid = pool.resolve_id(model_id)
    if ev is None:
        return json_response({"id": mid, "status": "not_loaded"})
    return json_response({"id": mid, "status": "unloaded", "freed_mlx_bytes": ev.freed_mlx_bytes,
                          "freed_process_bytes": ev.freed_process_bytes, "duration_s": round(ev.duration_s, 3)})


#: What each generation route does with its model; other POST /v1 routes naming one get no check.
ROUTE_TASKS = {"/v1/embeddings": "embeddings", "/v1/rerank": "rerank", "/v1/chat/completions": "chat",
               "/v1/completions": "chat", "/v1/messages": "chat", "/v1/messages/count_tokens": "chat",
               "/v1/responses": "chat"}


def _requested_model(http: HttpRequest) -> str | None:
    if http.method != "POST" or not http.path.startswith("/v1/") or http.path.startswith("/v1/models/"):
        return None
    if not http.body or len(http.body) > http.app.ctx.config.max_body_bytes:
        return None
    try:
        body = json.loads(http.body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # the route reports the bad body in its own words
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


async def hold_model(http: HttpRequest):
    """Request middleware: lease the model the body names (loading it first if needed).

    Raises (as the route's error response): ModelNotFoundError 404, InsufficientMemoryError 507,
    OverloadedError 529, ModelImportError 500.
    """
    model = _requested_model(http)
    if model is None:
        return None
    http.ctx.omlx_lease = await _pool(http).acquire_async(model, task=ROUTE_TASKS.get(http.path.rstrip("/")))
    return None


async def release_model(http: HttpRequest, response):
    """Response middleware: release the lease (the engine now holds the request, if any)."""
    lease = getattr(http.ctx, "omlx_lease", None)
    if lease is not None:
        http.ctx.omlx_lease = None
        _pool(http).release(lease)
    return None

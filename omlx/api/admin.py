"""Model management routes: ``GET /v1/models/status``, ``POST /v1/models/{id}/load``,
``POST /v1/models/{id}/unload``.

Models load on demand too: each model route leases the model its body names before it runs
(``omlx.api.holds``), loading it if needed on the pool's threads.
Must not: decide anything about memory or eviction (the pool does) or touch mlx.
"""

from __future__ import annotations

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
    """Register the admin routes on ``app``."""
    app.blueprint(bp)


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

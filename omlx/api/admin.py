"""Model management routes: ``GET /v1/models/status``, ``POST /v1/models/{id}/load``,
``POST /v1/models/{id}/unload``; the catalogue ``GET /v1/admin/models`` (what ``omlx models list``
shows, plus whether each is loaded); pulls from the Hugging Face hub in the background:
``POST /v1/admin/pulls`` (202 and the job), ``GET /v1/admin/pulls[/{id}]``, ``POST
/v1/admin/pulls/{id}/cancel`` (`omlx.engine.pulls.PullManager`, which runs ``omlx models pull``'s code).

Models load on demand too: each model route leases the model its body names before it runs
(``omlx.api.holds``), loading it if needed on the pool's threads. When the server has an API key,
these routes need it like every other (``omlx.api.app.require_api_key``).
Must not: decide anything about memory or eviction (the pool does), download (the pull manager
does) or touch mlx.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import unquote

from sanic import Blueprint, Sanic
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.bodies.admin import PullRequest, UnloadRequest
from omlx.api.bodies.base import parse_body
from omlx.engine import hub
from omlx.engine.catalogue import listing
from omlx.engine.pulls import PullJob, PullManager
from omlx.errors import InvalidRequestError, NotFoundError
from omlx.pool import EnginePool

logger = logging.getLogger(__name__)

bp = Blueprint("admin", url_prefix="/v1")


def install(app: Sanic) -> None:
    """Register the admin routes on ``app``, and the pull manager (``app.ctx.pulls``) that writes
    into the configured hub cache; its pulls are cancelled when the server stops."""
    config = app.ctx.config
    app.ctx.pulls = PullManager(config.hub_cache or hub.cache_dir(None))

    @app.before_server_stop
    async def _stop_pulls(app: Sanic) -> None:
        await asyncio.get_running_loop().run_in_executor(None, app.ctx.pulls.stop)

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
    drain_s = parse_body(UnloadRequest, http.body, http.app.ctx.config.max_body_bytes).body.drain_s if http.body else 30.0
    pool = _pool(http)
    ev = await pool.call_async(pool.unload, model_id, drain_s=drain_s)
    mid = pool.resolve_id(model_id)
    if ev is None:
        return json_response({"id": mid, "status": "not_loaded"})
    return json_response({"id": mid, "status": "unloaded", "freed_mlx_bytes": ev.freed_mlx_bytes,
                          "freed_process_bytes": ev.freed_process_bytes, "duration_s": round(ev.duration_s, 3)})


@bp.route("/admin/models", methods=["GET", "HEAD"])
async def catalogue(http: HttpRequest):
    """Every model on this machine (omlx's models folder and the hub cache), as ``omlx models list
    --json`` gives it (id, source, size_bytes, quantization, bits, group_size, architecture,
    context_length, prefix_cache, path), with ``loaded``."""
    cfg = http.app.ctx.config
    pool = _pool(http)
    cache = http.app.ctx.pulls.cache
    rows = await pool.call_async(listing, cfg.models_dir, cache, kv_bits=cfg.kv_bits,
                                 kv_group_size=cfg.kv_group_size, cache_enabled=cfg.cache.enabled)
    loaded = pool.loaded_ids()
    for r in rows:
        r["loaded"] = r["id"] in loaded
    return json_response({"models": rows, "models_dir": str(cfg.models_dir), "hub_cache": str(cache)})


def _pulls(http: HttpRequest) -> PullManager:
    return http.app.ctx.pulls


def pull_ref(body: PullRequest) -> hub.HubRef:
    """The `HubRef` of a ``POST /v1/admin/pulls`` body: ``repo`` is ``ORG/NAME`` (or ``ORG/NAME@REV``),
    ``revision`` an optional branch, tag or commit hash.

    Raises:
        InvalidRequestError: a malformed ``repo`` or ``revision``.
    """
    repo, revision = body.repo, body.revision
    ref = hub.parse_hub_id(repo if revision is None else f"{repo}@{revision}")
    if ref is None or (revision is not None and "@" in repo):
        raise InvalidRequestError(f"'repo' must be a Hugging Face model id ORG/NAME (e.g. "
                                  f"mlx-community/SmolLM2-135M-Instruct-4bit), with an optional 'revision' (a branch, "
                                  f"tag or commit hash); got {repo!r}" + (f" and {revision!r}" if revision else ""),
                                  param="revision" if hub.parse_hub_id(repo) and revision else "repo")
    return ref


@bp.post("/admin/pulls")
async def start_pull(http: HttpRequest):
    """Check a repo and start pulling it into the hub cache: 202 with the job (its ``id`` for the
    routes below). The checks answer at once: 404 no such repo or revision, 403 gated or not
    readable with the server's HF_TOKEN, 422 not an mlx-lm model, 507 not enough disk, 502 the hub
    cannot be reached; 409 when that repo is already being pulled; 400 for a malformed body."""
    ref = pull_ref(parse_body(PullRequest, http.body, http.app.ctx.config.max_body_bytes).body)
    # the checks call the hub: off the event loop
    job = await asyncio.get_running_loop().run_in_executor(None, _pulls(http).start, ref)
    return json_response(job.as_dict(), status=202, headers={"location": f"/v1/admin/pulls/{job.pull_id}"})


@bp.route("/admin/pulls", methods=["GET", "HEAD"])
async def list_pulls(http: HttpRequest):
    """Every pull the server remembers (the last 50 finished ones and all others), newest first."""
    return json_response({"pulls": [j.as_dict() for j in reversed(_pulls(http).jobs())]})


def _job(http: HttpRequest, pull_id: str) -> PullJob:
    job = _pulls(http).get(pull_id)
    if job is None:
        raise NotFoundError(f"no pull {pull_id!r} (see GET /v1/admin/pulls)", param="pull_id")
    return job


@bp.route("/admin/pulls/<pull_id>", methods=["GET", "HEAD"])
async def get_pull(http: HttpRequest, pull_id: str):
    """One pull: state (queued, running, done, failed, cancelled), done_bytes, total_bytes,
    rate_bytes_per_s, and the error (failed) or the model (done); 404 for an unknown id."""
    return json_response(_job(http, pull_id).as_dict())


@bp.post("/admin/pulls/<pull_id>/cancel")
async def cancel_pull(http: HttpRequest, pull_id: str):
    """Cancel a pull (202: a running one stops at its next chunk; poll it until ``cancelled``).
    404 for an unknown id, 409 for a pull that has already finished."""
    job = _pulls(http).cancel(pull_id)
    if job is None:
        raise NotFoundError(f"no pull {pull_id!r} (see GET /v1/admin/pulls)", param="pull_id")
    return json_response(job.as_dict(), status=202)

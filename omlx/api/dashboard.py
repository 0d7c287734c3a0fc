"""The web dashboard (``GET /admin``), its recent-requests route and ``GET /metrics``.

``/admin`` is one static HTML page (omlx/api/static/admin.html, plain JS, inline SVG plots, no
build step, nothing fetched from outside); it polls the JSON routes every 2 s and keeps the
history client side. When the server has an API key, every route here requires it; a browser
can pass it once as ``/admin?key=KEY`` (the page then keeps it in sessionStorage, strips it from
the address bar and sends it as ``Authorization: Bearer`` on every call), or type it into the
page's prompt.
Must not: compute figures itself (metrics.py and the pool do) or touch mlx.
"""

from __future__ import annotations

from importlib import resources

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response
from sanic.response import html, raw

from omlx.api.metrics import CONTENT_TYPE
from omlx.api.params import get_int

bp = Blueprint("dashboard")

#: Paths where the API key may come as ``?key=`` (a browser opening the page cannot send a header).
KEY_IN_QUERY_PATHS = ("/admin",)


def _page() -> str:
    return resources.files("omlx.api").joinpath("static/admin.html").read_text(encoding="utf-8")


@bp.route("/admin", methods=["GET", "HEAD"])  # HEAD: the GET without its body
async def admin_page(http: HttpRequest):
    """The dashboard page (text/html)."""
    return html(_page(), headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})


@bp.route("/v1/admin/recent", methods=["GET", "HEAD"])
async def recent_requests(http: HttpRequest):
    """The newest finished generation requests (``?limit=``, 1..200, default 50), newest first, and
    under ``prefilling`` the requests whose prompt is being prefilled now (progress, tok/s, ETA)."""
    limit = get_int({k: _int_arg(v) for k, v in http.args.items()}, "limit", 50, lo=1, hi=200)
    m = http.app.ctx.metrics
    return json_response({"requests": m.recent(limit), "prefilling": m.prefilling()})


def _int_arg(values: list[str]) -> int | str:
    v = values[0] if values else ""
    try:
        return int(v)
    except ValueError:
        return v  # get_int names the bad value in a 400


@bp.route("/metrics", methods=["GET", "HEAD"])
async def metrics(http: HttpRequest):
    """Prometheus text exposition of every omlx metric."""
    return raw(http.app.ctx.metrics.exposition(), content_type=CONTENT_TYPE)

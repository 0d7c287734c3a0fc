"""The OpenAPI 3.1 document omlx serves at ``GET /openapi.json``.

Every request body's schema is generated from its model (`omlx.api.bodies`, the same models the
routes validate with), so a generated client or a fuzzer (the schemathesis tests) sends what the
routes accept. The paths and their operations are listed here by hand (a line each); responses
are described loosely (an object); every error is one of the two error shapes of omlx.errors. A
unit test checks that every route registered on the Sanic app appears here with its methods, and
nothing else does. Must not: import Sanic or build responses (app.py serves the dict).
"""

from __future__ import annotations

import copy
from typing import Any

from omlx import __version__
from omlx.api.bodies.schema import REF, body_schemas

_STR = {"type": "string"}
_OBJ = {"type": "object"}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


ERROR_SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"],
                                 "properties": {"message": _STR, "type": _STR,
                                                "param": {"type": ["string", "null"]},
                                                "code": {"type": ["string", "null"]}}}},
    },
    "AnthropicError": {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"},
                       "error": {"type": "object", "required": ["type", "message"],
                                 "properties": {"type": _STR, "message": _STR}}},
    },
}


def _errors(anthropic: bool = False) -> dict[str, Any]:
    shape = {"content": {"application/json": {"schema": _ref("AnthropicError" if anthropic else "OpenAIError")}}}
    return {"4XX": {"description": "the client's mistake, named", **shape},
            "5XX": {"description": "a server-side failure of this request only", **shape}}


def _op(summary: str, *, body: str | None = None, anthropic: bool = False, stream: bool = False,
        params: list[str] = (), tag: str = "", media: str = "application/json", ok: str = "200") -> dict[str, Any]:
    """One operation; ``ok``: its success status ("202" for one that starts work in the background)."""
    content: dict[str, Any] = {media: {"schema": _OBJ if media == "application/json" else _STR}}
    if stream:  # each Server-Sent Event: optional ``event`` name, JSON text in ``data``
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"event": _STR, "data": _STR}}}
    op: dict[str, Any] = {"summary": summary, "tags": [tag] if tag else [],
                          "responses": {ok: {"description": "accepted" if ok == "202" else "success", "content": content},
                                        **_errors(anthropic)}}
    if body:
        op["requestBody"] = {"required": body != "UnloadRequest",
                             "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _STR} for p in params]
    return op


def _get(summary: str, tag: str, params: list[str] = (), media: str = "application/json") -> dict[str, Any]:
    """GET and HEAD (HEAD: the same answer without a body); ``media``: the 200's content type."""
    return {"get": _op(summary, tag=tag, params=params, media=media),
            "head": _op(summary + " (headers only)", tag=tag, params=params, media=media)}


PATHS: dict[str, dict[str, Any]] = {
    "/": _get("server name and status", "server"),
    "/health": _get("liveness, per-model engine state, slow paths (503 when an engine thread is dead)", "server"),
    "/openapi.json": _get("this document", "server"),
    "/v1/cache/stats": _get("prefix cache tiers (hot, cold) per model", "admin"),
    "/metrics": _get("Prometheus text exposition: requests, tokens, TTFT/TPOT histograms, cache, memory", "admin",
                     media="text/plain"),
    "/admin": _get("the web dashboard (HTML; ?key= once when an API key is set)", "admin", media="text/html"),
    "/v1/admin/recent": _get("the newest finished generation requests (query: limit, 1-200) and the prompts prefilling now", "admin"),
    "/v1/admin/models": _get("every model on this machine (models folder and hub cache), as `omlx models list --json` "
                             "gives it, with whether it is loaded", "admin"),
    "/v1/admin/pulls": {**_get("every pull the server remembers, newest first", "admin"),
                        "post": _op("start pulling a Hugging Face repo in the background (202 with the pull's id)",
                                    tag="admin", body="PullRequest", ok="202")},
    "/v1/admin/pulls/{pull_id}": _get("one pull: state (queued, running, done, failed, cancelled), done_bytes, "
                                      "total_bytes, rate_bytes_per_s, error", "admin", ["pull_id"]),
    "/v1/admin/pulls/{pull_id}/cancel": {"post": _op("cancel a pull (202; a running one stops at its next chunk)",
                                                     tag="admin", params=["pull_id"], ok="202")},
    "/v1/models": _get("models served (OpenAI or Anthropic shape by headers)", "models"),
    "/v1/models/{model_id}": _get("one model", "models", ["model_id"]),
    "/v1/models/status": _get("memory figures, every known model, recent load events", "admin"),
    "/v1/models/{model_id}/load": {"post": _op("load a model now", tag="admin", params=["model_id"])},
    "/v1/models/{model_id}/unload": {"post": _op("unload a model (running requests get drain_s)", tag="admin",
                                                 params=["model_id"], body="UnloadRequest")},
    "/v1/chat/completions": {"post": _op("OpenAI chat completion", body="ChatCompletionRequest", stream=True, tag="openai")},
    "/v1/completions": {"post": _op("OpenAI legacy completion", body="CompletionRequest", stream=True, tag="openai")},
    "/v1/messages": {"post": _op("Anthropic Messages", body="MessagesRequest", anthropic=True, stream=True, tag="anthropic")},
    "/v1/messages/count_tokens": {"post": _op("Anthropic token count", body="CountTokensRequest", anthropic=True,
                                              tag="anthropic")},
    "/v1/responses": {**_get("405: list is not supported (use POST or GET /v1/responses/{id})", "responses"),
                      "post": _op("OpenAI Responses", body="ResponsesRequest", stream=True, tag="responses")},
    "/v1/responses/input_tokens": {"post": _op("token count of a Responses request", body="ResponsesRequest",
                                               tag="responses")},
    "/v1/responses/{response_id}": {**_get("a stored response", "responses", ["response_id"]),
                                    "delete": _op("delete a stored response", tag="responses", params=["response_id"])},
    "/v1/responses/{response_id}/input_items": _get("the input items of a stored response", "responses", ["response_id"]),
    "/v1/embeddings": {"post": _op("OpenAI embeddings (encoder models)", body="EmbeddingsRequest", tag="openai")},
    "/v1/rerank": {"post": _op("rerank documents against a query (cross-encoder models)", body="RerankRequest", tag="openai")},
}


def openapi_document(server_url: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict; JSON-serializable).

    Args:
        server_url: the base URL to list under ``servers`` (None: none listed).
    """
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "omlx", "version": __version__,
                 "description": "Local LLM server: OpenAI, Anthropic and Responses APIs on MLX."},
        "paths": PATHS,
        "components": {
            "schemas": {**ERROR_SCHEMAS, **body_schemas()},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return copy.deepcopy(doc)

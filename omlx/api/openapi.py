"""The OpenAPI 3.1 document omlx serves at ``GET /openapi.json``.

Hand-maintained from the request validators (omlx.api.params and each protocol's ``_prepare``):
the same fields, types, ranges and required keys, so a generated client or a fuzzer (the
schemathesis tests) sends what the routes read. Responses are described loosely (an object);
every error is one of the two error shapes of omlx.errors. A unit test checks that every route
registered on the Sanic app appears here with its methods, and nothing else does.
Must not: import Sanic or build responses (app.py serves the dict).
"""

from __future__ import annotations

import copy
from typing import Any

from omlx import __version__
from omlx.api.params import REASONING_EFFORTS

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF + name}


_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_OBJ = {"type": "object"}
_STOP4 = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}]}

_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": _INT,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "n": {"type": "integer", "const": 1},
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
}

_RESPONSE_FORMAT = {
    "type": "object", "required": ["type"],
    "description": "structured outputs, enforced by constrained decoding (llguidance); a schema it cannot "
                   "enforce is a 400 naming the keyword",
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                   "json_schema": {"type": "object", "required": ["schema"],
                                   "properties": {"name": _STR, "description": _STR, "schema": _OBJ, "strict": _BOOL}}},
}
_OPENAI_TOOL = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string", "minLength": 1}, "description": _STR,
                                               "parameters": _OBJ}}},
}

SCHEMAS: dict[str, Any] = {
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
    "ChatMessage": {
        "type": "object", "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"oneOf": [_STR, {"type": "array", "items": _OBJ}, {"type": "null"}],
                        "description": "null only for an assistant message with tool_calls"},
            "tool_calls": {"type": "array", "items": _OBJ},
            "tool_call_id": _STR,
            "name": _STR,
        },
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "stop": _STOP4,
            "logprobs": _BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "tools": {"type": "array", "items": _OPENAI_TOOL},
            "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, _OBJ]},
            "response_format": _RESPONSE_FORMAT,
            "chat_template_kwargs": _OBJ,
            "reasoning_effort": {"enum": list(REASONING_EFFORTS)},
            **_SAMPLING,
        },
    },
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop": _STOP4,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "response_format": _RESPONSE_FORMAT,
            **_SAMPLING,
        },
    },
    "AnthropicMessage": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]},
                       "content": {"oneOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type"]}}]}},
    },
    "MessagesRequest": {
        "type": "object", "required": ["model", "max_tokens", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
            "system": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
            "stop_sequences": {"type": "array", "items": _STR},
            "stream": _BOOL,
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "tools": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "tool_choice": {"type": "object", "required": ["type"],
                            "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR}},
            "thinking": {"type": "object", "properties": {"type": {"enum": ["enabled", "disabled"]},
                                                          "budget_tokens": {"type": "integer", "minimum": 1024}}},
            "metadata": _OBJ,
        },
    },
    "CountTokensRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {"model": {"type": "string", "minLength": 1},
                       "messages": {"type": "array", "minItems": 1, "items": _ref("AnthropicMessage")},
                       "system": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
                       "tools": {"type": "array", "items": _OBJ}},
    },
    "ResponsesRequest": {
        "type": "object", "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
            "instructions": _STR,
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "stream": _BOOL,
            "store": _BOOL,
            "previous_response_id": _STR,
            "tools": {"type": "array", "items": _OBJ},
            "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, _OBJ]},
            "parallel_tool_calls": _BOOL,
            "truncation": {"enum": ["auto", "disabled"]},
            "include": {"type": "array", "items": _STR},
            "reasoning": {"type": "object", "properties": {"effort": {"enum": list(REASONING_EFFORTS)}}},
            "text": _OBJ,
            "metadata": _OBJ,
        },
    },
    "EmbeddingsRequest": {
        "type": "object", "required": ["model", "input"],
        "properties": {"model": {"type": "string", "minLength": 1},
                       "input": {"oneOf": [{"type": "string", "minLength": 1},
                                           {"type": "array", "minItems": 1, "maxItems": 2048,
                                            "items": {"type": "string", "minLength": 1}}]},
                       "encoding_format": {"enum": ["float", "base64"]},
                       "dimensions": {"type": "integer", "minimum": 1}},
    },
    "RerankRequest": {
        "type": "object", "required": ["model", "query", "documents"],
        "properties": {"model": {"type": "string", "minLength": 1}, "query": {"type": "string", "minLength": 1},
                       "documents": {"type": "array", "minItems": 1, "items": {"oneOf": [_STR, _OBJ]}},
                       "top_n": {"type": "integer", "minimum": 1}, "return_documents": _BOOL},
    },
    "UnloadRequest": {"type": "object", "properties": {"drain_s": {"type": "number", "minimum": 0, "maximum": 3600}}},
    "PullRequest": {
        "type": "object", "required": ["repo"], "additionalProperties": False,
        "description": "a Hugging Face model repo to download into the hub cache (omlx models pull's code). 409: "
                       "that repo is already being pulled; 400: a malformed body. The pull itself may then fail with "
                       "the status its error carries in GET /v1/admin/pulls/{id}: 404 no such repo or revision, 403 "
                       "gated or not readable with HF_TOKEN, 422 not an mlx-lm model, 507 not enough disk, 502 the "
                       "hub cannot be reached",
        "properties": {"repo": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
                                "description": "ORG/NAME (ORG/NAME@REVISION is accepted too)"},
                       "revision": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
                                    "description": "a branch, tag or commit hash (default: main)"}},
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
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return copy.deepcopy(doc)

"""Embeddings (OpenAI shape) and rerank (Cohere/Jina shape) routes.

``POST /v1/embeddings``: ``{model, input: str | [str], encoding_format: "float" | "base64",
dimensions?, truncate?}`` -> ``{object: "list", data: [{object: "embedding", index, embedding}],
model, usage: {prompt_tokens, total_tokens}}`` (OpenAI API reference, Embeddings). base64 is the
little-endian float32 bytes of the vector, as OpenAI sends it. ``truncate`` (TEI/Jina's name) cuts
inputs longer than the model accepts instead of a 400. Token-id arrays are refused: they are ids
of another tokenizer (tiktoken) and would embed noise.

``POST /v1/rerank``: ``{model, query, documents: [str | {text}], top_n?, return_documents?}``
-> ``{id, model, results: [{index, relevance_score, document?: {text}}], usage: {total_tokens},
meta: {billed_units: {search_units}}}`` (Cohere Rerank v1, Jina Reranker API), best first.
``return_documents`` defaults to false as in Cohere.
Must not: touch mlx (the encoder engine runs the model on its thread).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.holds import holding, holds_of
from omlx.api.params import get_bool, get_int, get_str, parse_json_object
from omlx.engine.embeddings import embed
from omlx.engine.rerank import rank, relevance, score
from omlx.errors import InvalidRequestError

bp = Blueprint("embeddings", url_prefix="/v1")

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_DOCUMENTS = 10000


def _texts(body: dict[str, Any]) -> list[str]:
    inp = body.get("input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp:
        raise InvalidRequestError("'input' must be a non-empty string or array of strings", param="input")
    if any(isinstance(x, (int, list)) and not isinstance(x, bool) for x in inp):
        raise InvalidRequestError(
            "'input' holds token ids; this server embeds text with the model's own tokenizer. Send strings "
            "(LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))", param="input")
    if len(inp) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' has {len(inp)} items; at most {MAX_INPUTS} per request", param="input")
    for i, x in enumerate(inp):
        if not isinstance(x, str) or not x:
            raise InvalidRequestError(f"input[{i}] must be a non-empty string", param="input")
    return inp


@bp.post("/embeddings")
@holding("embeddings")
async def embeddings(http: HttpRequest):
    body = parse_json_object(http.body, http.app.ctx.config.max_body_bytes)
    model = get_str(body, "model")
    texts = _texts(body)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequestError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    truncate = get_bool(body, "truncate", False)
    dims = get_int(body, "dimensions", None, lo=1)
    entry = holds_of(http).encoder_entry(model, "embeddings")
    if dims is not None and dims != entry.loaded.dim:
        raise InvalidRequestError(
            f"'dimensions' must be {entry.loaded.dim} for {entry.model_id} (it cannot shorten its vectors)", param="dimensions")
    job = embed(entry.engine, texts, truncate=truncate)
    vectors = await asyncio.wrap_future(job.future)  # (N, dim) float32
    if fmt == "base64":
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()}
                for i, v in enumerate(vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens}})


def _documents(body: dict[str, Any]) -> list[str]:
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise InvalidRequestError("'documents' must be a non-empty array of strings or {\"text\": ...} objects", param="documents")
    if len(docs) > MAX_DOCUMENTS:
        raise InvalidRequestError(f"'documents' has {len(docs)} items; at most {MAX_DOCUMENTS} per request", param="documents")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict):
            d = d.get("text")
        if not isinstance(d, str):
            raise InvalidRequestError(f"documents[{i}] must be a string or an object with a string 'text'", param="documents")
        out.append(d)
    return out


@bp.post("/rerank")
@holding("rerank")
async def rerank(http: HttpRequest):
    body = parse_json_object(http.body, http.app.ctx.config.max_body_bytes)
    model = get_str(body, "model")
    query = get_str(body, "query")
    docs = _documents(body)
    top_n = get_int(body, "top_n", None, lo=1)
    return_documents = get_bool(body, "return_documents", False)
    entry = holds_of(http).encoder_entry(model, "rerank")
    job = score(entry.engine, query, docs)
    logits = await asyncio.wrap_future(job.future)
    results = []
    for r in rank(relevance(logits), top_n):
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if return_documents:
            item["document"] = {"text": docs[r.index]}
        results.append(item)
    return json_response({"id": str(uuid.uuid4()), "model": model, "results": results,
                          "usage": {"total_tokens": job.num_tokens},
                          "meta": {"billed_units": {"search_units": 1}}})

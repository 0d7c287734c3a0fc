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
``return_documents`` defaults to false as in Cohere. Bodies: `omlx.api.bodies.encoders`.
Must not: touch mlx (the encoder engine runs the model on its thread).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from sanic import Blueprint
from sanic import Request as HttpRequest
from sanic import json as json_response

from omlx.api.bodies.encoders import EmbeddingsRequest, RerankRequest
from omlx.api.holds import holding, holds_of
from omlx.engine.embeddings import embed
from omlx.engine.rerank import rank, relevance, score
from omlx.errors import InvalidRequestError

bp = Blueprint("embeddings", url_prefix="/v1")


@bp.post("/embeddings")
@holding("embeddings", EmbeddingsRequest)
async def embeddings(http: HttpRequest):
    holds = holds_of(http)
    body: EmbeddingsRequest = holds.parsed.body
    entry = holds.encoder_entry(body.model, "embeddings")
    dims = body.dimensions
    if dims is not None and dims != entry.loaded.dim:
        raise InvalidRequestError(
            f"'dimensions' must be {entry.loaded.dim} for {entry.model_id} (it cannot shorten its vectors)", param="dimensions")
    job = embed(entry.engine, body.texts(), truncate=body.truncate)
    vectors = await asyncio.wrap_future(job.future)  # (N, dim) float32
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()}
                for i, v in enumerate(vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": body.model,
                          "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens}})


@bp.post("/rerank")
@holding("rerank", RerankRequest)
async def rerank(http: HttpRequest):
    holds = holds_of(http)
    body: RerankRequest = holds.parsed.body
    docs = body.texts()
    entry = holds.encoder_entry(body.model, "rerank")
    job = score(entry.engine, body.query, docs)
    logits = await asyncio.wrap_future(job.future)
    results = []
    for r in rank(relevance(logits), body.top_n):
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents:
            item["document"] = {"text": docs[r.index]}
        results.append(item)
    return json_response({"id": holds.request_id, "model": body.model, "results": results,
                          "usage": {"total_tokens": job.num_tokens},
                          "meta": {"billed_units": {"search_units": 1}}})

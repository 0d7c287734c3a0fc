"""Request models of the encoder routes: ``POST /v1/embeddings`` (OpenAI API reference, Embeddings)
and ``POST /v1/rerank`` (Cohere Rerank v1, Jina Reranker API). Must not: import sanic.
"""

from __future__ import annotations

from typing import Any, Literal

from omlx.api.bodies.base import Body, IntIn, Model, NonEmpty, shape

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_DOCUMENTS = 10000


def _input_problem(v: Any) -> str | None:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        return "'{param}' must be a non-empty string or array of strings"
    if any(isinstance(x, (int, list)) and not isinstance(x, bool) for x in v):
        return ("'{param}' holds token ids; this server embeds text with the model's own tokenizer. Send strings "
                "(LangChain: OpenAIEmbeddings(check_embedding_ctx_length=False))")
    if len(v) > MAX_INPUTS:
        return f"'{{param}}' has {len(v)} items; at most {MAX_INPUTS} per request"
    for i, x in enumerate(v):
        if not isinstance(x, str) or not x:
            return f"{{param}}[{i}] must be a non-empty string"
    return None


Texts = shape(_input_problem, {"anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
                                          "items": {"type": "string", "minLength": 1}}]})


class EmbeddingsRequest(Body):
    """``POST /v1/embeddings``; ``truncate`` (TEI/Jina's name) cuts inputs longer than the model accepts."""

    model: Model
    input: Texts
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: IntIn(ge=1) | None = None
    truncate: bool = False
    user: str | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _documents_problem(v: Any) -> str | None:
    if not isinstance(v, list) or not v:
        return "'{param}' must be a non-empty array of strings or {\"text\": ...} objects"
    if len(v) > MAX_DOCUMENTS:
        return f"'{{param}}' has {len(v)} items; at most {MAX_DOCUMENTS} per request"
    for i, d in enumerate(v):
        if not isinstance(d.get("text") if isinstance(d, dict) else d, str):
            return f"{{param}}[{i}] must be a string or an object with a string 'text'"
    return None


Documents = shape(_documents_problem, {"type": "array", "minItems": 1, "maxItems": MAX_DOCUMENTS, "items": {
    "anyOf": [{"type": "string"}, {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}})


class RerankRequest(Body):
    """``POST /v1/rerank``: documents scored against ``query``, best first."""

    model: Model
    query: NonEmpty
    documents: Documents
    top_n: IntIn(ge=1) | None = None
    return_documents: bool = False

    def texts(self) -> list[str]:
        return [d["text"] if isinstance(d, dict) else d for d in self.documents]

"""Reranking with cross-encoders: (query, document) pairs -> relevance scores.

Owns: building the pairs within the model's length limit (the document is cut, never the
query unless it alone is too long), turning classifier logits into scores, and ordering.
Must not: shape Cohere/Jina JSON (`omlx.api.embeddings`) or run MLX (`EncoderEngine`).

Scores: one-label cross-encoders (ms-marco MiniLM, bge-reranker) give ``sigmoid(logit)``, as
sentence-transformers' CrossEncoder and FlagEmbedding (``normalize=True``) do; two-label ones
give the softmax probability of label 1. Both lie in [0, 1] like Cohere's ``relevance_score``.

Architectures: BERT, XLM-RoBERTa and ModernBERT ``*ForSequenceClassification`` checkpoints,
e.g. cross-encoder/ms-marco-MiniLM-L-6-v2 (BERT), BAAI/bge-reranker-base and
bge-reranker-v2-m3 (XLM-R), Alibaba-NLP/gte-reranker-modernbert-base (ModernBERT). Tested here
with small random models of each architecture against an independent reference; no real
reranker checkpoint was available to test with.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from omlx.engine.encoder import EncoderEngine, LoadedEncoder, Sequence
from omlx.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class RankedDocument:
    """One result: the document's index in the request and its score in [0, 1]."""

    index: int
    relevance_score: float


@dataclass(slots=True)
class RerankJob:
    future: Future
    num_tokens: int


def tokenize_pairs(loaded: LoadedEncoder, query: str, documents: list[str]) -> list[Sequence]:
    """``[CLS] query [SEP] doc [SEP]`` (or the model's pair template) per document, cut to fit.

    Raises:
        ContextLengthError: the query alone leaves no room for any document token.
    """
    tok = loaded.tokenizer
    q = tok.encode(query, add_special_tokens=False)
    room = loaded.max_length - tok.num_special_tokens_to_add(True) - len(q.ids)
    if room < 1:
        raise ContextLengthError(
            f"the query is {len(q.ids)} tokens; {loaded.model_id} takes at most {loaded.max_length} tokens "
            "per query + document pair", param="query")
    out = []
    for d in tok.encode_batch(documents, add_special_tokens=False):
        if len(d.ids) > room:
            d.truncate(room)
        enc = tok.post_process(q, d)
        out.append(Sequence(list(enc.ids), list(enc.type_ids)))
    return out


def score(engine: EncoderEngine, query: str, documents: list[str]) -> RerankJob:
    """Queue the pairs; the future gives (len(documents), num_labels) float32 logits.

    Raises:
        InvalidRequestError: the engine is not a cross-encoder.
    """
    loaded = engine.loaded
    if loaded.task != "rerank":
        raise InvalidRequestError(f"model '{loaded.model_id}' is a {loaded.task} model, not a reranker (cross-encoder)", param="model")
    seqs = tokenize_pairs(loaded, query, documents)
    return RerankJob(engine.submit(seqs), sum(len(s.ids) for s in seqs))


def relevance(logits: np.ndarray) -> np.ndarray:
    """(N, num_labels) logits -> (N,) scores in [0, 1] (see the module docstring)."""
    logits = logits.astype(np.float64)
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits[:, 0]))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True))[:, 1]


def rank(scores: np.ndarray, top_n: int | None = None) -> list[RankedDocument]:
    """Documents by descending score (ties: lower index first), at most ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    if top_n is not None:
        order = order[:top_n]
    return [RankedDocument(i, float(scores[i])) for i in order]

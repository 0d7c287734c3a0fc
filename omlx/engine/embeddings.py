"""Text embeddings: inputs -> token sequences -> pooled, normalized vectors from an EncoderEngine.

Owns: turning the texts of one request into `Sequence`s within the model's length limit
(error or truncation), and the usage count. Must not: shape OpenAI JSON or base64 (the API
does), or run MLX (the engine thread does).

Pooling and normalization follow the model's sentence-transformers pipeline (``modules.json``):
all-MiniLM-L6-v2 is mean pooling over real tokens then L2 normalization.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from omlx.engine.encoder import EncoderEngine, LoadedEncoder, Sequence
from omlx.errors import ContextLengthError, InvalidRequestError


@dataclass(slots=True)
class EmbeddingJob:
    """One request's work: the future of a (N, dim) float32 array, and its token count."""

    future: Future
    num_tokens: int


def tokenize_texts(loaded: LoadedEncoder, texts: list[str], *, truncate: bool = False, param: str = "input") -> list[Sequence]:
    """Tokenize texts with the model's special tokens.

    Args:
        truncate: cut texts longer than ``loaded.max_length`` tokens instead of failing.

    Raises:
        ContextLengthError: a text is longer than the model accepts and ``truncate`` is off
            (names its index).
    """
    tok = loaded.tokenizer
    out: list[Sequence] = []
    for i, enc in enumerate(tok.encode_batch(texts)):
        if len(enc.ids) > loaded.max_length:
            if not truncate:
                raise ContextLengthError(
                    f"{param}[{i}] is {len(enc.ids)} tokens; {loaded.model_id} embeds at most {loaded.max_length}. "
                    "Split the text, or send \"truncate\": true to cut it", param=param)
            raw = tok.encode(texts[i], add_special_tokens=False)
            raw.truncate(loaded.max_length - tok.num_special_tokens_to_add(False))
            enc = tok.post_process(raw)
        out.append(Sequence(list(enc.ids), list(enc.type_ids)))
    return out


def embed(engine: EncoderEngine, texts: list[str], *, truncate: bool = False) -> EmbeddingJob:
    """Queue ``texts`` on ``engine``; the future gives (len(texts), dim) float32, in input order.

    Raises:
        InvalidRequestError: the engine is not an embedding model.
        ContextLengthError: see `tokenize_texts`.
    """
    loaded = engine.loaded
    if loaded.task != "embeddings":
        raise InvalidRequestError(f"model '{loaded.model_id}' is a {loaded.task} model, not an embedding model", param="model")
    seqs = tokenize_texts(loaded, texts, truncate=truncate)
    return EmbeddingJob(engine.submit(seqs), sum(len(s.ids) for s in seqs))

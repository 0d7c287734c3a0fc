"""BERT, XLM-RoBERTa and ModernBERT encoders on MLX against an independent numpy reference.

Tiny random checkpoints of each real architecture (Hugging Face weight names) go through
omlx's loader, tokenization and batched, padded engine; every row must equal the reference's
forward pass of that one sequence unpadded.
"""

from __future__ import annotations

import numpy as np
import pytest

from omlx.engine.encoder import EncoderEngine, Sequence, detect_task, load_encoder
from omlx.engine.embeddings import embed, tokenize_texts
from omlx.engine.rerank import rank, relevance, score, tokenize_pairs
from omlx.errors import ContextLengthError, InvalidRequestError, ModelImportError
from tests.tiny_encoders import Reference, write_encoder

QUERY = "what is the capital of france"
DOCS = [
    "paris is the capital of france",
    "the river in the city",
    "a guitar",
    "eating bread and food in paris , the capital city of france , on the river , with music",
    "they said it was hot",
]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta", "modernbert"])
def cross_encoder(request, tmp_path_factory):
    path = write_encoder(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    engine = EncoderEngine(load_encoder(request.param, path, "rerank"))
    engine.start()
    yield engine, Reference(path)
    engine.stop()


def test_cross_encoder_matches_the_reference_forward_pass(cross_encoder):
    engine, ref = cross_encoder
    job = score(engine, QUERY, DOCS)
    logits = job.future.result(60)
    tok = engine.loaded.tokenizer
    for i, doc in enumerate(DOCS):
        enc = tok.encode(QUERY, doc)  # the tokenizer's own pair template
        assert np.allclose(logits[i], ref.logits(enc.ids, enc.type_ids), atol=1e-4), i
    expected = [ref.score(tok.encode(QUERY, d).ids, tok.encode(QUERY, d).type_ids) for d in DOCS]
    assert np.allclose(relevance(logits), expected, atol=1e-5)
    assert job.num_tokens == sum(len(tok.encode(QUERY, d).ids) for d in DOCS)


def test_cross_encoder_batch_equals_one_by_one(cross_encoder):
    engine, _ = cross_encoder
    together = score(engine, QUERY, DOCS).future.result(60)
    alone = np.concatenate([score(engine, QUERY, [d]).future.result(60) for d in DOCS])
    assert np.allclose(together, alone, atol=1e-5)


def test_rank_orders_by_score_and_cuts_at_top_n(cross_encoder):
    engine, ref = cross_encoder
    scores = relevance(score(engine, QUERY, DOCS).future.result(60))
    ranked = rank(scores, top_n=3)
    assert [r.index for r in ranked] == list(np.argsort(-scores, kind="stable")[:3])
    assert all(a.relevance_score >= b.relevance_score for a, b in zip(ranked, ranked[1:]))
    assert all(0.0 <= r.relevance_score <= 1.0 for r in ranked)
    assert len(rank(scores)) == len(DOCS)


def test_pairs_cut_the_document_not_the_query(cross_encoder):
    engine, _ = cross_encoder
    loaded = engine.loaded
    long_doc = " ".join(["river"] * 500)
    (seq,) = tokenize_pairs(loaded, QUERY, [long_doc])
    assert len(seq.ids) == loaded.max_length
    q_ids = loaded.tokenizer.encode(QUERY, add_special_tokens=False).ids
    assert seq.ids[1:1 + len(q_ids)] == q_ids
    with pytest.raises(ContextLengthError):
        tokenize_pairs(loaded, long_doc, ["a"])


def test_modernbert_sliding_window_is_exercised(tmp_path):
    # local_attention = 4: tokens further apart than 2 do not see each other in local layers
    path = write_encoder(tmp_path / "mb", "modernbert", seed=3)
    loaded = load_encoder("mb", path, "rerank")
    ref = Reference(path)
    engine = EncoderEngine(loaded)
    engine.start()
    try:
        enc = loaded.tokenizer.encode(QUERY, DOCS[3])
        assert len(enc.ids) > 20
        out = engine.run([Sequence(enc.ids, enc.type_ids), Sequence([2, 5, 3], [0, 0, 0])])
        assert np.allclose(out[0], ref.logits(enc.ids, enc.type_ids), atol=1e-4)
        ref.cfg["local_attention"] = 10**6  # without the window the reference differs: the test has teeth
        assert not np.allclose(out[0], ref.logits(enc.ids, enc.type_ids), atol=1e-3)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = write_encoder(tmp_path_factory.mktemp("emb"), "bert", classifier=False, seed=2)
    engine = EncoderEngine(load_encoder("emb", path, "embeddings"))
    engine.start()
    yield engine, Reference(path)
    engine.stop()


def test_embeddings_match_reference_and_batch_equals_one_by_one(embedder):
    engine, ref = embedder
    loaded = engine.loaded
    assert (loaded.pooling, loaded.normalize, loaded.dim) == ("mean", True, 32)
    batch = embed(engine, DOCS).future.result(60)
    for i, d in enumerate(DOCS):
        assert np.allclose(batch[i], ref.embedding(loaded.tokenizer.encode(d).ids), atol=1e-5)
        assert np.allclose(batch[i], embed(engine, [d]).future.result(60)[0], atol=1e-6)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


def test_concurrent_requests_share_batches_and_get_their_own_rows(embedder):
    engine, _ = embedder
    jobs = [embed(engine, [DOCS[i % len(DOCS)], DOCS[(i + 1) % len(DOCS)]]) for i in range(12)]
    singles = {d: embed(engine, [d]).future.result(60)[0] for d in DOCS}
    for i, j in enumerate(jobs):
        out = j.future.result(60)
        assert np.allclose(out[0], singles[DOCS[i % len(DOCS)]], atol=1e-6)
        assert np.allclose(out[1], singles[DOCS[(i + 1) % len(DOCS)]], atol=1e-6)


def test_too_long_input_is_an_error_or_truncated(embedder):
    engine, _ = embedder
    loaded = engine.loaded
    text = " ".join(["music"] * 100)
    with pytest.raises(ContextLengthError, match=r"input\[1\] is 102 tokens"):
        tokenize_texts(loaded, ["ok", text])
    (seq,) = tokenize_texts(loaded, [text], truncate=True)
    assert len(seq.ids) == loaded.max_length == 64 and seq.ids[0] == 2 and seq.ids[-1] == 3


def test_wrong_task_and_bad_weights_are_clear_errors(embedder, tmp_path):
    engine, _ = embedder
    with pytest.raises(InvalidRequestError, match="not a reranker"):
        score(engine, "q", ["d"])
    path = write_encoder(tmp_path / "emb", "bert", classifier=False)
    with pytest.raises(ModelImportError, match="pooler"):
        load_encoder("emb", path, "rerank")  # an embedding model has no classifier head


def test_detect_task():
    assert detect_task({"model_type": "bert", "architectures": ["BertModel"]}) == "embeddings"
    assert detect_task({"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"]}) == "rerank"
    assert detect_task({"model_type": "modernbert", "architectures": ["ModernBertForSequenceClassification"]}) == "rerank"
    assert detect_task({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) == "chat"
    assert detect_task({}) == "chat"

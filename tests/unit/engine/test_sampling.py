"""Per-request samplers (omlx.engine.sampling) at the edges of their settings."""

from __future__ import annotations

import mlx.core as mx
import pytest

from omlx.engine.sampling import make_sampler
from omlx.request import SEED_MAX, SEED_MIN, SamplingParams

V = 16


def _logprobs() -> mx.array:
    logits = mx.arange(V, dtype=mx.float32)[None] / 4.0  # token V-1 most likely
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_top_k_at_or_past_the_vocabulary_keeps_every_token_and_later_samplers_still_work():
    # A top_k >= V used to raise inside mlx-lm's apply_top_k, compiled over mx.random.state,
    # and every later sampled request of the process failed ("eval an array without a primitive").
    for k in (V, V + 1, 60000, 2**63 + 5):
        tok = make_sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=k))(_logprobs())
        mx.eval(tok)
        assert 0 <= tok.item() < V
    after = make_sampler(SamplingParams(max_tokens=1, temperature=1.0))(_logprobs())
    mx.eval(after)
    assert 0 <= after.item() < V


def test_top_k_below_the_vocabulary_still_filters():
    sampler = make_sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=1))
    assert {sampler(_logprobs()).item() for _ in range(20)} == {V - 1}


def test_a_broken_random_state_is_reseeded_and_sampling_works_again():
    from mlx_lm.sample_utils import apply_top_k, categorical_sampling

    from omlx.engine.sampling import repair_random_state

    assert repair_random_state() is False  # a usable state is left alone
    try:  # what a sampler raising inside a function compiled over mx.random.state leaves behind
        apply_top_k(mx.zeros((1, V)), V + 3)
    except ValueError:
        pass
    assert repair_random_state() is True
    tok = categorical_sampling(_logprobs(), 1.0)
    mx.eval(tok)
    assert 0 <= tok.item() < V


def test_a_seed_outside_signed_64_bits_is_refused_not_folded():
    """Seeds were folded mod 2**64: 2**64 drew what 0 drew, 2**63 what -2**63 drew. The API
    refuses them (a 400); a sampler asked for one directly raises."""
    for bad in (SEED_MAX + 1, 2**64, 2**80, SEED_MIN - 1):
        with pytest.raises(ValueError, match=f"seed {bad} is outside"):
            make_sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=bad))
    for ok in (SEED_MIN, -5, SEED_MAX):  # the ends of the range sample, reproducibly
        runs = []
        for _ in range(2):
            sampler = make_sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=ok))
            runs.append([sampler(_logprobs()).item() for _ in range(8)])
        assert runs[0] == runs[1]

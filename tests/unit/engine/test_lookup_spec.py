"""Prompt-lookup speculative decoding in omlx's runner, in-process on a tiny random llama.

Differential: with drafting on, every sequence's greedy tokens equal mlx-lm's own
``generate_step`` (the same reference as test_runner), while verify steps really run, accept
some drafts and reject others. The model here is drawn with a small spread and a 512-token
vocabulary so its greedy output falls into loops of many tokens, which lookup partly predicts
(120 tokens of it: 34 distinct; 41 drafted, 35 accepted in 21 verify steps).
"""

from __future__ import annotations

import random

import pytest

from omlx.engine.lookup import PromptLookup
from omlx.engine.runner import BatchRunner
from tests.unit.engine.conftest import looping_llama
from tests.unit.engine.test_runner import drive, reference


def test_lookup_proposes_what_followed_the_last_earlier_occurrence():
    look = PromptLookup(max_ngram=3, min_ngram=2)
    hist = [1, 2, 3, 4, 5, 9, 2, 3]
    assert look.propose(hist, 3, last=4) == [5, 9, 2]  # (2, 3, 4) occurred at 1..3
    assert look.propose(hist + [4], 3, last=7) == []  # (4, 7) and (..., 4, 7) never occurred
    # The most recent occurrence wins; a match may run into the newest token.
    assert PromptLookup().propose([5, 6, 1, 5, 6, 2, 5], 4, last=6) == [2, 5, 6]
    assert PromptLookup().propose([7, 7, 7], 5, last=7) == [7, 7]
    assert look.propose(hist, 0, last=4) == []
    # Without ``last``, the history's own tail is the key (the runner's check before a read).
    assert PromptLookup().propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)


@pytest.fixture(scope="module")
def model():
    """A tiny random llama (vocab 512) whose greedy output loops (`conftest.looping_llama`)."""
    return looping_llama()


def _loop_prompt(n: int = 48, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 512) for _ in range(n)]


def test_a_lone_greedy_sequence_speculates_and_its_tokens_equal_generate_step(model):
    p = _loop_prompt()
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=64, num_draft_tokens=6)
    got = drive(runner, {0: [("a", p)]}, max_tokens=120)
    assert got["a"] == reference(model, p, 120)
    assert runner.num_spec_steps > 0 and runner.num_accepted_tokens > 0, (
        runner.num_spec_steps, runner.num_drafted_tokens, runner.num_accepted_tokens)
    # Some drafts were rejected (their KV trimmed) and the output is still exact.
    assert runner.num_accepted_tokens < runner.num_drafted_tokens


def test_max_tokens_and_stop_tokens_inside_an_accepted_draft(model):
    p = _loop_prompt()
    ref = reference(model, p, 60)
    for n in (1, 2, 5, 13, 37):
        runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=64, num_draft_tokens=8)
        assert drive(runner, {0: [("a", p)]}, max_tokens=n)["a"] == ref[:n], n
    # A stop token that appears mid-output ends the sequence there (drive checks the returned
    # caches hold exactly all_tokens).
    stop = ref[40]
    cut = ref.index(stop)
    runner = BatchRunner(model, stop_tokens=[(stop,)], prefill_step_size=128, block_size=64, num_draft_tokens=8)
    got = drive(runner, {0: [("a", p)]}, max_tokens=60)["a"]
    assert got == ref[: cut + 1], (cut, got)  # the stop token is emitted, with its finish reason


def test_a_batch_with_late_arrivals_and_a_removal_speculates_and_stays_exact(model):
    loop = _loop_prompt()
    other = [_loop_prompt(20, seed=2), _loop_prompt(90, seed=3)]
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, mixed_step_size=32, block_size=64,
                         num_draft_tokens=6)
    schedule = {0: [("a", loop)], 30: [("b", other[0])], 34: [("c", other[1])]}
    got = drive(runner, schedule, max_tokens=90, remove_at={40: "b"})
    assert got["a"] == reference(model, loop, 90)
    assert got["c"] == reference(model, other[1], 90)
    assert got["b"] == reference(model, other[0], 90)[: len(got["b"])]
    assert runner.num_spec_steps > 0


def test_a_sampler_that_cannot_draw_positions_never_speculates(model):
    """A custom sampler (no ``draw``/``keep``, `omlx.engine.speculate.can_draft`) decodes plainly."""
    import mlx.core as mx

    p = _loop_prompt()
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=64, num_draft_tokens=6)
    (uid,) = runner.insert_segments([[p]], max_tokens=[12], samplers=[lambda lp: mx.argmax(lp, axis=-1)])
    toks = []
    while len(runner):
        toks += [r.token for r in runner.next()[1]]
    assert toks == reference(model, p, 12)
    assert runner.num_spec_steps == 0


def test_the_engine_with_drafting_on_gives_generate_step_tokens_and_caches_decoded_blocks(model, tokenizer):
    """Through the engine (prefix cache on, 64-token blocks): tokens emitted several per step
    still detokenize, count and fill decode blocks exactly; the next turn hits those blocks."""
    from omlx.request import Request, SamplingParams
    from tests.unit.engine.test_runner import _engine, _run_all, _tokens, _usage

    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=100, temperature=0.0)
    p = _loop_prompt(40)
    eng = _engine(model, tokenizer, cache=True, num_draft_tokens=6)
    try:
        first = _run_all(eng, [Request("tiny", p, sp)])[0]
        out = _tokens(first)
        assert out == reference(model, p, 100, eos)
        assert _usage(first).num_completion_tokens == len(out)
        assert eng._gen.num_accepted_tokens > 0
        # The request's usage carries its verify steps' counts (the runner's all-time ones: it ran alone).
        u = _usage(first)
        assert (u.num_draft_tokens, u.num_accepted_draft_tokens) == (
            eng._gen.num_drafted_tokens, eng._gen.num_accepted_tokens)
        nxt = p + out + _loop_prompt(10, seed=9)
        second = _run_all(eng, [Request("tiny", nxt, SamplingParams(max_tokens=20, temperature=0.0))])[0]
        assert _tokens(second) == reference(model, nxt, 20, eos)
        assert _usage(second).num_cached_tokens == len(p) + len(out)  # the whole first turn, KV exact
        assert _usage(second).num_draft_tokens == eng._gen.num_drafted_tokens - u.num_draft_tokens
    finally:
        eng.stop()


def test_a_model_whose_cache_cannot_drop_a_draft_is_named_at_load():
    """`drafting_blocker` says why a model never speculates (the runner's `_trims_rows` rule:
    plain KVCache layers only), so the load log does not announce drafting "on" for it."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    from omlx.engine.runner import drafting_blocker
    from tests.unit.engine.archs import tiny
    from tests.unit.engine.conftest import tiny_llama

    assert drafting_blocker(make_prompt_cache(tiny_llama(vocab_size=512))) is None
    assert "RotatingKVCache" in drafting_blocker(make_prompt_cache(tiny("gemma3_text")))
    assert "ArraysCache" in drafting_blocker(make_prompt_cache(tiny("qwen3_next")))
    assert "QuantizedKVCache" in drafting_blocker([KVCache(), QuantizedKVCache(64, 4)])

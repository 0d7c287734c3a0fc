"""Verify steps with repeating attention shapes (``pad_shapes``, on for CUDA), on a tiny random llama.

On CUDA, MLX builds a cuDNN attention graph for every new (query length, key length) pair of a
multi-token forward (~45 ms each on an H100), and a verify step's key length moves every step.
With ``pad_shapes`` the runner feeds every verify step ``1 + num_draft_tokens`` tokens and shows
the attention keys rounded up to 256 positions (`BucketedKV` for a lone row, the merged cache's
``bucket``), the rest masked. Checked here on the CPU: the widths and key lengths repeat, and the
tokens stay those of mlx-lm's ``generate_step``, alone and in a merged batch with joins and aborts.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx.engine.ragged_cache import BucketedKV, RaggedBatchKVCache
from omlx.engine.runner import BatchRunner
from tests.unit.engine.conftest import looping_llama
from tests.unit.engine.test_runner import drive, reference
from tests.unit.engine.test_spec_batch import Recording, _prompt


@pytest.fixture(scope="module")
def model():
    return looping_llama()


def test_a_bucketed_view_gives_the_same_logits_with_keys_rounded_up_to_256(model):
    p, feed = _prompt(300, 1), [5, 9, 11, 3]
    plain, view_of = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array(p)[None], cache=plain)
    model(mx.array(p)[None], cache=view_of)
    want = model(mx.array(feed)[None], cache=plain)
    views = [BucketedKV(c, KVCache.step) for c in view_of]
    got = model(mx.array(feed)[None], cache=views)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert all(c.offset == 304 for c in view_of)  # the writes went to the cache itself
    k, _ = BucketedKV(view_of[0], 256).update_and_fetch(*[mx.zeros((1, *view_of[0].keys.shape[1:2], 2,
                                                                     view_of[0].keys.shape[3]))] * 2)
    assert k.shape[2] == 512 and view_of[0].offset == 306
    assert BucketedKV(view_of[0], 256).make_mask(3).shape == (3, 512)


def test_a_bucketed_view_grows_a_buffer_short_of_the_rounded_length(model):
    """254 cached tokens and 4 more: the ``KVCache`` grows itself to 510 positions (254 + 256),
    short of 512, so the view grows it to 512; the logits stay those of the plain cache."""
    p, feed = _prompt(254, 2), [5, 9, 11, 3]
    plain, view_of = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array(p)[None], cache=plain)
    model(mx.array(p)[None], cache=view_of)
    want = model(mx.array(feed)[None], cache=plain)
    assert plain[0].keys.shape[2] == 510
    got = model(mx.array(feed)[None], cache=[BucketedKV(c, KVCache.step) for c in view_of])
    assert mx.allclose(got, want, atol=1e-4).item()
    assert all(c.offset == 258 and c.keys.shape[2] == 512 and c.values.shape[2] == 512 for c in view_of)


def test_a_bucketed_ragged_batch_gives_the_same_logits_as_without(model):
    a, b = _prompt(40, 1), _prompt(70, 2)
    logits = {}
    for bucket in (0, 256):
        cache = [RaggedBatchKVCache([30, 0]) for _ in model.layers]
        x = mx.array([[0] * 30 + a, b])
        model(x, cache=cache)
        for c in cache:
            c.trim_rows([0, 3])  # ragged: row 1 dropped its last three tokens
            c.bucket = bucket
        logits[bucket] = model(mx.array([[1, 2, 3], [4, 5, 6]]), cache=cache)
        if bucket:
            assert cache[0].make_mask(2).shape[-1] == 256
    assert mx.allclose(logits[0], logits[256], atol=1e-4).item()


def test_a_lone_row_verifies_with_one_width_and_stays_exact(model):
    p = _prompt(48, 1)
    rec = Recording(model)
    runner = BatchRunner(rec, stop_tokens=[], prefill_step_size=128, block_size=64, num_draft_tokens=6,
                         pad_shapes=True)
    got = drive(runner, {0: [("a", p)]}, max_tokens=120)
    assert got["a"] == reference(model, p, 120)
    widths = {n for b, n in rec.shapes if 1 < n <= 9}
    assert widths == {7}, rec.shapes
    assert runner.num_spec_steps > 3 and runner.num_accepted_tokens < runner.num_drafted_tokens


def test_a_merged_batch_verifies_with_one_width_and_each_row_equals_generate_step(model):
    ps = {n: _prompt(length, seed) for n, length, seed in (("a", 48, 1), ("b", 40, 2), ("c", 60, 3),
                                                            ("d", 30, 4))}
    rec = Recording(model)
    runner = BatchRunner(rec, stop_tokens=[], prefill_step_size=128, mixed_step_size=32, block_size=64,
                         num_draft_tokens=6, pad_shapes=True)
    schedule = {0: [("a", ps["a"]), ("b", ps["b"])], 20: [("c", ps["c"])], 45: [("d", ps["d"])]}
    got = drive(runner, schedule, max_tokens=90, remove_at={60: "b"})
    for name in "acd":
        assert got[name] == reference(model, ps[name], 90), name
    assert got["b"] == reference(model, ps["b"], 90)[: len(got["b"])]
    assert rec.batch_verify_steps() > 3
    assert {n for b, n in rec.shapes if b > 1 and 1 < n <= 9} == {7}, rec.shapes

"""`omlx.engine.cache_spec` without a model: layer kinds, where a state hit may end, which
tokens a window layer still holds, and exact restores of window and state layers."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from omlx.engine.cache_spec import (ATTENTION, STATE, WINDOW, CacheSpec, LayerSpec, NotHeldError,
                                    UnsupportedCacheError, describe, freeze, layer_specs)

H, D, W = 2, 4, 8


def kv(n: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """Keys/values whose entries name their position (position p holds p + 0.25 / p + 0.5)."""
    pos = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(pos + 0.25, (1, H, n, D)), mx.broadcast_to(pos + 0.5, (1, H, n, D))


def fill(c, n: int, chunk: int) -> None:
    """Feed ``n`` positions in chunks of ``chunk`` (1 = decode steps), as a forward pass would."""
    done = 0
    while done < n:
        m = min(chunk, n - done)
        c.update_and_fetch(*kv(m, done))
        done += m
    mx.eval(c.keys, c.values)


def spec_of(caches):
    return CacheSpec(layer_specs(caches))


def test_layer_kinds_and_their_description():
    caches = [KVCache(), RotatingKVCache(512, 0), RotatingKVCache(512, 0), ArraysCache(2)]
    specs = layer_specs(caches)
    assert [s.kind for s in specs] == [ATTENTION, WINDOW, WINDOW, STATE]
    assert describe(specs) == "A,W512k0*2,S2"
    assert describe(layer_specs([KVCache(), QuantizedKVCache(64, 4)])) == "A,Q4g64"
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        layer_specs([KVCache(), ChunkedKVCache(64)])
    with pytest.raises(UnsupportedCacheError, match="state-only"):
        layer_specs([ArraysCache(2), ArraysCache(2)])


def test_a_state_hit_ends_at_the_last_part_used_whole_with_a_snapshot():
    spec = CacheSpec((LayerSpec(ATTENTION), LayerSpec(STATE, num_arrays=1)))
    blk = {"kv": mx.zeros((1, 2, H, 4, D))}
    snap = {**blk, "state.1.0": mx.zeros((1, 3))}
    assert spec.hit_end([(blk, 4), (snap, 4), (blk, 4)]) == 8
    assert spec.hit_end([(snap, 4), (snap, 2)]) == 4  # a snapshot is for the part's end only
    assert spec.hit_end([(blk, 4), (blk, 4)]) == 0
    plain = CacheSpec.plain(1)
    assert plain.hit_end([(blk, 4), (blk, 3)]) == 7  # attention only: any length


@pytest.mark.parametrize("chunk", [1, 3, 8, 20])
def test_a_window_layer_holds_the_last_tokens_and_refuses_older_ones(chunk):
    c = RotatingKVCache(W, 0)
    fill(c, 30, chunk)
    spec = spec_of([c])
    first = spec.held_from([c])
    assert first <= 30 - W + 1  # at least the window (a prefill chunk leaves W - 1 + chunk)
    payload = spec.payload_fn([c], None)
    got = payload(first, 30)["win"]  # a window layer's part: (1, 2, H, T, D)
    assert mx.array_equal(got[0, 0, 0, :, 0], mx.arange(first, 30, dtype=mx.float32) + 0.25)
    if first > 0:
        with pytest.raises(NotHeldError):
            payload(first - 1, 30)


@pytest.mark.parametrize("n", [5, W, W + 1, 29])
def test_a_restored_window_layer_continues_exactly_like_the_original(n):
    """Restored from blocks of every position, a window layer then takes the same prefill
    chunk and decode steps as the cache that saw the whole prefix, with the same result."""
    orig = RotatingKVCache(W, 0)
    fill(orig, n, 4)
    spec = CacheSpec((LayerSpec(WINDOW, window=W),))
    full = kv(n)
    block = {"win": mx.stack([full[0][0], full[1][0]])[None]}  # the window part: (1, 2, H, n, D)
    (restored,) = spec.materialize([(block, n)])
    assert restored.offset == n
    ko = orig.update_and_fetch(*kv(3, n))[0]  # a prefill chunk
    kr = restored.update_and_fetch(*kv(3, n))[0]
    # Both attend over (at least) the last W positions, in temporal order.
    assert mx.array_equal(ko[..., -W:, :], kr[..., -W:, :])
    for step in range(W + 2):  # decode steps rotate in place
        a = orig.update_and_fetch(*kv(1, n + 3 + step))[0]
        b = restored.update_and_fetch(*kv(1, n + 3 + step))[0]
        held = sorted(b[0, 0, :, 0].tolist())
        assert sorted(a[0, 0, :, 0].tolist())[-len(held):] == held and held[-1] == n + 3 + step + 0.25


def test_a_frozen_view_keeps_the_state_a_later_step_replaces():
    rot = RotatingKVCache(W, 0)
    fill(rot, W, W)  # full: the next decode step writes in place
    state = ArraysCache(1)
    state[0] = mx.ones((1, 3))
    view = freeze([rot, state])
    before = mx.array(view[0].keys)
    rot.update_and_fetch(*kv(1, W))
    state[0] = mx.zeros((1, 3))
    mx.eval(rot.keys)
    assert mx.array_equal(view[0].keys, before)
    assert mx.array_equal(view[1][0], mx.ones((1, 3)))

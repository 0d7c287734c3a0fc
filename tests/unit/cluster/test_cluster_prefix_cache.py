"""Cluster mode's prefix cache without a model: the ranks' agreement on a request's cached-token
count (`agree_num_cached`), and cutting one rank's hit to that count, which must give exactly
the KV of the shorter prefix (hot blocks, a tail, and restored cold parts)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omlx.cache.hashing import Namespace, make_kv_format
from omlx.cache.paged import BlockPool
from omlx.cache.tiered import TieredCache, PrefixHit
from omlx.cluster.prefix_cache import agree_num_cached
from omlx.engine.cache_spec import CacheSpec
from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers


def test_the_ranks_use_the_fewest_cached_tokens_and_leave_one_to_prefill():
    assert agree_num_cached([512, 300, 700], 1000, whole=False) == 300
    # Every rank holds the whole prompt but nobody holds its last logits: prefill one token.
    assert agree_num_cached([40, 40], 40, whole=False) == 39
    # With rank 0 holding the logits after the prompt, a whole hit on every rank is whole...
    assert agree_num_cached([40, 40, 40], 40, whole=True) == 40
    # ... and one rank short of it makes it an ordinary hit.
    assert agree_num_cached([40, 40, 39], 40, whole=True) == 39
    assert agree_num_cached([40, 0], 40, whole=True) == 0
    assert agree_num_cached([], 10, whole=False) == 0


@pytest.mark.parametrize("counts", [[-1, 3], [3, 11]])
def test_a_count_outside_the_prompt_is_a_bug_that_raises(counts):
    with pytest.raises(ValueError, match="outside"):
        agree_num_cached(counts, 10, whole=False)


@given(st.integers(1, 5000).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n), min_size=1, max_size=8), st.booleans())))
def test_agreement_never_exceeds_any_rank_and_always_leaves_a_token_unless_whole(case):
    n, counts, whole = case
    agreed = agree_num_cached(counts, n, whole)
    assert 0 <= agreed <= min(counts)
    assert agreed == min(min(counts), n - 1) or (whole and agreed == n == min(counts))
    # Every rank computes it from the same gathered list: order does not matter.
    assert agree_num_cached(list(reversed(counts)), n, whole) == agreed


def test_truncating_a_hit_keeps_leading_parts_and_counts_cold_tokens_off_first():
    hit = PrefixHit(parts=[("a", 4), ("b", 4), ("c", 3)], num_cached_tokens=11, num_cached_tokens_cold=7)
    hit.truncate(6)
    assert hit.parts == [("a", 4), ("b", 2)] and hit.num_cached_tokens == 6 and hit.num_cached_tokens_cold == 2
    hit.truncate(0)
    assert hit.parts == [] and hit.num_cached_tokens == 0 and hit.num_cached_tokens_cold == 0
    with pytest.raises(ValueError, match="cannot truncate"):
        hit.truncate(1)


def _cache(keys: mx.array, values: mx.array):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.state = (keys, values, keys.shape[2])
    return c


@pytest.mark.parametrize("num_tokens", [0, 3, 4, 6, 9])
def test_a_truncated_lease_materializes_exactly_the_shorter_prefix(num_tokens):
    bs, num_layers, seq = 4, 2, list(range(100, 111))  # two full blocks and a 3-token tail
    ns = Namespace("m", "t", make_kv_format("float32", None, None, "KVCache"), 3, 5)
    tiers = PrefixCacheTiers(TieredCache(BlockPool(max_bytes=10**8, block_size=bs), ns, MlxPayloadCodec("float32")),
                             CacheSpec.plain(num_layers))
    kv = [(mx.random.normal((1, 2, len(seq), 8)), mx.random.normal((1, 2, len(seq), 8))) for _ in range(num_layers)]
    tiers.store(tiers.acquire(seq), [_cache(k, v) for k, v in kv], seq)

    lease = tiers.acquire(seq + [7], materialize=False)
    assert lease.num_cached_tokens == len(seq)
    tiers.truncate(lease, num_tokens)
    assert lease.num_cached_tokens == num_tokens
    tiers.materialize(lease)
    if num_tokens == 0:
        assert lease.caches is None
    else:
        for (k, v), c in zip(kv, lease.caches):
            assert c.offset == num_tokens
            assert mx.array_equal(c.keys[:, :, :num_tokens], k[:, :, :num_tokens]).item()
            assert mx.array_equal(c.values[:, :, :num_tokens], v[:, :, :num_tokens]).item()
    tiers.release(lease)
    assert tiers.pool.stats().num_blocks == 3  # cutting a hit short drops nothing from the cache


def test_a_materialized_lease_cannot_be_cut():
    ns = Namespace("m", "t", make_kv_format("float32", None, None, "KVCache"), 0, 1)
    tiers = PrefixCacheTiers(TieredCache(BlockPool(max_bytes=10**8, block_size=4), ns, MlxPayloadCodec("float32")), CacheSpec.plain(1))
    seq = [1, 2, 3, 4, 5]
    tiers.store(tiers.acquire(seq), [_cache(mx.zeros((1, 1, 5, 2)), mx.zeros((1, 1, 5, 2)))], seq)
    lease = tiers.acquire(seq + [6])
    with pytest.raises(ValueError, match="before materializing"):
        tiers.truncate(lease, 2)


def test_a_follower_adopts_the_pipelines_prefill_rate_for_its_restore_decisions():
    from omlx.cache.tiered import RestoreCostModel

    # Its own few layers prefill fast: 0.1 s to read 20 MB (assumed 200 MB/s) loses to 0.02 s.
    cost = RestoreCostModel(prefill_tokens_per_s=50_000.0)
    assert not cost.decide(num_bytes=20_000_000, num_tokens=1000).restore
    cost.adopt_prefill_rate(100.0)  # what rank 0 observes for the whole pipeline: 10 s
    assert cost.decide(num_bytes=20_000_000, num_tokens=1000).restore
    cost.adopt_prefill_rate(0.0)  # nothing measured: ignored
    assert cost.prefill_tokens_per_s == 100.0


def _tiers(bs: int = 4, num_layers: int = 2) -> PrefixCacheTiers:
    ns = Namespace("m", "t", make_kv_format("float32", None, None, "KVCache"), 3, 3 + num_layers)
    return PrefixCacheTiers(TieredCache(BlockPool(max_bytes=10**8, block_size=bs), ns, MlxPayloadCodec("float32")),
                            CacheSpec.plain(num_layers))


def _kv(num_tokens: int, num_layers: int = 2) -> list:
    return [_cache(mx.random.normal((1, 2, num_tokens, 8)), mx.random.normal((1, 2, num_tokens, 8)))
            for _ in range(num_layers)]


def test_a_follower_checks_rank_0s_insert_against_its_lookup_and_stores_when_rank_0_stores():
    from omlx.cluster.group import ClusterGroup
    from omlx.cluster.prefix_cache import FollowerPrefixCache
    from omlx.errors import EngineError

    # MLX's singleton group (one process): the gather is real, every collective the identity.
    group = ClusterGroup(mx.distributed.init(strict=False), rank=0, size=1, timeout_s=5)
    tiers = _tiers()
    seq = list(range(100, 111))
    tiers.store(tiers.acquire(seq), _kv(len(seq)), seq)
    follower = FollowerPrefixCache(tiers, group)
    prompt = seq + [7, 8]
    follower.lookup({"op": "lookup", "lease": 0, "tokens": prompt, "whole": False})

    with pytest.raises(EngineError, match="holds 11 cached tokens where rank 0 inserts 8"):
        follower.insert_caches({"lease": 0, "num_cached": 8, "segments": [[prompt[8:]]]})
    with pytest.raises(EngineError, match="not the rest of the prompt"):
        follower.insert_caches({"lease": 0, "num_cached": 11, "segments": [[[7, 9]]]})
    msg = {"lease": 0, "num_cached": 11, "segments": [[[7], [8]]]}
    caches, all_tokens = follower.insert_caches(msg)
    assert all_tokens == [seq] and caches[0][0].offset == 11
    assert follower.insert_caches({"lease": None}) == (None, None)  # a retried request: no lease

    # The replayed generator finishes uid 5 (prompt + 3 generated tokens); rank 0 releases and
    # stores lease 0: the follower stores the same sequence in its own tiers.
    follower.inserted(msg, 5)
    done = prompt + [20, 21, 22]
    follower.finished(5, _kv(len(done) - 1), done)
    follower.release({"op": "release", "lease": 0})
    follower.store({"op": "store", "lease": 0})
    lease = tiers.acquire(done + [1])
    assert lease.num_cached_tokens == len(done) - 1
    tiers.release(lease)

    # Released but not stored by rank 0 (another op came first): nothing is stored.
    follower.lookup({"op": "lookup", "lease": 1, "tokens": [1, 2, 3, 4, 5, 6], "whole": False})
    follower.insert_caches({"lease": 1, "num_cached": 0, "segments": [[[1, 2, 3, 4, 5, 6]]]})
    follower.inserted({"lease": 1}, 6)
    follower.finished(6, _kv(7), [1, 2, 3, 4, 5, 6, 9, 9])
    follower.release({"op": "release", "lease": 1})
    follower.forget_unstored()
    follower.store({"op": "store", "lease": 1})
    lease = tiers.acquire([1, 2, 3, 4, 5, 6, 9])
    assert lease.num_cached_tokens == 0
    tiers.release(lease)

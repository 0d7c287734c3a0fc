"""The engine's cache path without a model (omlx.engine.kv_cache.PrefixCacheTiers): blocks are
hashed once per request across acquire + cache_blocks + store (and the SSD write and read),
blocks registered as prefill chunks complete are hits for a second request while the first
still runs, store at finish copies only what cache_blocks did not, and a materialized cache
grows correctly on mlx-lm's next update_and_fetch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import omlx.cache.blockfile
import omlx.cache.hashing
import omlx.cache.paged
import omlx.cache.tiered
from omlx.cache.hashing import Namespace, make_kv_format
from omlx.cache.paged import BlockPool
from omlx.cache.ssd import SSDStore
from omlx.cache.tiered import RestoreCostModel, TieredCache, TierPolicy
from omlx.engine.cache_spec import CacheSpec
from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers

BS = 8
LAYERS, HEADS, DIM = 3, 2, 4
NS = Namespace("m", "t", make_kv_format("float32", None, None, "KVCache"), 0, LAYERS)


def kv_of(tokens: list[int]) -> list[tuple[mx.array, mx.array]]:
    """Deterministic KV: position t holds its token id (+ layer, k/v) in every element."""
    t = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
    shape = (1, HEADS, len(tokens), DIM)
    return [(mx.broadcast_to(t + 100 * layer, shape), mx.broadcast_to(t + 100 * layer + 50, shape))
            for layer in range(LAYERS)]


def prefill(caches: list[KVCache], tokens: list[int]) -> None:
    """Append the KV of ``tokens`` to the per-layer caches as a forward pass would."""
    for c, (k, v) in zip(caches, kv_of(tokens)):
        c.update_and_fetch(k, v)
    mx.eval([c.keys for c in caches])


def tiers_for(root: Path | None, pool_bytes: int = 10**8) -> PrefixCacheTiers:
    store = SSDStore(root, NS, dtype="float32", max_bytes=10**9) if root is not None else None
    pool = BlockPool(max_bytes=pool_bytes, block_size=BS)
    tiers = TieredCache(pool, NS, MlxPayloadCodec("float32"), store, TierPolicy(),
                        RestoreCostModel(prefill_tokens_per_s=1.0, read_bytes_per_s=1e9))
    return PrefixCacheTiers(tiers, CacheSpec.plain(LAYERS))


@pytest.fixture
def hash_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Every full-block key computed, by (parent, tokens), wherever it is computed."""
    calls: Counter = Counter()
    real = omlx.cache.hashing.hash_block

    def counting(parent, token_ids, extra=b"", *, namespace=None):
        if len(token_ids) == BS:
            calls[(parent, tuple(token_ids))] += 1
        return real(parent, token_ids, extra, namespace=namespace)

    for module in (omlx.cache.hashing, omlx.cache.paged, omlx.cache.tiered, omlx.cache.blockfile):
        monkeypatch.setattr(module, "hash_block", counting)
    return calls


PROMPT = list(range(1, 4 * BS + 4))  # 4 full blocks + 3


def test_each_block_is_hashed_once_across_acquire_cache_blocks_store_and_disk(tmp_path: Path, hash_calls: Counter):
    pc = tiers_for(tmp_path)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    for end in (2 * BS, 4 * BS, len(PROMPT)):  # prefill chunks
        prefill(caches, PROMPT[caches[0].offset:end])
        pc.cache_blocks(lease, caches, PROMPT, end)
    seq = PROMPT + list(range(200, 200 + 2 * BS))  # decode fills blocks 4 and 5
    prefill(caches, seq[len(PROMPT):])
    pc.cache_blocks(lease, caches, seq, len(seq))
    pc.release(lease)
    pc.store(lease, caches, seq)
    assert pc.tiers.flush(10)
    assert len(hash_calls) == 6 and set(hash_calls.values()) == {1}, hash_calls

    # A second request after a restart: hashed once for lookup, hot and cold, and the read.
    hash_calls.clear()
    assert pc.close(10)
    pc2 = tiers_for(tmp_path)
    hash_calls.clear()  # the index rebuild validates each file's key once at start
    lease2 = pc2.acquire(seq + [7])
    assert lease2.num_cached_tokens == len(seq) and lease2.num_cached_tokens_cold == len(seq)
    assert lease2.num_registered_blocks == 6
    pc2.release(lease2)
    assert len(hash_calls) == 6 and set(hash_calls.values()) == {1}, hash_calls


def test_blocks_cached_per_chunk_are_hits_while_the_first_request_runs():
    pc = tiers_for(None)
    first = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, PROMPT[: 2 * BS + 3])
    assert pc.cache_blocks(first, caches, PROMPT, 2 * BS + 3) == 2
    assert pc.cache_blocks(first, caches, PROMPT, 2 * BS + 3) == 0  # nothing new
    second = pc.acquire(PROMPT[: 3 * BS] + [999])
    assert second.num_cached_tokens == 2 * BS and second.caches is not None
    for layer, (k, v) in enumerate(kv_of(PROMPT[: 2 * BS])):
        assert mx.array_equal(second.caches[layer].keys[..., : 2 * BS, :], k).item()
        assert mx.array_equal(second.caches[layer].values[..., : 2 * BS, :], v).item()
    pc.release(second)
    # Held by the first lease until it is released: the chain cannot be evicted under it.
    held = [pc.pool.get(h) for h in first.block_hashes.hashes[:2]]
    assert all(b is not None and b.ref_count == 1 for b in held)
    pc.release(first)
    assert all(b.ref_count == 0 for b in held)


def test_store_after_cache_blocks_copies_only_the_rest_and_the_tail():
    pc = tiers_for(None)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, PROMPT)
    assert pc.cache_blocks(lease, caches, PROMPT, len(PROMPT)) == 4
    before = {h: pc.pool.get(h) for h in lease.block_hashes.hashes}
    payloads = {h: id(b.payload) for h, b in before.items()}
    seq = PROMPT + list(range(200, 200 + BS))
    prefill(caches, seq[len(PROMPT):])
    pc.release(lease)
    pc.store(lease, caches, seq)
    s = pc.pool.stats()
    assert s.num_full_blocks == 5 and s.num_tails == 1
    assert all(pc.pool.get(h) is b and id(b.payload) == payloads[h] for h, b in before.items())
    # the stored sequence is exact: a lookup of it plus one token reuses all of it
    again = pc.acquire(seq + [1])
    assert again.num_cached_tokens == len(seq)
    for layer, (k, v) in enumerate(kv_of(seq)):
        assert mx.array_equal(again.caches[layer].keys[..., : len(seq), :], k).item()
    pc.release(again)


def test_a_full_hot_tier_stops_cache_blocks_and_store_retries_after_release():
    one_block = LAYERS * 2 * HEADS * BS * DIM * 4
    pc = tiers_for(None, pool_bytes=2 * one_block)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, PROMPT)
    assert pc.cache_blocks(lease, caches, PROMPT, len(PROMPT)) == 2
    assert lease.hot_full and lease.num_registered_blocks == 2
    assert pc.cache_blocks(lease, caches, PROMPT, len(PROMPT)) == 0
    pc.release(lease)
    pc.store(lease, caches, PROMPT)
    assert pc.pool.num_bytes <= 2 * one_block


def test_a_materialized_cache_grows_like_a_fresh_one_on_the_next_update():
    pc = tiers_for(None)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, PROMPT)
    pc.release(lease)
    pc.store(lease, caches, PROMPT)
    hit = pc.acquire(PROMPT + [5, 6])
    assert hit.num_cached_tokens == len(PROMPT)
    rest = [5, 6] + list(range(300, 300 + 300))  # past the next 256-token step too
    for chunk in (rest[:2], rest[2:]):
        for c, (k, v) in zip(hit.caches, kv_of(chunk)):
            c.update_and_fetch(k, v)
    ref = [KVCache() for _ in range(LAYERS)]
    prefill(ref, PROMPT + rest)
    for got, want in zip(hit.caches, ref):
        assert got.offset == want.offset == len(PROMPT) + len(rest)
        gk, gv = got.keys_and_values() if hasattr(got, "keys_and_values") else got.state[:2]
        wk, wv = want.keys[..., : want.offset, :], want.values[..., : want.offset, :]
        assert mx.array_equal(gk[..., : got.offset, :], wk).item()
        assert mx.array_equal(gv[..., : got.offset, :], wv).item()
    # the hot tier's blocks were not written through by the updates
    again = pc.acquire(PROMPT + [5, 6])
    for layer, (k, _) in enumerate(kv_of(PROMPT)):
        assert mx.array_equal(again.caches[layer].keys[..., : len(PROMPT), :], k).item()
    pc.release(again)
    pc.release(hit)


def _buffer_address(a: mx.array) -> int:
    """Where an evaluated array's data starts (its memoryview released at once: a held view
    would keep MLX from updating the buffer in place)."""
    m = memoryview(a)
    address = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
    m.release()
    return address


@pytest.mark.parametrize("disk", [False, True])
def test_a_materialized_cache_takes_the_prompts_rest_in_place(disk: bool, tmp_path: Path):
    """The hit's KV is copied once into per-layer buffers with room for the prompt's uncached
    rest: prefilling that rest (two chunks) and a decode step write into the same buffers, with
    the values of a fresh prefill, and the blocks (hot, or read back from disk) stay as stored."""
    pc = tiers_for(tmp_path if disk else None)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, PROMPT)
    pc.release(lease)
    pc.store(lease, caches, PROMPT)
    if disk:
        assert pc.close()
        pc = tiers_for(tmp_path)
    rest = list(range(300, 300 + 40))
    hit = pc.acquire(PROMPT + rest, materialize=False)
    assert hit.num_cached_tokens == len(PROMPT) and hit.num_cached_tokens_cold == (len(PROMPT) if disk else 0)
    pc.materialize(hit, room=len(rest))
    assert all(c.keys.shape[2] >= len(PROMPT) + len(rest) and c.offset == len(PROMPT) for c in hit.caches)
    where = [(_buffer_address(c.keys), _buffer_address(c.values)) for c in hit.caches]
    for chunk in (rest[:16], rest[16:39], rest[39:]):
        for c, (k, v) in zip(hit.caches, kv_of(chunk)):
            c.update_and_fetch(k, v)
        mx.eval([c.keys for c in hit.caches] + [c.values for c in hit.caches])
    assert [(_buffer_address(c.keys), _buffer_address(c.values)) for c in hit.caches] == where
    ref = [KVCache() for _ in range(LAYERS)]
    prefill(ref, PROMPT + rest)
    for got, want in zip(hit.caches, ref):
        assert got.offset == want.offset
        assert mx.array_equal(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :]).item()
        assert mx.array_equal(got.values[..., : got.offset, :], want.values[..., : want.offset, :]).item()
    again = pc.acquire(PROMPT + [5])
    for layer, (k, v) in enumerate(kv_of(PROMPT)):
        assert mx.array_equal(again.caches[layer].keys[..., : len(PROMPT), :], k).item()
        assert mx.array_equal(again.caches[layer].values[..., : len(PROMPT), :], v).item()
    pc.release(again)
    pc.release(hit)


@pytest.mark.parametrize("shape", ["heads", "value_dim"])
def test_layers_that_differ_in_kv_shape_are_cached_per_layer_and_restored_exactly(shape, tmp_path):
    """Layers with other KV heads, or values of another head dim than keys (MLA), cannot share
    one block-major array: each layer's keys and values get their own tensors, hot and on disk."""
    pc = tiers_for(tmp_path)
    lease = pc.acquire(PROMPT)
    caches = [KVCache() for _ in range(LAYERS)]
    for i, c in enumerate(caches):
        h = 2 * HEADS if shape == "heads" and i == 1 else HEADS
        vd = DIM // 2 if shape == "value_dim" else DIM
        c.update_and_fetch(mx.random.normal((1, h, len(PROMPT), DIM)), mx.random.normal((1, h, len(PROMPT), vd)))
    assert pc.cache_blocks(lease, caches, PROMPT, len(PROMPT)) == len(PROMPT) // BS
    pc.release(lease)
    pc.store(lease, caches, PROMPT)
    assert pc.close(10)
    for tiers in (pc, tiers_for(tmp_path)):  # hot, then after a restart (cold)
        again = tiers.acquire(PROMPT + [7])
        assert again.num_cached_tokens == len(PROMPT)
        for got, want in zip(again.caches, caches):
            assert mx.array_equal(got.keys[..., : len(PROMPT), :], want.keys[..., : len(PROMPT), :])
            assert mx.array_equal(got.values[..., : len(PROMPT), :], want.values[..., : len(PROMPT), :])
        tiers.release(again)


def test_the_restore_cost_model_takes_the_chunk_rate_and_keeps_what_served_prefills_showed(tmp_path: Path):
    """A start-up block measurement is replaced by the faster rate at the engine's chunk size;
    once served prefills were observed they win, and a clean close leaves them in the SSD
    tier's note for the next start."""
    pc = tiers_for(tmp_path)
    pc.prefill_note_tokens = 256
    cost = pc.tiers.cost
    cost.adopt_prefill_rate(1000.0)
    pc.adopt_chunk_prefill_rate(400.0)  # slower than what it has: kept
    assert cost.prefill_tokens_per_s == 1000.0
    pc.adopt_chunk_prefill_rate(8000.0)
    assert cost.prefill_tokens_per_s == 8000.0
    pc.observe_prefill(3000, 1.0)
    rate = cost.prefill_tokens_per_s
    pc.adopt_chunk_prefill_rate(50000.0)  # served prefills are the better evidence
    assert cost.prefill_tokens_per_s == rate < 8000.0
    assert pc.close(10)
    note = pc.tiers.store.load_note("prefill")
    assert note["source"] == "observed" and note["num_tokens"] == 256 and note["tokens_per_s"] == rate


def test_another_block_size_over_the_same_ssd_folder_finds_nothing_and_fails_nothing(tmp_path: Path):
    """A server restarted with another --block-size over the same cache folder once read a
    tail of the old size back as a full block of the new one and could not start: the block
    size is part of the namespace, so the old files are another namespace's."""
    import dataclasses

    def tiers(bs: int) -> PrefixCacheTiers:
        ns = dataclasses.replace(NS, block_size=bs)
        store = SSDStore(tmp_path, ns, dtype="float32", max_bytes=10**9)
        t = TieredCache(BlockPool(max_bytes=10**8, block_size=bs), ns, MlxPayloadCodec("float32"), store,
                        TierPolicy(), RestoreCostModel(prefill_tokens_per_s=1.0, read_bytes_per_s=1e9))
        return PrefixCacheTiers(t, CacheSpec.plain(LAYERS))

    assert dataclasses.replace(NS, block_size=2).key() != NS.key()
    seq = list(range(1, 6 * BS + 3))  # 6 full blocks of BS tokens and a tail of 2
    pc = tiers(BS)
    lease = pc.acquire(seq)
    caches = [KVCache() for _ in range(LAYERS)]
    prefill(caches, seq)
    pc.release(lease)
    pc.store(lease, caches, seq)
    assert pc.close(10)
    for bs, expected in ((2, 0), (BS, len(seq))):  # another size: nothing; the same size again: all
        pc = tiers(bs)
        lease = pc.acquire(seq + [7])
        assert lease.num_cached_tokens == expected
        if expected:
            pc.materialize(lease)
            assert lease.caches[0].offset == expected
        pc.release(lease)
        assert pc.close(10)

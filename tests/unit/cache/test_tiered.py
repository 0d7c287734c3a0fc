"""Hot <-> cold policy without a model: write-back on eviction, write-through (new blocks, hot
hits), restore on lookup after a restart, the restore cost rule, bad files mid-chain, flush on
close, and the failure case `ssd-cache-key-misses-kv-quant-setting` (a changed KV format,
dtype or weights is a miss, never concatenated)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from omlx.cache.blockfile import HostBlock, block_path
from omlx.cache.hashing import Namespace, hash_block, make_kv_format
from omlx.cache.paged import BlockPool
from omlx.cache.ssd import SSDStore
from omlx.cache.tiered import RestoreCostModel, TieredCache, TierPolicy

BS = 4
KV = make_kv_format("bfloat16", None, None, "KVCache")
NS = Namespace("model-a", "tok-a", KV, 0, 2)
BLOCK_BYTES = 2 * 2 * (1 * 2 * BS * 8) * 2  # layers x (k, v) x elements x 2 bytes


class HostCodec:
    """Payloads are HostBlocks already; from_host copies so restored payloads are fresh objects."""

    def to_host(self, payload: object) -> HostBlock:
        assert isinstance(payload, HostBlock)
        return payload

    def from_host(self, host: HostBlock) -> tuple[object, int]:
        copy = HostBlock(host.dtype, host.kv.copy())
        return copy, copy.num_bytes


def kv_for(tokens: list[int]) -> HostBlock:
    """Deterministic fake KV: position t of the sequence holds its token id (+ layer, k/v)."""
    t = np.array(tokens, dtype=np.uint16)

    def arr(offset: int) -> np.ndarray:
        return np.ascontiguousarray(np.broadcast_to((t + offset)[None, None, :, None], (1, 2, len(t), 8)))

    return HostBlock.from_layers("bfloat16", [(arr(100 * layer), arr(100 * layer + 50)) for layer in range(2)])


def make_payload(tokens: list[int]):
    def payload(a: int, b: int) -> tuple[object, int]:
        p = kv_for(tokens[a:b])
        return p, p.num_bytes
    return payload


def tiers_for(root: Path, *, ns: Namespace = NS, pool_bytes: int = 10**6, policy: TierPolicy | None = None,
              cost: RestoreCostModel | None = None, disk_bytes: int = 10**9) -> TieredCache:
    store = SSDStore(root, ns, dtype="bfloat16", max_bytes=disk_bytes)
    pool = BlockPool(max_bytes=pool_bytes, block_size=BS)
    # Reads always win unless a test says otherwise.
    cost = cost or RestoreCostModel(prefill_tokens_per_s=1.0, read_bytes_per_s=1e9)
    return TieredCache(pool, ns, HostCodec(), store, policy or TierPolicy(), cost)


def run(tiers: TieredCache, tokens: list[int]) -> None:
    """A request that finished with these tokens: look up, store, release."""
    hit = tiers.acquire(tokens)
    tiers.store_sequence(tokens, len(tokens), make_payload(tokens))
    tiers.release(hit)


def hashes(tokens: list[int], ns: Namespace = NS) -> list[bytes]:
    out, parent = [], ns.key()
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = hash_block(parent, tokens[i : i + BS])
        out.append(parent)
    return out


def cached_kv(hit) -> np.ndarray:
    """Layer 0 keys of the hit, concatenated along the token axis (what the engine would see)."""
    parts = [p.layers[0][0][:, :, :n] for p, n in hit.parts]
    return np.concatenate(parts, axis=2)


SEQ = list(range(1, 15))  # 3 full blocks + a tail of 2


def test_new_full_blocks_and_tail_are_written_through_at_registration(tmp_path: Path):
    tiers = tiers_for(tmp_path)
    run(tiers, SEQ)
    assert tiers.flush(10)
    assert [tiers.store.contains(h) for h in hashes(SEQ)] == [True, True, True]
    tail = hash_block(hashes(SEQ)[-1], SEQ[12:])
    assert tiers.store.contains(tail) and tiers.store.stats().num_files == 4


def test_write_back_on_eviction(tmp_path: Path):
    policy = TierPolicy(write_new_blocks=False, write_through_hits=0)
    tiers = tiers_for(tmp_path, pool_bytes=3 * BLOCK_BYTES, policy=policy)
    run(tiers, SEQ[:12])
    assert tiers.flush(10) and tiers.store.stats().num_files == 0
    run(tiers, [90 + i for i in range(12)])  # evicts the first chain, leaf first
    assert tiers.flush(10)
    assert all(tiers.store.contains(h) for h in hashes(SEQ[:12]))
    assert tiers.pool.stats().num_evictions == 3


def test_write_through_after_n_hits(tmp_path: Path):
    policy = TierPolicy(write_new_blocks=False, write_through_hits=2)
    tiers = tiers_for(tmp_path, policy=policy)
    run(tiers, SEQ)
    tiers.release(tiers.acquire(SEQ))  # hit once
    assert tiers.flush(10) and tiers.store.stats().num_files == 0
    tiers.release(tiers.acquire(SEQ))  # hit twice
    assert tiers.flush(10) and tiers.store.stats().num_files == 3


def test_restore_after_restart_is_exact_and_goes_back_to_the_hot_tier(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    assert first.close(10)
    second = tiers_for(tmp_path)  # a restart: empty RAM, index rebuilt from disk
    query = SEQ[:12] + [77, 78]
    hit = second.acquire(query)
    assert hit.num_cached_tokens == 12 and hit.num_cached_tokens_cold == 12
    expected = kv_for(SEQ[:12]).layers[0][0]
    assert np.array_equal(cached_kv(hit), expected)
    second.release(hit)
    assert second.pool.stats().num_full_blocks == 3
    again = second.acquire(query)
    assert again.num_cached_tokens == 12 and again.num_cached_tokens_cold == 0
    second.release(again)
    stats = second.cold_stats()
    assert stats["num_hits"] == 1 and stats["num_cached_tokens"] == 12 and stats["num_restored_blocks"] == 3
    # restore_s: wall seconds of the restore (reads, validation, conversion), for the benchmark
    assert 0 < stats["restore_s"] < 60 and stats["num_restored_bytes"] > 0


def test_last_block_of_the_prompt_is_restored_and_used_in_part(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    first.close(10)
    second = tiers_for(tmp_path)
    hit = second.acquire(SEQ[:12])  # exactly 3 blocks: the model must still run the last token
    assert hit.num_cached_tokens == 11 and hit.num_cached_tokens_cold == 11
    assert np.array_equal(cached_kv(hit), kv_for(SEQ[:11]).layers[0][0])
    second.release(hit)


def test_restore_is_skipped_when_recompute_is_cheaper(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    first.close(10)
    slow_disk = RestoreCostModel(prefill_tokens_per_s=1e6, read_bytes_per_s=1.0)
    second = tiers_for(tmp_path, cost=slow_disk)
    hit = second.acquire(SEQ)
    assert hit.num_cached_tokens == 0
    assert second.cold_stats()["num_restores_skipped"] == 1
    second.release(hit)


def test_cost_model_rule_and_measurements():
    cost = RestoreCostModel(prefill_tokens_per_s=1000.0, read_bytes_per_s=None, policy=TierPolicy(assumed_read_bytes_per_s=1e6))
    d = cost.decide(num_bytes=500_000, num_tokens=1000)  # 0.5 s read vs 1 s prefill
    assert d.restore and d.est_restore_s == pytest.approx(0.5) and d.est_prefill_s == pytest.approx(1.0)
    assert not cost.decide(num_bytes=2_000_000, num_tokens=1000).restore
    assert not cost.read_measured
    cost.observe_read(4_000_000, 1.0)  # first measurement replaces the assumption
    assert cost.read_bytes_per_s == pytest.approx(4e6) and cost.read_measured
    cost.observe_read(1_000_000, 1.0)
    assert cost.read_bytes_per_s == pytest.approx(0.7 * 4e6 + 0.3 * 1e6) and cost.num_read_samples == 2
    cost.observe_prefill(500, 1.0)  # a served prefill moves the start-up measurement
    assert cost.prefill_tokens_per_s == pytest.approx(0.7 * 1000 + 0.3 * 500) and cost.num_prefill_samples == 1
    assert not cost.decide(0, 0).restore


def test_bad_file_mid_chain_stops_the_restore_and_is_counted(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    first.close(10)
    path = block_path(tmp_path, NS, hashes(SEQ)[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    second = tiers_for(tmp_path)
    hit = second.acquire(SEQ)
    assert hit.num_cached_tokens == 4 and hit.num_cached_tokens_cold == 4  # block 0 only
    assert np.array_equal(cached_kv(hit), kv_for(SEQ[:4]).layers[0][0])
    second.release(hit)
    stats = second.cold_stats()
    assert stats["num_bad_files"] == 1 and stats["num_restore_failures"] == 1 and not path.exists()


def test_cold_blocks_supersede_a_shorter_hot_partial(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    first.close(10)
    second = tiers_for(tmp_path, policy=TierPolicy(write_new_blocks=False))
    second.pool.release([second.pool.register(NS, None, SEQ[:4], kv_for(SEQ[:4]), BLOCK_BYTES)])
    tail = second.pool.register_tail(NS, hashes(SEQ)[0], SEQ[4:6], kv_for(SEQ[4:6]), BLOCK_BYTES // 2)
    second.pool.release([tail])
    hit = second.acquire(SEQ)
    # blocks 1 and 2 and 1 token of the tail [13, 14] (the last prompt token is never cached)
    assert hit.num_cached_tokens == 13 and hit.num_cached_tokens_cold == 9
    assert tail.ref_count == 0  # the hot partial was released, not leaked
    assert np.array_equal(cached_kv(hit), kv_for(SEQ[:13]).layers[0][0])
    second.release(hit)
    assert all(b.ref_count == 0 for b in second.pool.blocks())


def test_restored_blocks_beyond_the_hot_budget_are_still_used(tmp_path: Path):
    first = tiers_for(tmp_path)
    run(first, SEQ)
    first.close(10)
    second = tiers_for(tmp_path, pool_bytes=BLOCK_BYTES)
    hit = second.acquire(SEQ)
    assert hit.num_cached_tokens == 13 and hit.num_cached_tokens_cold == 13
    assert np.array_equal(cached_kv(hit), kv_for(SEQ[:13]).layers[0][0])
    assert second.pool.num_bytes <= BLOCK_BYTES
    second.release(hit)


def test_close_writes_back_every_hot_block(tmp_path: Path):
    tiers = tiers_for(tmp_path, policy=TierPolicy(write_new_blocks=False, write_through_hits=0))
    run(tiers, SEQ)
    run(tiers, [50 + i for i in range(8)])
    assert tiers.store.stats().num_files == 0
    assert tiers.close(10)
    # SEQ: 3 blocks + its tail; the second sequence: 2 blocks
    assert SSDStore(tmp_path, NS, dtype="bfloat16", max_bytes=10**9).stats().num_files == 6


def test_a_block_still_in_the_write_queue_is_restored_from_memory(tmp_path: Path):
    policy = TierPolicy(write_new_blocks=False, write_through_hits=0)
    tiers = tiers_for(tmp_path, pool_bytes=3 * BLOCK_BYTES, policy=policy)
    gate = threading.Event()
    real = tiers.store._write
    tiers.store._write = lambda job: (gate.wait(10), real(job))  # type: ignore[method-assign]
    try:
        run(tiers, SEQ[:12])
        run(tiers, [90 + i for i in range(12)])  # evicts SEQ's blocks into the (stalled) queue
        hit = tiers.acquire(SEQ)
        assert hit.num_cached_tokens_cold == 12
        assert np.array_equal(cached_kv(hit), kv_for(SEQ[:12]).layers[0][0])
        tiers.release(hit)
    finally:
        gate.set()
    assert tiers.flush(10)


@pytest.mark.parametrize(
    "changed",
    [
        Namespace("model-a", "tok-a", make_kv_format("bfloat16", 6, 64, "QuantizedKVCache"), 0, 2),
        Namespace("model-a", "tok-a", make_kv_format("float16", None, None, "KVCache"), 0, 2),
        Namespace("model-a-new-weights", "tok-a", KV, 0, 2),
        Namespace("model-a", "tok-a-new-template", KV, 0, 2),
        Namespace("model-a", "tok-a", KV, 0, 1),
    ],
    ids=["kv-bits", "dtype", "weights", "chat-template", "layers"],
)
def test_changed_kv_format_or_weights_is_a_miss_never_concatenated(tmp_path: Path, changed: Namespace):
    """Failure case ssd-cache-key-misses-kv-quant-setting: the key covers everything that changes
    KV layout or values; incompatible blocks are misses, never loaded."""
    before = Namespace("model-a", "tok-a", make_kv_format("bfloat16", 4, 64, "QuantizedKVCache"), 0, 2) \
        if "Quantized" in changed.kv_format else NS
    first = tiers_for(tmp_path, ns=before)
    run(first, SEQ)
    first.close(10)
    assert changed.digest() != before.digest()
    store = SSDStore(tmp_path, changed, dtype="bfloat16", max_bytes=10**9)
    pool = BlockPool(max_bytes=10**6, block_size=BS)
    second = TieredCache(pool, changed, HostCodec(), store, TierPolicy(), RestoreCostModel(1.0, 1e9))
    hit = second.acquire(SEQ)
    assert hit.num_cached_tokens == 0 and hit.parts == []
    second.release(hit)
    assert store.stats().num_files == 0 and store.stats().num_reads == 0
    # The old namespace's files are untouched (another server may still use them).
    assert SSDStore(tmp_path, before, dtype="bfloat16", max_bytes=10**9).stats().num_files == 4


def test_without_a_store_the_cache_is_ram_only(tmp_path: Path):
    pool = BlockPool(max_bytes=10**6, block_size=BS)
    tiers = TieredCache(pool, NS, HostCodec(), None)
    run(tiers, SEQ)
    hit = tiers.acquire(SEQ)
    assert hit.num_cached_tokens == 13 and hit.num_cached_tokens_cold == 0
    tiers.release(hit)
    assert tiers.cold_stats() is None and tiers.close() and pool.on_evict is None


def test_blocks_and_tails_holding_generated_tokens_are_written_when_idle_hit_or_closed(tmp_path: Path):
    """A finished request with a 6-token prompt and 8 generated tokens: block 0 (prompt only)
    goes to disk at once; block 1 (prompt and generated), block 2 and the tail wait for the
    engine to idle (`write_deferred`), a hit (a next turn repeating the answer), or close."""
    tiers = tiers_for(tmp_path, policy=TierPolicy(write_through_hits=0))
    hit = tiers.acquire(SEQ[:6])
    tiers.store_sequence(SEQ, len(SEQ), make_payload(SEQ), num_prompt_tokens=6)
    tiers.release(hit)
    assert tiers.flush(10)
    h = hashes(SEQ)
    assert [tiers.store.contains(x) for x in h] == [True, False, False]
    assert not tiers.store.contains(tail_hash(SEQ))
    # The next turn repeats prompt and answer: the blocks and the tail it hits are queued.
    tiers.release(tiers.acquire(SEQ + [70, 71]))
    assert tiers.flush(10)
    assert all(tiers.store.contains(x) for x in h) and tiers.store.contains(tail_hash(SEQ))
    assert tiers.write_deferred() == 0  # nothing left held back: the hit queued it all
    # Another answer, never hit, is queued once the engine idles.
    other = SEQ[:6] + [90 + i for i in range(8)]
    tiers.store_sequence(other, len(other), make_payload(other), num_prompt_tokens=6)
    assert tiers.flush(10) and not tiers.store.contains(hashes(other)[1])
    assert tiers.write_deferred() == 3 and tiers.flush(10)
    assert all(tiers.store.contains(x) for x in hashes(other)) and tiers.store.contains(tail_hash(other))
    # A third reaches the disk at close (write-back of the hot tier).
    third = SEQ[:6] + [50 + i for i in range(8)]
    tiers.store_sequence(third, len(third), make_payload(third), num_prompt_tokens=6)
    assert tiers.close(10)
    assert all(tiers.store.contains(x) for x in hashes(third)) and tiers.store.contains(tail_hash(third))


def test_without_deferral_every_new_block_and_tail_is_written_at_once(tmp_path: Path):
    tiers = tiers_for(tmp_path, policy=TierPolicy(write_through_hits=0, defer_generated=False))
    tiers.store_sequence(SEQ, len(SEQ), make_payload(SEQ), num_prompt_tokens=6)
    assert tiers.flush(10)
    assert all(tiers.store.contains(x) for x in hashes(SEQ)) and tiers.store.contains(tail_hash(SEQ))


# ---- tails on disk ------------------------------------------------------------------------

TAIL_POLICY = TierPolicy(write_new_blocks=False, write_through_hits=0)  # disk only at close


def tail_hash(tokens: list[int]) -> bytes:
    """Key of the tail after the last full block of ``tokens``."""
    full = len(tokens) // BS * BS
    return hash_block(hashes(tokens)[-1] if full else NS.key(), tokens[full:])


def test_a_tail_written_at_close_is_restored_with_its_common_prefix(tmp_path: Path):
    first = tiers_for(tmp_path, policy=TAIL_POLICY)
    run(first, SEQ)  # 3 blocks + tail [13, 14]
    assert first.store.stats().num_files == 0
    assert first.close(10)
    second = tiers_for(tmp_path)
    assert second.store.contains(tail_hash(SEQ))
    # A follow-up turn extends the sequence: the whole tail is reused (14 tokens).
    hit = second.acquire(SEQ + [70, 71])
    assert hit.num_cached_tokens == 14 and hit.num_cached_tokens_cold == 14
    assert np.array_equal(cached_kv(hit), kv_for(SEQ).layers[0][0])
    second.release(hit)
    # The restored tail is registered in the hot tier: the next lookup needs no disk.
    reads = second.store.stats().num_reads
    hit = second.acquire(SEQ[:13] + [77, 78])  # diverges inside the tail: 1 of its tokens
    assert hit.num_cached_tokens == 13 and hit.num_cached_tokens_cold == 0
    assert second.store.stats().num_reads == reads
    second.release(hit)


def test_a_cold_tail_under_the_root_serves_a_prompt_shorter_than_a_block(tmp_path: Path):
    first = tiers_for(tmp_path, policy=TAIL_POLICY)
    run(first, [5, 6, 7])
    first.close(10)
    second = tiers_for(tmp_path)
    hit = second.acquire([5, 6, 7, 8])
    assert hit.num_cached_tokens == 3 and hit.num_cached_tokens_cold == 3
    assert np.array_equal(cached_kv(hit), kv_for([5, 6, 7]).layers[0][0])
    second.release(hit)


def test_a_cold_tail_shorter_than_the_hot_partial_is_not_read(tmp_path: Path):
    first = tiers_for(tmp_path, policy=TAIL_POLICY)
    run(first, SEQ[:13])  # tail [13]
    first.close(10)
    second = tiers_for(tmp_path, policy=TAIL_POLICY)
    run(second, SEQ)  # restores blocks + tail [13]; registers the longer tail [13, 14] in RAM
    reads = second.store.stats().num_reads
    hit = second.acquire(SEQ + [99])
    assert hit.num_cached_tokens == 14 and hit.num_cached_tokens_cold == 0
    assert second.store.stats().num_reads == reads
    second.release(hit)


def test_a_tail_superseded_by_a_longer_sibling_is_deleted_from_disk(tmp_path: Path):
    tiers = tiers_for(tmp_path)  # write-through: every block and tail as it is registered
    run(tiers, SEQ[:13])  # tail [13]
    assert tiers.flush(10) and tiers.store.contains(tail_hash(SEQ[:13]))
    run(tiers, SEQ)  # tail [13, 14] covers [13]
    assert tiers.flush(10)
    assert tiers.store.contains(tail_hash(SEQ)) and not tiers.store.contains(tail_hash(SEQ[:13]))
    run(tiers, SEQ + [15, 16, 17])  # a full block [13..16] covers [13, 14]; new tail [17]
    assert tiers.flush(10)
    assert not tiers.store.contains(tail_hash(SEQ))
    s = tiers.store.stats()
    assert s.num_superseded == 2 and s.num_files == 5  # 4 blocks + tail [17]
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 5 and sum(f.stat().st_size for f in files) == s.num_bytes
    tiers.close(10)


def test_a_tail_covered_on_disk_is_not_written(tmp_path: Path):
    tiers = tiers_for(tmp_path)
    run(tiers, SEQ)  # blocks + tail [13, 14] on disk
    assert tiers.flush(10)
    store = tiers.store
    writes = store.stats().num_writes
    parent = hashes(SEQ)[-1]
    assert store.put(tail_hash(SEQ[:13]), parent, [13], kv_for([13]))  # [13, 14] covers it
    assert store.flush(10)
    s = store.stats()
    assert s.num_writes == writes and s.num_superseded == 1
    assert not store.contains(tail_hash(SEQ[:13]))


def test_superseded_tails_found_at_start_are_deleted(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, seq in ((a, SEQ[:13]), (b, SEQ)):
        tiers = tiers_for(root, policy=TAIL_POLICY)
        run(tiers, seq)
        tiers.close(10)
    short = block_path(a, NS, tail_hash(SEQ[:13]))
    target = block_path(b, NS, tail_hash(SEQ[:13]))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(short.read_bytes())  # e.g. left by a crash between two writes
    store = SSDStore(b, NS, dtype="bfloat16", max_bytes=10**9)
    assert store.stats().num_superseded == 1 and not target.exists()
    assert store.contains(tail_hash(SEQ))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_bad_tail_file_is_deleted_counted_and_never_served(tmp_path: Path, damage: str):
    first = tiers_for(tmp_path, policy=TAIL_POLICY)
    run(first, SEQ)
    first.close(10)
    path = block_path(tmp_path, NS, tail_hash(SEQ))
    data = path.read_bytes()
    path.write_bytes(data[:-10] if damage == "truncated" else data[:-1] + bytes([data[-1] ^ 0x01]))
    second = tiers_for(tmp_path)
    hit = second.acquire(SEQ + [70])
    assert hit.num_cached_tokens == 12 and hit.num_cached_tokens_cold == 12  # full blocks only
    assert np.array_equal(cached_kv(hit), kv_for(SEQ[:12]).layers[0][0])
    second.release(hit)
    stats = second.cold_stats()
    assert stats["num_bad_files"] == 1 and not path.exists()
    # truncated: found by the index rebuild at start; flipped: by the checksum on read
    assert stats["num_restore_failures"] == (1 if damage == "flipped" else 0)


def test_best_child_prefers_the_longest_common_prefix(tmp_path: Path):
    store = SSDStore(tmp_path, NS, dtype="bfloat16", max_bytes=10**9)
    parent = NS.key()
    for toks in ([1, 2, 3], [1, 5], [9, 9, 9, 9]):
        store.put(hash_block(parent, toks), parent, toks, kv_for(toks))
    assert store.flush(10)
    m = store.best_child(parent, [1, 2, 7, 7])
    assert m is not None and m.token_ids == (1, 2, 3) and m.num_common == 2
    m = store.best_child(parent, [9, 9, 9, 9])
    assert m is not None and m.num_common == 4 and len(m.token_ids) == 4
    assert store.best_child(parent, [4]) is None and store.best_child(b"x" * 32, [1]) is None
    store.close()


def test_a_tail_whose_last_few_tokens_differ_is_superseded_too(tmp_path: Path):
    """The hot tier's rule: a finished request's tail ends in generated tokens the next prompt may
    re-tokenize differently; a sibling agreeing on all but <= 16 of them (and 4/5 of them) covers it."""
    store = SSDStore(tmp_path, NS, dtype="bfloat16", max_bytes=10**9)
    parent = NS.key()
    near = list(range(100, 140)) + [7, 7]  # 40 shared + 2 differing tokens
    far = list(range(100, 110)) + [7] * 20  # 10 shared + 20 differing: kept
    block = list(range(100, 164))
    for toks in (near, far, block):
        store.put(hash_block(parent, toks), parent, toks, kv_for(toks))
        assert store.flush(10)
    assert not store.contains(hash_block(parent, near)) and store.contains(hash_block(parent, far))
    assert store.stats().num_superseded == 1
    # ... and a new file that an existing sibling supersedes is not written
    assert store.put(hash_block(parent, near), parent, near, kv_for(near)) and store.flush(10)
    assert not store.contains(hash_block(parent, near)) and store.stats().num_superseded == 2
    m = store.best_child(parent, near)  # lookup reuses the 40 shared tokens of the block
    assert m is not None and m.num_common == 40 and len(m.token_ids) == 64
    store.close()


def test_read_cold_reads_the_write_queue_then_the_file_as_the_restore_does(tmp_path: Path):
    """`TieredCache.read_cold` (a window part the hot tier dropped, read back) reads through the
    restore's own step: the write queue's copy, else the validated file; a bad file is a counted
    failure, a block the cold tier lacks is None without one."""
    hs = hashes(SEQ)
    ram_only = tiers_for(tmp_path / "a", policy=TierPolicy(write_new_blocks=False, write_through_hits=0))
    run(ram_only, SEQ)
    assert ram_only.read_cold(ram_only.pool.get(hs[0])) is None and ram_only.num_restore_failures == 0

    queued = tiers_for(tmp_path / "b")
    gate = threading.Event()
    real = queued.store._write
    queued.store._write = lambda job: (gate.wait(10), real(job))  # type: ignore[method-assign]
    try:
        run(queued, SEQ)
        assert queued.store.is_pending(hs[0]) and not queued.store.contains(hs[0])
        payload, _ = queued.read_cold(queued.pool.get(hs[0]))
        assert np.array_equal(payload.layers[0][0], kv_for(SEQ[:4]).layers[0][0])
    finally:
        gate.set()
    assert queued.flush(10)

    on_disk = tiers_for(tmp_path / "c")
    run(on_disk, SEQ)
    assert on_disk.flush(10) and not on_disk.store.is_pending(hs[1])
    payload, _ = on_disk.read_cold(on_disk.pool.get(hs[1]))
    assert np.array_equal(payload.layers[0][0], kv_for(SEQ[4:8]).layers[0][0])
    path = block_path(tmp_path / "c", NS, hs[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert on_disk.read_cold(on_disk.pool.get(hs[2])) is None and on_disk.num_restore_failures == 1

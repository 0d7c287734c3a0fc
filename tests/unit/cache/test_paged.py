"""Hot block pool: exact block ids, ref counts, eviction order, tails, CoW, byte budget."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omlx.cache.hashing import Namespace, block_hashes, hash_block
from omlx.cache.paged import BlockPool, KVBlock

BS = 4
NS = Namespace(
    "model-a", "tok-a", "dtype=bfloat16;kv_bits=none;group_size=none;cache=KVCache", 0, 2
)
NS_B = Namespace("model-b", "tok-a", NS.kv_format, 0, 2)


class Recorder:
    """on_evict hook that records evicted block ids and checks they were unheld."""

    def __init__(self) -> None:
        self.evicted: list[int] = []

    def __call__(self, block: KVBlock) -> None:
        assert block.ref_count == 0
        self.evicted.append(block.block_id)


def make_pool(max_bytes: int = 1000, block_size: int = BS) -> tuple[BlockPool, Recorder]:
    recorder = Recorder()
    return BlockPool(max_bytes=max_bytes, block_size=block_size, on_evict=recorder), recorder


def register_chain(
    pool: BlockPool,
    tokens: list[int],
    *,
    namespace: Namespace = NS,
    num_bytes: int = 10,
    parent: bytes | None = None,
) -> list[KVBlock]:
    """Register the full blocks, then a tail for the rest; every returned block is held once."""
    blocks = []
    full = len(tokens) // pool.block_size * pool.block_size
    for start in range(0, full, pool.block_size):
        chunk = tokens[start : start + pool.block_size]
        block = pool.register(namespace, parent, chunk, f"kv{chunk}", num_bytes)
        assert block is not None
        blocks.append(block)
        parent = block.block_hash
    if full < len(tokens):
        tail = pool.register_tail(namespace, parent, tokens[full:], f"kv{tokens[full:]}", num_bytes)
        assert tail is not None
        blocks.append(tail)
    return blocks


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------- register / lookup


def test_register_and_lookup_exact_ids_and_ref_counts() -> None:
    pool, _ = make_pool()
    seq = list(range(100, 112))
    blocks = register_chain(pool, seq)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert [b.block_index for b in blocks] == [0, 1, 2]
    assert [b.block_hash for b in blocks] == block_hashes(NS, seq, BS)
    assert blocks[0].parent_hash == NS.key()
    assert blocks[1].parent_hash == blocks[0].block_hash

    hit = pool.lookup(seq + [1, 2], NS)
    assert ids(hit.blocks) == [0, 1, 2]
    assert hit.partial is None
    assert hit.num_cached_tokens == 12
    assert hit.parent_hash == blocks[2].block_hash
    assert [b.ref_count for b in blocks] == [1, 1, 1]  # lookup does not acquire

    pool.acquire(hit.all_blocks)
    assert [b.ref_count for b in blocks] == [2, 2, 2]
    pool.release(hit.all_blocks + blocks)
    assert [b.ref_count for b in blocks] == [0, 0, 0]
    assert pool.stats().num_free_blocks == 3
    assert ids(pool.lookup(seq, NS).blocks) == [0, 1, 2]  # still cached at ref 0


def test_lookup_stops_at_first_miss_then_reuses_a_common_prefix() -> None:
    pool, _ = make_pool()
    register_chain(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    hit = pool.lookup([1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12], NS)
    # block 2 (tokens 9..12) is not reused: its parent chain differs
    assert ids(hit.blocks) == [0]
    assert hit.partial is not None and hit.partial.block_id == 1
    assert hit.num_partial_tokens == 2
    assert hit.num_cached_tokens == 6
    assert pool.lookup([9, 9, 9, 9], NS).num_cached_tokens == 0


def test_max_cached_tokens_leaves_the_last_token_to_compute() -> None:
    pool, _ = make_pool()
    seq = list(range(8))
    register_chain(pool, seq)
    hit = pool.lookup(seq, NS, max_cached_tokens=len(seq) - 1)
    assert ids(hit.blocks) == [0]
    assert hit.partial is not None and hit.partial.block_id == 1
    assert hit.num_partial_tokens == 3
    assert hit.num_cached_tokens == 7
    assert pool.lookup(seq, NS, max_cached_tokens=0).num_cached_tokens == 0
    with pytest.raises(ValueError):
        pool.lookup(seq, NS, max_cached_tokens=-1)


def test_different_namespace_never_matches() -> None:
    pool, _ = make_pool()
    seq = [1, 2, 3, 4, 5, 6]
    register_chain(pool, seq, namespace=NS)
    assert pool.lookup(seq, NS_B).num_cached_tokens == 0
    assert pool.lookup(seq, NS).num_cached_tokens == 6
    other = register_chain(pool, seq, namespace=NS_B)
    assert ids(other) == [2, 3]  # not deduplicated across namespaces
    with pytest.raises(ValueError, match="namespace"):
        pool.register(NS_B, pool.lookup(seq, NS).blocks[0].block_hash, [5, 6, 7, 8], None, 1)


def test_register_deduplicates_and_holds_the_existing_block() -> None:
    pool, _ = make_pool()
    (first,) = register_chain(pool, [1, 2, 3, 4])
    again = pool.register(NS, None, (1, 2, 3, 4), "other payload", 10)
    assert again is first
    assert first.ref_count == 2
    assert first.payload == "kv[1, 2, 3, 4]"
    assert pool.num_bytes == 10


def test_register_rejects_wrong_calls() -> None:
    pool, _ = make_pool()
    (block, tail) = register_chain(pool, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="register_tail"):
        pool.register(NS, None, [1, 2, 3], None, 1)
    with pytest.raises(ValueError, match="use register"):
        pool.register_tail(NS, None, [1, 2, 3, 4], None, 1)
    with pytest.raises(ValueError):
        pool.register_tail(NS, None, [], None, 1)
    with pytest.raises(ValueError):
        pool.register(NS, None, [1, 2, 3, -4], None, 1)
    with pytest.raises(ValueError):
        pool.register(NS, None, [1, 2, 3, 4], None, -1)
    with pytest.raises(ValueError):
        pool.register(NS, b"\x00" * 5, [1, 2, 3, 4], None, 1)
    with pytest.raises(ValueError, match="tail"):
        pool.register(NS, tail.block_hash, [6, 7, 8, 9], None, 1)
    with pytest.raises(ValueError):
        BlockPool(max_bytes=10, block_size=0)
    with pytest.raises(ValueError):
        BlockPool(max_bytes=-1)


def test_register_under_a_parent_no_longer_cached_returns_none() -> None:
    pool, _ = make_pool()
    missing_parent = hash_block(None, [9, 9, 9, 9], namespace=NS)
    assert pool.register(NS, missing_parent, [1, 2, 3, 4], None, 1) is None
    assert pool.register_tail(NS, missing_parent, [1], None, 1) is None
    assert pool.stats().num_rejected == 2
    assert pool.stats().num_blocks == 0


def test_acquire_and_release_reject_wrong_calls() -> None:
    pool, _ = make_pool(max_bytes=10)
    (block,) = register_chain(pool, [1, 2, 3, 4], num_bytes=10)
    with pytest.raises(ValueError, match="released 2"):
        pool.release([block, block])
    assert block.ref_count == 1  # nothing changed
    pool.release([block])
    with pytest.raises(ValueError):
        pool.release([block])
    register_chain(pool, [5, 6, 7, 8], num_bytes=10)  # evicts block
    with pytest.raises(ValueError, match="not live"):
        pool.acquire([block])
    other_pool, _ = make_pool()
    with pytest.raises(ValueError, match="not live"):
        other_pool.acquire([block])


# ---------------------------------------------------------------- eviction order


def test_eviction_is_lru_leaves_first_chain_tails_first() -> None:
    pool, recorder = make_pool(max_bytes=50)
    chain_a = register_chain(pool, list(range(12)))  # ids 0, 1, 2
    chain_b = register_chain(pool, list(range(50, 58)))  # ids 3, 4
    pool.release(chain_a)
    pool.release(chain_b)
    assert pool.num_bytes == 50
    assert pool.evict(1) == 10
    assert recorder.evicted == [2]
    assert pool.evict(30) == 30
    assert recorder.evicted == [2, 1, 0, 4]
    assert pool.stats().num_evictions == 4
    assert pool.stats().num_evicted_bytes == 40
    assert pool.lookup(list(range(50, 58)), NS).num_cached_tokens == 4


def test_a_cached_parent_outlives_its_child_even_when_older() -> None:
    pool, recorder = make_pool(max_bytes=30)
    a0, a1 = register_chain(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.release([a0])  # a0 is least recent, but a1 (its child) is still cached
    (b0,) = register_chain(pool, [9, 9, 9, 9])
    pool.release([b0])
    pool.release([a1])
    assert a0.last_access < b0.last_access < a1.last_access
    register_chain(pool, [7, 7, 7, 7])  # needs 10 bytes
    assert recorder.evicted == [b0.block_id]
    assert pool.evict(100) == 20
    assert recorder.evicted == [b0.block_id, a1.block_id, a0.block_id]


def test_lookup_refreshes_recency() -> None:
    pool, recorder = make_pool(max_bytes=20)
    (a,) = register_chain(pool, [1, 1, 1, 1])
    (b,) = register_chain(pool, [2, 2, 2, 2])
    pool.release([a])
    pool.release([b])
    pool.lookup([1, 1, 1, 1, 5], NS)  # a is now more recent than b
    pool.evict(1)
    assert recorder.evicted == [b.block_id]
    assert a.num_hits == 1


def test_held_blocks_are_never_evicted_and_capacity_returns_none() -> None:
    pool, recorder = make_pool(max_bytes=30)
    held = register_chain(pool, list(range(8)))  # 20 bytes held
    (free,) = register_chain(pool, [9, 9, 9, 9])
    pool.release([free])
    # 20 more bytes cannot fit even after evicting the free block: nothing is evicted
    assert pool.register(NS, None, [5, 5, 5, 5], None, 20) is None
    assert recorder.evicted == []
    assert pool.register(NS, None, [5, 5, 5, 5], None, 31) is None
    assert pool.stats().num_rejected == 2
    assert pool.register(NS, None, [5, 5, 5, 5], None, 10) is not None
    assert recorder.evicted == [free.block_id]
    assert pool.num_bytes == 30
    assert all(b.ref_count == 1 for b in held)
    assert pool.evict(100) == 0


def test_registering_a_child_never_evicts_its_unheld_parent() -> None:
    pool, recorder = make_pool(max_bytes=20)
    (parent,) = register_chain(pool, [1, 2, 3, 4])
    pool.release([parent])  # the only evictable block, and a leaf
    (other,) = register_chain(pool, [8, 8, 8, 8])
    assert pool.register(NS, parent.block_hash, [5, 6, 7, 8], None, 10) is None
    assert recorder.evicted == []
    pool.release([other])
    child = pool.register(NS, parent.block_hash, [5, 6, 7, 8], None, 10)
    assert child is not None
    assert recorder.evicted == [other.block_id]
    assert child.block_index == 1


def test_on_evict_errors_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken(block: KVBlock) -> None:
        raise OSError("disk full")

    pool = BlockPool(max_bytes=10, block_size=BS, on_evict=broken)
    (block,) = register_chain(pool, [1, 2, 3, 4])
    pool.release([block])
    with caplog.at_level(logging.ERROR, logger="omlx.cache.paged"):
        assert register_chain(pool, [5, 6, 7, 8])
    assert "on_evict failed" in caplog.text


# ---------------------------------------------------------------- tails


def test_repeated_short_prompt_hits_its_tail() -> None:
    pool, _ = make_pool(block_size=256)
    prompt = [11, 12, 13, 14, 15]
    generated = [20, 21, 22]
    # finished request: KV holds the prompt and all generated tokens but the last
    tail = pool.register_tail(NS, None, prompt + generated[:-1], "kv", 10)
    assert tail is not None and tail.is_tail and tail.block_id == 0
    pool.release([tail])

    hit = pool.lookup(prompt, NS, max_cached_tokens=len(prompt) - 1)
    assert hit.blocks == []
    assert hit.partial is tail
    assert hit.num_partial_tokens == 4  # KV of prompt[:4] is reused, prompt[4] is computed
    assert hit.all_blocks == [tail]

    follow_up = prompt + generated + [30, 31]
    hit = pool.lookup(follow_up, NS, max_cached_tokens=len(follow_up) - 1)
    assert hit.partial is tail
    assert hit.num_cached_tokens == 7  # the whole tail

    assert pool.lookup([11, 99], NS).num_cached_tokens == 1
    assert pool.lookup(prompt, NS_B).num_cached_tokens == 0


def test_tail_after_full_blocks_is_keyed_by_its_parent() -> None:
    pool, _ = make_pool()
    chain = register_chain(pool, [1, 2, 3, 4, 5, 6])
    assert ids(chain) == [0, 1]
    assert chain[1].is_tail and chain[1].parent_hash == chain[0].block_hash
    assert chain[1].block_index == 1
    assert pool.get(chain[1].block_hash or b"") is chain[1]
    hit = pool.lookup([1, 2, 3, 4, 5, 6, 7], NS)
    assert ids(hit.blocks) == [0]
    assert hit.partial is chain[1] and hit.num_partial_tokens == 2
    # the same tokens under another parent do not match
    assert pool.lookup([5, 6, 7, 8], NS).num_cached_tokens == 0
    assert pool.lookup([9, 9, 9, 9, 5, 6], NS).num_cached_tokens == 0


def test_tail_is_evicted_before_full_blocks_of_the_same_recency() -> None:
    pool, recorder = make_pool(max_bytes=100)
    chain = register_chain(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # full 0, 1; tail 2
    (tail_only,) = register_chain(pool, [42])  # tail 3, released with the chain below
    pool.release([tail_only, *chain])
    pool.evict(100)
    assert recorder.evicted == [2, 3, 1, 0]


def test_register_tail_returns_a_covering_block_and_drops_covered_tails() -> None:
    pool, _ = make_pool()
    (short,) = register_chain(pool, [1, 2])
    pool.release([short])
    (longer,) = register_chain(pool, [1, 2, 3])
    # the unheld shorter tail is redundant: lookup reuses a prefix of the longer one
    assert pool.get(short.block_hash or b"") is None
    assert pool.stats().num_dropped_tails == 1
    assert pool.stats().num_evictions == 0
    again = pool.register_tail(NS, None, [1, 2], "x", 10)
    assert again is longer and longer.ref_count == 2
    # a full block covers tails that are its prefix
    pool.release([longer, longer])
    (full,) = register_chain(pool, [1, 2, 3, 4])
    assert pool.stats().num_tails == 0
    assert pool.register_tail(NS, None, [1, 2, 3], "x", 10) is full
    assert full.ref_count == 2


def test_held_tail_is_not_dropped() -> None:
    pool, _ = make_pool()
    (short,) = register_chain(pool, [1, 2])
    (longer,) = register_chain(pool, [1, 2, 3])
    assert pool.get(short.block_hash or b"") is short
    assert pool.stats().num_tails == 2
    hit = pool.lookup([1, 2, 3, 9], NS)
    assert hit.partial is longer and hit.num_partial_tokens == 3


def test_a_tail_covered_while_held_is_dropped_when_released() -> None:
    # A chat turn holds its previous turn's tail while its own longer blocks are registered;
    # once released, that tail is a prefix of a sibling and only costs bytes.
    pool, recorder = make_pool()
    (tail,) = register_chain(pool, [1, 2])
    (full,) = register_chain(pool, [1, 2, 3, 4])
    assert pool.stats().num_tails == 1 and pool.stats().num_dropped_tails == 0
    bytes_before = pool.num_bytes
    pool.release([tail])
    assert pool.get(tail.block_hash or b"") is None
    assert pool.stats().num_dropped_tails == 1 and pool.num_bytes == bytes_before - tail.num_bytes
    assert recorder.evicted == []  # dropped, not evicted: nothing is written back
    pool.release([full])
    assert pool.lookup([1, 2, 9], NS).partial is full
    # a tail that is no sibling's prefix stays cached when released
    (other,) = register_chain(pool, [1, 5])
    pool.release([other])
    assert pool.get(other.block_hash or b"") is other
    assert pool.stats().num_free_bytes == pool.num_bytes


def test_a_tail_that_a_sibling_agrees_with_up_to_its_last_tokens_is_dropped() -> None:
    # A completion's tail ends with its generated token; the next prompt (same text plus a
    # suffix) fills the block with another token there. Keeping the tail would store 39 shared
    # tokens twice to save recomputing one.
    pool, _ = make_pool(max_bytes=10**6, block_size=64)
    prompt = list(range(100, 139))
    (tail,) = register_chain(pool, prompt + [7])  # 40 tokens, the last one generated
    pool.release([tail])
    (full,) = register_chain(pool, prompt + list(range(500, 525)))
    assert pool.get(tail.block_hash or b"") is None and pool.stats().num_dropped_tails == 1
    hit = pool.lookup(prompt + [7], NS)
    assert hit.partial is full and hit.num_cached_tokens == 39  # one token to recompute
    # a tail that shares only part of itself is no duplicate: it stays
    (half,) = register_chain(pool, prompt[:20] + list(range(900, 920)))
    pool.release([half])
    assert pool.get(half.block_hash or b"") is half
    # ... and more than TAIL_SLACK_TOKENS unshared tokens keep a tail too
    (long_tail,) = register_chain(pool, list(range(1, 61)))
    pool.release([long_tail])
    (other,) = register_chain(pool, list(range(1, 41)) + list(range(700, 724)))
    assert pool.get(long_tail.block_hash or b"") is long_tail and other.is_tail is False


# ---------------------------------------------------------------- copy-on-write


def test_writable_copies_a_registered_or_shared_block() -> None:
    copies: list[object] = []

    def copy_payload(payload: object) -> object:
        copies.append(payload)
        return f"copy of {payload}"

    pool = BlockPool(max_bytes=100, block_size=BS, copy_payload=copy_payload)
    (block,) = register_chain(pool, [1, 2, 3, 4])
    pool.acquire([block])  # shared by two requests
    mine = pool.writable(block)
    assert mine is not None and mine is not block
    assert mine.block_id == 1 and mine.block_hash is None and mine.ref_count == 1
    assert mine.payload == "copy of kv[1, 2, 3, 4]"
    assert copies == ["kv[1, 2, 3, 4]"]
    assert block.ref_count == 1  # our reference moved to the copy
    assert pool.num_bytes == 20
    # a private block held once is already writable
    assert pool.writable(mine) is mine
    # a registered block held once is still copied: a lookup could share it
    other = pool.writable(block)
    assert other is not None and other is not block and block.ref_count == 0
    assert pool.lookup([1, 2, 3, 4], NS).blocks == [block]
    # a private block is freed when released
    pool.release([mine, other])
    assert pool.stats().num_blocks == 1
    assert pool.stats().num_cow_copies == 2
    assert pool.num_bytes == 10


def test_writable_without_room_returns_none_and_keeps_the_reference() -> None:
    pool, _ = make_pool(max_bytes=10)
    (block,) = register_chain(pool, [1, 2, 3, 4])
    assert pool.writable(block) is None
    assert block.ref_count == 1
    pool.release([block])
    with pytest.raises(ValueError, match="not held"):
        pool.writable(block)


# ---------------------------------------------------------------- budget, clear, stats


def test_byte_budget_is_enforced_on_register() -> None:
    pool, recorder = make_pool(max_bytes=25)
    for i in range(5):
        (block,) = register_chain(pool, [i] * 4)
        pool.release([block])
        assert pool.num_bytes <= 25
    assert recorder.evicted == [0, 1, 2]
    assert pool.stats().num_blocks == 2


def test_clear_a_namespace_frees_unheld_and_privatizes_held_blocks() -> None:
    pool, recorder = make_pool()
    held = register_chain(pool, [1, 2, 3, 4, 5])
    unheld = register_chain(pool, [1, 2, 3, 4, 6, 7, 8, 9], namespace=NS_B)
    pool.release(unheld)
    assert pool.clear(NS_B, write_back=True) == 2
    assert recorder.evicted == [unheld[1].block_id, unheld[0].block_id]  # deepest first
    assert pool.stats().num_evictions == 0
    assert pool.lookup([1, 2, 3, 4, 5], NS).num_cached_tokens == 5

    assert pool.clear() == 2
    assert pool.lookup([1, 2, 3, 4, 5], NS).num_cached_tokens == 0
    assert all(b.block_hash is None and b.ref_count == 1 for b in held)
    assert pool.stats().num_private_blocks == 2
    pool.release(held)
    assert pool.stats().num_blocks == 0
    assert pool.num_bytes == 0
    assert recorder.evicted == [unheld[1].block_id, unheld[0].block_id]


def test_stats_count_lookups_hits_and_tokens() -> None:
    pool, _ = make_pool(max_bytes=100)
    register_chain(pool, list(range(8)))
    pool.lookup(list(range(10)), NS)
    pool.lookup([99] * 6, NS)
    pool.lookup(list(range(6)), NS, max_cached_tokens=5)
    stats = pool.stats()
    assert (stats.num_lookups, stats.num_hits, stats.num_misses) == (3, 2, 1)
    assert stats.num_cached_tokens == 8 + 5
    assert stats.num_query_tokens == 10 + 6 + 5
    assert (stats.num_blocks, stats.num_full_blocks, stats.num_tails) == (2, 2, 0)
    assert (stats.num_bytes, stats.num_free_bytes, stats.max_bytes) == (20, 0, 100)


def test_blocks_lists_live_blocks_by_id() -> None:
    pool, _ = make_pool()
    chain = register_chain(pool, [1, 2, 3, 4, 5])
    assert pool.blocks() == chain


# ---------------------------------------------------------------- state machine

MAX_BYTES = 60
SM_BS = 3
NAMESPACES = (NS, NS_B)
token_lists = st.lists(st.integers(0, 1), min_size=0, max_size=10)


class PoolMachine(RuleBasedStateMachine):
    """Random register/lookup/acquire/release/CoW/evict/clear sequences keep the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(max_bytes=MAX_BYTES, block_size=SM_BS, on_evict=self._on_evict)
        self.held: Counter[KVBlock] = Counter()
        self.evicted: list[KVBlock] = []

    def _on_evict(self, block: KVBlock) -> None:
        assert block.ref_count == 0, "a held block was evicted"
        assert self.pool.get(block.block_hash or b"") is None
        self.evicted.append(block)

    def _registered_full(self, namespace: Namespace) -> list[KVBlock]:
        return [
            b
            for b in self.pool.blocks()
            if b.is_registered and not b.is_tail and b.namespace == namespace
        ]

    def _hold(self, block: KVBlock | None) -> None:
        if block is not None:
            self.held[block] += 1

    @rule(
        ns=st.sampled_from(NAMESPACES),
        parent_pick=st.integers(-1, 20),
        tokens=st.lists(st.integers(0, 1), min_size=SM_BS, max_size=SM_BS),
        num_bytes=st.integers(0, 25),
    )
    def register(self, ns: Namespace, parent_pick: int, tokens: list[int], num_bytes: int) -> None:
        parents = self._registered_full(ns)
        parent = None if parent_pick < 0 or not parents else parents[parent_pick % len(parents)]
        block = self.pool.register(
            ns, None if parent is None else parent.block_hash, tokens, list(tokens), num_bytes
        )
        self._hold(block)
        if block is not None:
            assert block.token_ids == tuple(tokens)
            assert block.parent_hash == (ns.key() if parent is None else parent.block_hash)

    @rule(
        ns=st.sampled_from(NAMESPACES),
        parent_pick=st.integers(-1, 20),
        tokens=st.lists(st.integers(0, 1), min_size=1, max_size=SM_BS - 1),
        num_bytes=st.integers(0, 25),
    )
    def register_tail(
        self, ns: Namespace, parent_pick: int, tokens: list[int], num_bytes: int
    ) -> None:
        parents = self._registered_full(ns)
        parent = None if parent_pick < 0 or not parents else parents[parent_pick % len(parents)]
        block = self.pool.register_tail(
            ns, None if parent is None else parent.block_hash, tokens, list(tokens), num_bytes
        )
        self._hold(block)
        if block is not None:
            assert block.token_ids[: len(tokens)] == tuple(tokens)

    @rule(
        ns=st.sampled_from(NAMESPACES),
        tokens=token_lists,
        cap=st.none() | st.integers(0, 10),
        take=st.booleans(),
    )
    def lookup(self, ns: Namespace, tokens: list[int], cap: int | None, take: bool) -> None:
        hit = self.pool.lookup(tokens, ns, max_cached_tokens=cap)
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        n = hit.num_cached_tokens
        assert n <= limit
        reused = [t for b in hit.blocks for t in b.token_ids]
        if hit.partial is not None:
            assert 0 < hit.num_partial_tokens < SM_BS
            reused += hit.partial.token_ids[: hit.num_partial_tokens]
            expected_parent = hit.blocks[-1].block_hash if hit.blocks else ns.key()
            assert hit.partial.parent_hash == expected_parent
        else:
            assert hit.num_partial_tokens == 0
        assert reused == tokens[:n]
        assert (
            hit.blocks
            == [self.pool.get(h) for h in block_hashes(ns, tokens, SM_BS)][: len(hit.blocks)]
        )
        next_start = len(hit.blocks) * SM_BS
        if next_start + SM_BS <= limit:  # the walk stopped at a miss, not at the cap
            parent = hit.blocks[-1].block_hash if hit.blocks else None
            nxt = hash_block(parent, tokens[next_start : next_start + SM_BS], namespace=ns)
            assert self.pool.get(nxt) is None
        if take:
            taken = hit.blocks + ([] if hit.partial is None else [hit.partial])
            assert hit.all_blocks == taken
            self.pool.acquire(taken)
            for block in taken:
                self.held[block] += 1

    @precondition(lambda self: bool(self.held))
    @rule(pick=st.integers(0, 1000))
    def release(self, pick: int) -> None:
        block = sorted(self.held, key=lambda b: b.block_id)[pick % len(self.held)]
        self.pool.release([block])
        self.held[block] -= 1
        if not self.held[block]:
            del self.held[block]

    @precondition(lambda self: bool(self.held))
    @rule(pick=st.integers(0, 1000))
    def writable(self, pick: int) -> None:
        block = sorted(self.held, key=lambda b: b.block_id)[pick % len(self.held)]
        was_private_and_sole = not block.is_registered and block.ref_count == 1
        result = self.pool.writable(block)
        if result is None:
            return
        if was_private_and_sole:
            assert result is block
            return
        assert result is not block and not result.is_registered and result.ref_count == 1
        assert result.payload == block.payload and result.payload is not block.payload
        self.held[block] -= 1
        if not self.held[block]:
            del self.held[block]
        self.held[result] += 1

    @rule(num_bytes=st.integers(0, MAX_BYTES))
    def evict(self, num_bytes: int) -> None:
        before = self.pool.num_bytes
        freed = self.pool.evict(num_bytes)
        assert self.pool.num_bytes == before - freed

    @rule(ns=st.none() | st.sampled_from(NAMESPACES))
    def clear(self, ns: Namespace | None) -> None:
        self.pool.clear(ns)
        for block in self.pool.blocks():
            if ns is None or block.namespace == ns:
                assert not block.is_registered and block.ref_count > 0

    @invariant()
    def ref_counts_match_holders(self) -> None:
        live = self.pool.blocks()
        for block in live:
            assert block.ref_count >= 0
            assert block.ref_count == self.held[block]
            if not block.is_registered:
                assert block.ref_count > 0, "an unheld private block leaked"
        assert set(self.held) <= set(live), "a held block left the pool"

    @invariant()
    def bytes_within_budget(self) -> None:
        live = self.pool.blocks()
        assert self.pool.num_bytes == sum(b.num_bytes for b in live) <= MAX_BYTES
        stats = self.pool.stats()
        free = [b for b in live if b.is_registered and b.ref_count == 0]
        assert stats.num_free_bytes == sum(b.num_bytes for b in free)
        assert stats.num_free_blocks == len(free)

    @invariant()
    def cached_child_has_cached_parent(self) -> None:
        for block in self.pool.blocks():
            if not block.is_registered:
                continue
            assert self.pool.get(block.block_hash or b"") is block
            assert len(block.token_ids) == SM_BS or block.is_tail
            if block.parent_hash == block.namespace.key():
                assert block.block_index == 0
            else:
                parent = self.pool.get(block.parent_hash)
                assert parent is not None and not parent.is_tail
                assert parent.block_index + 1 == block.block_index
                assert parent.namespace == block.namespace

    @invariant()
    def evicted_blocks_are_gone(self) -> None:
        live_ids = {b.block_id for b in self.pool.blocks()}
        assert all(b.block_id not in live_ids for b in self.evicted)
        assert self.pool.stats().num_evictions == len(self.evicted)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_with_negative_tail_slack_every_tail_is_its_own_and_lookups_reuse_children_whole() -> None:
    """A recurrent model's snapshot stands at a tail's end: no tail covers, supersedes or stands
    in for another, and the last child of a hit is used only whole."""
    pool = BlockPool(max_bytes=1000, block_size=BS, tail_slack_tokens=-1)
    (short,) = register_chain(pool, [1, 2])
    pool.release([short])
    (longer,) = register_chain(pool, [1, 2, 3])
    pool.release([longer])
    assert pool.get(short.block_hash or b"") is short and pool.stats().num_dropped_tails == 0
    (full,) = register_chain(pool, [1, 2, 3, 4])
    pool.release([full])
    assert pool.stats().num_tails == 2
    again = pool.register_tail(NS, None, [1, 2, 3], "x", 10)
    assert again is longer  # the same tail, not the covering full block
    pool.release([again])
    # [1, 2, 3, 9]: the full block and the 3-token tail share 3 tokens; only the tail is whole.
    hit = pool.lookup([1, 2, 3, 9, 9], NS, whole_partial_only=True)
    assert hit.partial is longer and hit.num_cached_tokens == 3
    hit = pool.lookup([1, 2, 7, 9, 9], NS, whole_partial_only=True)
    assert hit.partial is short and hit.num_cached_tokens == 2
    assert pool.lookup([1, 2, 3, 9], NS).partial is not None  # without the flag: any common prefix

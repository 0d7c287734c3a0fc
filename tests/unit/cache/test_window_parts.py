"""Hot block pool on a sliding-window model: which window parts go, and that they go first.

Payloads here are dicts ``{"attn": bytes, "win": bytes}``; the window part is ``"win"``.
Block size 4, reach (``W - keep``) 8 tokens: a block's window part may go once every cached
chain through it goes on for at least 8 tokens (2 blocks) past it.
"""

from __future__ import annotations

import pytest

from omlx.cache.hashing import Namespace
from omlx.cache.paged import BlockPool, KVBlock, WindowParts

BS = 4
NS = Namespace("model-w", "tok", "dtype=float32;kv_bits=none;group_size=none;cache=W8k0,A", 0, 2)
ATTN, WIN = 6, 4  # bytes of each part of a block


def parts(reach: int = 8, keep: int = 0) -> WindowParts:
    return WindowParts(reach_tokens=reach, keep_tokens=keep,
                       num_bytes=lambda p: len(p.get("win", b"")),  # type: ignore[attr-defined]
                       drop=lambda p: {k: v for k, v in p.items() if k != "win"})  # type: ignore[attr-defined]


def make_pool(max_bytes: int = 10_000, reach: int = 8, keep: int = 0) -> tuple[BlockPool, list[int]]:
    evicted: list[int] = []
    pool = BlockPool(max_bytes=max_bytes, block_size=BS, window_parts=parts(reach, keep),
                     on_evict=lambda b: evicted.append(b.block_id))
    return pool, evicted


def payload() -> dict[str, bytes]:
    return {"attn": b"a" * ATTN, "win": b"w" * WIN}


def chain(pool: BlockPool, tokens: list[int], parent: bytes | None = None, release: bool = True) -> list[KVBlock]:
    """Register ``tokens`` as full blocks then a tail under ``parent``; released unless told."""
    out = []
    full = len(tokens) // BS * BS
    for a in range(0, full, BS):
        b = pool.register(NS, parent, tokens[a : a + BS], payload(), ATTN + WIN)
        assert b is not None
        out.append(b)
        parent = b.block_hash
    if full < len(tokens):
        t = pool.register_tail(NS, parent, tokens[full:], payload(), ATTN + WIN)
        assert t is not None
        out.append(t)
    if release:
        pool.release(out)
    return out


def test_window_bytes_are_counted_and_only_parts_far_enough_from_every_chain_end_may_go() -> None:
    pool, _ = make_pool()
    a = chain(pool, list(range(10, 30)))  # 5 full blocks, ends at 20
    assert pool.stats().num_window_bytes == 5 * WIN and pool.num_bytes == 5 * (ATTN + WIN)
    # Blocks ending at 4, 8, 12 are >= 8 tokens before the chain's end (20); 16 and 20 are not.
    assert [b.block_id for b in pool.window_droppable()] == [a[0].block_id, a[1].block_id, a[2].block_id]
    # A second chain branching after block 1 ends 2 tokens later (a tail ending at 10): blocks
    # 0 and 1 are within 8 tokens of that chain's end (10 - 4 = 6 < 8); block 2 (end 12, on
    # chain a only) may still go.
    chain(pool, [90, 91], parent=a[1].block_hash)
    assert [b.block_id for b in pool.window_droppable()] == [a[2].block_id]


def test_sink_blocks_keep_their_window_part_and_held_ones_drop_it_without_changing_a_captured_payload() -> None:
    pool, _ = make_pool(keep=1, max_bytes=5 * (ATTN + WIN) + 2)
    a = chain(pool, list(range(10, 30)), release=False)  # held, as by the request that registered them
    # Block 0 holds the sink token (position 0): never dropped.
    assert [b.block_id for b in pool.window_droppable()] == [a[1].block_id, a[2].block_id]
    captured = a[1].payload  # what a lookup's parts hold
    free_before = pool.stats().num_free_bytes
    assert pool.register(NS, None, [1, 2, 3, 4], payload(), ATTN + WIN) is not None  # over budget by 8
    assert [b.window_bytes for b in a] == [WIN, 0, 0, WIN, WIN]
    assert "win" in captured and "win" not in a[1].payload  # type: ignore[operator]
    assert pool.stats().num_free_bytes == free_before  # held blocks: no free bytes changed


def test_under_pressure_window_parts_of_old_blocks_go_before_any_leaf() -> None:
    pool, evicted = make_pool(max_bytes=5 * (ATTN + WIN))
    old = chain(pool, list(range(100, 120)))  # the budget, exactly; older than what follows
    assert pool.num_bytes == pool.max_bytes
    # A new block needs 10 bytes: droppable window parts go, least recent and nearest the start
    # first, as many as needed (blocks 0, 1, 2: 12 bytes >= 10).
    new = chain(pool, list(range(500, 504)))
    assert evicted == []  # no leaf went, though the old chain's leaf is the least recent
    assert [b.window_bytes for b in old] == [0, 0, 0, WIN, WIN]
    assert all("win" not in b.payload for b in old[:3]) and "win" in old[3].payload  # type: ignore[operator]
    assert [b.num_bytes for b in old] == [ATTN, ATTN, ATTN, ATTN + WIN, ATTN + WIN]
    s = pool.stats()
    assert s.num_window_parts_dropped == 3 and s.num_window_bytes_dropped == 3 * WIN
    assert s.num_window_bytes == 2 * WIN + WIN and pool.num_bytes == 3 * ATTN + 2 * (ATTN + WIN) + ATTN + WIN
    assert pool.num_bytes <= pool.max_bytes
    # Nothing droppable is left: the next registration evicts the least recent leaf (old's).
    chain(pool, list(range(600, 604)))
    assert evicted == [old[-1].block_id]
    assert new[0].block_id not in evicted


def test_evict_drops_window_parts_first_and_a_restored_block_without_one_is_not_counted() -> None:
    pool, evicted = make_pool()
    a = chain(pool, list(range(10, 30)))
    assert pool.evict(2 * WIN) == 2 * WIN and evicted == []
    assert [b.window_bytes for b in a] == [0, 0, WIN, WIN, WIN]
    # A payload without its window part (read back from a file written without it).
    b = pool.register(NS, None, [7, 7, 7, 7], {"attn": b"a" * ATTN}, ATTN)
    assert b is not None and b.window_bytes == 0
    assert pool.stats().num_window_parts_dropped == 2


def test_without_window_parts_nothing_is_droppable() -> None:
    pool = BlockPool(max_bytes=100, block_size=BS)
    b = pool.register(NS, None, [1, 2, 3, 4], payload(), ATTN + WIN)
    assert b is not None and b.window_bytes == 0 and pool.window_droppable() == []


def test_a_held_block_gets_its_window_part_back_within_the_budget() -> None:
    pool, evicted = make_pool(max_bytes=5 * (ATTN + WIN))
    a = chain(pool, list(range(10, 30)))
    assert pool.evict(WIN) == WIN and a[0].window_bytes == 0
    with pytest.raises(ValueError, match="held block"):
        pool.restore_window_part(a[0], payload())  # not held
    pool.acquire(a[:1])
    assert pool.restore_window_part(a[0], payload())  # room: the budget had WIN bytes free
    assert (a[0].window_bytes, a[0].num_bytes, pool.num_bytes) == (WIN, ATTN + WIN, 5 * (ATTN + WIN))
    assert pool.stats().num_window_parts_restored == 1 and evicted == []
    pool.release(a[:1])

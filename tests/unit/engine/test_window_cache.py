"""Sliding-window models under a small hot budget: window parts of early blocks are dropped
first, and greedy output with any hit still equals mlx-lm's ``generate_step`` token for token.

Tiny random gemma3_text and gpt_oss (window 16 = one block of 16; half of each block is the
window part). The hot budget holds 7.5 whole blocks: a 7-block conversation, then a 2-block
prompt, drops the window parts of the conversation's first three blocks and evicts nothing.
Then: the conversation's next turn (a hit over those blocks), a hit ending mid-window, a hit
cut back because its window reads a dropped part, and a restart whose SSD files of those
blocks were written without their window part.
"""

from __future__ import annotations

import pytest

from tests.unit.engine.archs import WINDOW, tiny
from tests.unit.engine.test_cache_kinds import BS, rand_prompts
from tests.unit.engine.test_runner import _run_all, _tokens, _usage, reference


def block_bytes(model) -> tuple[int, int]:
    """(bytes of one whole block, bytes of its window part) of ``model``'s payloads."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from omlx.engine.cache_spec import spec_of_model

    spec = spec_of_model(model)
    caches = make_prompt_cache(model)
    model(mx.array([list(range(10, 10 + BS))]), cache=caches)
    p = spec.payload_fn(caches, None)(0, BS)
    return int(sum(x.nbytes for x in p.values())), spec.window_part_bytes(p)


def make_engine(model, tokenizer, root, max_bytes: int, write_through: bool = False):
    """An engine whose hot tier drops window parts (as `make_prefix_cache` builds it) over a
    budget of ``max_bytes``. Without ``write_through`` files reach the SSD tier only when written
    back (eviction, close), so a block whose window part was dropped is written without it."""
    from omlx.cache.hashing import Namespace, make_kv_format
    from omlx.cache.paged import BlockPool
    from omlx.cache.ssd import SSDStore
    from omlx.cache.tiered import RestoreCostModel, TieredCache, TierPolicy
    from omlx.engine.cache_spec import spec_of_model
    from omlx.engine.engine import Engine
    from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers, window_parts
    from omlx.scheduler import Scheduler

    spec = spec_of_model(model)
    ns = Namespace("tiny", "tok", make_kv_format("float32", None, None, spec.describe()), 0, len(spec.layers))
    store = SSDStore(root, ns, dtype="float32", max_bytes=10**9)
    pool = BlockPool(max_bytes=max_bytes, block_size=BS, window_parts=window_parts(spec))
    tiers = TieredCache(pool, ns, MlxPayloadCodec("float32"), store,
                        TierPolicy(write_new_blocks=write_through, write_through_hits=0),
                        RestoreCostModel(prefill_tokens_per_s=1.0, read_bytes_per_s=1e9))
    pc = PrefixCacheTiers(tiers, spec)
    eng = Engine("tiny", model, tokenizer, scheduler=Scheduler(8, 64), prefix_cache=pc, block_size=BS,
                 prefill_step_size=32, mixed_step_size=16)
    eng.start()
    return eng, pc


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_hits_after_window_parts_were_dropped_are_exact_hot_and_after_a_restart(arch, tokenizer, tmp_path):
    from omlx.cache.blockfile import iter_block_files, read_header
    from omlx.engine.cache_spec import WINDOW_TENSOR
    from omlx.request import Request, SamplingParams

    model = tiny(arch)
    assert WINDOW == BS
    whole, win = block_bytes(model)
    assert 2 * win == whole  # half of the layers are window layers
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    base, other, tail2, tail3, junk = rand_prompts([100, 31, 9, 7, 12], seed=11)
    eng, pc = make_engine(model, tokenizer, tmp_path, max_bytes=9 * whole - 3 * win)
    try:
        out1 = _tokens(_run_all(eng, [Request("tiny", base, sp)])[0])
        if len(out1) < 12:
            pytest.skip(f"the random model stopped after {len(out1)} tokens")  # EOS drawn early
        assert out1 == reference(model, base, 12, eos)
        assert pc.stats()["num_window_bytes"] == 7 * win  # 100 + 12 tokens: 7 blocks, no tail
        _run_all(eng, [Request("tiny", other, SamplingParams(max_tokens=1, temperature=0.0))])
        s = pc.stats()
        assert (s["num_window_parts_dropped"], s["num_evictions"]) == (3, 0), s
        seq = base + out1
        chain = sorted((b for b in pc.pool.blocks() if b.token_ids == tuple(seq[b.block_index * BS:][:BS])),
                       key=lambda b: b.block_index)
        assert [b.window_bytes for b in chain] == [0, 0, 0] + [win] * 4
        assert s["num_bytes"] == 9 * whole - 3 * win and s["num_window_bytes_dropped"] == 3 * win

        # The next turn: its hit reads only the last block's window part.
        turn2 = base + out1 + tail2
        ev = _run_all(eng, [Request("tiny", turn2, sp)])[0]
        out2 = _tokens(ev)
        assert out2 == reference(model, turn2, 12, eos)
        assert _usage(ev).num_cached_tokens == 112, _usage(ev)
        # A hit ending mid-window (and mid-block): it reads positions 88..103 (blocks 5, 6).
        mid = base + out1[:4] + junk[:5]
        ev = _run_all(eng, [Request("tiny", mid, sp)])[0]
        assert _tokens(ev) == reference(model, mid, 12, eos)
        assert _usage(ev).num_cached_tokens == 104, _usage(ev)
        # A hit ending at 50 would read 34..49 (block 2 lost its window part), any shorter one
        # blocks 0 or 1: cut back to nothing, and counted.
        cut = base[:50] + junk
        ev = _run_all(eng, [Request("tiny", cut, sp)])[0]
        assert _tokens(ev) == reference(model, cut, 12, eos)
        assert _usage(ev).num_cached_tokens == 0, _usage(ev)
        assert pc.stats()["num_hits_cut_to_window"] >= 1
    finally:
        eng.stop()
        assert pc.close(30)
    ns_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    names = [set(read_header(f)[0].tensors) for f in iter_block_files(ns_dir)]
    assert any(WINDOW_TENSOR not in n for n in names) and any(WINDOW_TENSOR in n for n in names)
    # A restart: the conversation goes on from disk; its first blocks' files lack the window part.
    eng, pc = make_engine(model, tokenizer, tmp_path, max_bytes=10**9)
    try:
        turn3 = turn2 + out2 + tail3
        ev = _run_all(eng, [Request("tiny", turn3, sp)])[0]
        assert _tokens(ev) == reference(model, turn3, 12, eos)
        assert _usage(ev).num_cached_tokens_cold >= len(turn2) + len(out2) - 1 - BS, _usage(ev)
        assert pc.pool.stats().num_window_bytes < pc.pool.num_bytes / 2  # restored without some parts
    finally:
        eng.stop()
        pc.close(30)


def test_a_hit_cut_by_a_dropped_window_part_reads_it_back_from_the_ssd_tier(tokenizer, tmp_path):
    """With write-through (the default), every block's file holds its window part: a hit whose
    window reads a part the hot tier dropped gets it back from disk instead of being cut."""
    from omlx.request import Request, SamplingParams

    model = tiny("gemma3_text")
    whole, win = block_bytes(model)
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    base, other, junk = rand_prompts([100, 31, 12], seed=11)
    eng, pc = make_engine(model, tokenizer, tmp_path, max_bytes=9 * whole - 3 * win, write_through=True)
    try:
        out1 = _tokens(_run_all(eng, [Request("tiny", base, sp)])[0])
        if len(out1) < 12:
            pytest.skip(f"the random model stopped after {len(out1)} tokens")
        _run_all(eng, [Request("tiny", other, SamplingParams(max_tokens=1, temperature=0.0))])
        assert pc.stats()["num_window_parts_dropped"] == 3
        cut = base[:50] + junk  # its window reads 34..49: blocks 2 (dropped) and 3
        ev = _run_all(eng, [Request("tiny", cut, sp)])[0]
        assert _tokens(ev) == reference(model, cut, 12, eos)
        assert _usage(ev).num_cached_tokens == 50, _usage(ev)
        s = pc.stats()
        assert s["num_window_parts_refilled"] == 1 and s["num_hits_cut_to_window"] == 0, s
    finally:
        eng.stop()
        pc.close(30)


def test_a_conversation_over_the_budget_keeps_its_whole_chain_by_dropping_its_own_old_window_parts(tokenizer, tmp_path):
    """A 7-block conversation under a 5-block budget: the request holds its chain while it
    runs, and each new block makes room from the window parts of its own blocks that lie 16+
    tokens before its last one; the next turn hits all 112 tokens, exactly."""
    from omlx.request import Request, SamplingParams

    model = tiny("gemma3_text")
    whole, win = block_bytes(model)
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    base, tail2 = rand_prompts([100, 9], seed=11)
    eng, pc = make_engine(model, tokenizer, tmp_path, max_bytes=5 * whole)
    try:
        out1 = _tokens(_run_all(eng, [Request("tiny", base, sp)])[0])
        if len(out1) < 12:
            pytest.skip(f"the random model stopped after {len(out1)} tokens")
        s = pc.stats()
        assert (s["num_full_blocks"], s["num_window_parts_dropped"], s["num_evictions"]) == (7, 4, 0), s
        turn2 = base + out1 + tail2
        ev = _run_all(eng, [Request("tiny", turn2, sp)])[0]
        assert _tokens(ev) == reference(model, turn2, 12, eos)
        assert _usage(ev).num_cached_tokens == 112, _usage(ev)
    finally:
        eng.stop()
        pc.close(30)

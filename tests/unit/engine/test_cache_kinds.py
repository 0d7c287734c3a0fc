"""The prefix cache on every cache kind mlx-lm serves (tiny random models of real families).

For each architecture of ``archs.py`` (sliding window, gated delta-net, Mamba-2, MLA), greedy
output with a prefix hit equals mlx-lm's own ``generate_step`` without any cache, token for
token: an identical prompt, prompt plus suffix, a multi-turn continuation (the previous answer
included), a hit that ends mid-window, eight concurrent requests sharing a prefix, and the
same after a restart (blocks and snapshots read back from the SSD tier). In-process: the engine
thread over tiny models (block 16, chunks of 32 alone and 16 beside decoding streams).
"""

from __future__ import annotations

import pytest

from tests.unit.engine.archs import CONFIGS, VOCAB, WINDOW, tiny
from tests.unit.engine.test_runner import _run_all, _tokens, _usage, reference

BS = 16
ARCHS = sorted(CONFIGS)
STATE_ARCHS = {"qwen3_5", "qwen3_next", "nemotron_h"}


def rand_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(n)] for n in lengths]


def make_engine(model, tokenizer, root, spec=None):
    """An engine with hot and SSD tiers over ``root`` for ``model`` (layout ``spec``, default
    the model's own; a quantized one also makes the runner's caches)."""
    from omlx.cache.hashing import Namespace, make_kv_format
    from omlx.cache.paged import BlockPool
    from omlx.cache.ssd import SSDStore
    from omlx.cache.tiered import RestoreCostModel, TieredCache, TierPolicy
    from omlx.engine.cache_spec import spec_of_model
    from omlx.engine.engine import Engine
    from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers
    from omlx.scheduler import Scheduler

    spec = spec or spec_of_model(model)
    n = len(spec.layers)
    bits, group = spec.kv_quantization or (None, None)
    ns = Namespace("tiny", "tok", make_kv_format("float32", bits, group, spec.describe()), 0, n)
    slack = -1 if spec.has_state else 16  # as make_prefix_cache sets them (PrefixCacheTiers checks)
    store = SSDStore(root, ns, dtype="float32", max_bytes=10**9, tail_slack_tokens=slack)
    tiers = TieredCache(BlockPool(max_bytes=10**9, block_size=BS, tail_slack_tokens=slack), ns,
                        MlxPayloadCodec("float32"), store, TierPolicy(whole_partials_only=spec.has_state),
                        RestoreCostModel(prefill_tokens_per_s=1.0, read_bytes_per_s=1e9))
    pc = PrefixCacheTiers(tiers, spec)
    eng = Engine("tiny", model, tokenizer, scheduler=Scheduler(8, 64), prefix_cache=pc, block_size=BS,
                 prefill_step_size=32, mixed_step_size=16,
                 make_cache=spec.make_cache if spec.kv_quantization else None)
    eng.start()
    return eng, pc


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param, tiny(request.param)


def test_the_layout_is_known_and_named(arch):
    from omlx.engine.cache_spec import spec_of_model

    name, model = arch
    spec = spec_of_model(model)
    tags = spec.describe()
    if name in ("gemma3_text", "gpt_oss"):
        assert f"W{WINDOW}k0" in tags and "A" in tags
    if name in STATE_ARCHS:
        assert spec.has_state and "S" in tags and "A" in tags
    if name == "deepseek_v3":
        assert tags == "A*2"


def test_every_kind_of_hit_is_exact_hot_and_after_a_restart(arch, tokenizer, tmp_path):
    from omlx.request import Request, SamplingParams

    name, model = arch
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    base, tail1, tail2, tail3, other = rand_prompts([100, 21, 9, 40, 33], seed=7)
    eng, pc = make_engine(model, tokenizer, tmp_path)
    try:
        first = _run_all(eng, [Request("tiny", base, sp)])[0]
        out1 = _tokens(first)
        assert out1 == reference(model, base, 12, eos)
        turn2 = base + out1 + tail2  # the next turn of a chat: the answer, then a new message
        # A next turn that re-tokenizes the prompt's last token (as "\n" after "assistant"
        # merges with the answer's first characters in a chat template).
        retok = base[:-1] + [(base[-1] + 1) % VOCAB] + tail1
        evs = _run_all(eng, [Request("tiny", base + tail1, sp), Request("tiny", base, sp),
                             Request("tiny", turn2, sp), Request("tiny", other, sp), Request("tiny", retok, sp)])
        for ev, prompt in zip(evs, [base + tail1, base, turn2, other, retok]):
            assert _tokens(ev) == reference(model, prompt, 12, eos), (name, len(prompt))
        cached = [_usage(ev).num_cached_tokens for ev in evs]
        assert cached[0] >= 64 and cached[1] >= 64, cached  # blocks of base (state: a snapshot)
        if name in STATE_ARCHS:  # the finished turn's snapshot sits at its very end
            assert cached[2] == len(base) + len(out1), cached
        else:
            assert cached[2] >= len(base) + len(out1) - BS, cached
        assert cached[3] == 0
        assert cached[4] == len(base) - 1, cached  # state: the snapshot before the prompt's last token
        stats = pc.stats()
        assert stats["cache_layout"] and (stats["num_snapshots"] > 0) == (name in STATE_ARCHS)
    finally:
        eng.stop()
        assert pc.close(30)
    # A restart: a new hot tier over the same SSD folder.
    eng, pc = make_engine(model, tokenizer, tmp_path)
    try:
        ev = _run_all(eng, [Request("tiny", base + tail3, sp)])[0]
        assert _tokens(ev) == reference(model, base + tail3, 12, eos)
        assert _usage(ev).num_cached_tokens_cold >= 64, _usage(ev)
    finally:
        eng.stop()
        pc.close(30)


def test_eight_concurrent_requests_sharing_a_prefix_are_exact(arch, tokenizer, tmp_path):
    from omlx.request import Request, SamplingParams

    name, model = arch
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    shared, *suffixes = rand_prompts([80] + [5 + 3 * i for i in range(8)], seed=13)
    eng, pc = make_engine(model, tokenizer, tmp_path)
    try:
        reqs = [Request("tiny", shared + s, sp) for s in suffixes]
        evs = _run_all(eng, reqs)
        for ev, s in zip(evs, suffixes):
            assert _tokens(ev) == reference(model, shared + s, 8, eos), name
        # The shared prefix is prefilled once (after the first request, every other one hits it).
        assert sum(_usage(ev).num_cached_tokens >= 64 for ev in evs) >= 7, [_usage(e) for e in evs]
    finally:
        eng.stop()
        pc.close(30)


def test_blocks_decoded_in_a_batch_on_a_window_model_are_cached_as_they_fill(tokenizer, tmp_path):
    """Two requests decode side by side (a merged ``BatchRotatingKVCache``) for longer than the
    window: each block the answer fills is cached at once (a window cache at the end holds only
    its last ``W`` tokens, too late for the older ones), and a prompt over the answer hits them."""
    from omlx.request import Request, SamplingParams

    model = tiny("gemma3_text")
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=48, temperature=0.0)
    a, b, more = rand_prompts([40, 37, 9], seed=21)
    eng, pc = make_engine(model, tokenizer, tmp_path)
    try:
        evs = _run_all(eng, [Request("tiny", a, sp), Request("tiny", b, sp)])
        out = _tokens(evs[0])
        if len(out) < 40:
            pytest.skip(f"the random model stopped after {len(out)} tokens")  # EOS drawn early
        nxt = a + out[:40] + more
        ev = _run_all(eng, [Request("tiny", nxt, SamplingParams(max_tokens=8, temperature=0.0))])[0]
        assert _tokens(ev) == reference(model, nxt, 8, eos)
        assert _usage(ev).num_cached_tokens >= (len(a) + 40) // BS * BS, _usage(ev)
    finally:
        eng.stop()
        pc.close(30)

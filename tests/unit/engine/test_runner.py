"""omlx's step loop (`BatchRunner`) and the engine over it, in-process on a tiny random llama.

Differential: every sequence's greedy tokens equal mlx-lm's own ``generate_step`` for the same
prompt, whatever else is in the batch (mixed prompt lengths, arrivals mid-decode, a sequence
removed mid-decode, prefix-cache hits).
"""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from omlx.engine.runner import BatchRunner
from omlx.engine.step_sizes import measure_step_sizes

VOCAB = 49152


def reference(model, prompt: list[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
    """mlx-lm's greedy tokens for ``prompt`` (at most ``n``, ending at an EOS id, excluded)."""
    out: list[int] = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        if tok in eos:
            break
        out.append(tok)
    return out


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in lengths]


def drive(runner: BatchRunner, schedule: dict[int, list[tuple[str, list[int]]]], max_tokens: int,
          remove_at: dict[int, str] | None = None) -> dict[str, list[int]]:
    """Run ``runner`` step by step; at step k insert ``schedule[k]`` (name, prompt) and remove
    ``remove_at[k]``. Returns each name's tokens."""
    uid_of: dict[str, int] = {}
    name_of: dict[int, str] = {}
    got: dict[str, list[int]] = {}
    step = 0
    last = max(schedule)
    while step <= last or len(runner):
        for name, prompt in schedule.get(step, []):
            (uid,) = runner.insert_segments([[prompt]], max_tokens=[max_tokens])
            uid_of[name], name_of[uid] = uid, name
            got[name] = []
        if remove_at and step in remove_at:
            runner.remove([uid_of[remove_at[step]]])
        _, gen = runner.next()
        for r in gen:
            got[name_of[r.uid]].append(r.token)
            if r.finish_reason is not None:
                assert r.all_tokens[-len(got[name_of[r.uid]]):] == got[name_of[r.uid]]
                offsets = {c.offset for c in r.prompt_cache if hasattr(c, "offset")}  # state layers have none
                assert offsets == {len(r.all_tokens)}, offsets
        step += 1
        assert step < 2000
    return got


def test_a_batch_of_mixed_lengths_and_late_arrivals_matches_generate_step(model):
    p = prompts([1, 7, 64, 300, 700, 129])
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, mixed_step_size=32, block_size=64)
    schedule = {0: [("a", p[0]), ("b", p[1])], 3: [("c", p[2]), ("d", p[3])], 9: [("e", p[4])], 30: [("f", p[5])]}
    got = drive(runner, schedule, max_tokens=24, remove_at={12: "b"})
    for name, prompt in zip("acdef", [p[0], p[2], p[3], p[4], p[5]]):
        assert got[name] == reference(model, prompt, 24), name
    # The removed sequence produced a prefix of its own reference, then nothing more.
    ref_b = reference(model, p[1], 24)
    assert 0 < len(got["b"]) < 24 and got["b"] == ref_b[: len(got["b"])]
    assert len(runner) == 0


def test_a_lone_sequence_decodes_on_its_own_plain_cache(model):
    from mlx_lm.models.cache import KVCache

    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=256, block_size=64)
    (uid,) = runner.insert_segments([[prompts([50])[0]]], max_tokens=[5])
    seen = []
    while len(runner):
        runner.next()
        seen.append(type(runner._cache[0]) if runner._cache else None)
    assert KVCache in seen  # batch of one: mlx-lm's fast causal path, no padding mask
    assert all(t in (KVCache, None) for t in seen)


def test_prefill_chunks_end_at_absolute_multiples_of_the_chunk_size_and_report_each(model):
    from mlx_lm.models.cache import make_prompt_cache

    calls: list[tuple[int, int]] = []
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=64,
                         on_prefill_chunk=lambda state, caches, n: calls.append((state, n)))
    prefix, rest = prompts([64, 250])
    cache = make_prompt_cache(model)
    model(mx.array([prefix]), cache=cache)  # a block-aligned "hit" of 64 tokens
    runner.insert_segments([[rest]], max_tokens=[2], caches=[cache], all_tokens=[prefix], states=["a"])
    while len(runner):
        runner.next()
    assert calls == [("a", 128), ("a", 256), ("a", 314)]
    assert runner.num_prefill_tokens == 250


def test_stop_tokens_end_a_sequence_with_its_caches(model):
    p = prompts([20])[0]
    ref = reference(model, p, 10)
    stop = ref[3]
    runner = BatchRunner(model, stop_tokens=[(stop,)], block_size=64)
    got = drive(runner, {0: [("a", p)]}, max_tokens=10)
    assert got["a"] == ref[: ref.index(stop) + 1]


def test_step_sizes_are_measured_within_their_bounds(model):
    sizes = measure_step_sizes(model, 64, max_step=512)
    assert sizes.prefill_step_size % 64 == 0 and 64 <= sizes.prefill_step_size <= 512
    assert 1 <= sizes.mixed_step_size <= sizes.prefill_step_size
    assert sizes.decode_step_ms > 0 and all(v > 0 for v in sizes.chunk_ms.values())


def test_the_alone_chunk_size_is_the_shortest_near_the_best_rate_not_the_first_stall():
    from omlx.engine.step_sizes import alone_step_size

    # H200, 3B model, 2026-12-04: one slow probe at 1,024 tokens must not stop the choice at 512.
    h200 = {32: 0.012, 64: 0.0128, 128: 0.0087, 256: 0.0081, 512: 0.0102, 1024: 0.0303, 2048: 0.0251}
    assert alone_step_size(h200, 256) == 2048
    # A CPU: tokens/s flat from the first block on, so the block size.
    cpu = {32: 0.05, 64: 0.1, 128: 0.2, 256: 0.4, 512: 0.8}
    assert alone_step_size(cpu, 256) == 256
    assert alone_step_size({32: 0.01}, 256) == 256


# ---- the engine over the runner -------------------------------------------------------------


def _engine(model, tokenizer, *, cache: bool, block_size: int = 64, num_draft_tokens: int = 0):
    from omlx.cache.hashing import Namespace, make_kv_format
    from omlx.cache.paged import BlockPool
    from omlx.cache.tiered import TieredCache
    from omlx.engine.engine import Engine
    from omlx.engine.cache_spec import spec_of_model
    from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers
    from omlx.scheduler import Scheduler

    pc = None
    if cache:
        ns = Namespace("tiny", "tok", make_kv_format("float32", None, None, "KVCache"), 0, 2)
        pc = PrefixCacheTiers(TieredCache(BlockPool(max_bytes=10**9, block_size=block_size), ns,
                                          MlxPayloadCodec("float32")), spec_of_model(model))
    eng = Engine("tiny", model, tokenizer, scheduler=Scheduler(8, 64), prefix_cache=pc,
                 block_size=block_size, prefill_step_size=128, mixed_step_size=32, num_draft_tokens=num_draft_tokens)
    eng.start()
    return eng


def _run_all(eng, reqs) -> list[list]:
    """Submit every request at once; return each one's events when all finished."""
    return eng.run_all(reqs, 120)


def _tokens(events) -> list[int]:
    from omlx.request import TextDelta

    return [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]


def _usage(events):
    return events[-1].usage


def test_engine_output_with_every_kind_of_cache_hit_equals_generate_step(model, tokenizer):
    from omlx.request import Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    base, tail1, tail2 = prompts([300, 30, 45], seed=7)
    eng = _engine(model, tokenizer, cache=True)
    try:
        first = _run_all(eng, [Request("tiny", base, sp)])[0]
        assert _tokens(first) == reference(model, base, 16, eos)
        # A longer prompt over the cached blocks, and the same prompt again (a whole hit),
        # beside a new prompt, all at once.
        evs = _run_all(eng, [Request("tiny", base + tail1, sp), Request("tiny", base, sp),
                             Request("tiny", tail2, sp)])
        assert _tokens(evs[0]) == reference(model, base + tail1, 16, eos)
        assert _usage(evs[0]).num_cached_tokens == 300  # the blocks of ``base``, its tail too
        assert _tokens(evs[1]) == reference(model, base, 16, eos)
        assert _usage(evs[1]).num_cached_tokens >= 256
        assert _tokens(evs[2]) == reference(model, tail2, 16, eos)
    finally:
        eng.stop()


def test_an_aborted_request_leaves_the_others_exact(model, tokenizer):
    from omlx.request import Finished, Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    a, b, c = prompts([40, 200, 90], seed=11)
    eng = _engine(model, tokenizer, cache=False)
    try:
        long_req = Request("tiny", b, SamplingParams(max_tokens=400, temperature=0.0))
        seen = threading.Event()
        events: list = []

        def sink(ev):
            events.append(ev)
            if len(events) > 5:
                seen.set()

        eng.submit(long_req, sink)
        assert seen.wait(60)
        others = [Request("tiny", a, SamplingParams(max_tokens=12, temperature=0.0)),
                  Request("tiny", c, SamplingParams(max_tokens=12, temperature=0.0))]
        result: list = []
        t = threading.Thread(target=lambda: result.append(_run_all(eng, others)))
        t.start()
        eng.abort(long_req.request_id)
        t.join(120)
        assert isinstance(events[-1], Finished) and events[-1].finish_reason == "abort"
        assert _tokens(result[0][0]) == reference(model, a, 12, eos)
        assert _tokens(result[0][1]) == reference(model, c, 12, eos)
        assert eng.num_active() == 0
    finally:
        eng.stop()


@pytest.mark.parametrize("lengths", [(512, 20, 33), (200, 20, 9)])
def test_two_requests_sharing_a_long_prefix_prefill_it_once(model, tokenizer, lengths):
    from omlx.request import Request, SamplingParams

    if not hasattr(__import__("omlx.engine.kv_cache", fromlist=["PrefixCacheTiers"]).PrefixCacheTiers,
                   "cache_blocks"):
        pytest.fail("PrefixCacheTiers has no cache_blocks: blocks are cached only when a request finishes")
    eos = frozenset(tokenizer.eos_token_ids)
    # (200, 20, 9): shared blocks lie in the first request's last chunk, [128, 220).
    shared, s1, s2 = prompts(list(lengths), seed=5)
    eng = _engine(model, tokenizer, cache=True)
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0)
        evs = _run_all(eng, [Request("tiny", shared + s1, sp), Request("tiny", shared + s2, sp)])
        assert _tokens(evs[0]) == reference(model, shared + s1, 8, eos)
        assert _tokens(evs[1]) == reference(model, shared + s2, 8, eos)
        # Every full block of the shared prefix is reused (the first request is still running:
        # its partial last block is not cached yet).
        num_cached = len(shared) // 64 * 64
        assert _usage(evs[1]).num_cached_tokens == num_cached
        assert eng._gen.num_prefill_tokens == 2 * len(shared) + len(s1) + len(s2) - num_cached
    finally:
        eng.stop()


def test_a_block_filled_by_decode_is_cached_before_the_request_ends(model, tokenizer):
    from omlx.request import Finished, Request, SamplingParams

    eng = _engine(model, tokenizer, cache=True)
    try:
        (p,) = prompts([40], seed=13)
        req = Request("tiny", p, SamplingParams(max_tokens=400, temperature=0.0))
        events: list = []
        enough = threading.Event()

        def sink(ev):
            events.append(ev)
            if len(_tokens(events)) >= 70:
                enough.set()

        eng.submit(req, sink)
        assert enough.wait(60)
        eng.abort(req.request_id)  # an aborted request stores nothing at its end
        for _ in range(200):
            if events and isinstance(events[-1], Finished):
                break
            threading.Event().wait(0.05)
        generated = _tokens(events)
        follow = _run_all(eng, [Request("tiny", p + generated[:30], SamplingParams(max_tokens=2, temperature=0.0))])[0]
        assert _usage(follow).num_cached_tokens == 64  # the block decode filled (40 prompt + 24 generated)
    finally:
        eng.stop()


def test_step_sizes_measured_once_per_model_shape(model, monkeypatch):
    """A second load of the same model shape reuses the measurement (no new forward passes)."""
    from omlx.engine import step_sizes as runner

    monkeypatch.setattr(runner, "_MEASURED", {})
    first, reused = runner.measured_step_sizes(model, 64, max_step=256)
    assert not reused
    calls = []
    real = runner.measure_step_sizes
    monkeypatch.setattr(runner, "measure_step_sizes", lambda *a, **k: calls.append(a) or real(*a, **k))
    again, reused = runner.measured_step_sizes(model, 64, max_step=256)
    assert reused and again is first and not calls
    _, reused = runner.measured_step_sizes(model, 128, max_step=256)  # another block size: measured
    assert not reused and len(calls) == 1


def test_hold_last_token_prefills_the_last_prompt_token_alone(model):
    """With ``hold_last_token`` the chunk hook sees the caches before the prompt's last token
    (where a recurrent model is snapshotted); the output is unchanged."""
    calls: list[int] = []
    (p,) = prompts([100], seed=3)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=64, block_size=32, hold_last_token=True,
                         on_prefill_chunk=lambda state, caches, n: calls.append(n))
    got = drive(runner, {0: [("a", p)]}, max_tokens=6)
    assert calls == [64, 99, 100]
    assert got["a"] == reference(model, p, 6)


def test_the_gpu_warm_up_batch_runs_together_and_each_request_equals_generate_step(model, tokenizer):
    """The batched warm-up (`omlx.engine.factory.warmup_batch`) gives rows of different prompt
    and output lengths, so a load builds the kernels of merging and dropping decode rows."""
    from omlx.engine.factory import warmup_batch
    from omlx.request import Finished

    assert warmup_batch("tiny", [1, 2, 3], 1) == []
    ids = prompts([40], seed=11)[0]
    reqs = warmup_batch("tiny", ids, 8, block_size=64)
    assert len({len(r.prompt_token_ids) for r in reqs}) == 8
    assert len({r.sampling.max_tokens for r in reqs}) == 7  # the last crosses a block in decode
    assert len(reqs[-1].prompt_token_ids) == 62 and reqs[-1].sampling.max_tokens == 6
    eos = frozenset(tokenizer.eos_token_ids)
    eng = _engine(model, tokenizer, cache=True)
    try:
        evs = eng.run_all(reqs, 120)
    finally:
        eng.stop()
    for r, e in zip(reqs, evs):
        assert isinstance(e[-1], Finished)
        assert _tokens(e) == reference(model, r.prompt_token_ids, r.sampling.max_tokens, eos)


# ---- batched prefill of fresh short prompts ---------------------------------------------------


def test_short_fresh_prompts_queued_together_prefill_in_one_step_and_match_generate_step(model):
    calls: list[tuple[int, int, int]] = []

    def hook(state, caches, n):
        calls.append((state, n, caches[0].offset))
        assert caches[0].keys.shape[2] == n  # a batch-1 view of its own row, no padding

    p = prompts([5, 17, 40, 3])
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=256, block_size=64, on_prefill_chunk=hook)
    uids = runner.insert_segments([[x] for x in p], max_tokens=[12] * 4, states=["a", "b", "c", "d"])
    runner.next()
    assert runner.num_prefilling == 0 and runner.num_prefill_tokens == 65  # one forward pass
    got = {u: [] for u in uids}
    while len(runner):
        for r in runner.next()[1]:
            got[r.uid].append(r.token)
            assert r.state == "abcd"[uids.index(r.uid)]  # each response names its sequence's state
    for u, x in zip(uids, p):
        assert got[u] == reference(model, x, 12)
    assert sorted(calls) == sorted((u, len(x), len(x)) for u, x in zip("abcd", p))


def test_a_prefill_batch_beside_decoding_rows_and_a_removal_while_joining_stay_exact(model):
    p = prompts([30, 9, 21, 14, 250], seed=4)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, mixed_step_size=64, block_size=64)
    # "a" decodes alone; "b", "c", "d" arrive together (3 x 21 padded tokens <= 64 beside
    # decoding) and are prefilled in one pass; "c" is removed before its batch joins; "e" is
    # too long to batch and is chunked on its own.
    schedule = {0: [("a", p[0])], 4: [("b", p[1]), ("c", p[2]), ("d", p[3]), ("e", p[4])]}
    got = drive(runner, schedule, max_tokens=16, remove_at={5: "c"})
    for name, prompt in zip("abde", [p[0], p[1], p[3], p[4]]):
        assert got[name] == reference(model, prompt, 16), name
    assert got["c"] == []  # removed between its prefill and its first decode step
    assert len(runner) == 0


def test_a_prompt_with_a_cached_prefix_or_over_the_budget_is_not_batched(model):
    from mlx_lm.models.cache import make_prompt_cache

    prefix, a, b = prompts([64, 10, 12], seed=9)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=64)
    cache = make_prompt_cache(model)
    model(mx.array([prefix]), cache=cache)
    runner.insert_segments([[a]], max_tokens=[2], caches=[cache], all_tokens=[prefix])
    runner.insert_segments([[b]], max_tokens=[2])
    runner.next()
    assert runner.num_prefilling == 1  # the hit prefilled alone
    runner.next()
    assert runner.num_prefilling == 0
    c, d = prompts([65, 65], seed=10)
    runner.insert_segments([[c], [d]], max_tokens=[2, 2])
    runner.next()
    assert runner.num_prefilling == 1  # 2 x 65 padded tokens > 128: one at a time
    e, f = prompts([64, 64], seed=11)
    runner.insert_segments([[e], [f]], max_tokens=[2, 2])
    runner.next()  # the second 65 alone
    runner.next()
    assert runner.num_prefilling == 0  # 2 x 64 <= 128: in one pass


def test_the_engine_admits_short_distinct_prompts_into_one_prefill_and_shared_ones_one_by_one(model, tokenizer):
    from omlx.request import Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True, block_size=16)
    try:
        steps: list[int] = []
        real = eng._gen.__class__._prefill_batch

        def spy(self, group):
            steps.append(len(group))
            return real(self, group)

        eng._gen._prefill_batch = spy.__get__(eng._gen)
        distinct = prompts([20, 33, 47, 12], seed=21)
        evs = _run_all(eng, [Request("tiny", x, sp) for x in distinct])
        for x, e in zip(distinct, evs):
            assert _tokens(e) == reference(model, x, 6, eos)
        assert sum(steps) >= 2  # at least two of them went through one batched prefill
        # What the batched rows computed was cached: a follow-up hits it.
        tails = prompts([3, 4, 5, 6], seed=24)
        evs = _run_all(eng, [Request("tiny", x + t, sp) for x, t in zip(distinct, tails)])
        for x, t, e in zip(distinct, tails, evs):
            assert _usage(e).num_cached_tokens >= len(x) // 16 * 16 > 0 or len(x) < 16
            assert _tokens(e) == reference(model, x + t, 6, eos)
        shared = prompts([32], seed=22)[0]
        steps.clear()
        tails = prompts([5, 6], seed=23)
        evs = _run_all(eng, [Request("tiny", shared + t, sp) for t in tails])
        assert steps == []  # the same first block: the second waits and hits the first's blocks
        assert _usage(evs[1]).num_cached_tokens == 32
        for t, e in zip(tails, evs):
            assert _tokens(e) == reference(model, shared + t, 6, eos)
    finally:
        eng.stop()


def _first_token_steps(runner: BatchRunner, schedule: dict[int, list[tuple[str, list[int]]]],
                       max_tokens: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Drive ``runner`` like `drive`; return the step at which each name's first token came
    out, and its tokens."""
    uid_of: dict[int, str] = {}
    first: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    step = 0
    while step <= max(schedule) or len(runner):
        for name, prompt in schedule.get(step, []):
            (uid,) = runner.insert_segments([[prompt]], max_tokens=[max_tokens])
            uid_of[uid], got[name] = name, []
        for r in runner.next()[1]:
            first.setdefault(uid_of[r.uid], step)
            got[uid_of[r.uid]].append(r.token)
        step += 1
        assert step < 2000
    return first, got


def test_a_short_prompt_goes_ahead_of_a_long_prefill_and_every_token_stays_exact(model):
    """A 700-token prompt prefills in 32-token chunks beside a decoding row; a 20-token prompt
    arriving after its first chunk gets its first token within a few steps, not after the
    long prompt's 20 remaining chunks (FIFO order would put it there)."""
    p = prompts([6, 700, 20], seed=31)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, mixed_step_size=32, block_size=32)
    first, got = _first_token_steps(runner, {0: [("a", p[0])], 2: [("long", p[1])], 4: [("short", p[2])]}, 30)
    assert first["short"] <= 7, first
    assert first["long"] > first["short"] + 15, first
    for name, prompt in zip(["a", "long", "short"], p):
        assert got[name] == reference(model, prompt, 30), name


def test_short_prompts_arriving_without_end_still_leave_the_long_prefill_a_chunk_every_round(model):
    """A new short prompt every step: the long one is passed by each batch of shorts that
    arrived before its next chunk, then runs that chunk, so it finishes within about twice its
    chunk count (never starved) and every stream stays exact."""
    p = prompts([5, 320] + [7] * 24, seed=32)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=64, mixed_step_size=32, block_size=32)
    schedule = {0: [("a", p[0])], 1: [("long", p[1])]}
    for i, x in enumerate(p[2:]):
        schedule.setdefault(2 + i, []).append((f"s{i}", x))
    first, got = _first_token_steps(runner, schedule, 4)
    assert first["long"] <= 1 + 2 * (320 // 32) + 4, first["long"]  # 10 chunks, passed at most once each
    assert max(first[f"s{i}"] - (2 + i) for i in range(24)) <= 4, first
    for name, prompt in [("a", p[0]), ("long", p[1])] + [(f"s{i}", x) for i, x in enumerate(p[2:])]:
        assert got[name] == reference(model, prompt, 4), name


def test_the_engine_starts_a_short_turn_during_a_long_prefill_and_a_sharer_once_its_blocks_are_cached(model, tokenizer):
    """Head-of-line blocking (a fresh user's 8 cached agents stalled 35-41 s behind two long
    first prompts): a turn on a cached conversation starts while another client's 900-token
    prompt prefills and gets its first token before it; a prompt sharing the long one's first
    64 tokens waits only until those blocks are cached, hits them, and also comes out first."""
    from omlx.request import Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True, block_size=16)
    try:
        convo, long_p, tail, tail2 = prompts([60, 900, 5, 7], seed=41)
        _run_all(eng, [Request("tiny", convo, sp)])
        turn, sharer = convo + tail, long_p[:64] + tail2
        evs = _run_all(eng, [Request("tiny", long_p, sp), Request("tiny", turn, sp), Request("tiny", sharer, sp)])
        first = [_usage(e).ttft_s for e in evs]
        assert first[1] < first[0] and first[2] < first[0], first
        assert _usage(evs[1]).num_cached_tokens >= 48
        assert _usage(evs[2]).num_cached_tokens == 64  # the long prompt's blocks, computed for it
        for x, e in zip([long_p, turn, sharer], evs):
            assert _tokens(e) == reference(model, x, 4, eos)
    finally:
        eng.stop()


def _paced_runner(model) -> BatchRunner:
    """A runner with pacing on (2x) and a fake clock: each step costs 4 ms of decode plus 1 ms
    per token prefilled since the last clock read."""
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=64, mixed_step_size=32, block_size=32,
                         max_tpot_slowdown=2.0)
    t, seen = [0.0], [0]

    def clock() -> float:
        t[0] += 0.004 + 0.001 * (runner.num_prefill_tokens - seen[0])
        seen[0] = runner.num_prefill_tokens
        return t[0]

    runner.pacer.clock = clock
    return runner


def test_paced_prefill_beside_a_decoding_row_is_held_back_and_stays_exact(model):
    """With pacing on, a long prompt arriving mid-decode waits between its chunks (a fake
    clock makes each chunk cost 1 ms per token against a 4 ms decode step) and every token
    still equals generate_step's."""
    runner = _paced_runner(model)
    p = prompts([5, 200], seed=7)
    got = drive(runner, {0: [("a", p[0])], 20: [("b", p[1])]}, max_tokens=60)
    assert got["a"] == reference(model, p[0], 60)
    assert got["b"] == reference(model, p[1], 60)
    assert runner.pacer.num_held > 10


def test_with_pacing_a_short_prompt_is_not_held_behind_a_long_prefills_debt(model):
    """Pacing on, a fake clock charging 1 ms per prefilled token against a 4 ms decode step:
    a 20-token prompt (one chunk) arriving while a 400-token one is held between its chunks
    gets its first token within a few steps (its one chunk is never held, and goes ahead of
    the long one's next), and every token equals generate_step's."""
    runner = _paced_runner(model)
    p = prompts([5, 400, 20], seed=41)
    first, got = _first_token_steps(runner, {0: [("a", p[0])], 20: [("long", p[1])], 40: [("short", p[2])]}, 80)
    assert runner.pacer.num_held > 10  # the long prefill was paced...
    assert first["short"] <= 40 + 4, first  # ...the short prompt was not
    assert first["long"] > first["short"], first
    for name, prompt in zip(["a", "long", "short"], p):
        assert got[name] == reference(model, prompt, 80), name


def test_padded_lengths_repeat_and_waste_little():
    from omlx.engine.runner import padded_length

    assert [padded_length(n) for n in (1, 16, 17, 100, 129, 256, 257, 1000, 2047, 2048)] == \
        [16, 16, 32, 128, 256, 256, 512, 1024, 2048, 2048]
    for n in range(1, 5000, 37):
        p = padded_length(n)
        assert n <= p < max(2 * n, n + 256)


@pytest.mark.parametrize("batched", [False, True])
def test_shape_padding_leaves_every_token_equal_to_generate_step(model, batched):
    """Ragged last chunks (and a prefill batch) padded at their end, trimmed after: the same
    tokens as mlx-lm's, for single prompts, a batch, and an arrival mid-decode."""
    p = prompts([3, 45, 130, 201, 77], seed=11)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128 if not batched else 512,
                         mixed_step_size=64, block_size=64, pad_shapes=True)
    schedule = ({0: [("a", p[0])], 1: [("b", p[1])], 4: [("c", p[2]), ("d", p[3])], 12: [("e", p[4])]}
                if not batched else {0: [(n, q) for n, q in zip("abcde", p)]})
    got = drive(runner, schedule, max_tokens=12)
    for name, prompt in zip("abcde", p):
        assert got[name] == reference(model, prompt, 12), name
    assert runner.num_pad_tokens > 0


def test_a_model_that_returns_only_the_last_positions_logits_runs_unchanged(model):
    """A cluster stage computes logits for the last position only ((B, 1, V), see
    `omlx.cluster.pipeline.StageModel`); the runner must read that one, not index the chunk."""
    from mlx_lm.models.cache import make_prompt_cache

    class LastOnly:
        def __call__(self, x, cache=None):
            return model(x, cache=cache)[:, -1:, :]

    p = prompts([3, 45, 130], seed=13)
    runner = BatchRunner(LastOnly(), stop_tokens=[], prefill_step_size=128, mixed_step_size=64, block_size=64,
                         make_cache=lambda: make_prompt_cache(model))
    got = drive(runner, {0: [("a", p[0])], 2: [("b", p[1]), ("c", p[2])]}, max_tokens=8)
    for name, prompt in zip("abc", p):
        assert got[name] == reference(model, prompt, 8), name


def test_a_lone_sequence_emits_its_first_token_before_its_first_decode_step_is_queued(model):
    """Nothing else in flight: the step that reads a prompt's first token does not queue the
    decode step feeding it first (on a CPU that step's ``async_eval`` blocks, so the pipelined
    order put a whole decode step into the time to first token); the next step does, without
    emitting that token again. Tokens stay exact, and a sequence that ends at its first token
    still returns caches holding all its tokens."""
    (p,) = prompts([40], seed=41)
    ref = reference(model, p, 6)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=32)
    (uid,) = runner.insert_segments([[p]], max_tokens=[6])
    got: list[int] = []
    while not got:
        _, gen = runner.next()
        got += [r.token for r in gen]
    assert got == ref[:1]
    assert {c.offset for c in runner.decode_caches(uid)} == {len(p)}  # the decode step feeding it is not queued yet
    while len(runner):
        got += [r.token for r in runner.next()[1]]
    assert got == ref
    one = drive(BatchRunner(model, stop_tokens=[], prefill_step_size=128, block_size=32), {0: [("a", p)]}, max_tokens=1)
    assert one["a"] == ref[:1]  # drive checks the returned caches hold prompt + token

"""A long prompt's prefill is never lost (issue 27), in-process on a tiny random llama.

An aborted prefill leaves every full block it computed in the prefix cache, so the retry resumes
there and its greedy output equals an uninterrupted run; a request whose prompt another request
is prefilling waits for those blocks instead of computing them again (counted with the runner's
``num_prefill_tokens``); each request reports the prompt tokens it ran through the model
(``num_prefilled_tokens``), and a prefilling request its progress, rate and ETA.
"""

from __future__ import annotations

import logging
import threading

import pytest

from tests.unit.engine.test_runner import _engine, _run_all, _tokens, _usage, prompts, reference

BLOCK = 64  # _engine's block size; chunks of 128 tokens alone


def _abort_when(eng, req, num_computed: int):
    """Submit ``req``; abort it (from its own sink, on the engine thread) at its first prefill
    progress event of at least ``num_computed`` tokens. Returns (its events, a done event)."""
    from omlx.request import Failed, Finished, PrefillProgress

    events: list = []
    done = threading.Event()
    fired: list[int] = []

    def sink(ev):
        events.append(ev)
        if isinstance(ev, PrefillProgress) and ev.num_computed_tokens >= num_computed and not fired:
            fired.append(ev.num_computed_tokens)
            eng.abort(req.request_id)
        if isinstance(ev, (Finished, Failed)):
            done.set()

    eng.submit(req, sink)
    return events, done, fired


def test_an_aborted_long_prefill_leaves_its_blocks_and_the_retry_resumes_exactly(model, tokenizer):
    from omlx.request import Finished, Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    (p,) = prompts([1000], seed=21)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True)
    try:
        first = Request("tiny", p, sp)
        events, done, fired = _abort_when(eng, first, 384)
        assert done.wait(60)
        assert isinstance(events[-1], Finished) and events[-1].finish_reason == "abort"
        assert fired == [384]
        # The abort landed mid-prefill: 384 tokens dispatched, the last chunk's hook still due.
        assert first.num_prefilled_tokens == 384
        before = eng._gen.num_prefill_tokens
        retry = Request("tiny", p, sp)
        evs = _run_all(eng, [retry])[0]
        assert _usage(evs).num_cached_tokens >= first.num_prefilled_tokens // BLOCK * BLOCK
        assert _usage(evs).num_cached_tokens == 384
        assert retry.num_prefilled_tokens == len(p) - 384
        assert eng._gen.num_prefill_tokens - before == len(p) - 384
        assert _tokens(evs) == reference(model, p, 12, eos)
    finally:
        eng.stop()


def test_a_retry_submitted_during_the_prefill_joins_it_and_computes_nothing_twice(model, tokenizer):
    """The second copy of a prompt waits while the first prefills it; when the first is aborted
    it resumes from every block the first computed (a client's retry while its abandoned first
    attempt still runs)."""
    from omlx.request import Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    (p,) = prompts([1000], seed=22)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True)
    try:
        first, retry = Request("tiny", p, sp), Request("tiny", p, sp)
        result: list = []
        submitted = threading.Event()
        from omlx.request import Failed, Finished, PrefillProgress

        events: list = []
        done = threading.Event()

        def sink(ev):
            events.append(ev)
            if isinstance(ev, PrefillProgress) and ev.num_computed_tokens == 256 and not submitted.is_set():
                submitted.set()  # the retry arrives while the first attempt prefills
                threading.Thread(target=lambda: result.append(_run_all(eng, [retry]))).start()
            if isinstance(ev, PrefillProgress) and ev.num_computed_tokens == 640:
                eng.abort(first.request_id)
            if isinstance(ev, (Finished, Failed)):
                done.set()

        eng.submit(first, sink)
        assert done.wait(60) and events[-1].finish_reason == "abort"
        for _ in range(600):
            if result:
                break
            threading.Event().wait(0.05)
        (evs,) = result[0]
        assert first.num_prefilled_tokens == 640
        assert _usage(evs).num_cached_tokens == 640
        assert first.num_prefilled_tokens + retry.num_prefilled_tokens == len(p)
        assert eng._gen.num_prefill_tokens == len(p)  # every prompt token ran through the model once
        assert _tokens(evs) == reference(model, p, 8, eos)
    finally:
        eng.stop()


@pytest.mark.parametrize("length", [1000, 1024])
def test_two_concurrent_identical_long_prompts_prefill_once(model, tokenizer, length):
    from omlx.request import Request, SamplingParams

    eos = frozenset(tokenizer.eos_token_ids)
    (p,) = prompts([length], seed=23)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True)
    try:
        a, b = Request("tiny", p, sp), Request("tiny", p, sp)
        evs = _run_all(eng, [a, b])
        ref = reference(model, p, 8, eos)
        assert _tokens(evs[0]) == ref and _tokens(evs[1]) == ref
        # The second waits for the first's blocks: it computes only what lies past the first's
        # full blocks (its partial last block is cached only when it ends) and at least its last
        # token (a lookup covers that only with stored log-probabilities).
        reused = min(length - 1, length // BLOCK * BLOCK)
        assert _usage(evs[1]).num_cached_tokens == reused
        assert a.num_prefilled_tokens == length and b.num_prefilled_tokens == length - reused
        assert eng._gen.num_prefill_tokens == 2 * length - reused
        assert eng._gen.num_prefill_tokens <= length + BLOCK
    finally:
        eng.stop()


def test_a_prefilling_request_reports_progress_rate_and_eta(model, tokenizer):
    from omlx.request import Failed, Finished, PrefillProgress, Request, SamplingParams

    (p,) = prompts([1000], seed=24)
    eng = _engine(model, tokenizer, cache=True)
    try:
        req = Request("tiny", p, SamplingParams(max_tokens=4, temperature=0.0))
        rows: list = []
        done = threading.Event()

        def sink(ev):  # on the engine thread, between steps: a consistent snapshot
            if isinstance(ev, PrefillProgress) and ev.num_computed_tokens == 512:
                rows.extend(eng.prefilling())
            if isinstance(ev, (Finished, Failed)):
                done.set()

        eng.submit(req, sink)
        assert done.wait(60)
        (row,) = rows
        d = row.as_dict()
        assert d["request_id"] == req.request_id and d["outcome"] == "prefilling"
        assert d["num_prompt_tokens"] == 1000 and d["num_cached_tokens"] == 0
        assert d["num_prefilled_tokens"] == 512 and d["num_done_tokens"] == 512 and d["num_to_prefill"] == 1000
        assert d["progress"] == pytest.approx(0.512)
        assert row.tokens_per_s == pytest.approx(512 / row.elapsed_s)
        assert row.eta_s == pytest.approx(488 / row.tokens_per_s)
        assert eng.prefilling() == []  # finished: no longer listed
        assert req.num_prefilled_tokens == 1000
    finally:
        eng.stop()


def test_a_prefill_longer_than_the_client_timeout_is_warned_at_admission(model, tokenizer, caplog, monkeypatch):
    from omlx.engine.kv_cache import PrefixCacheTiers
    from omlx.engine.progress import CLIENT_REQUEST_TIMEOUT_S
    from omlx.request import Request, SamplingParams

    short, long_ = prompts([400, 600], seed=25)
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    eng = _engine(model, tokenizer, cache=True)
    monkeypatch.setattr(PrefixCacheTiers, "observe_prefill", lambda self, n, s: None)  # the rate stays set
    cost = eng.prefix_cache.tiers.cost
    try:
        cost.prefill_tokens_per_s, cost.num_prefill_samples = 1280.0, 1  # 600 tokens in 0.5 s
        with caplog.at_level(logging.WARNING, logger="omlx.engine.progress"):
            _run_all(eng, [Request("tiny", long_, sp)])
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            cost.prefill_tokens_per_s = 1.5
            _run_all(eng, [Request("tiny", short, sp)])  # 400 / 1.5 = 267 s: under the limit
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            hit = Request("tiny", long_[:300] + short, sp)  # 256 cached: 444 / 1.5 = 296 s
            _run_all(eng, [hit])
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            slow = Request("tiny", short + long_, sp)  # 400 cached (blocks and tail): 600 / 1.5 = 400 s
            _run_all(eng, [slow])
        (w,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        msg = w.getMessage()
        assert slow.request_id in msg
        assert "600 uncached prompt tokens of 1000" in msg and "about 400 s" in msg and "300 s" in msg
    finally:
        eng.stop()
    assert CLIENT_REQUEST_TIMEOUT_S == 300.0


def test_the_prefill_rate_prefers_served_prefills_then_chunk_timings():
    from omlx.cache.tiered import RestoreCostModel
    from omlx.engine.progress import prefill_rate

    cost = RestoreCostModel(prefill_tokens_per_s=500.0)
    assert prefill_rate(None, None, 256) is None
    assert prefill_rate(cost, None, 256).source == "measured"
    assert prefill_rate(RestoreCostModel(), None, 256).source == "assumed"
    # 256 tokens in 128 ms (the chunk size the engine runs alone): 2000 tok/s
    got = prefill_rate(cost, {128: 100.0, 256: 128.0, 512: 400.0}, 256)
    assert (got.tokens_per_s, got.source) == (2000.0, "measured")
    cost.observe_prefill(1000, 4.0)
    got = prefill_rate(cost, {256: 128.0}, 256)
    assert got.source == "observed" and got.tokens_per_s == pytest.approx(0.7 * 500 + 0.3 * 250)

"""Exactness of the hot prefix cache with the real model: greedy output with any cache hit equals
the output of a server running without the cache, token for token."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess, running

SYSTEM = (
    "You are a careful assistant for a software team. Follow the house rules: answer briefly, "
    "prefer lists, cite file names in backticks, never invent APIs, and say when unsure. "
) * 12
QUESTION = "List five prime numbers and explain each in one line."


@pytest.fixture(scope="module")
def servers():
    # RAM tier only: the shared test home's SSD tier would turn the first (cold) request into a hit.
    with running(ServerProcess(["--block-size", "32", "--no-ssd-cache"]), ServerProcess(["--no-cache"])) as pair:
        yield pair


def _client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _chat(s: ServerProcess, messages, max_tokens=48):
    r = _client(s).chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=max_tokens, seed=1)
    return r.choices[0].message.content, r.usage


def _complete(s: ServerProcess, prompt: str, max_tokens=24):
    r = _client(s).completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=max_tokens)
    return r.choices[0].text, r.usage


def test_repeated_request_cold_warm_warm_is_identical(servers):
    cached, plain = servers
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ref, ref_usage = _chat(plain, msgs, max_tokens=256)
    outs = [_chat(cached, msgs, max_tokens=256) for _ in range(3)]
    for text, usage in outs:
        assert text == ref
        assert usage.completion_tokens == ref_usage.completion_tokens
    assert outs[0][1].prompt_tokens_details.cached_tokens == 0
    # A repeat is a whole-prompt hit: every prompt token's KV and the last position's
    # log-probabilities come from the cache; no forward pass runs for the first token.
    assert outs[1][1].prompt_tokens_details.cached_tokens == outs[1][1].prompt_tokens
    assert outs[2][1].prompt_tokens_details.cached_tokens == outs[2][1].prompt_tokens


def _sampled(s: ServerProcess, prompt: str, **kw):
    r = _client(s).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, logprobs=3, **kw)
    lp = r.choices[0].logprobs
    return r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs, r.usage


def test_whole_prompt_hit_is_exact_for_seeded_sampling_and_logprobs(servers):
    cached, plain = servers
    prompt = "Seeded sampling check. Write a short line about the sea and the wind:"
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    ref = _sampled(plain, prompt, **kw)
    cold = _sampled(cached, prompt, **kw)
    warm = _sampled(cached, prompt, **kw)
    assert warm[4].prompt_tokens_details.cached_tokens == warm[4].prompt_tokens
    for got in (cold, warm):
        assert got[0] == ref[0]
        assert got[1] == ref[1]
        assert got[2] == pytest.approx(ref[2], abs=1e-6)
        assert got[3] == ref[3]


def test_penalised_repeat_runs_the_model_and_stays_exact(servers):
    # Penalties change the first token's logits per request: stored log-probabilities must not be used.
    cached, plain = servers
    prompt = "Penalty check: repeat the word echo as many times as you can: echo echo"
    kw = {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    _complete(cached, prompt, max_tokens=4)  # leaves the unpenalised log-probabilities behind
    r = _client(cached).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, **kw)
    ref = _client(plain).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, **kw)
    assert r.choices[0].text == ref.choices[0].text
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_prompt_plus_suffix(servers):
    cached, plain = servers
    base = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 3
    _complete(cached, base)
    text, usage = _complete(cached, base + "told stories about the storm of the century.")
    ref, _ = _complete(plain, base + "told stories about the storm of the century.")
    assert text == ref
    assert usage.prompt_tokens_details.cached_tokens >= 32


def test_multi_turn_chat_hits_previous_turn(servers):
    cached, plain = servers
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    reply, _ = _chat(cached, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now name a fruit of that colour."}]
    text, usage = _chat(cached, turn2)
    ref, _ = _chat(plain, turn2)
    assert text == ref
    # everything up to the new message was cached (system prompt + turn 1)
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 40


def test_middle_changed_prompt(servers):
    cached, plain = servers
    lines = [f"Line {i}: the value of item {i} is {i * 7 % 13}." for i in range(30)]
    p1 = "\n".join(lines) + "\nSum the values of items 3 and 4:"
    lines[15] = "Line 15: the value of item 15 is 99."
    p2 = "\n".join(lines) + "\nSum the values of items 3 and 4:"
    _complete(cached, p1)
    text, usage = _complete(cached, p2)
    ref, _ = _complete(plain, p2)
    assert text == ref
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens - 32


def test_short_prompt_shorter_than_a_block_hits(servers):
    cached, plain = servers
    prompt = "A short note: the capital of France is"
    a, _ = _complete(cached, prompt, max_tokens=8)
    b, usage = _complete(cached, prompt, max_tokens=8)
    assert a == b == _complete(plain, prompt, max_tokens=8)[0]
    assert usage.prompt_tokens < 32  # shorter than one block
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


def test_eight_concurrent_requests_sharing_a_prefix(servers):
    cached, plain = servers
    questions = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(8)]
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    _chat(cached, msgs[0], max_tokens=4)  # warm the shared prefix
    results: list = [None] * 8

    def run(i):
        results[i] = _chat(cached, msgs[i], max_tokens=24)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        assert results[i] == _chat(plain, msgs[i], max_tokens=24)[0], i


def test_cache_stats_report_hits(servers):
    cached, _ = servers
    stats = httpx.get(cached.url + "/v1/cache/stats").json()["models"][MODEL_ID]
    assert stats["enabled"] is True
    hot = stats["hot"]
    assert hot["num_hits"] > 0 and hot["num_cached_tokens"] > 0 and hot["num_bytes"] > 0
    assert hot["num_bytes"] <= hot["max_bytes"]
    assert hot["num_whole_prompt_hits"] > 0 and hot["num_next_logprobs"] > 0


# ---- a long first prompt is never lost (issue 27) --------------------------------------------

LONG_SYSTEM = "".join(f"Rule {i}: when a request touches module number {i}, read its tests first, keep "
                      f"its public names, and write down why in the review note. " for i in range(30))


def _recent(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/v1/admin/recent?limit=20", timeout=30).json()


def test_an_aborted_long_prefill_is_resumed_by_its_retries_and_prefilled_once(servers):
    """A client leaves mid-prefill (the real openai SDK closes its stream); its blocks stay cached:
    two concurrent retries of the prompt resume from them and from each other, their greedy output
    equals a server without cache, and over the three attempts each prompt token ran through the
    model about once (``num_prefilled_tokens`` in ``/v1/admin/recent``)."""
    import time

    cached, plain = servers
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Which rule covers module 7?"}]
    ref, ref_usage = _chat(plain, msgs, max_tokens=24)
    assert ref_usage.prompt_tokens > 1000
    known = {r["request_id"] for r in _recent(cached)["requests"]}
    stream = _client(cached).chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0, max_tokens=24,
                                                     seed=1, stream=True)
    row, deadline = None, time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = _recent(cached)["prefilling"]
        if rows and rows[0]["num_prefilled_tokens"] >= 256:
            row = rows[0]
            break
        time.sleep(0.05)
    stream.close()  # the client leaves mid-prefill
    assert row is not None, "the prompt was never seen prefilling with 256 tokens done"
    # at most the chat template's opening hits (a tail another test's prompt left): not a block
    assert row["num_prompt_tokens"] == ref_usage.prompt_tokens and row["num_cached_tokens"] < 32, row
    assert row["num_done_tokens"] == row["num_cached_tokens"] + row["num_prefilled_tokens"], row
    assert 0 < row["progress"] < 1 and row["tokens_per_s"] > 0 and row["eta_s"] > 0, row
    aborted = None
    while time.monotonic() < deadline and aborted is None:
        aborted = next((r for r in _recent(cached)["requests"] if r["request_id"] not in known), None)
        time.sleep(0.05)
    assert aborted is not None and aborted["outcome"] == "abort", aborted
    assert 256 <= aborted["num_prefilled_tokens"] < ref_usage.prompt_tokens
    known.add(aborted["request_id"])

    out: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _chat(cached, msgs, max_tokens=24)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    (text_a, usage_a), (text_b, usage_b) = out
    assert text_a == ref and text_b == ref
    first, second = sorted([usage_a, usage_b], key=lambda u: u.prompt_tokens_details.cached_tokens)
    assert first.prompt_tokens_details.cached_tokens >= aborted["num_prefilled_tokens"] // 32 * 32
    assert second.prompt_tokens_details.cached_tokens >= ref_usage.prompt_tokens // 32 * 32 - 1
    retries = [r for r in _recent(cached)["requests"] if r["request_id"] not in known]
    assert len(retries) == 2 and all(r["outcome"] in ("stop", "length") for r in retries), retries
    for r in retries:
        assert r["num_prefilled_tokens"] == r["num_prompt_tokens"] - r["num_cached_tokens"]
    total = aborted["num_prefilled_tokens"] + sum(r["num_prefilled_tokens"] for r in retries)
    assert total <= ref_usage.prompt_tokens + 32  # the second retry redoes at most the first's partial block

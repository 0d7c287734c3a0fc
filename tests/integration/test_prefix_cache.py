"""Exactness of the hot prefix cache with the real model: greedy output with any cache hit equals
the output of a server running without the cache, token for token."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess

SYSTEM = (
    "You are a careful assistant for a software team. Follow the house rules: answer briefly, "
    "prefer lists, cite file names in backticks, never invent APIs, and say when unsure. "
) * 12
QUESTION = "List five prime numbers and explain each in one line."


@pytest.fixture(scope="module")
def servers():
    # RAM tier only: the shared test home's SSD tier would turn the first (cold) request into a hit.
    cached = ServerProcess(["--block-size", "32", "--no-ssd-cache"])
    plain = ServerProcess(["--no-cache"])
    cached.start()
    try:
        plain.start()
    except Exception:
        cached.stop()
        raise
    yield cached, plain
    cached.stop()
    plain.stop()


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
    assert outs[1][1].prompt_tokens_details.cached_tokens == outs[1][1].prompt_tokens - 1
    assert outs[2][1].prompt_tokens_details.cached_tokens == outs[2][1].prompt_tokens - 1


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
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


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
    assert hot["num_hits"] > 0 and hot["num_hit_tokens"] > 0 and hot["num_bytes"] > 0
    assert hot["num_bytes"] <= hot["max_bytes"]

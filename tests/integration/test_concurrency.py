"""Continuous batching with the real model: batched output equals single-request output,
disconnects free their batch row, a full queue answers 429, long prefills send keep-alives."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess

PROMPTS = [
    "Name a planet.", "What is 2+2?", "Say a colour.", "Name a fruit.",
    "Write one word about the sea.", "What is the opposite of hot?", "Name an animal.", "Count to three.",
]


@pytest.fixture(scope="module")
def srv():
    with ServerProcess(["--no-cache"], env={"OMLX_KEEPALIVE_S": "0.2"}) as s:
        yield s


def _client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _stream_text(client, prompt: str) -> str:
    chunks = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=32, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _running(s) -> int:
    m = httpx.get(s.url + "/health").json()["models"][0]
    return m["running"] + m["waiting"]


def test_eight_concurrent_greedy_streams_equal_single_requests(srv):
    client = _client(srv)
    single = [_stream_text(client, p) for p in PROMPTS]
    out: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def run(i):
        start.wait()
        out[i] = _stream_text(client, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == single


def test_client_disconnect_frees_its_batch_row(srv):
    body = {"model": MODEL_ID, "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}]}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n >= 3:
                break
        assert _running(srv) == 1
    deadline = time.monotonic() + 15
    while _running(srv) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(srv) == 0, "the aborted request still holds its batch row"
    r = _client(srv).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_keepalive_comments_during_long_prefill(srv):
    long_prompt = "This sentence is part of a very long document about caching. " * 300
    body = {"model": MODEL_ID, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": long_prompt + "Summarize."}]}
    lines = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
        lines = [line for line in r.iter_lines() if line]
    first_content = next(i for i, l in enumerate(lines) if l.startswith("data: ") and '"content":"' in l and '"role"' not in l)
    assert any(l.startswith(": keep-alive") for l in lines[:first_content]), lines[:10]
    assert lines[-1] == "data: [DONE]"


def test_queue_overflow_gets_429_with_retry_after():
    with ServerProcess(["--max-concurrent-requests", "1", "--max-queued-requests", "1", "--no-cache"]) as s:
        body = {"model": MODEL_ID, "stream": True, "max_tokens": 300, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        statuses: list[int] = []
        holders = []
        for _ in range(2):  # one running, one waiting
            cm = httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120)
            holders.append(cm)
            r = cm.__enter__()
            statuses.append(r.status_code)
        time.sleep(0.5)
        r3 = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False})
        for cm in holders:
            cm.__exit__(None, None, None)
        assert statuses == [200, 200]
        assert r3.status_code == 429
        assert int(r3.headers["retry-after"]) >= 1
        assert r3.json()["error"]["type"] == "rate_limit_error"
        deadline = time.monotonic() + 15
        while _running(s) and time.monotonic() < deadline:
            time.sleep(0.1)
        ok = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200

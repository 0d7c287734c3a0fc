"""Fault isolation: an exception inside one request's generation fails that request only.

The server runs with the test-only hook ``OMLX_TEST_FAULT`` (omlx/engine/faults.py): a request
with seed 101 gets a logits processor that raises, seed 102 fails while its first token is
detokenized, seed 103 makes the batched forward pass raise once while it is in the batch. Each
faulted request is sent together with plain greedy requests in the same batch; those must
finish with exactly the text they give without any fault.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import MODEL_ID, ServerProcess

FAULTS = "processor:seed=101,detokenize:seed=102,forward:seed=103"
PROMPTS = ["Name three colors.", "Count from one to five.", "Say hello politely.", "What is two plus two?"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-concurrent-requests", "8"], env={"OMLX_TEST_FAULT": FAULTS}) as s:
        yield s


def _chat(url: str, prompt: str, seed: int | None = None, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if seed is not None:
        body["seed"] = seed
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def baseline(server) -> dict[str, str]:
    out = {}
    for p in PROMPTS:
        r = _chat(server.url, p)
        assert r.status_code == 200, r.text
        out[p] = r.json()["choices"][0]["message"]["content"]
    return out


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()["models"][0]


def _batch_with(server, seed: int, victim: str = "Tell me a story.", stream: bool = False):
    with ThreadPoolExecutor(len(PROMPTS) + 1) as ex:
        futs = [ex.submit(_chat, server.url, p) for p in PROMPTS]
        bad = ex.submit(_chat, server.url, victim, seed, stream)
        return [f.result() for f in futs], bad.result()


@pytest.mark.parametrize("seed", [101, 102], ids=["processor", "detokenize"])
def test_attributed_fault_fails_only_its_request(server, baseline, seed):
    before = _health(server.url)
    others, bad = _batch_with(server, seed)
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "injected" in err["message"], err
    for p, r in zip(PROMPTS, others):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == baseline[p]
    after = _health(server.url)
    assert after["alive"] and after["active"] == 0 and after["running"] == 0
    assert after["request_failures"] == before["request_failures"] + 1
    assert after["batch_failures"] == before["batch_failures"]  # nobody else was disturbed


def test_attributed_fault_while_streaming_is_an_error_event(server, baseline):
    others, bad = _batch_with(server, 101, stream=True)
    assert bad.status_code == 200  # the stream had started: the error arrives as an event
    assert '"error"' in bad.text and "injected" in bad.text and bad.text.rstrip().endswith("data: [DONE]")
    assert all(r.status_code == 200 for r in others)


def test_forward_fault_retries_the_batch(server, baseline):
    before = _health(server.url)
    others, victim = _batch_with(server, 103)
    assert victim.status_code == 200, victim.text  # retried, not failed
    for p, r in zip(PROMPTS, others):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == baseline[p]
    after = _health(server.url)
    assert after["batch_failures"] == before["batch_failures"] + 1
    assert after["retried_requests"] > before["retried_requests"]
    assert after["request_failures"] == before["request_failures"]
    assert after["active"] == 0 and after["alive"]
    assert "injected forward fault" in server.log()


def test_server_serves_after_faults(server, baseline):
    r = _chat(server.url, PROMPTS[0])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == baseline[PROMPTS[0]]

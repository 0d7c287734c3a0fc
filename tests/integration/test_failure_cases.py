"""The bad_input, params and concurrency cases of shared/cases/failure-cases.jsonl, each a test,
replayed as written against a real server (the ``memory`` case is in test_model_pool.py).

Each test reads its case by id and sends the case's own requests; the model name in them
(``local-model``) is an alias of the embedded SmolLM2.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import MODEL_ID, ServerProcess

CASE_FILES = (Path(__file__).resolve().parents[3] / "shared" / "cases" / "failure-cases.jsonl",
              Path("/work/shared/cases/failure-cases.jsonl"))


def case(case_id: str) -> dict:
    for p in CASE_FILES:
        if p.exists():
            for line in p.read_text().splitlines():
                if line.strip() and json.loads(line)["id"] == case_id:
                    return json.loads(line)
            pytest.fail(f"case {case_id} is not in {p}")
    pytest.skip("shared/cases/failure-cases.jsonl is not available")


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--alias", f"local-model={MODEL_ID}"]) as s:
        yield s


def test_malformed_json_body_returns_400_in_the_routes_shape(server):
    c = case("malformed-json-body-returns-500")
    for req in c["repro"]["requests"]:
        r = httpx.request(req["method"], server.url + req["path"], content=req["raw_body"].encode(),
                          headers=req["headers"], timeout=30)
        assert r.status_code == 400, (req["path"], r.status_code, r.text)
        body = r.json()  # JSON even on errors
        if req["path"] == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_n_other_than_one_is_400_naming_n(server):
    c = case("n-nonpositive-silently-accepted")
    for body in c["repro"]["bodies"]:
        r = httpx.post(server.url + c["repro"]["path"], json=body, timeout=60)
        if body["n"] == 2:  # the case allows 2 choices or a 400 with the envelope; never 200 with an error
            assert r.status_code == 400 or len(r.json()["choices"]) == 2, r.text
            if r.status_code == 200:
                assert "error" not in r.json()
        else:
            assert r.status_code == 400, (body["n"], r.text)
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "n" and err["code"] is None, err


def test_streamed_logprobs_arrive_in_every_content_chunk(server):
    c = case("logprobs-dropped-when-streaming")
    body = {**c["repro"]["body"], "stream_options": {"include_usage": True}}
    entries, usage, content_chunks = [], None, 0
    with httpx.stream("POST", server.url + c["repro"]["path"], json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                if ch["delta"].get("content"):
                    content_chunks += 1
                    lp = ch["logprobs"]["content"]
                    assert lp, ch
                    entries.extend(lp)
    assert content_chunks > 0
    assert len(entries) == usage["completion_tokens"]
    for e in entries:
        assert isinstance(e["token"], str) and e["logprob"] <= 0 and all(isinstance(b, int) for b in e["bytes"])
        assert len(e["top_logprobs"]) == 2
        assert all({"token", "logprob", "bytes"} <= set(t) for t in e["top_logprobs"])


def test_mixed_sampling_in_one_batch_keeps_the_thread_alive(server):
    c = case("mixed-sampling-batch-kills-generation-thread")
    text = (Path(__file__).resolve().parents[1] / "data" / "perplexity_paragraph.txt").read_text()

    def body(spec: dict, num_words: int) -> dict:
        b = json.loads(json.dumps(spec["body"]))
        words = (text.split() * 100)[:num_words]
        b["messages"][0]["content"] = " ".join(words) + " Summarize."
        return b

    # about 4000 and 2000 tokens of text, as the case says (roughly 0.75 words per token here)
    a, b = body(c["repro"]["A"], 3000), body(c["repro"]["B"], 1500)
    with ThreadPoolExecutor(2) as ex:
        fa = ex.submit(httpx.post, server.url + "/v1/chat/completions", json=a, timeout=600)
        time.sleep(1.0)  # B arrives while A is still in prefill
        fb = ex.submit(httpx.post, server.url + "/v1/chat/completions", json=b, timeout=600)
        ra, rb = fa.result(), fb.result()
    for r in (ra, rb):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    nxt = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                     json={"model": "local-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert nxt.status_code == 200
    m = httpx.get(server.url + "/health", timeout=10).json()["models"][0]
    assert m["alive"] and m["batch_failures"] == 0 and m["request_failures"] == 0, m

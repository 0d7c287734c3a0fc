"""Fuzzing a real server: schemathesis against its own /openapi.json, then hypothesis-made JSON
bodies for the generation routes.

Every answer must be a success or the route's own error shape with a 4xx; never a 5xx; the
server stays up and its RSS stays flat (measured before and after). Generation is cut to 4
tokens by the model's ``max_output_tokens`` (config.toml), so examples are cheap; example counts
are bounded so this module takes about two minutes on 2 cores. The counts and RSS figures are
written to ``<test home>/reliability/fuzz.json`` (docs/RELIABILITY.md quotes a run).
"""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from omlx.api.openapi import openapi_document
from tests.fake_hub import FakeHub
from tests.helpers import MODEL_ID, TEST_HOME, ServerProcess

SCHEMATHESIS_EXAMPLES = 10  # per operation (27 operations)
BODY_EXAMPLES = 30  # per generation route
# RSS growth allowed beyond the KV bytes the hot cache holds (bounded at 64 MB here)
RSS_GROWTH_LIMIT_BYTES = 48 * 1024 * 1024
STATS = {"schemathesis_requests": 0, "fuzz_requests": 0, "status_counts": {}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz-home")
    (home / "config.toml").write_text(f'[models."{MODEL_ID}"]\nmax_output_tokens = 4\n')
    env = {"OMLX_HOT_CACHE_MAX_SIZE": "64MB", "OMLX_SSD_CACHE_ENABLED": "0", "OMLX_KEEPALIVE_S": "30"}
    # POST /v1/admin/pulls asks a hub: a fake one with no repos answers every repo with a 404
    # (no hub reachable would be a 502, which is right but not a client's mistake)
    with FakeHub([]) as hub, ServerProcess(base_path=home, env={**env, "HF_ENDPOINT": hub.url,
                                                                "HF_HUB_CACHE": str(home / "hub")}) as s:
        for _ in range(3):  # warm every path once before the RSS baseline
            httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        s.rss_before = psutil.Process(s.proc.pid).memory_info().rss
        s.kv_before = _hot_kv_bytes(s)
        yield s
        rss_after = psutil.Process(s.proc.pid).memory_info().rss if s.proc.poll() is None else None
        out = TEST_HOME / "reliability"
        out.mkdir(parents=True, exist_ok=True)
        (out / "fuzz.json").write_text(json.dumps({**STATS, "rss_before_bytes": s.rss_before, "rss_after_bytes": rss_after,
                                                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))


def _hot_kv_bytes(server) -> int:
    hot = httpx.get(server.url + "/v1/cache/stats", timeout=10).json()["models"][MODEL_ID].get("hot") or {}
    return hot.get("num_bytes", 0)


def _count(status: int) -> None:
    STATS["status_counts"][str(status)] = STATS["status_counts"].get(str(status), 0) + 1


@pytest.fixture(scope="module")
def api_schema(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert {k: v for k, v in doc.items() if k != "servers"} == openapi_document()
    # Steer the fuzzer to the served model (and one unknown name) so bodies reach generation
    # instead of stopping at the model lookup.
    models = {"enum": [MODEL_ID, "no-such-model"]}
    for name in ("ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = models
    return schemathesis.openapi.from_dict(doc)


def _error_shape_check(ctx, response, case) -> bool | None:
    """A 4xx carries the route's error JSON."""
    if 400 <= response.status_code < 500 and case.method.upper() != "HEAD":
        body = json.loads(response.content)
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
        else:
            assert {"message", "type"} <= set(body["error"]), body
    return None


OPERATIONS = [(path, method) for path, ops in openapi_document()["paths"].items() for method in ops]


@pytest.mark.parametrize("path,method", OPERATIONS, ids=[f"{m.upper()} {p}" for p, m in OPERATIONS])
def test_schemathesis(server, api_schema, path, method):
    op = api_schema[path][method.upper()]
    strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)
    session = requests.Session()

    @settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def run(case):
        STATS["schemathesis_requests"] += 1
        resp = case.call_and_validate(base_url=server.url, session=session, timeout=60,
                                      checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                              response_schema_conformance],
                                      additional_checks=[_error_shape_check])
        _count(resp.status_code)

    try:
        run()
    finally:
        session.close()


# ---- hypothesis: JSON bodies -----------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
MSG = {"role": "user", "content": "hi"}
BASES = {
    "/v1/chat/completions": {"model": MODEL_ID, "messages": [MSG], "max_tokens": 4},
    "/v1/completions": {"model": MODEL_ID, "prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"model": MODEL_ID, "messages": [MSG], "max_tokens": 4},
    "/v1/responses": {"model": MODEL_ID, "input": "hi", "max_output_tokens": 4},
    "/v1/embeddings": {"model": MODEL_ID, "input": "hi"},
}
FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "max_completion_tokens", "stream",
          "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_sequences", "n", "logprobs",
          "top_logprobs", "logit_bias", "tools", "tool_choice", "system", "thinking", "instructions", "previous_response_id",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "response_format", "encoding_format",
          "dimensions", "chat_template_kwargs", "metadata", "include", "reasoning", "content", "role"]


@st.composite
def bodies(draw, path: str):
    """A valid body with some fields replaced by arbitrary JSON, or arbitrary JSON outright."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = dict(BASES[path])
    for key in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=8), max_size=3)):
        if draw(st.booleans()):
            body[key] = draw(JSON)
        else:
            body.pop(key, None)
    if draw(st.integers(0, 3)) == 0:  # a message with an odd shape
        body["messages"] = [draw(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), JSON, max_size=3))]
    return body


def _check_answer(path: str, resp: httpx.Response) -> None:
    _count(resp.status_code)
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error"
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert "server_error" not in resp.text and "api_error" not in resp.text, resp.text[-500:]


@pytest.mark.parametrize("path", list(BASES))
def test_fuzz_json_bodies(server, path):
    client = httpx.Client(timeout=60)

    @settings(max_examples=BODY_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies(path))
    def run(body):
        STATS["fuzz_requests"] += 1
        hdrs = {"anthropic-version": "2023-06-01"} if path == "/v1/messages" else {}
        t0 = time.perf_counter()
        resp = client.post(server.url + path, content=json.dumps(body, allow_nan=False), headers=hdrs)
        took = time.perf_counter() - t0
        if took > 1.0:
            STATS.setdefault("slow", []).append([path, round(took, 2), resp.status_code, json.dumps(body)[:300]])
        _check_answer(path, resp)

    try:
        run()
    finally:
        client.close()


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"model": "' + b"a" * 5000 + b'"}',
                                 b"[" * 100000, b'{"messages": "\\ud800"}'],
                         ids=["empty", "truncated", "array", "null", "not-utf8", "long-model", "deep", "lone-surrogate"])
@pytest.mark.parametrize("path", list(BASES))
def test_raw_bodies(server, path, raw):
    STATS["fuzz_requests"] += 1
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    _check_answer(path, r)
    assert r.status_code in (400, 404, 413), r.text


def test_server_is_up_and_rss_is_flat(server):
    """Runs last in this module: the server still answers, nothing is running, RSS is flat."""
    r = httpx.post(server.url + "/v1/chat/completions", json={**BASES["/v1/chat/completions"]}, timeout=60)
    assert r.status_code == 200, r.text
    health = httpx.get(server.url + "/health", timeout=10).json()
    m = health["models"][0]
    assert health["status"] == "ok" and (m["active"], m["running"], m["waiting"]) == (0, 0, 0), health
    assert m["batch_failures"] == 0 and m["request_failures"] == 0, m
    rss = psutil.Process(server.proc.pid).memory_info().rss
    kv = _hot_kv_bytes(server)
    STATS.update(rss_growth_bytes=rss - server.rss_before, hot_kv_growth_bytes=kv - server.kv_before)
    assert (rss - server.rss_before) - (kv - server.kv_before) < RSS_GROWTH_LIMIT_BYTES, (server.rss_before, rss, kv)
    assert "Traceback" not in server.log(), server.log()

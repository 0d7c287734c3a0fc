"""``GET /metrics``: the Prometheus exposition parses with prometheus-client's own parser, its
counters and histograms move with real traffic, and it needs the API key when one is set."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess, metric_samples, metric_value as value

KEY = "metrics-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--api-key", KEY, "--block-size", "32", "--no-ssd-cache"]) as s:
        yield s


def scrape(s: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return metric_samples(s, AUTH)


def test_metrics_need_the_api_key(server):
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 401
    assert "API key" in r.json()["error"]["message"]


def test_counters_move_with_traffic(server):
    before = scrape(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    prompt = "Tell me about rivers and mountains. " * 12  # > 2 blocks of 32 tokens: the repeat hits
    usages = []
    for _ in range(2):
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0)
        usages.append(r.usage)
    after = scrape(server)
    m = MODEL_ID
    assert value(after, "omlx_requests_total", model=m, outcome="length") - \
        value(before, "omlx_requests_total", model=m, outcome="length") == 2
    assert value(after, "omlx_prompt_tokens_total", model=m) - value(before, "omlx_prompt_tokens_total", model=m) \
        == sum(u.prompt_tokens for u in usages)
    assert value(after, "omlx_completion_tokens_total", model=m) - \
        value(before, "omlx_completion_tokens_total", model=m) == sum(u.completion_tokens for u in usages)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached > 0
    assert value(after, "omlx_cached_prompt_tokens_total", model=m, tier="hot") - \
        value(before, "omlx_cached_prompt_tokens_total", model=m, tier="hot") == cached
    assert value(after, "omlx_ttft_seconds_count", model=m) - value(before, "omlx_ttft_seconds_count", model=m) == 2
    assert value(after, "omlx_tpot_seconds_count", model=m) - value(before, "omlx_tpot_seconds_count", model=m) == 2
    # live figures read at scrape time: the hot tier's lookups and hits, its bytes, memory, queue
    assert value(after, "omlx_cache_lookups_total", model=m, tier="hot") > \
        value(before, "omlx_cache_lookups_total", model=m, tier="hot")
    assert value(after, "omlx_cache_hits_total", model=m, tier="hot") > \
        value(before, "omlx_cache_hits_total", model=m, tier="hot")
    assert value(after, "omlx_cache_bytes", model=m, tier="hot") > 0
    assert value(after, "omlx_memory_bytes", kind="used") > 0
    assert 0 < value(after, "omlx_memory_bytes", kind="soft") <= value(after, "omlx_memory_bytes", kind="ceiling")
    assert (("omlx_queue_depth", (("model", m),)) in after)
    assert value(after, "omlx_model_loaded", model=m, pinned="false") == 1
    # leases the pool only dropped at their 120 s expiry (each one a request path that leaked it)
    assert ("omlx_leases_expired_total", (("model", m),)) in after
    assert value(after, "omlx_leases_expired_total", model=m) == 0


def test_recent_requests_list_the_traffic(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3)
    r = httpx.get(server.url + "/v1/admin/recent?limit=1", headers=AUTH, timeout=30)
    assert r.status_code == 200
    (row,) = r.json()["requests"]
    assert row["model"] == MODEL_ID and row["num_completion_tokens"] >= 1 and row["ttft_ms"] > 0
    # a fresh prompt: every prompt token ran through the model (none came from the cache)
    assert row["num_prefilled_tokens"] == row["num_prompt_tokens"] - row["num_cached_tokens"] > 0
    assert r.json()["prefilling"] == []  # nothing is prefilling now
    bad = httpx.get(server.url + "/v1/admin/recent?limit=abc", headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

"""`omlx serve --cluster` alone (no peers, mDNS off): the one-node plan still serves, through the front.

The node plans SmolLM2 onto itself (one stage, all 30 layers), its agent starts the rank-0
worker on a loopback port, and the public port forwards to it: the real `openai` and `anthropic`
SDKs, streaming included, with the API key checked. Killing the worker gives a 503
`cluster_unavailable` with Retry-After naming the exit; the coordinator then restarts the
pipeline in a new epoch and the same request gives the same greedy text. Runs without root.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess, default_model_dir, free_port

KEY = "front-test-key"
PROMPT = "Name one colour."


def wait_ready(url: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        r = httpx.get(url + "/health", timeout=5)
        body = r.json()
        if r.status_code == 200:
            return body
        assert r.status_code == 503 and body["cluster"]["status"] == "unavailable", body
        time.sleep(0.25)
    raise AssertionError(f"the cluster front did not become ready in {timeout_s} s: {body}")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("cluster-front")
    cfg = home / "cluster.toml"
    cfg.write_text("[cluster]\nmdns = false\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 2.0\n"
                   f"control_port = {free_port()}\nworker_port = {free_port()}\n")
    args = ["--cluster", "--cluster-secret", "front-test-secret", "--api-key", KEY, "--config", str(cfg),
            "--model", str(default_model_dir())]
    with ServerProcess(args, base_path=home) as s:
        yield s


def chat(url: str, **kw) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}],
                                       temperature=0, max_tokens=8, **kw)
    if kw.get("stream"):
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content or ""


def test_a_one_node_plan_serves_through_the_front(front: ServerProcess) -> None:
    health = wait_ready(front.url)
    w = health["cluster"]["worker"]
    assert w["num_ranks"] == 1 and w["rank"] == 0 and w["ranges"] == [[0, 30]] and w["state"] == "ready", w
    assert w["http_port"] != front.port and "--api-key" not in w["command"]  # the key travels in the env
    r = httpx.post(front.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    text = chat(front.url)
    assert text and chat(front.url, stream=True) == text
    # Errors of the worker pass through in the protocol's own shape.
    client = anthropic.Anthropic(base_url=front.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and "no-such-model" in e.value.body["error"]["message"]


def test_a_dead_worker_is_a_clear_503_then_the_pipeline_restarts(front: ServerProcess) -> None:
    health = wait_ready(front.url)
    text = chat(front.url)
    epoch = health["cluster"]["epoch"]
    os.kill(health["cluster"]["worker"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # until the launcher has seen the exit (it polls every 0.25 s)
        r = httpx.post(front.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        if r.status_code == 503 and "exited with code -9" in r.json()["error"]["message"]:
            break
        assert r.status_code in (200, 503) and time.monotonic() < deadline, r.text
        time.sleep(0.1)
    err = r.json()["error"]
    assert err["code"] == "cluster_unavailable" and int(r.headers["retry-after"]) > 0, r.text
    health = wait_ready(front.url)
    assert health["cluster"]["epoch"] > epoch and health["cluster"]["worker"]["state"] == "ready"
    assert chat(front.url) == text

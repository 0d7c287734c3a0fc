"""`omlx serve --cluster` alone (no peers, mDNS off): the one-node plan still serves, through the front.

The node plans SmolLM2 onto itself (one stage, all 30 layers), its agent starts the rank-0
worker on a loopback port, and the public port forwards to it: the real `openai` and `anthropic`
SDKs, streaming included, with the API key checked. Killing the worker gives a 503
`cluster_unavailable` with Retry-After naming the exit; the coordinator then restarts the
pipeline in a new epoch and the same request gives the same greedy text. Killing the worker in
the middle of a streamed response ends the stream with the protocol's own error event (the SDKs
raise, or see ``response.failed``), not a silent end. Runs without root.
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
LONG_PROMPT = "Write a long story about a dragon who learns to cook, in many chapters."
LONG_MAX_TOKENS = 1000  # long enough that the kill lands mid-response (it is sent at the first text)


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
    # rank 0 batches as many sequences as the serve's setting (default 8), which the plan's KV reserve assumes
    assert "--max-concurrent-requests 8" in w["command"], w["command"]
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


def stream_and_kill(url: str, protocol: str, pid: int) -> tuple[str, object]:
    """Stream a long generation with the real SDK, SIGKILL rank 0's worker at the first text;
    returns (the text received, what ended the stream: the raised error or the last event)."""
    text: list[str] = []

    def got(piece: str | None) -> None:
        if piece and not "".join(text):
            os.kill(pid, signal.SIGKILL)
        text.append(piece or "")

    msgs = [{"role": "user", "content": LONG_PROMPT}]
    if protocol == "anthropic":
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        try:
            for ev in client.messages.create(model=MODEL_ID, messages=msgs, max_tokens=LONG_MAX_TOKENS, stream=True):
                if ev.type == "content_block_delta":
                    got(ev.delta.text)
        except anthropic.APIStatusError as e:
            return "".join(text), e
        return "".join(text), None
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    if protocol == "responses":
        last = None
        for last in client.responses.create(model=MODEL_ID, input=LONG_PROMPT, max_output_tokens=LONG_MAX_TOKENS,
                                            temperature=0, stream=True):
            if last.type == "response.output_text.delta":
                got(last.delta)
        return "".join(text), last
    try:
        for chunk in client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=LONG_MAX_TOKENS,
                                                    temperature=0, stream=True):
            if chunk.choices:
                got(chunk.choices[0].delta.content)
    except openai.APIError as e:
        return "".join(text), e
    return "".join(text), None


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "responses"])
def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event(front: ServerProcess, protocol: str) -> None:
    health = wait_ready(front.url)
    text, end = stream_and_kill(front.url, protocol, health["cluster"]["worker"]["pid"])
    assert text, f"no text before the stream ended: {end!r}"
    if protocol == "openai":
        assert isinstance(end, openai.APIError), f"the stream ended without an error after {text!r}"
        body = end.body
        assert body["code"] == "cluster_unavailable" and body["type"] == "server_error", body
        message = body["message"]
    elif protocol == "anthropic":
        assert isinstance(end, anthropic.APIStatusError), f"the stream ended without an error after {text!r}"
        body = end.body
        assert body["type"] == "error" and body["error"]["type"] == "api_error", body
        message = body["error"]["message"]
    else:
        assert end is not None and end.type == "response.failed", f"last event {end!r} after {text!r}"
        assert end.response.status == "failed" and end.response.error.code == "cluster_unavailable", end
        message = end.response.error.message
    assert "lost mid-response" in message and "exited with code -9" in message, message
    wait_ready(front.url)  # the coordinator restarts the pipeline for the next test

"""Cluster mode's data plane: real `omlx cluster worker` processes on one machine, ring over TCP.

Two and three ranks on 127.0.0.1 (each rank its own port in the hostfile) split the real SmolLM2
(30 layers) by the planner and by uneven hand-picked ranges; rank 0 serves the HTTP API. Greedy
output through the API must be token-for-token the single-node output (compared with logprobs,
so token ids and their log-probabilities, not only text). A killed rank and a frozen rank must
give a 503 with a clear message within the step timeout, never a hang, and `/health` turns 503.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omlx.cluster.group import write_hostfile
from omlx.cluster.layer_bytes import activation_bytes_per_token, read_layout
from omlx.cluster.plan import PlanRequest, parse_nodes_spec, plan_pipeline
from tests.helpers import MODEL_ID, ServerProcess, default_model_dir, free_port

TIMEOUT_S = 6.0  # the workers' step timeout; a frozen peer must be reported within it
PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
]


def chat_body(prompt: str, **kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 16, "logprobs": True, **kw}


def greedy(url: str, prompt: str) -> tuple[str, list[tuple[str, float]]]:
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(prompt), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]


def greedy_stream(url: str, prompt: str) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(prompt, stream=True, logprobs=False),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        import json

        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text.append(c["delta"].get("content") or "")
    return "".join(text)


class Cluster:
    """`python -m omlx.cli.cluster_worker` once per rank, rank 0 serving HTTP on a free port."""

    def __init__(self, tmp: Path, ranges: str):
        self.ranges = ranges
        self.num_ranks = len(ranges.split(","))
        self.port = free_port()
        self.hostfile = write_hostfile(tmp / "hostfile.json", [("127.0.0.1", free_port()) for _ in range(self.num_ranks)])
        self.base = tmp / "home"
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp / f"rank{r}.log" for r in range(self.num_ranks)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180) -> Cluster:
        self.base.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMLX_LOG_LEVEL": "INFO"}
        for r in range(self.num_ranks):
            cmd = [sys.executable, "-m", "omlx.cli.cluster_worker", "--model", str(default_model_dir()),
                   "--ranges", self.ranges, "--rank", str(r), "--hostfile", str(self.hostfile),
                   "--port", str(self.port), "--base-path", str(self.base), "--timeout-s", str(TIMEOUT_S)]
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{self.log(r)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"cluster did not become ready in {timeout_s}s:\n{self.log(0)}")

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()[-6000:]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture(scope="module")
def reference():
    """Single-node greedy outputs of PROMPTS, from a plain `omlx serve` without the prefix cache."""
    with ServerProcess(["--no-cache", "--max-concurrent-requests", "1"]) as s:
        return {p: greedy(s.url, p) for p in PROMPTS}, greedy_stream(s.url, PROMPTS[0])


def planner_ranges(num_nodes_spec: str) -> str:
    model = default_model_dir()
    layout = read_layout(model)
    nodes = parse_nodes_spec(num_nodes_spec, headroom_bytes=0)
    plan = plan_pipeline(layout, nodes, PlanRequest(2048, 1, activation_bytes_per_token(model)))
    return ",".join(f"{s.layer_start}:{s.layer_end}" for s in plan.stages)


def test_two_ranks_planned_split_matches_single_node_then_survives_nothing_when_a_rank_dies(tmp_path, reference):
    # Unequal nodes: the planner gives the smaller node fewer layers than an even 15/15 split.
    ranges = planner_ranges("small:0.30GB:50GB/s,big:0.60GB:100GB/s")
    first, second = (tuple(map(int, r.split(":"))) for r in ranges.split(","))
    assert first[0] == 0 and second[1] == 30 and first[1] == second[0] and first[1] != 15, ranges
    outputs, stream_text = reference
    cluster = Cluster(tmp_path, ranges).start()
    try:
        health = httpx.get(cluster.url + "/health").json()["cluster"]
        assert health["num_ranks"] == 2 and health["ranges"] == [list(first), list(second)]
        # Memory is really split: each rank holds its layers (+ embeddings/head), not the model.
        full = sum(f.stat().st_size for f in default_model_dir().glob("*.safetensors"))
        assert all(b < 0.8 * full for b in health["weight_bytes_per_rank"]), (health, full)
        for prompt in PROMPTS:
            assert greedy(cluster.url, prompt) == outputs[prompt]
        assert greedy_stream(cluster.url, PROMPTS[0]) == stream_text

        # Kill the last rank: the next request fails fast with a 503 naming the lost peer.
        os.killpg(cluster.procs[1].pid, signal.SIGKILL)
        cluster.procs[1].wait(10)
        t0 = time.monotonic()
        r = httpx.post(cluster.url + "/v1/chat/completions", json=chat_body(PROMPTS[1]), timeout=60)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert r.status_code == 503, r.text
        assert "peer" in r.json()["error"]["message"] and r.json()["error"]["code"] == "cluster_unavailable"
        h = httpx.get(cluster.url + "/health")
        assert h.status_code == 503 and h.json()["cluster"]["status"] == "lost"
        # ... and keeps answering (an error, at once) instead of hanging.
        r = httpx.post(cluster.url + "/v1/chat/completions", json=chat_body(PROMPTS[0]), timeout=10)
        assert r.status_code == 503
    finally:
        cluster.stop()


def test_three_ranks_uneven_split_matches_single_node_and_a_frozen_rank_times_out(tmp_path, reference):
    outputs, _ = reference
    cluster = Cluster(tmp_path, "0:4,4:21,21:30").start()
    try:
        for prompt in PROMPTS:
            assert greedy(cluster.url, prompt) == outputs[prompt]

        # Freeze the middle rank (alive, sockets open: no EOF). The watchdog must answer.
        os.killpg(cluster.procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(cluster.url + "/v1/chat/completions", json=chat_body(PROMPTS[0]), timeout=60)
        elapsed = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "did not complete within" in r.json()["error"]["message"]
        assert elapsed < TIMEOUT_S + 5, elapsed
        assert httpx.get(cluster.url + "/health").status_code == 503
        # The last rank, stuck behind the frozen one, stops itself with the peer-lost code.
        assert cluster.procs[2].wait(TIMEOUT_S + 10) == 3, cluster.log(2)
    finally:
        cluster.stop()

"""Cluster mode's data plane: real `omlx cluster worker` processes on one machine, ring over TCP.

Two and three ranks on 127.0.0.1 (each rank its own port in the hostfile) split the real SmolLM2
(30 layers) by the planner and by uneven hand-picked ranges; rank 0 serves the HTTP API. Greedy
output through the API must be token-for-token the single-node output without a cache (compared
with logprobs, so token ids and their log-probabilities, not only text). A killed rank and a
frozen rank must give a 503 with a clear message within the step timeout, never a hang, and
`/health` turns 503.

Every rank keeps the prefix cache of its own layers: a repeated prompt, a prompt with a new
ending and a chat's next turn take their prefix from the cache with unchanged output; a rank
holding less than rank 0 (a tiny hot tier) lowers the count every rank uses; a restart of the
workers restores the prefix from each rank's SSD tier.
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
SLOW_TIMEOUT_S = 60.0  # for clusters that prefill long prompts and need not detect a freeze
PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
]
# Over one 256-token KV block, with a tail of well over 100 tokens (the tiny-hot-tier test).
LONG = ("Here are my notes on lighthouses. " + " ".join(
    f"Lighthouse {i} stands on a rocky cape, its lamp turning every {i + 3} seconds." for i in range(22)))
TURN1 = [{"role": "user", "content": LONG + " Which lighthouse turns slowest?"}]
SUFFIXED = [{"role": "user", "content": LONG + " Which lighthouse turns fastest?"}]


def chat_body(prompt: str | list[dict], **kw) -> dict:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"model": MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": 16, "logprobs": True, **kw}


def chat(url: str, prompt: str | list[dict], **kw) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(prompt, **kw), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(body: dict) -> tuple[str, list[tuple[str, float]]]:
    choice = body["choices"][0]
    return choice["message"]["content"], [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]


def greedy(url: str, prompt: str | list[dict]) -> tuple[str, list[tuple[str, float]]]:
    return tokens_of(chat(url, prompt))


def same_output(got: tuple[str, list[tuple[str, float]]], ref: tuple[str, list[tuple[str, float]]]) -> bool:
    """Token for token the reference; log-probabilities within 1e-4 (a prefix hit prefills the rest
    in other chunks than a cold run, which moves the last digits, as on one node)."""
    return got[0] == ref[0] and [t for t, _ in got[1]] == [t for t, _ in ref[1]] and \
        [lp for _, lp in got[1]] == pytest.approx([lp for _, lp in ref[1]], abs=1e-4)


def cached(body: dict) -> tuple[int, int]:
    d = body["usage"]["prompt_tokens_details"]
    return d["cached_tokens"], d.get("cached_tokens_cold", 0)


def turn2(answer: str) -> list[dict]:
    return [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Say that in five words."}]


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

    def __init__(self, tmp: Path, ranges: str, timeout_s: float = TIMEOUT_S,
                 rank_env: dict[int, dict[str, str]] | None = None):
        self.ranges = ranges
        self.num_ranks = len(ranges.split(","))
        self.tmp = tmp
        self.timeout_s = timeout_s
        self.rank_env = rank_env or {}
        self.base = tmp / "home"
        self.procs: list[subprocess.Popen] = []
        self.num_starts = 0

    def _new_addresses(self) -> None:
        self.port = free_port()
        self.hostfile = write_hostfile(self.tmp / "hostfile.json", [("127.0.0.1", free_port()) for _ in range(self.num_ranks)])
        self.logs = [self.tmp / f"rank{r}-start{self.num_starts}.log" for r in range(self.num_ranks)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180) -> Cluster:
        self.base.mkdir(parents=True, exist_ok=True)
        self._new_addresses()
        self.num_starts += 1
        self.procs = []
        for r in range(self.num_ranks):
            env = {**os.environ, "OMLX_LOG_LEVEL": "INFO", "OMLX_SSD_CACHE_MAX_SIZE": "256MB", **self.rank_env.get(r, {})}
            cmd = [sys.executable, "-m", "omlx.cli.cluster_worker", "--model", str(default_model_dir()),
                   "--ranges", self.ranges, "--rank", str(r), "--hostfile", str(self.hostfile),
                   "--port", str(self.port), "--base-path", str(self.base), "--timeout-s", str(self.timeout_s)]
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

    def stop_gracefully(self, timeout_s: float = 60) -> None:
        """SIGTERM rank 0 only: it stops the followers (`stop` op); every rank flushes its KV tiers."""
        os.killpg(self.procs[0].pid, signal.SIGTERM)
        for r, p in enumerate(self.procs):
            assert p.wait(timeout_s) == 0, self.log(r)

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


@pytest.fixture(scope="module")
def long_reference():
    """Single-node greedy outputs without a cache: TURN1, SUFFIXED and the turn after TURN1."""
    with ServerProcess(["--no-cache", "--max-concurrent-requests", "1"]) as s:
        first = greedy(s.url, TURN1)
        return {"turn1": first, "suffixed": greedy(s.url, SUFFIXED), "turn2": greedy(s.url, turn2(first[0]))}


def planner_ranges(num_nodes_spec: str) -> str:
    model = default_model_dir()
    layout = read_layout(model)
    nodes = parse_nodes_spec(num_nodes_spec, headroom_bytes=0)
    plan = plan_pipeline(layout, nodes, PlanRequest(2048, 1, activation_bytes_per_token(model)))
    return ",".join(f"{s.layer_start}:{s.layer_end}" for s in plan.stages)


def test_two_ranks_planned_split_matches_single_node_then_survives_nothing_when_a_rank_dies(
        tmp_path, reference, long_reference):
    # Unequal nodes: the planner gives the smaller node fewer layers than an even 15/15 split.
    ranges = planner_ranges("small:0.30GB:50GB/s,big:0.60GB:100GB/s")
    first, second = (tuple(map(int, r.split(":"))) for r in ranges.split(","))
    assert first[0] == 0 and second[1] == 30 and first[1] == second[0] and first[1] != 15, ranges
    outputs, stream_text = reference
    # A long step timeout (long prompts on a busy machine); a killed peer is reported at once anyway.
    cluster = Cluster(tmp_path, ranges, timeout_s=SLOW_TIMEOUT_S).start()
    try:
        body = httpx.get(cluster.url + "/health").json()
        health = body["cluster"]
        assert health["num_ranks"] == 2 and health["ranges"] == [list(first), list(second)]
        # Memory is really split: each rank holds its layers (+ embeddings/head), not the model.
        full = sum(f.stat().st_size for f in default_model_dir().glob("*.safetensors"))
        assert all(b < 0.8 * full for b in health["weight_bytes_per_rank"]), (health, full)
        # Each rank keeps the prefix cache of its own layers, in its own SSD folder.
        per_rank = health["prefix_cache"]["per_rank"]
        assert [n.split(":")[0] for n in per_rank] == [f"rank 0 layers [0, {first[1]})", f"rank 1 layers [{first[1]}, 30)"]
        assert all(": on (hot tier, SSD tier " in n for n in per_rank), per_rank
        assert body["models"][0]["prefix_cache"].startswith("on per rank"), body["models"][0]
        for prompt in PROMPTS:
            assert same_output(greedy(cluster.url, prompt), outputs[prompt])
        # The repeat of PROMPTS[0] is a whole-prompt hit on every rank (greedy): same text.
        assert greedy_stream(cluster.url, PROMPTS[0]) == stream_text

        # A long prompt, its repeat, the same prompt with a new ending, and the chat's next
        # turn: each takes its prefix from every rank's cache, with the no-cache output.
        cold = chat(cluster.url, TURN1)
        assert same_output(tokens_of(cold), long_reference["turn1"])
        again = chat(cluster.url, TURN1)
        assert same_output(tokens_of(again), long_reference["turn1"])
        assert cached(again)[0] == again["usage"]["prompt_tokens"] > 256, again["usage"]
        suffixed = chat(cluster.url, SUFFIXED)
        assert same_output(tokens_of(suffixed), long_reference["suffixed"])
        assert 256 <= cached(suffixed)[0] < suffixed["usage"]["prompt_tokens"], suffixed["usage"]
        nxt = chat(cluster.url, turn2(long_reference["turn1"][0]))
        assert same_output(tokens_of(nxt), long_reference["turn2"])
        assert cached(nxt)[0] >= cold["usage"]["prompt_tokens"], (nxt["usage"], cold["usage"])
        # Seeded sampling takes the cache too (no whole-prompt hit: rank 0 alone would advance
        # its key chain) and stays reproducible: the ranks agree, the pipeline lives.
        seeded = [chat(cluster.url, TURN1, temperature=0.9, seed=7, logprobs=False) for _ in range(2)]
        assert seeded[0]["choices"][0]["message"]["content"] == seeded[1]["choices"][0]["message"]["content"]
        assert 0 < cached(seeded[1])[0] < seeded[1]["usage"]["prompt_tokens"]
        stats = httpx.get(cluster.url + "/v1/cache/stats").json()["models"][MODEL_ID]["cluster"]["ranks"]
        assert [s["layers"] for s in stats] == health["ranges"]
        assert all(s["hot"]["num_cached_tokens"] > 256 and s["hot"]["num_blocks"] > 0 for s in stats), stats

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
    # Rank 0 runs without a prefix cache, so no rank takes anything from its cache (no lookups
    # are sent) and the split alone must give the single node's logits bit for bit.
    cluster = Cluster(tmp_path, "0:4,4:21,21:30", rank_env={0: {"OMLX_CACHE_ENABLED": "0"}}).start()
    try:
        body = httpx.get(cluster.url + "/health").json()
        notes = body["cluster"]["prefix_cache"]["per_rank"]
        assert [n.split(": ", 1)[1].split(" (")[0] for n in notes] == ["off", "on", "on"], notes
        assert body["models"][0]["prefix_cache"] == "off (disabled by configuration)", body["models"][0]
        for prompt in PROMPTS:
            assert greedy(cluster.url, prompt) == outputs[prompt]
        again = chat(cluster.url, PROMPTS[0])
        assert tokens_of(again) == outputs[PROMPTS[0]] and cached(again) == (0, 0), again["usage"]

        # Idle for longer than a follower's bound on waiting for a message (heartbeat_s + the
        # step timeout = 9 s): rank 0's pings keep every rank in the pipeline.
        time.sleep(TIMEOUT_S * 1.5 + 2)
        assert [p.poll() for p in cluster.procs] == [None] * 3, cluster.log(2)
        assert httpx.get(cluster.url + "/health").status_code == 200

        # Freeze the middle rank (alive, sockets open: no EOF). The watchdog must answer.
        os.killpg(cluster.procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(cluster.url + "/v1/chat/completions", json=chat_body(PROMPTS[0]), timeout=60)
        elapsed = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "did not complete within" in r.json()["error"]["message"]
        assert elapsed < TIMEOUT_S + 5, elapsed
        assert httpx.get(cluster.url + "/health").status_code == 503
        # The last rank, stuck behind the frozen one (in a step, or waiting for the message that
        # the frozen rank never passed on: a bounded wait, rank 0 pings when idle), stops itself
        # with the peer-lost code.
        assert cluster.procs[2].wait(TIMEOUT_S + 10) == 3, cluster.log(2)
    finally:
        cluster.stop()


def test_a_rank_with_a_tiny_hot_tier_lowers_the_cached_count_and_a_restart_restores_from_each_ranks_ssd(
        tmp_path, long_reference):
    # Rank 1's hot tier holds one block of its 19 layers (7.5 MB of float32 KV), not LONG's tail too; its
    # SSD tier gets only what its hot tier registered: it holds 256 tokens of the prompt, rank 0
    # all of them. Every rank must use 256, rank 0 cutting its hit short (exactly).
    cluster = Cluster(tmp_path, "0:11,11:30", timeout_s=SLOW_TIMEOUT_S,
                      rank_env={1: {"OMLX_HOT_CACHE_MAX_SIZE": "10MB"}}).start()
    try:
        assert same_output(tokens_of(chat(cluster.url, TURN1)), long_reference["turn1"])
        again = chat(cluster.url, TURN1)
        assert same_output(tokens_of(again), long_reference["turn1"])
        assert cached(again)[0] == 256, again["usage"]
        cluster.stop_gracefully()  # rank 0 stops the followers; each flushes its hot tier to SSD
        dirs = sorted(p.parent for p in (cluster.base / "cache").glob("*/namespace.json"))
        assert len(dirs) == 2 and all(any(d.rglob("*.safetensors")) for d in dirs), dirs

        cluster.start()
        after = chat(cluster.url, TURN1)
        assert same_output(tokens_of(after), long_reference["turn1"])
        n, n_cold = cached(after)
        assert n >= 256 and n_cold > 0, after["usage"]
    finally:
        cluster.stop()

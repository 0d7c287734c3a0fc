"""A load generator: many concurrent streaming chat clients, some of which disconnect.

Used by tests/integration/test_load.py (bounded) and benchmarks/bench_load.py (figures). Each
client loops until the deadline: it sends a streaming chat completion (greedy, a random
``max_tokens``), and with probability ``disconnect_frac`` drops the connection at a random
point: before the response starts (while queued or prefilling) or after a random number of
content chunks. TTFT is the time from sending to the first content chunk; tokens are counted
from the ``include_usage`` chunk of completed streams and from content chunks of dropped ones.
Traffic goes only to the given URL (a server on this machine).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PROMPTS = ["Write a short poem about the sea.", "List five fruits and their colors.", "Explain what a CPU does.",
           "Tell me a story about a fox.", "Give three tips for learning to code.", "Describe a rainy day in a city."]


@dataclass(slots=True)
class StreamResult:
    """One request: ``outcome`` is completed, disconnected, rejected (429) or error."""

    outcome: str
    status: int | None = None
    ttft_s: float | None = None
    num_tokens: int = 0
    retry_after: str | None = None
    error: str | None = None


@dataclass(slots=True)
class LoadReport:
    """What a load run did and measured (times in seconds, throughput in tokens per second)."""

    num_clients: int
    duration_s: float
    disconnect_frac: float
    wall_s: float = 0.0
    num_requests: int = 0
    num_completed: int = 0
    num_disconnected: int = 0
    num_rejected: int = 0
    num_errors: int = 0
    num_tokens: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tokens_per_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


async def one_stream(client: httpx.AsyncClient, url: str, model: str, rng: random.Random,
                     disconnect_frac: float, max_tokens: tuple[int, int]) -> StreamResult:
    """Send one streaming chat completion; maybe drop it at a random point."""
    n = rng.randint(*max_tokens)
    body = {"model": model, "max_tokens": n, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": rng.choice(PROMPTS) + f" ({rng.randint(0, 10**6)})"}]}
    drop = rng.random() < disconnect_frac
    drop_before_response = drop and rng.random() < 0.25
    drop_after_chunks = rng.randint(0, n) if drop and not drop_before_response else None
    res = StreamResult("completed")
    t0 = time.perf_counter()

    async def run() -> StreamResult:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.outcome = "rejected" if r.status_code == 429 else "error"
                res.retry_after = r.headers.get("retry-after")
                res.error = f"{r.status_code}: {text[:200]}"
                return res
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return res
                obj = json.loads(data)
                if "error" in obj:
                    res.outcome, res.error = "error", json.dumps(obj)[:200]
                    return res
                if obj.get("usage"):
                    res.num_tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices") or []:
                    if ch.get("delta", {}).get("content"):
                        chunks += 1
                        if res.ttft_s is None:
                            res.ttft_s = time.perf_counter() - t0
                if drop_after_chunks is not None and chunks >= drop_after_chunks:
                    res.outcome, res.num_tokens = "disconnected", chunks
                    return res  # leaving the context manager closes the connection mid-stream
        res.outcome, res.error = "error", "stream ended without [DONE]"
        return res

    if drop_before_response:
        try:
            return await asyncio.wait_for(run(), rng.uniform(0.0, 0.5))
        except asyncio.TimeoutError:
            return StreamResult("disconnected", ttft_s=None)
    try:
        return await run()
    except httpx.HTTPError as e:
        return StreamResult("error", error=f"{type(e).__name__}: {e}")


async def run_load(url: str, model: str, *, num_clients: int = 64, duration_s: float = 30.0,
                   disconnect_frac: float = 0.3, seed: int = 0, max_tokens: tuple[int, int] = (8, 48)) -> LoadReport:
    """Run ``num_clients`` looping clients for ``duration_s`` seconds against ``url``.

    Returns:
        The LoadReport (requests started before the deadline are finished, or dropped as drawn).
    """
    rep = LoadReport(num_clients, duration_s, disconnect_frac)
    results: list[StreamResult] = []
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=num_clients * 2, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def client_loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.perf_counter() < deadline:
                results.append(await one_stream(client, url, model, rng, disconnect_frac, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(num_clients)))
        rep.wall_s = time.perf_counter() - t0
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    rep.num_requests = len(results)
    rep.num_completed = sum(r.outcome == "completed" for r in results)
    rep.num_disconnected = sum(r.outcome == "disconnected" for r in results)
    rep.num_rejected = sum(r.outcome == "rejected" for r in results)
    rep.num_errors = sum(r.outcome == "error" for r in results)
    rep.errors = sorted({r.error for r in results if r.outcome == "error" and r.error})[:10]
    rep.num_tokens = sum(r.num_tokens for r in results)
    rep.ttft_p50_s = _percentile(ttfts, 50)
    rep.ttft_p99_s = _percentile(ttfts, 99)
    rep.tokens_per_s = rep.num_tokens / rep.wall_s if rep.wall_s else 0.0
    return rep


async def burst(url: str, model: str, num_requests: int, max_tokens: int = 16) -> list[StreamResult]:
    """``num_requests`` non-streaming chat completions at once (to overflow the queue)."""
    limits = httpx.Limits(max_connections=num_requests + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def one(i: int) -> StreamResult:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Count to ten ({i})."}]}
            r = await client.post(url + "/v1/chat/completions", json=body)
            if r.status_code == 200:
                return StreamResult("completed", 200, num_tokens=r.json()["usage"]["completion_tokens"])
            out = StreamResult("rejected" if r.status_code == 429 else "error", r.status_code,
                               retry_after=r.headers.get("retry-after"), error=r.text[:300])
            return out

        return list(await asyncio.gather(*(one(i) for i in range(num_requests))))

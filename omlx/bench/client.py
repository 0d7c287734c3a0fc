"""HTTP side of `omlx bench`: a timed SSE client, the server's token counter and memory figure.

Talks to any OpenAI-compatible server over ``/v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``. Per request it records the time of the first content chunk
(TTFT) and of every later one; tokens are ``usage.completion_tokens`` when the server reports
them, else content chunks (each result says which); the SSE framing is httpx-sse's. Extras used
when the server has them: ``/v1/messages/count_tokens`` (token counting) and
``/v1/models/status`` (omlx's memory figures, for peak memory). Must not: import anything of omlx's server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse


@dataclass(slots=True)
class Target:
    """One server under test.

    Attributes:
        label: the name in tables and JSON ("base", "compare").
        base_url: e.g. ``http://127.0.0.1:8000`` (without ``/v1``).
        model: the model id sent in every request.
        api_key: sent as ``Authorization: Bearer`` when set.
    """

    label: str
    base_url: str
    model: str | None = None
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class StreamResult:
    """One streamed request, timed at the client (seconds since it was sent).

    ``chunk_times`` are arrival times of chunks that carried text; a chunk may carry several
    tokens, so per-token figures divide by tokens, not chunks.
    """

    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    num_content_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_count_source: str = "chunks"
    finish_reason: str | None = None
    text: str = ""
    t_send: float = 0.0  # perf_counter at send (to line up concurrent streams)

    @property
    def num_tokens(self) -> int:
        """Generated tokens: usage.completion_tokens if reported, else content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_content_chunks

    @property
    def decode_s(self) -> float | None:
        """Seconds from the first content chunk to the end of the stream."""
        if self.ttft_s is None or self.total_s is None:
            return None
        return max(0.0, self.total_s - self.ttft_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than 2 tokens)."""
        d = self.decode_s
        if d is None or self.num_tokens < 2 or d <= 0:
            return None
        return d / (self.num_tokens - 1)

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first / decode seconds."""
        t = self.tpot_s
        return 1.0 / t if t else None


def new_client(num_connections: int = 1, timeout_s: float = 900.0) -> httpx.AsyncClient:
    """An async client with one fresh connection per concurrent stream."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=max(8, 2 * num_connections),
                                                 max_keepalive_connections=0))


async def stream_chat(client: httpx.AsyncClient, target: Target, body: dict[str, Any]) -> StreamResult:
    """POST ``body`` to ``/v1/chat/completions`` (streaming) and time it. Never raises: a failed
    request comes back with ``ok=False`` and ``error``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    if target.model:
        body["model"] = target.model
    res = StreamResult()
    t0 = time.perf_counter()
    res.t_send = t0
    finish_t: float | None = None
    try:
        # httpx-sse does the SSE framing (fields, multi-line data, comments such as omlx's
        # keep-alives skipped); an error status is read as a body first, before it could raise
        # SSEError for a JSON content type.
        async with aconnect_sse(client, "POST", target.base_url + "/v1/chat/completions", json=body,
                                headers=dict(target.headers)) as source:
            resp = source.response
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: " + (await resp.aread()).decode(errors="replace")[:500]
                return res
            async for event in source.aiter_sse():
                now = time.perf_counter() - t0  # an event is complete when its blank line arrives
                if not event.data:
                    continue
                if event.data == "[DONE]":
                    break
                obj = event.json()
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    res.token_count_source = "usage"
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    if text or delta.get("tool_calls"):
                        res.chunk_times.append(now)
                        res.num_content_chunks += 1
                        res.text += text or ""
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                        finish_t = now
        res.total_s = time.perf_counter() - t0
        # TTFT: the first chunk with text; a reply whose only token has no text falls back to the
        # chunk carrying finish_reason.
        res.ttft_s = res.chunk_times[0] if res.chunk_times else finish_t
        res.ok = res.ttft_s is not None
        if not res.ok:
            res.error = "no content and no finish_reason in the stream"
    # httpx_sse.SSEError (a 200 that is not text/event-stream) is an httpx.HTTPError.
    except (httpx.HTTPError, ValueError, OSError) as e:  # reported, never raised: a benchmark keeps going
        res.error = f"{type(e).__name__}: {e}"
        res.total_s = time.perf_counter() - t0
    return res


class MemoryProbe:
    """Polls omlx's ``GET /v1/models/status`` every ``interval_s`` while a step runs (and once
    after it) and keeps the peak ``memory.used_bytes``; ``peak_bytes`` stays None on servers
    that do not report it. A sampled peak: a spike shorter than the interval can be missed."""

    def __init__(self, client: httpx.AsyncClient, target: Target, interval_s: float = 0.5):
        self.client, self.target, self.interval_s = client, target, interval_s
        self.peak_bytes: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.supported = True

    async def sample(self) -> None:
        if not self.supported:
            return
        try:
            r = await self.client.get(self.target.base_url + "/v1/models/status", headers=self.target.headers)
            used = r.json().get("memory", {}).get("used_bytes") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            used = None
        if used is None:
            self.supported = False
            return
        self.peak_bytes = max(self.peak_bytes or 0, int(used))

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self.peak_bytes = None
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> int | None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.sample()
        return self.peak_bytes


class ServerCounter:
    """Token counts from the server's ``POST /v1/messages/count_tokens`` (Anthropic shape):
    one user message with the text, minus the same message empty (the template's overhead).

    Raises (from ``probe``): nothing; returns False when the server has no such route.
    """

    source = "server"

    def __init__(self, target: Target, timeout_s: float = 60.0):
        self.target = target
        self._http = httpx.Client(timeout=timeout_s)
        self._overhead: int | None = None
        self._cache: dict[str, int] = {}

    def _raw(self, text: str) -> int | None:
        body = {"model": self.target.model, "messages": [{"role": "user", "content": text}]}
        try:
            r = self._http.post(self.target.base_url + "/v1/messages/count_tokens", json=body,
                                headers={**self.target.headers,
                                         **({"x-api-key": self.target.api_key} if self.target.api_key else {})})
            return int(r.json()["input_tokens"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def probe(self) -> bool:
        """True when the server counts tokens (and the template overhead is now known)."""
        self._overhead = self._raw("")
        return self._overhead is not None

    def count(self, text: str) -> int:
        if text not in self._cache:
            n = self._raw(text)
            if n is None:
                raise RuntimeError(f"{self.target.base_url} stopped counting tokens")
            self._cache[text] = max(0, n - (self._overhead or 0))
        return self._cache[text]

    def close(self) -> None:
        self._http.close()


def list_models(target: Target, timeout_s: float = 30.0) -> list[str]:
    """Model ids of ``GET /v1/models``.

    Raises:
        httpx.HTTPError: the server cannot be reached or answers an error.
    """
    r = httpx.get(target.base_url + "/v1/models", headers=target.headers, timeout=timeout_s)
    r.raise_for_status()
    return [m["id"] for m in r.json().get("data", [])]

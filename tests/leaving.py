"""Clients that leave, and the check that they left nothing held.

`RawClient` sends one request to a generation route over a plain socket and leaves whenever the
test says: while the body is still being sent, before the first response byte, after some bytes,
by FIN (``close``) or by TCP reset (``SO_LINGER`` 0). A body can be padded with JSON whitespace
to more than Sanic's 64 KiB read buffer (``REQUEST_BUFFER_SIZE``), past which the server stops
reading the socket unless it watches it, as real Claude Code bodies are. `held` and
`wait_released` read what the server still holds for requests: model leases
(``/v1/models/status``), hot-tier blocks held by requests (``/v1/cache/stats``) and requests
running, waiting or holding a batch row (``/health``).

Used by tests/integration/test_load.py and tests/integration/test_disconnect_points.py.
"""

from __future__ import annotations

import json
import random
import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.helpers import MODEL_ID

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "count_tokens": "/v1/messages/count_tokens", "responses": "/v1/responses"}
GENERATING = ("chat", "completions", "messages", "responses")
READ_BUFFER_BYTES = 65536  # Sanic's REQUEST_BUFFER_SIZE: a larger body pauses reading the socket


def body(api: str, prompt: str, *, stream: bool = False, max_tokens: int = 16) -> dict[str, Any]:
    """A greedy request body for ``api`` (a key of `PATHS`) asking ``prompt``."""
    if api == "completions":
        return {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "responses":
        return {"model": MODEL_ID, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0,
                "stream": stream, "store": False}
    msgs = [{"role": "user", "content": prompt}]
    if api == "count_tokens":
        return {"model": MODEL_ID, "messages": msgs}
    return {"model": MODEL_ID, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def long_prompt(num_words: int, rng: random.Random) -> str:
    """About ``num_words`` tokens of text, starting with a random number so no prefix is cached."""
    return f"{rng.randint(0, 10**9)} " + " ".join(rng.choice(("river", "stone", "cloud", "field", "lamp"))
                                                   for _ in range(num_words)) + "\nSummarize."


class RawClient:
    """One HTTP/1.1 request over a plain socket, which leaves when told to.

    Args:
        port: the server's port on 127.0.0.1.
        api: a key of `PATHS`.
        payload: the JSON body.
        pad_bytes: JSON whitespace appended to the body (the prompt does not change).
        headers: extra request headers.
    """

    def __init__(self, port: int, api: str, payload: dict[str, Any], *, pad_bytes: int = 0,
                 headers: dict[str, str] | None = None):
        self.api = api
        data = json.dumps(payload).encode() + b" " * pad_bytes
        head = [f"POST {PATHS[api]} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "anthropic-version: 2023-06-01"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._head = ("\r\n".join(head) + "\r\n\r\n").encode()
        self._data = data
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.received = b""
        self.left_at: float | None = None

    def send(self, *, fraction: float = 1.0) -> RawClient:
        """Send the headers and ``fraction`` of the body (all of it by default)."""
        self.sock.sendall(self._head + self._data[: int(len(self._data) * fraction)])
        return self

    def read_available(self) -> bytes:
        """Whatever response bytes have arrived, without waiting."""
        self.sock.setblocking(False)
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.received += chunk
        except (BlockingIOError, ConnectionError):
            pass
        finally:
            self.sock.setblocking(True)
        return self.received

    def read_until(self, marker: bytes, timeout_s: float) -> bool:
        """Read until ``marker`` has arrived (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.received and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except (socket.timeout, ConnectionError):
                continue
            if not chunk:
                break
            self.received += chunk
        return marker in self.received

    def leave(self, how: str = "fin") -> float:
        """Close the connection: ``fin`` (an orderly close) or ``rst`` (a TCP reset). Returns when."""
        if how == "rst":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        self.left_at = time.monotonic()
        return self.left_at


@dataclass(frozen=True, slots=True)
class Held:
    """What the server holds for requests, per loaded chat model.

    Attributes:
        num_leases: model id -> leases (``/v1/models/status``), every loaded model.
        num_held_blocks: model id -> hot-tier blocks held by requests (``/v1/cache/stats``).
        num_requests: model id -> running + waiting + active requests (``/health``).
    """

    num_leases: dict[str, int]
    num_held_blocks: dict[str, int]
    num_requests: dict[str, int]


def held(url: str) -> Held:
    """What the server at ``url`` holds now."""
    status = httpx.get(url + "/v1/models/status", timeout=30).json()
    leases = {m["id"]: m["num_leases"] for m in status["models"] if m["state"] == "loaded"}
    stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()["models"]
    blocks = {mid: s["hot"]["num_held_blocks"] for mid, s in stats.items() if s.get("hot")}
    health = httpx.get(url + "/health", timeout=30).json()["models"]
    reqs = {m["id"]: m["running"] + m["waiting"] + m["active"] for m in health}
    return Held(leases, blocks, reqs)


def is_released(h: Held, baseline: Held) -> bool:
    """No lease and no request left, and every model's held blocks back to ``baseline``."""
    return (not any(h.num_leases.values()) and not any(h.num_requests.values())
            and all(h.num_held_blocks.get(m, 0) == n for m, n in baseline.num_held_blocks.items()))


def wait_released(url: str, baseline: Held, timeout_s: float = 10.0) -> Held:
    """`held` once `is_released` (or the last one seen at ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = held(url)
        if is_released(h, baseline) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def expired_leases(log: str) -> list[str]:
    """The log's reports of leases that only expired (their request never released them); the
    log's lines are joined first, since it wraps long messages."""
    return re.findall(r"lease on \S+ .{0,120}?expired after", " ".join(log.split()))


def running_or_waiting(url: str) -> int:
    """Requests running or waiting on every model (``/health``)."""
    return sum(m["running"] + m["waiting"] for m in httpx.get(url + "/health", timeout=30).json()["models"])


def not_aborted(url: str) -> int:
    """Requests running or waiting that were not aborted (``/health``: running - aborting +
    waiting); an aborted one still runs until the engine's step in flight ends."""
    return sum(m["running"] - m["aborting"] + m["waiting"] for m in httpx.get(url + "/health", timeout=30).json()["models"])

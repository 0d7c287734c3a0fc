"""The control channel between node agents: authenticated JSON lines over TCP (stdlib asyncio).

Owns the wire protocol and its mechanisms: the join handshake, request/reply, ping-pong and the
bandwidth blob. Policy (who is a member, what an epoch is, what to plan) lives in
``omlx.cluster.membership`` and ``omlx.cluster.agent``. Must not import sanic, zeroconf or mlx.

Wire format: one JSON object per line (UTF-8, ``\\n``-terminated, at most ``MAX_LINE_BYTES``),
except the payload of a ``blob`` message, which follows its line as ``num_bytes`` raw bytes.

Handshake (mutual challenge-response, HMAC-SHA256 over the shared secret, RFC 2104)::

    server -> {"type": "challenge", "proto": PROTOCOL, "nonce": Ns}
    client -> {"type": "hello", "node_id": C, "info": {...} | null, "nonce": Nc,
               "mac": HMAC(secret, "client|" Ns "|" C)}
    server -> {"type": "refused", "reason": ...}                      (bad mac: logged, closed)
           or {"type": "welcome", "node_id": S, "info": {...}, "mac": HMAC(secret, "server|" Nc "|" S)}

Nonces are 32 random bytes (hex), fresh per connection, so a recorded exchange cannot be
replayed; macs are compared with ``hmac.compare_digest``. The client checks the server's mac
too, so a node never trusts a listener that does not know the secret. ``info: null`` marks a
local CLI client (status, leave), not a joining node.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omlx.errors import AuthError, ClusterError, ControlError

logger = logging.getLogger(__name__)

PROTOCOL = "omlx-control/1"
MAX_LINE_BYTES = 1 << 20
"""Longest JSON line accepted (1 MiB); a longer one closes the connection."""

MAX_BLOB_BYTES = 64 << 20
"""Largest bandwidth-probe payload accepted (64 MiB)."""

HANDSHAKE_TIMEOUT_S = 5.0


def join_mac(secret: bytes, role: str, nonce: str, node_id: str) -> str:
    """HMAC-SHA256 (hex, 64 digits) proving knowledge of ``secret`` for one handshake.

    Args:
        secret: The shared cluster secret (UTF-8 bytes of what the user gave).
        role: ``"client"`` or ``"server"`` (so one side's answer is never valid for the other).
        nonce: The other side's challenge (hex).
        node_id: The id of the side computing the mac.
    """
    msg = f"{PROTOCOL}|{role}|{nonce}|{node_id}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def check_secret(secret: str | bytes | None) -> bytes:
    """The secret as bytes.

    Raises:
        AuthError: No secret, or one shorter than 8 bytes (too easy to guess).
    """
    if secret is None or secret == "" or secret == b"":
        raise AuthError(
            "a cluster needs a shared secret: pass --secret, set OMLX_CLUSTER_SECRET or "
            "[cluster] secret in the config file"
        )
    raw = secret.encode() if isinstance(secret, str) else secret
    if len(raw) < 8:
        raise AuthError("the cluster secret must be at least 8 bytes long")
    return raw


class Connection:
    """One authenticated control connection; requests on it are serialized.

    Attributes:
        peer_id: The other side's node id (from the handshake).
        peer_info: Its NodeInfo dict, or None for a CLI client.
        address: ``host:port`` of the other side.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer_id: str,
        peer_info: dict[str, Any] | None,
        address: str,
    ) -> None:
        self.reader, self.writer = reader, writer
        self.peer_id, self.peer_info, self.address = peer_id, peer_info, address
        self._lock = asyncio.Lock()

    @property
    def closed(self) -> bool:
        """The other side closed the connection (EOF seen, nothing left to read) or we did."""
        return self.writer.is_closing() or self.reader.at_eof()

    async def send(self, msg: dict[str, Any], payload: bytes = b"") -> None:
        self.writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n" + payload)
        await self.writer.drain()

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next message.

        Raises:
            ControlError: Timeout, closed connection or a malformed line.
        """
        return await _read_msg(self.reader, timeout_s, self.address)

    async def request(self, msg: dict[str, Any], timeout_s: float, payload: bytes = b"") -> dict[str, Any]:
        """Send ``msg`` (and a raw ``payload``) and wait at most ``timeout_s`` for the reply.

        Raises:
            ControlError: No reply in time, the connection broke, or the reply is an error
                (``{"type": "error"}``; its message is raised).
        """
        async with self._lock:
            try:
                await asyncio.wait_for(self.send(msg, payload), timeout_s)
            except (OSError, asyncio.TimeoutError) as e:
                raise ControlError(f"{self.address}: send failed: {e or 'timeout'}") from e
            reply = await self.recv(timeout_s)
        if reply.get("type") == "error":
            raise ControlError(f"{self.address}: {reply.get('message', 'error')}")
        return reply

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, ConnectionError):
            pass


async def _read_msg(reader: asyncio.StreamReader, timeout_s: float, where: str) -> dict[str, Any]:
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except asyncio.TimeoutError as e:
        raise ControlError(f"{where}: no reply within {timeout_s:g} s") from e
    except (OSError, ValueError) as e:  # ValueError: line over the reader's limit
        raise ControlError(f"{where}: {e}") from e
    if not line:
        raise ControlError(f"{where}: connection closed")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ControlError(f"{where}: malformed message: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ControlError(f"{where}: message without a type")
    return msg


async def connect(
    host: str,
    port: int,
    *,
    secret: bytes,
    node_id: str,
    info: dict[str, Any] | None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> Connection:
    """Open a connection to an agent and run the handshake as the client.

    Args:
        info: This node's NodeInfo dict when joining as a node; None for a CLI client.

    Raises:
        AuthError: The agent refused us (wrong secret) or could not prove it holds the secret.
        ControlError: Cannot connect, or the agent did not follow the protocol in time.
    """
    address = f"{host}:{port}"
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=MAX_LINE_BYTES), timeout_s
        )
    except (OSError, asyncio.TimeoutError) as e:
        raise ControlError(f"cannot connect to {address}: {e or 'timeout'}") from e
    try:
        challenge = await _read_msg(reader, timeout_s, address)
        if challenge.get("type") != "challenge" or challenge.get("proto") != PROTOCOL:
            raise ControlError(f"{address}: not an omlx control port (got {challenge.get('type')!r})")
        my_nonce = secrets.token_hex(32)
        hello = {
            "type": "hello",
            "node_id": node_id,
            "info": info,
            "nonce": my_nonce,
            "mac": join_mac(secret, "client", str(challenge.get("nonce", "")), node_id),
        }
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        reply = await _read_msg(reader, timeout_s, address)
        if reply.get("type") == "refused":
            raise AuthError(f"{address} refused to let us join: {reply.get('reason', 'refused')}")
        peer_id = str(reply.get("node_id", ""))
        if reply.get("type") != "welcome" or not peer_id:
            raise ControlError(f"{address}: unexpected handshake reply {reply.get('type')!r}")
        expected = join_mac(secret, "server", my_nonce, peer_id)
        if not hmac.compare_digest(str(reply.get("mac", "")), expected):
            raise AuthError(f"{address} (node {peer_id}) does not hold the cluster secret")
    except BaseException:
        writer.close()
        raise
    return Connection(reader, writer, peer_id, reply.get("info"), address)


Handler = Callable[[Connection, dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""Agent callback for one request: returns the reply (None: no reply is sent)."""


@dataclass
class ControlServer:
    """Accepts control connections, authenticates them, and passes requests to ``handler``.

    ``ping`` and ``blob`` are answered here (the link probes); every other message type goes to
    ``handler``. A refused handshake is logged at WARNING with the remote address and the node
    id it claimed. ``on_connect(conn)`` runs after a successful handshake, ``on_close(conn)``
    when the connection ends.
    """

    secret: bytes
    node_id: str
    info: Callable[[], dict[str, Any]]
    handler: Handler
    on_connect: Callable[[Connection], None] = lambda _c: None
    on_close: Callable[[Connection], None] = lambda _c: None
    _server: asyncio.base_events.Server | None = None
    _conns: set[Connection] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the bound port (useful with port 0).

        Raises:
            OSError: The port cannot be bound.
        """
        self._conns = set()
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_LINE_BYTES)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns or ()):
            await c.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve_conn(reader, writer)
        except asyncio.CancelledError:  # the server is stopping; the connection is closed below
            writer.close()

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if peer else "?"
        conn = await self._handshake(reader, writer, address)
        if conn is None:
            writer.close()
            return
        assert self._conns is not None
        self._conns.add(conn)
        self.on_connect(conn)
        try:
            while True:
                try:
                    msg = await conn.recv(timeout_s=3600)
                except ControlError:
                    return
                kind = msg["type"]
                if kind == "ping":
                    reply: dict[str, Any] | None = {"type": "pong", "t": msg.get("t")}
                elif kind == "blob":
                    n = int(msg.get("num_bytes", 0))
                    if not 0 <= n <= MAX_BLOB_BYTES:
                        return
                    try:
                        await reader.readexactly(n)
                    except (asyncio.IncompleteReadError, OSError):
                        return
                    reply = {"type": "blob_ack", "num_bytes": n}
                else:
                    try:
                        reply = await self.handler(conn, msg)
                    except ClusterError as e:
                        reply = {"type": "error", "message": str(e)}
                    except Exception as e:  # a bug in one request must not kill the agent
                        logger.exception("control request %s from %s failed", kind, address)
                        reply = {"type": "error", "message": f"{type(e).__name__}: {e}"}
                if reply is not None:
                    try:
                        await conn.send(reply)
                    except (OSError, ConnectionError):
                        return
        finally:
            self._conns.discard(conn)
            self.on_close(conn)
            await conn.close()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> Connection | None:
        nonce = secrets.token_hex(32)
        try:
            writer.write(
                json.dumps({"type": "challenge", "proto": PROTOCOL, "nonce": nonce}).encode() + b"\n"
            )
            await writer.drain()
            hello = await _read_msg(reader, HANDSHAKE_TIMEOUT_S, address)
        except (ControlError, OSError) as e:
            logger.info("control connection from %s dropped before its hello: %s", address, e)
            return None
        claimed = str(hello.get("node_id", ""))
        expected = join_mac(self.secret, "client", nonce, claimed)
        if hello.get("type") != "hello" or not claimed or not hmac.compare_digest(
            str(hello.get("mac", "")), expected
        ):
            logger.warning(
                "refused control connection from %s (claims node %s): wrong or missing cluster secret",
                address,
                claimed or "?",
            )
            try:
                writer.write(b'{"type":"refused","reason":"wrong cluster secret"}\n')
                await writer.drain()
            except (OSError, ConnectionError):
                pass
            return None
        info = hello.get("info")
        welcome = {
            "type": "welcome",
            "node_id": self.node_id,
            "info": self.info(),
            "mac": join_mac(self.secret, "server", str(hello.get("nonce", "")), self.node_id),
        }
        try:
            writer.write(json.dumps(welcome).encode() + b"\n")
            await writer.drain()
        except (OSError, ConnectionError):
            return None
        return Connection(reader, writer, claimed, info if isinstance(info, dict) else None, address)


# ---------------------------------------------------------------------------------------------
# Link probes


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """Measured link to one peer over the control channel (TCP, so an upper bound on latency).

    Attributes:
        latency_s: One-way latency = median ping-pong round trip / 2, in seconds.
        bandwidth_bytes_s: Bytes/s of one ``blob_bytes`` transfer, its round-trip latency
            subtracted.
    """

    latency_s: float
    bandwidth_bytes_s: float


async def measure_link(
    conn: Connection, *, num_pings: int = 7, blob_bytes: int = 4 << 20, timeout_s: float = 10.0
) -> LinkFigures:
    """Ping-pong ``num_pings`` times, then send ``blob_bytes`` once and time the ack.

    Raises:
        ControlError: The peer stopped answering.
    """
    rtts: list[float] = []
    for _ in range(num_pings):
        t0 = time.perf_counter()
        await conn.request({"type": "ping", "t": t0}, timeout_s)
        rtts.append(time.perf_counter() - t0)
    rtts.sort()
    rtt = rtts[len(rtts) // 2]
    payload = bytes(blob_bytes)
    t0 = time.perf_counter()
    await conn.request({"type": "blob", "num_bytes": blob_bytes}, timeout_s, payload)
    elapsed = max(time.perf_counter() - t0 - rtt, 1e-9)
    return LinkFigures(latency_s=rtt / 2, bandwidth_bytes_s=blob_bytes / elapsed)

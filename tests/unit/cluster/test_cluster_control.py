"""The control channel's handshake (HMAC challenge-response) and probes, over real loopback TCP."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import Any

import pytest

from omlx.cluster.control import (
    PROTOCOL,
    Connection,
    ControlServer,
    check_secret,
    connect,
    join_mac,
    measure_link,
)
from omlx.errors import AuthError

SECRET = b"correct horse battery"


def test_join_mac_is_hmac_sha256_bound_to_role_nonce_and_node() -> None:
    mac = join_mac(SECRET, "client", "ab" * 32, "node-a")
    expected = hmac.new(SECRET, f"{PROTOCOL}|client|{'ab' * 32}|node-a".encode(), hashlib.sha256).hexdigest()
    assert mac == expected and len(mac) == 64
    others = {
        join_mac(SECRET, "server", "ab" * 32, "node-a"),
        join_mac(SECRET, "client", "cd" * 32, "node-a"),
        join_mac(SECRET, "client", "ab" * 32, "node-b"),
        join_mac(b"another secret", "client", "ab" * 32, "node-a"),
    }
    assert mac not in others and len(others) == 4


def test_check_secret() -> None:
    assert check_secret("12345678") == b"12345678"
    for bad in (None, "", "short"):
        with pytest.raises(AuthError):
            check_secret(bad)


async def _echo_handler(conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
    return {"type": "echo", "from": conn.peer_id, "got": msg["type"], "member": conn.peer_info is not None}


async def _server(secret: bytes = SECRET) -> tuple[ControlServer, int]:
    server = ControlServer(secret=secret, node_id="srv", info=lambda: {"node_id": "srv"}, handler=_echo_handler)
    port = await server.start("127.0.0.1", 0)
    return server, port


def test_handshake_with_the_secret_then_requests_and_probes() -> None:
    async def main() -> None:
        server, port = await _server()
        try:
            conn = await connect("127.0.0.1", port, secret=SECRET, node_id="cli-a", info={"node_id": "cli-a"})
            assert conn.peer_id == "srv" and conn.peer_info == {"node_id": "srv"}
            reply = await conn.request({"type": "hello-world"}, 5)
            assert reply == {"type": "echo", "from": "cli-a", "got": "hello-world", "member": True}
            figs = await measure_link(conn, num_pings=3, blob_bytes=1 << 20)
            assert figs.latency_s > 0 and figs.bandwidth_bytes_s > 0
            await conn.close()
            cli = await connect("127.0.0.1", port, secret=SECRET, node_id="cli", info=None)
            assert (await cli.request({"type": "x"}, 5))["member"] is False
            await cli.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_wrong_secret_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server, port = await _server()
        try:
            with caplog.at_level(logging.WARNING, logger="omlx.cluster.control"):
                with pytest.raises(AuthError, match="refused"):
                    await connect("127.0.0.1", port, secret=b"wrong secret!", node_id="intruder", info={})
            assert any(
                "refused control connection" in r.getMessage() and "intruder" in r.getMessage()
                for r in caplog.records
            )
        finally:
            await server.stop()

    asyncio.run(main())


def test_client_refuses_a_server_without_the_secret() -> None:
    """Mutual auth: a listener that does not know the secret cannot pass itself off as a node."""

    async def main() -> None:
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b'{"type":"challenge","proto":"%s","nonce":"00"}\n' % PROTOCOL.encode())
            await reader.readline()
            writer.write(b'{"type":"welcome","node_id":"evil","mac":"' + b"0" * 64 + b'"}\n')
            await writer.drain()
            await reader.read()
            writer.close()

        srv = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(AuthError, match="does not hold the cluster secret"):
                await connect("127.0.0.1", port, secret=SECRET, node_id="a", info={})
        finally:
            srv.close()
            await srv.wait_closed()

    asyncio.run(main())


def test_replayed_hello_is_refused() -> None:
    """A hello recorded from one handshake is useless in the next: the server's nonce changed."""

    async def main() -> None:
        server, port = await _server()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            import json

            challenge = json.loads(await reader.readline())
            good = join_mac(SECRET, "client", challenge["nonce"], "a")
            writer.write(json.dumps({"type": "hello", "node_id": "a", "info": {}, "nonce": "11", "mac": good}).encode() + b"\n")
            assert json.loads(await reader.readline())["type"] == "welcome"
            writer.close()
            reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
            await reader2.readline()  # a fresh challenge
            writer2.write(json.dumps({"type": "hello", "node_id": "a", "info": {}, "nonce": "11", "mac": good}).encode() + b"\n")
            assert json.loads(await reader2.readline())["type"] == "refused"
            writer2.close()
        finally:
            await server.stop()

    asyncio.run(main())

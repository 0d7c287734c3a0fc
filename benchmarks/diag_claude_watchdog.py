"""Which SSE events keep the real Claude Code waiting through a long prefill (issue 27).

A stand-in Anthropic server on 127.0.0.1 answers ``POST /v1/messages`` (stream) by holding the
stream open for ``--hold-s`` seconds while sending one kind of filler every ``--every-s``, then a
short text answer; every other request gets a minimal reply at once (a non-streaming message
says "NONSTREAM", so a fallback shows in the result). The real CLI runs against it, so what ends
an attempt is Claude Code's own watchdog, not omlx.

Modes (the filler): ``comment`` (``: keep-alive`` SSE comments), ``ping`` (``event: ping``, what
omlx sends after ``message_start``), ``empty_delta`` (``message_start`` and an open text block at
once, then ``content_block_delta`` events with an empty ``text_delta``), ``no_stream`` (the stream
ends at once without ``message_start``, so the CLI falls back to a non-streaming request, which
is answered after ``--nonstream-delay-s``: what ``API_TIMEOUT_MS`` does to it).
Usage (as root; a loopback-only namespace keeps the CLI off the network):
  unshare -n sh -c 'ip link set lo up; python benchmarks/diag_claude_watchdog.py --mode ping'
Prints one JSON line: the CLI's exit code, wall time, its result text and every request seen.
A diagnostic, not a benchmark of record: Claude Code's stream idle watchdog cannot be set below
300 s (``max(CLAUDE_STREAM_IDLE_TIMEOUT_MS, 300000)`` in 2.1.197), so a run takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLAUDE = Path(os.environ.get("OMLX_CLAUDE_BIN", REPO / "clients" / "node_modules" / ".bin" / "claude"))


def sse(event: str, obj: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(obj)}\n\n".encode()


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "local-model", "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 0}}


async def serve(port: int, mode: str, hold_s: float, every_s: float, seen: list[dict],
                nonstream_delay_s: float = 0.0) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                req = json.loads(body) if body else {}
                t0 = time.monotonic()
                entry = {"t_s": round(t0 - START, 1), "method": method, "path": path.split("?")[0],
                         "stream": bool(req.get("stream"))}
                seen.append(entry)
                if method == "POST" and path.startswith("/v1/messages") and "count_tokens" not in path:
                    if req.get("stream") and mode == "no_stream":
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                        await writer.drain()
                        return
                    if req.get("stream"):
                        await stream_answer(writer, mode, hold_s, every_s)
                        entry["served_s"] = round(time.monotonic() - t0, 1)
                        return  # the stream ends with the connection
                    await asyncio.sleep(nonstream_delay_s)
                    entry["served_s"] = round(time.monotonic() - t0, 1)
                    msg = {**MESSAGE, "content": [{"type": "text", "text": "NONSTREAM"}], "stop_reason": "end_turn"}
                    await reply(writer, msg)
                elif "count_tokens" in path:
                    await reply(writer, {"input_tokens": 10})
                else:
                    await reply(writer, {})
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the server is closing
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def reply(writer: asyncio.StreamWriter, obj: dict) -> None:
    data = json.dumps(obj).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()


async def stream_answer(writer: asyncio.StreamWriter, mode: str, hold_s: float, every_s: float) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                 b"connection: close\r\n\r\n")
    if mode != "comment":
        writer.write(sse("message_start", {"type": "message_start", "message": MESSAGE}))
    if mode == "empty_delta":
        writer.write(sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}))
    await writer.drain()
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        await asyncio.sleep(every_s)
        if mode == "comment":
            writer.write(b": keep-alive\n\n")
        elif mode == "ping":
            writer.write(sse("ping", {"type": "ping"}))
        else:
            writer.write(sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": ""}}))
        await writer.drain()
    if mode == "comment":
        writer.write(sse("message_start", {"type": "message_start", "message": MESSAGE}))
    if mode != "empty_delta":
        writer.write(sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}))
    writer.write(sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": "STREAMED"}}))
    writer.write(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
    writer.write(sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                       "stop_sequence": None}, "usage": {"output_tokens": 1}}))
    writer.write(sse("message_stop", {"type": "message_stop"}))
    await writer.drain()


START = time.monotonic()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["comment", "ping", "empty_delta", "no_stream"], required=True)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--hold-s", type=float, default=330.0)
    ap.add_argument("--every-s", type=float, default=5.0)
    ap.add_argument("--nonstream-delay-s", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=1500.0)
    ap.add_argument("--env", nargs="*", default=[], help="extra NAME=VALUE for the CLI")
    a = ap.parse_args()
    seen: list[dict] = []
    server = await serve(a.port, a.mode, a.hold_s, a.every_s, seen, a.nonstream_delay_s)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        env = {**os.environ, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{a.port}", "ANTHROPIC_API_KEY": "dummy",
               "ANTHROPIC_AUTH_TOKEN": "", "ANTHROPIC_MODEL": "local-model",
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": "local-model", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               **dict(kv.split("=", 1) for kv in a.env)}
        cmd = [str(CLAUDE), "-p", "say hi", "--output-format", "json", "--no-session-persistence",
               "--system-prompt", "Answer briefly.", "--tools", "Bash"]
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), a.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
    server.close()
    text = out.decode(errors="replace").strip().splitlines()
    result = None
    try:
        result = json.loads(text[-1]).get("result") if text else None
    except ValueError:
        pass
    print(json.dumps({"mode": a.mode, "env": a.env, "hold_s": a.hold_s, "rc": proc.returncode,
                      "wall_s": round(time.monotonic() - t0, 1), "result": result, "requests": seen,
                      "stderr_tail": err.decode(errors="replace")[-600:]}))
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())

"""Which Responses-API stream events keep the real Codex CLI waiting through a long prefill (issue 27).

A stand-in Responses server on 127.0.0.1 answers ``POST /v1/responses`` (always a stream from
Codex) by sending ``response.created``, then holding the stream open for ``--hold-s`` seconds
while sending one kind of filler every ``--every-s``, then a short text answer
("STREAMED") and ``response.completed``. The real CLI runs against it with the provider's
``stream_idle_timeout_ms`` set low (``--idle-ms``, default 15000: Codex's own default is 300 s),
so what ends an attempt is Codex's own idle watchdog, not the server.

Modes (the filler): ``none`` (nothing: the control, which must time out), ``comment``
(``: keep-alive`` SSE comments), ``in_progress`` (``response.in_progress`` again, with the next
``sequence_number``), ``empty_delta`` (a message item and its output_text part opened at once,
then ``response.output_text.delta`` events with an empty ``delta``).
Usage (as root; a loopback-only namespace keeps the CLI off the network):
  unshare -n sh -c 'ip link set lo up; python benchmarks/diag_codex_watchdog.py --mode in_progress'
Prints one JSON line: the CLI's exit code, wall time, its answer, every request seen (a retry is
a second POST) and the tail of its stderr.
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
CODEX = Path(os.environ.get("OMLX_CODEX_BIN", REPO / "clients" / "node_modules" / ".bin" / "codex"))
MODEL = "local-model"  # not in Codex's own catalogue (CLIENTS.md)
MODES = ["none", "comment", "in_progress", "empty_delta"]


class Stream:
    """The stream events of one response, numbered as the Responses API numbers them."""

    def __init__(self) -> None:
        self.seq = 0
        self.response = {"id": "resp_1", "object": "response", "created_at": int(time.time()), "status": "in_progress",
                         "model": MODEL, "output": [], "error": None, "incomplete_details": None,
                         "instructions": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                         "temperature": None, "top_p": None, "metadata": {}, "usage": None}
        self.item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    def ev(self, type_: str, **fields) -> bytes:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(obj)}\n\n".encode()

    def life(self, type_: str) -> bytes:
        return self.ev(type_, response=dict(self.response))

    def open_message(self) -> bytes:
        return (self.ev("response.output_item.added", output_index=0, item=self.item)
                + self.ev("response.content_part.added", item_id="msg_1", output_index=0, content_index=0,
                          part=self.part))

    def delta(self, text: str) -> bytes:
        self.part = {**self.part, "text": self.part["text"] + text}
        return self.ev("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0, delta=text,
                       logprobs=[])

    def finish(self) -> bytes:
        done = {**self.item, "status": "completed", "content": [self.part]}
        common = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
        out = (self.ev("response.output_text.done", **common, text=self.part["text"], logprobs=[])
               + self.ev("response.content_part.done", **common, part=self.part)
               + self.ev("response.output_item.done", output_index=0, item=done))
        self.response = {**self.response, "status": "completed", "output": [done], "usage": {
            "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 11}}
        return out + self.life("response.completed")


async def serve(port: int, mode: str, hold_s: float, every_s: float, seen: list[dict]) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                t0 = time.monotonic()
                entry = {"t_s": round(t0 - START, 1), "method": method, "path": path.split("?")[0]}
                seen.append(entry)
                if method == "POST" and path.startswith("/v1/responses"):
                    entry["stream"] = bool(json.loads(body).get("stream")) if body else None
                    await stream_answer(writer, mode, hold_s, every_s, entry)
                    entry["served_s"] = round(time.monotonic() - t0, 1)
                    return  # the stream ends with the connection
                status = "426 Upgrade Required" if headers.get("upgrade") else "404 Not Found"
                data = b'{"error": {"message": "not here"}}'
                writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the server is closing
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def stream_answer(writer: asyncio.StreamWriter, mode: str, hold_s: float, every_s: float, entry: dict) -> None:
    s = Stream()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                 b"connection: close\r\n\r\n" + s.life("response.created"))
    if mode == "empty_delta":
        writer.write(s.open_message())
    await writer.drain()
    end = time.monotonic() + hold_s
    entry["fillers"] = 0
    while time.monotonic() < end:
        await asyncio.sleep(every_s)
        if mode == "comment":
            writer.write(b": keep-alive\n\n")
        elif mode == "in_progress":
            writer.write(s.life("response.in_progress"))
        elif mode == "empty_delta":
            writer.write(s.delta(""))
        if mode != "none":
            entry["fillers"] += 1
        await writer.drain()  # raises once the client has gone
    if mode != "empty_delta":
        writer.write(s.open_message())
    writer.write(s.delta("STREAMED") + s.finish())
    await writer.drain()
    entry["finished"] = True


START = time.monotonic()

CONFIG = """\
model = "{model}"
model_provider = "local"
model_instructions_file = "{home}/instructions.md"

[model_providers.local]
name = "stand-in"
base_url = "http://127.0.0.1:{port}/v1"
env_key = "DIAG_KEY"
wire_api = "responses"
stream_idle_timeout_ms = {idle_ms}
"""


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--idle-ms", type=int, default=15000, help="the provider's stream_idle_timeout_ms")
    ap.add_argument("--hold-s", type=float, default=45.0)
    ap.add_argument("--every-s", type=float, default=5.0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args()
    seen: list[dict] = []
    server = await serve(a.port, a.mode, a.hold_s, a.every_s, seen)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "codex-home"
        home.mkdir()
        (home / "instructions.md").write_text("Answer briefly.\n")
        (home / "config.toml").write_text(CONFIG.format(model=MODEL, home=home, port=a.port, idle_ms=a.idle_ms))
        env = {**os.environ, "HOME": tmp, "CODEX_HOME": str(home), "DIAG_KEY": "unused"}
        cmd = [str(CODEX), "exec", "--skip-git-repo-check", "-c", "analytics.enabled=false",
               "-c", "check_for_update_on_startup=false", "-c", "feedback.enabled=false",
               "--disable", "plugins", "--disable", "remote_plugin", "--disable", "apps", "say hi"]
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), a.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
    server.close()
    posts = [r for r in seen if r["method"] == "POST"]
    print(json.dumps({"mode": a.mode, "idle_ms": a.idle_ms, "hold_s": a.hold_s, "every_s": a.every_s,
                      "rc": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
                      "answer": out.decode(errors="replace").strip()[-200:], "num_posts": len(posts),
                      "first_served": posts[0].get("finished", False) if posts else None,
                      "requests": seen, "stderr_tail": err.decode(errors="replace")[-800:]}))
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())

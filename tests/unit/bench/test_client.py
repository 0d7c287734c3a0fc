"""`omlx bench`'s timed SSE client (httpx-sse) against a scripted server: TTFT at the first content
event, keep-alive comments skipped, and every failure reported in the result, never raised."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx

from omlx.bench.client import StreamResult, Target, stream_chat

SSE = {"content-type": "text/event-stream"}
DELAY_S = 0.2  # before the first content event; the headers and the role chunk come at once


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk",
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return f"data: {json.dumps(obj)}\n\n".encode()


async def script(*parts: bytes | float) -> AsyncIterator[bytes]:
    for p in parts:
        if isinstance(p, float):
            await asyncio.sleep(p)
        else:
            yield p


def run(handler: Callable[[httpx.Request], httpx.Response]) -> StreamResult:
    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_chat(client, Target("base", "http://test", model="m"), {"messages": []})
    return asyncio.run(go())


def test_ttft_is_the_first_content_event_and_keepalives_are_skipped() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers=SSE, content=script(
            chunk({"role": "assistant", "content": ""}), b": keep-alive\n\n", DELAY_S, b": keep-alive\n\n",
            # one event cut across two reads, with a CRLF line end
            chunk({"content": "Hel"})[:20], 0.01, chunk({"content": "Hel"})[20:].replace(b"\n\n", b"\r\n\r\n"),
            chunk({"content": "lo"}), chunk({}, finish="stop"),
            chunk(usage={"prompt_tokens": 7, "completion_tokens": 2,
                         "prompt_tokens_details": {"cached_tokens": 3}}),
            b"data: [DONE]\n\n", chunk({"content": "after DONE: not read"})))

    res = run(handler)
    assert res.ok and res.error is None and res.status == 200, res
    assert res.text == "Hello" and res.num_content_chunks == 2 and res.finish_reason == "stop"
    assert DELAY_S <= res.ttft_s < res.total_s and res.chunk_times[0] == res.ttft_s
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens, res.token_count_source) == (7, 2, 3, "usage")
    body = json.loads(seen[0].content)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    assert seen[0].headers["accept"] == "text/event-stream"


def test_a_4xx_json_body_is_reported_with_its_status() -> None:
    err = b'{"error": {"message": "temperature must be >= 0", "type": "invalid_request_error"}}'
    res = run(lambda r: httpx.Response(400, headers={"content-type": "application/json"}, content=err))
    assert not res.ok and res.status == 400
    assert res.error == "HTTP 400: " + err.decode()


def test_a_200_that_is_not_an_event_stream_is_reported() -> None:
    res = run(lambda r: httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}]}))
    assert not res.ok and res.status == 200
    assert res.error.startswith("SSEError: ") and "application/json" in res.error, res.error


def test_an_error_event_instead_of_content_is_a_failed_request() -> None:
    res = run(lambda r: httpx.Response(200, headers=SSE, content=script(
        chunk({"role": "assistant", "content": ""}),
        b'data: {"error":{"message":"boom","type":"server_error"}}\n\n', b"data: [DONE]\n\n")))
    assert not res.ok and res.error == "no content and no finish_reason in the stream"


def test_a_cut_connection_is_reported_not_raised() -> None:
    async def cut() -> AsyncIterator[bytes]:
        yield chunk({"content": "Hi"})
        raise httpx.ReadError("connection reset")

    res = run(lambda r: httpx.Response(200, headers=SSE, content=cut()))
    assert not res.ok and res.error == "ReadError: connection reset" and res.chunk_times and res.total_s

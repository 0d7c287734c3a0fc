"""The cluster front's SSE relay: where each protocol's stream ends, and the error it writes at a cut.

The relay's output is decoded with the real SDKs' SSE decoders (openai, anthropic), as a client
would read it.
"""

from __future__ import annotations

import json

import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from openai._streaming import SSEDecoder as OpenAIDecoder

from omlx.api.sse_relay import ANTHROPIC, OPENAI, RESPONSES, SseRelay, protocol_of
from omlx.errors import ClusterUnavailableError, EngineError

ERR = ClusterUnavailableError("the cluster pipeline was lost mid-response: node n2 is lost")


def decode(data: bytes, decoder=OpenAIDecoder) -> list[tuple[str | None, str]]:
    return [(e.event, e.data) for e in decoder().iter_bytes(iter([data]))]


def feed_bytewise(relay: SseRelay, data: bytes) -> list[bytes]:
    """Feed one byte at a time: events come out whole however the upstream chunks them."""
    out = []
    for i in range(len(data)):
        out += [e.raw for e in relay.feed(data[i:i + 1])]
    return out


def test_protocol_of_paths() -> None:
    assert protocol_of("/v1/messages") == ANTHROPIC
    assert protocol_of("/v1/responses") == RESPONSES
    assert protocol_of("/v1/chat/completions") == OPENAI
    assert protocol_of("/v1/completions") == OPENAI
    with pytest.raises(ValueError, match="unknown SSE protocol"):
        SseRelay("grpc")


OPENAI_STREAM = (b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
                 b": keep-alive\n\n"
                 b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')


def test_openai_ends_at_done_and_a_cut_gets_an_error_chunk_then_done() -> None:
    relay = SseRelay(OPENAI)
    partial = b'data: {"id":"c1","cho'
    assert feed_bytewise(relay, OPENAI_STREAM + partial) == [e + b"\n\n" for e in OPENAI_STREAM.split(b"\n\n")[:-1]]
    assert not relay.ended and relay.num_events == 3 and relay.num_pending_bytes == len(partial)
    events = decode(relay.error_event(ERR))
    assert events[-1] == (None, "[DONE]")
    body = json.loads(events[0][1])
    assert body == {"error": {"message": ERR.message, "type": "server_error", "param": None,
                              "code": "cluster_unavailable"}}
    finished = SseRelay(OPENAI)
    finished.feed(OPENAI_STREAM + b"data: [DONE]\n\n")
    assert finished.ended


def test_anthropic_ends_at_message_stop_or_error_and_a_cut_gets_an_error_event() -> None:
    head = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1"}}\n\n'
            b'event: ping\ndata: {"type":"ping"}\n\n'
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hi"}}\n\n')
    relay = SseRelay(ANTHROPIC)
    relay.feed(head)
    assert not relay.ended
    events = decode(relay.error_event(ERR), AnthropicDecoder)
    assert [e for e, _ in events] == ["error"]
    assert json.loads(events[0][1]) == {"type": "error", "error": {"type": "api_error", "message": ERR.message}}
    for last in (b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
                 b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'):
        done = SseRelay(ANTHROPIC)
        done.feed(head + last)
        assert done.ended


def responses_event(name: str, seq: int, **fields) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': seq, **fields})}\n\n".encode()


def test_responses_cut_gets_response_failed_with_the_last_response_object() -> None:
    resp = {"id": "resp_1", "object": "response", "status": "in_progress", "error": None, "output": []}
    relay = SseRelay(RESPONSES)
    relay.feed(responses_event("response.created", 0, response=resp)
               + responses_event("response.in_progress", 1, response=resp)
               + responses_event("response.output_text.delta", 2, item_id="msg_1", delta="Hi"))
    assert not relay.ended
    (name, data), = decode(relay.error_event(ERR))
    ev = json.loads(data)
    assert name == ev["type"] == "response.failed" and ev["sequence_number"] == 3
    assert ev["response"]["id"] == "resp_1" and ev["response"]["status"] == "failed"
    assert ev["response"]["error"] == {"code": "cluster_unavailable", "message": ERR.message}
    for last in ("response.completed", "response.incomplete", "response.failed", "error"):
        done = SseRelay(RESPONSES)
        done.feed(responses_event(last, 0, response=resp))
        assert done.ended, last


def test_responses_cut_before_any_response_object_gets_an_error_event() -> None:
    relay = SseRelay(RESPONSES)
    relay.feed(b": keep-alive\n\n")
    (name, data), = decode(relay.error_event(EngineError("boom")))
    assert name == "error"
    assert json.loads(data) == {"type": "error", "sequence_number": 0, "code": "server_error",
                                "message": "boom", "param": None}


@pytest.mark.parametrize("protocol, event", [
    (OPENAI, b'data: {"error":{"message":"cluster rank 0: a pipeline peer was lost","type":"server_error",'
             b'"param":null,"code":"cluster_unavailable"}}\n\n'),
    (ANTHROPIC, b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                b'"message":"cluster rank 0: a pipeline peer was lost"}}\n\n'),
    (RESPONSES, b'event: response.failed\ndata: {"type":"response.failed","sequence_number":5,"response":'
                b'{"id":"resp_1","status":"failed","error":{"code":"cluster_unavailable",'
                b'"message":"cluster rank 0: a pipeline peer was lost"}}}\n\n'),
])
def test_the_workers_own_cluster_error_event_is_found_and_renamed(protocol: str, event: bytes) -> None:
    relay = SseRelay(protocol)
    (ev,) = relay.feed(event)
    assert relay.cluster_error(ev) == "cluster rank 0: a pipeline peer was lost"
    (name, data), = decode(relay.with_message(ev, "node n2 is lost. cluster rank 0: ..."))
    assert name == ev.name
    assert "node n2 is lost. cluster rank 0: ..." in data and json.loads(data)
    other = SseRelay(protocol)
    (plain,) = other.feed(b'data: {"choices":[]}\n\n')
    assert other.cluster_error(plain) is None and other.with_message(plain, "x") == plain.raw


def test_fields_are_read_by_the_sse_rules_and_bytes_pass_unchanged() -> None:
    # httpx-sse's decoder reads the fields: data lines joined by \n, one leading space dropped,
    # id/retry and unknown fields ignored; the event's bytes (a comment's too) are kept as sent.
    stream = (b": keep-alive\n\n"
              b"event: response.output_text.delta\nid: 7\nretry: 10\nx-unknown: 1\ndata:{\"a\":\ndata:  1}\n\n"
              b"event: message\ndata: [DONE]\n\n")
    relay = SseRelay(RESPONSES)
    comment, delta, done = relay.feed(stream)
    assert (comment.name, comment.data) == (None, None) and comment.raw == b": keep-alive\n\n"
    assert delta.name == "response.output_text.delta" and delta.data == '{"a":\n 1}' and delta.json() == {"a": 1}
    assert b"".join(e.raw for e in (comment, delta, done)) == stream
    assert done.name is None and done.data == "[DONE]" and done.json() is None

"""OpenAI stream chunks: `ChunkFramer`'s pre-serialized per-token chunks are byte for byte the
chunk dicts the route used to build and `json.dumps` whole (the reference below), and a turn's
events frame to the same stream whether the engine's events came one by one or in batches."""

from __future__ import annotations

import asyncio
import json

import pytest

from omlx.api.openai_framing import SSE_DONE, ChunkFramer, legacy_logprobs, logprob_json, usage_json
from omlx.api.turn import ModelTurn, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from omlx.errors import EngineError
from omlx.request import Failed, Finished, TextDelta, TokenLogprob, Usage
from tests.helpers import BatchedFake

TEXTS = ["", "Hello", " world", 'say "hi"\\n', "line\nbreak\ttab", "naïve café ✓ 日本語 🙂", "\u2028\x00\x1f", "</script>"]
LPS = [TokenLogprob("Hé", -0.25, [72, 195, 169], [TokenLogprob("Hé", -0.25, [72, 195, 169]), TokenLogprob("x", -3.5, [120])])]


def reference_chunk(rid, created, model, *, chat, include_usage, want_lp, delta, lps=None, finish=None):
    """The chunk exactly as omlx.api.openai built it before ChunkFramer (dict, then json.dumps)."""
    if chat:
        ch = {"index": 0, "delta": delta, "finish_reason": finish}
        ch["logprobs"] = {"content": [logprob_json(x) for x in lps]} if (want_lp and lps) else None
    else:
        ch = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
              "logprobs": legacy_logprobs(lps) if (want_lp and lps) else None}
    c = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
         "model": model, "choices": [ch]}
    if include_usage:
        c["usage"] = None
    return f"data: {json.dumps(c, ensure_ascii=False, separators=(',', ':'))}\n\n"


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("want_lp", [True, False])
def test_per_token_chunks_are_the_reference_bytes(chat, include_usage, want_lp):
    model = 'org/model "q" ✓'
    f = ChunkFramer("chatcmpl-abc", 1700000000, model, chat=chat, include_usage=include_usage, want_logprobs=want_lp)
    ref = dict(chat=chat, include_usage=include_usage, want_lp=want_lp)
    for text in TEXTS:
        for lps in (None, LPS):
            assert f.content(text, lps) == reference_chunk("chatcmpl-abc", 1700000000, model, **ref,
                                                           delta={"content": text}, lps=lps)
        if chat:
            assert f.reasoning(text) == reference_chunk("chatcmpl-abc", 1700000000, model, **ref,
                                                        delta={"reasoning_content": text})
        else:
            assert f.reasoning(text) == ""  # completions have no reasoning field
    assert json.loads(f.content("x")[len("data: "):])["choices"][0]["index"] == 0


def test_frame_writes_the_stream_end_and_errors_as_before():
    f = ChunkFramer("chatcmpl-abc", 1, "m", chat=True, include_usage=True, want_logprobs=False)
    u = Usage(5, 2, num_cached_tokens=3)
    end = f.frame(Finished("length", u))
    chunks = end.split("\n\n")
    assert chunks[0] + "\n\n" == reference_chunk("chatcmpl-abc", 1, "m", chat=True, include_usage=True, want_lp=False,
                                                 delta={}, finish="length")
    assert json.loads(chunks[1][len("data: "):]) == {"id": "chatcmpl-abc", "object": "chat.completion.chunk",
                                                     "created": 1, "model": "m", "choices": [], "usage": usage_json(u)}
    assert end.endswith(SSE_DONE)
    assert f.frame(Finished("stop", u), num_tool_calls=1).count('"finish_reason":"tool_calls"') == 1
    err = f.frame(Failed(RuntimeError("boom")))
    assert err == f"data: {json.dumps(EngineError('boom').openai_body(), ensure_ascii=False, separators=(',', ':'))}\n\n" + SSE_DONE
    assert f.frame(ToolCallEnd(0)) == "" and f.frame(ToolCallArgsDelta(0, "")) == ""
    start = json.loads(f.frame(ToolCallStart(0, "call_1", "write"))[len("data: "):])
    assert start["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                            "function": {"name": "write", "arguments": ""}}]}
    args = json.loads(f.frame(ToolCallArgsDelta(0, '{"a"'))[len("data: "):])
    assert args["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}




def test_the_stream_does_not_depend_on_how_engine_events_are_batched():
    text = '<think>Hmm.</think>Sure.\n<tool_call>\n{"name": "write", "arguments": {"path": "a"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
    engine = [TextDelta(text[i:i + 4], [i]) for i in range(0, len(text), 4)] + [Finished("stop", Usage(3, 9))]

    def stream(batches):
        f = ChunkFramer("chatcmpl-abc", 1, "m", chat=True, include_usage=True, want_logprobs=False)
        turn = ModelTurn(BatchedFake(batches), tool_dialect="hermes", tools=tools, think=("<think>", "</think>"))

        async def go():
            return "".join(["".join(f.frame(ev, turn.num_tool_calls) for ev in b) async for b in turn.batches()])

        out = asyncio.run(go())
        return [json.loads(c[len("data: "):]) for c in out.split("\n\n") if c.startswith("data: {")], out

    one, raw = stream([[ev] for ev in engine])
    for batches in ([engine], [engine[i:i + 5] for i in range(0, len(engine), 5)]):
        other, _ = stream(batches)
        for a, b in zip(one, other):  # tool-call ids are random per parser
            for c in (a, b):
                for tc in (c["choices"][0]["delta"].get("tool_calls", []) if c["choices"] else []):
                    tc.pop("id", None)
        assert other == one
    deltas = [c["choices"][0]["delta"] for c in one if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm."
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert one[-2]["choices"][0]["finish_reason"] == "tool_calls" and raw.endswith(SSE_DONE)

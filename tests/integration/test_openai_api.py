"""The OpenAI API against a real `omlx serve` process with the real SmolLM2, through the official SDK."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.helpers import MODEL_ID, ServerProcess, metric_samples, metric_value

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ"
                                                      "AAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="}}
PLACEHOLDER = "[{} omitted: this model reads text only]"
DROPPED = "omlx_dropped_content_total"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_lines(server, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def data_events(lines: list[str]) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_health_reports_blas_and_model(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok"
    assert h["models"][0]["id"] == MODEL_ID
    assert h["blas"]["name"] in ("openblas", "reference", "accelerate", "unknown")


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL_ID in ids


def test_greedy_chat_answers_paris(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_matches_non_stream_and_has_one_finish_reason(client):
    full = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_include_usage_final_chunk(server):
    body = {"model": MODEL_ID, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Reply with OK."}]}
    events = data_events(sse_lines(server, body))
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    u = last["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] > 0
    assert all(e["usage"] is None for e in events[:-2])
    # without include_usage: no choices-empty chunk at all
    events2 = data_events(sse_lines(server, {**body, "stream_options": None}))
    assert all(e == "[DONE]" or e["choices"] for e in events2)


def test_natural_eos_sends_stop_once_and_length_with_max_tokens(server):
    body = {"model": MODEL_ID, "stream": True, "max_tokens": 512, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello in three words."}]}
    ev = [e for e in data_events(sse_lines(server, body)) if e != "[DONE]"]
    reasons = [e["choices"][0]["finish_reason"] for e in ev]
    assert reasons[-1] == "stop" and reasons.count("stop") == 1 and all(r is None for r in reasons[:-1])
    ev = [e for e in data_events(sse_lines(server, {**body, "max_tokens": 2})) if e != "[DONE]"]
    reasons = [e["choices"][0]["finish_reason"] for e in ev]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_stop_string_spanning_tokens_is_not_leaked(client):
    base = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24).choices[0].message.content
    assert "Paris" in base
    idx = base.index("Paris")
    stop = base[idx + 1: idx + 4]  # "ari": inside one or more tokens
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24, stop=[stop])
    assert r.choices[0].message.content == base[: idx + 1]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24, stop=[stop], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == base[: idx + 1]


def test_length_finish(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs_non_stream_and_stream(client, server):
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Count: one two"}],
                                       temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4  # greedy: the pick is the top one
    body = {"model": MODEL_ID, "stream": True, "logprobs": True, "top_logprobs": 2, "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "Count: one two"}]}
    ev = [e for e in data_events(sse_lines(server, body)) if e != "[DONE]"]
    entries = [x for e in ev if e["choices"] and e["choices"][0].get("logprobs") for x in e["choices"][0]["logprobs"]["content"]]
    assert len(entries) == ev[-1]["usage"]["completion_tokens"]
    assert all(len(x["top_logprobs"]) == 2 and isinstance(x["bytes"], list) for x in entries)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Write a word."}], temperature=1.0, max_tokens=12, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_sampling_params_accepted(client):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}, logit_bias={"1000": -5},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 5
    chunks = list(client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("n", [0, -1, True, 2])
def test_n_other_than_one_is_400(server, n):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_ID, "n": n, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error" and "code" in err


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="claude-haiku-x", messages=CHAT)
    body = ei.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["message"] == "The model 'claude-haiku-x' does not exist"


@pytest.mark.parametrize("raw", [
    '{"model": "x", "messages": [{"role": "user", "content": "hi"}], x}',
    "[]",
    "",
    "not json",
])
def test_malformed_json_is_400_in_openai_shape(server, raw):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("patch,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"stop": 5}, "stop"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_values_name_the_parameter(server, patch, param):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **patch}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_image_url_part_is_served_as_a_placeholder_and_counted(client, server):
    """A screenshot (image_url) and a PDF (file) part answer 200, streamed and not; the prompt is the
    request's with the placeholder text written in by hand; /metrics counts each part."""
    before = metric_samples(server)
    pdf = {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"}}
    asked = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, IMAGE_URL, pdf]}]
    by_hand = [{"role": "user", "content": "What is in this picture?\n" + PLACEHOLDER.format("image") + "\n"
                + PLACEHOLDER.format("file")}]
    r = client.chat.completions.create(model=MODEL_ID, messages=asked, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    hand = client.chat.completions.create(model=MODEL_ID, messages=by_hand, temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == hand.usage.prompt_tokens and r.choices[0].message.content == hand.choices[0].message.content
    # other bytes, the same placeholder: the prompt is the one just served, from the prefix cache
    other = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQSkZJRgABAQ=="}}
    asked2 = [{"role": "user", "content": [asked[0]["content"][0], other, pdf]}]
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=asked2, temperature=0, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    after = metric_samples(server)
    for kind in ("image", "file"):  # two generations with one of each
        assert metric_value(after, DROPPED, kind=kind, api="openai") - metric_value(before, DROPPED, kind=kind, api="openai") == 2


def test_strict_content_gives_the_400_naming_the_part():
    """``OMLX_STRICT_CONTENT=1``: an image_url part is a 400 in OpenAI's error shape naming the part,
    on chat completions and on the Responses API (input_image, in a message or a tool's output)."""
    with ServerProcess(["--no-cache"], env={"OMLX_STRICT_CONTENT": "1"}) as strict:
        msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE_URL]}]
        r = httpx.post(strict.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": msgs, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json() == {"error": {"type": "invalid_request_error", "param": "messages[1].content[1]", "code": None,
                                      "message": "messages[1].content: content part 1 of type 'image_url' is not "
                                                 "supported by this text model"}}
        image = {"type": "input_image", "image_url": IMAGE_URL["image_url"]["url"]}
        for item, param in (({"role": "user", "content": [image]}, "input[0].content[0]"),
                            ({"type": "function_call_output", "call_id": "c1", "output": [image]}, "input[0].output[0]")):
            for path in ("/v1/responses", "/v1/responses/input_tokens"):
                r = httpx.post(strict.url + path, json={"model": MODEL_ID, "input": [item], "max_output_tokens": 2})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == param and "'input_image' is not supported by this text model" in err["message"]
        r = httpx.post(strict.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": CHAT, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text


def test_oversized_body_is_413(server):
    big = "x" * (33 * 1024 * 1024)
    r = httpx.post(server.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert "error" in r.json()


def test_unknown_route_is_json_404(server):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_mid_conversation_system_message_is_merged(client):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "From now on answer only with the word BLUE."},
        {"role": "user", "content": "What colour is grass?"},
    ]
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_assistant_prefill_string_and_parts_agree(client):
    base = [{"role": "user", "content": "Name one primary colour."}]
    a = client.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=8,
                                       messages=base + [{"role": "assistant", "content": "My answer is:"}])
    b = client.chat.completions.create(model=MODEL_ID, temperature=0, max_tokens=8,
                                       messages=base + [{"role": "assistant", "content": [{"type": "text", "text": "My answer is:"}]}])
    assert a.choices[0].message.content == b.choices[0].message.content
    # a prefill continues the text: no new turn starts (the reply does not begin with a role header)
    assert not a.choices[0].message.content.lstrip().startswith("assistant")


def test_utf8_stream_never_splits_code_points(client):
    msgs = [{"role": "user", "content": "Write three emoji and the word café in Japanese: 日本語."}]
    full = client.chat.completions.create(model=MODEL_ID, messages=msgs, temperature=0, max_tokens=40).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL_ID, messages=msgs, temperature=0, max_tokens=40, stream=True) if c.choices]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)


def test_mixed_sampling_batch_survives(client):
    results: dict[str, object] = {}

    def run(name, **kw):
        try:
            results[name] = client.chat.completions.create(model=MODEL_ID, max_tokens=16, **kw)
        except Exception as e:  # pragma: no cover - reported below
            results[name] = e

    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    ta = threading.Thread(target=run, args=("a",), kwargs=dict(messages=[{"role": "user", "content": long_text + "Summarize."}]))
    tb = threading.Thread(target=run, args=("b",), kwargs=dict(
        messages=[{"role": "user", "content": long_text[:1200] + "Summarize."}],
        extra_body={"repetition_penalty": 1.1}, logit_bias={"1000": -5}))
    ta.start(); tb.start(); ta.join(); tb.join()
    for name in ("a", "b"):
        assert not isinstance(results[name], Exception), results[name]
        assert results[name].choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=8)
    assert r.choices[0].message.content


@pytest.mark.parametrize("raw", [
    '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}' % MODEL_ID,
    '{"model": "x", "messages": ' + "[" * 100000 + "]" * 100000 + "}",
])
def test_invalid_text_and_deep_nesting_are_400(server, raw):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("seed", [-5, -(2**63), 2**63 - 1])
def test_every_signed_64_bit_seed_is_accepted(client, seed):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=1.0, max_tokens=4, seed=seed)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,extra", [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})])
def test_a_seed_outside_signed_64_bits_is_400_naming_it(server, path, extra):
    """OpenAI's seed is a signed 64-bit integer; 2**80 was folded mod 2**64 into seed 0's draws."""
    r = httpx.post(server.url + path, timeout=60, json={"model": MODEL_ID, "max_tokens": 4, "temperature": 1.0,
                                                        "seed": 2**80, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "seed") and str(2**63 - 1) in err["message"], err


def test_model_retrieve_percent_encoded_id(server):
    r = httpx.get(server.url + "/v1/models/SmolLM2-135M%2DInstruct")
    assert r.status_code == 200 and r.json()["id"] == MODEL_ID


def test_health_names_the_blas_that_serves_mlx(server):
    blas = httpx.get(server.url + "/health").json()["blas"]
    assert "numpy.libs" not in (blas["path"] or "")

"""Prompt-lookup speculative decoding over HTTP: the real SmolLM2-135M, `omlx serve
--lookup-draft-tokens 6` against a server with drafting off, through the real `openai` SDK.

The `edit` scenario (a function in the prompt, returned with one rename) repeats its input, so
verify steps run and accept drafts (benchmarks/bench_lookup.py: 67% accepted on this prompt);
greedy text, streamed and not, its logprobs, a stop string that ends the text inside an
accepted draft, and the completion token count equal the plain server's; the drafts show in
`usage.completion_tokens_details` (OpenAI's accepted/rejected prediction tokens), `/metrics`
and `/v1/admin/recent`, and nowhere on the plain server.
"""

from __future__ import annotations

import inspect
import time

import httpx
import openai
import pytest

from tests.helpers import ServerProcess, metric_samples, metric_value, running


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    on = ServerProcess(["--lookup-draft-tokens", "6", "--no-cache"], base_path=tmp_path_factory.mktemp("lookup_on"))
    off = ServerProcess(["--no-cache"], base_path=tmp_path_factory.mktemp("lookup_off"))
    with running(on, off):
        yield on, off


def _messages() -> list[dict]:
    import omlx.engine.lookup as source

    code = inspect.getsource(source.PromptLookup._extend)
    return [{"role": "user", "content": "Here is a Python function:\n\n```python\n" + code + "```\n\nReturn it "
             "unchanged except that `table` is renamed to `grams`. Reply with the code only."}]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _ask(server: ServerProcess, stream: bool) -> tuple[str, int | None]:
    client = _client(server)
    msgs = _messages()
    if stream:
        parts = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=48,
                                               temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices), None
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=48, temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


def test_drafting_on_gives_the_plain_servers_greedy_text(servers):
    on, off = servers
    text_on, n_on = _ask(on, stream=False)
    text_off, n_off = _ask(off, stream=False)
    assert text_on == text_off and n_on == n_off == 48, (text_on, text_off)
    assert _ask(on, stream=True)[0] == text_off
    # The load log says drafting is on (the log reaches its file a little after the line is written).
    deadline = time.monotonic() + 15
    while "prompt-lookup drafting on (experimental): up to 6 tokens" not in " ".join(on.log().split()):
        assert time.monotonic() < deadline, on.log()
        time.sleep(0.5)
    assert "prompt-lookup drafting on" not in " ".join(off.log().split())
    import mlx.core as mx  # on a CPU device (CI) the slower decode is announced, never silent

    if mx.default_device() == mx.cpu:
        assert "drafting makes decode slower on a CPU device" in " ".join(on.log().split()), on.log()
    assert "grams" in text_on or "table" in text_on  # it is copying the function, the case drafts serve


def _drafts(server: ServerProcess) -> float:
    """omlx_draft_tokens_total of the test model on ``server``'s /metrics (0 when absent)."""
    return metric_value(metric_samples(server), "omlx_draft_tokens_total", model="SmolLM2-135M-Instruct")


def test_drafts_are_counted_in_usage_metrics_and_recent_requests(servers):
    on, off = servers
    before = _drafts(on)
    r = _client(on).chat.completions.create(model="SmolLM2-135M-Instruct", messages=_messages(), max_tokens=48,
                                            temperature=0)
    d = r.usage.completion_tokens_details
    assert d is not None and d.accepted_prediction_tokens > 0, r.usage
    assert d.rejected_prediction_tokens >= 0
    assert _drafts(on) - before == d.accepted_prediction_tokens + d.rejected_prediction_tokens
    row = httpx.get(on.url + "/v1/admin/recent?limit=1", timeout=30).json()["requests"][0]
    assert row["num_accepted_draft_tokens"] == d.accepted_prediction_tokens
    assert row["num_draft_tokens"] == d.accepted_prediction_tokens + d.rejected_prediction_tokens
    plain = _client(off).chat.completions.create(model="SmolLM2-135M-Instruct", messages=_messages(), max_tokens=8,
                                                 temperature=0)
    assert plain.usage.completion_tokens_details is None and _drafts(off) == 0


def test_logprobs_and_a_stop_string_inside_a_draft_equal_the_plain_server(servers):
    on, off = servers
    kw = dict(model="SmolLM2-135M-Instruct", messages=_messages(), max_tokens=40, temperature=0, logprobs=True,
              top_logprobs=2)
    a = _client(on).chat.completions.create(**kw).choices[0]
    b = _client(off).chat.completions.create(**kw).choices[0]
    assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content]
    for x, y in zip(a.logprobs.content, b.logprobs.content):
        # A verify step scores several positions in one wider matmul: the same values up to float32 rounding.
        assert x.logprob == pytest.approx(y.logprob, abs=1e-3), (x, y)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
    # A stop string from late in the plain text: on the drafting server (two thirds of its drafts
    # accepted on this prompt) it most likely arrives among a verify step's accepted tokens, which
    # follow it in the same step and must not reach the text.
    text = b.message.content
    stop = text[len(text) * 3 // 4:][:6]
    assert stop.strip(), text
    kw = dict(model="SmolLM2-135M-Instruct", messages=_messages(), max_tokens=40, temperature=0, stop=[stop])
    sa = _client(on).chat.completions.create(**kw).choices[0]
    sb = _client(off).chat.completions.create(**kw).choices[0]
    assert (sa.message.content, sa.finish_reason) == (sb.message.content, sb.finish_reason)
    assert sb.finish_reason == "stop" and stop not in sb.message.content


def _edit(old: str, new: str) -> list[dict]:
    import omlx.engine.lookup as source

    code = inspect.getsource(source.PromptLookup.propose)
    return [{"role": "user", "content": "Here is a Python function:\n\n```python\n" + code + "```\n\nReturn it "
             f"unchanged except that `{old}` is renamed to `{new}`. Reply with the code only."}]


def test_concurrent_requests_draft_in_one_batch_and_each_equals_the_plain_server(servers):
    """Four requests at once (three edits that draft, one chat answer that hardly does) decode in
    one batch on the drafting server; each greedy text equals the plain server's, and a seeded
    sampled edit draws the same text on both (the acceptance rule draws each position with the
    key a plain step would use)."""
    from concurrent.futures import ThreadPoolExecutor

    on, off = servers
    asks = [dict(messages=_edit("draft", "guess"), max_tokens=40, temperature=0),
            dict(messages=_edit("history", "seen"), max_tokens=40, temperature=0),
            dict(messages=[{"role": "user", "content": "Name three rivers of Europe."}], max_tokens=24, temperature=0),
            dict(messages=_edit("tail", "suffix"), max_tokens=40, temperature=0.3, seed=8)]

    def ask(server: ServerProcess, kw: dict) -> tuple[str, int]:
        r = _client(server).chat.completions.create(model="SmolLM2-135M-Instruct", **kw)
        d = r.usage.completion_tokens_details
        return r.choices[0].message.content, (d.accepted_prediction_tokens if d is not None else 0)

    with ThreadPoolExecutor(len(asks)) as pool:
        got_on = list(pool.map(lambda kw: ask(on, kw), asks))
        got_off = list(pool.map(lambda kw: ask(off, kw), asks))
    assert [t for t, _ in got_on] == [t for t, _ in got_off]
    assert got_on[0][1] > 0 and got_on[1][1] > 0 and got_on[3][1] > 0, got_on

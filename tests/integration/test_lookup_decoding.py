"""Prompt-lookup speculative decoding over HTTP: the real SmolLM2-135M, `omlx serve
--lookup-draft-tokens 6` against a server with drafting off, through the real `openai` SDK.

The `edit` scenario (a function in the prompt, returned with one rename) repeats its input, so
verify steps run and accept drafts (benchmarks/bench_lookup.py: 67% accepted on this prompt);
greedy text, streamed and not, and the completion token count equal the plain server's.
"""

from __future__ import annotations

import inspect
import time

import openai
import pytest

from tests.helpers import ServerProcess, running


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    on = ServerProcess(["--lookup-draft-tokens", "6", "--no-cache"], base_path=tmp_path_factory.mktemp("lookup_on"))
    off = ServerProcess(["--no-cache"], base_path=tmp_path_factory.mktemp("lookup_off"))
    with running(on, off):
        yield on, off


def _ask(server: ServerProcess, stream: bool) -> tuple[str, int | None]:
    import omlx.engine.lookup as source

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    code = inspect.getsource(source.PromptLookup._extend)
    msgs = [{"role": "user", "content": "Here is a Python function:\n\n```python\n" + code + "```\n\nReturn it "
             "unchanged except that `table` is renamed to `grams`. Reply with the code only."}]
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

    if mx.default_device().type == mx.DeviceType.cpu:
        assert "drafting makes decode slower on a CPU device" in " ".join(on.log().split()), on.log()
    assert "grams" in text_on or "table" in text_on  # it is copying the function, the case drafts serve

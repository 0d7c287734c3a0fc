"""The prefix cache on a sliding-window model: the real gemma-3-270m (``tests/gemma3_model.py``).

gemma3_text has 18 layers, 15 of them sliding-window (``RotatingKVCache``, window 512) and every
6th global. Through `omlx serve` with the cache (64-token blocks, SSD tier on), greedy output
with a hit equals a server without the cache, text for text: an identical prompt, prompt plus
suffix, a hit that ends mid-window (a 641-token prompt: the window layers restore only their
last 512 tokens), a continuation over the previous answer, eight concurrent requests sharing a
prefix, and after a restart (blocks read back from the SSD tier).
"""

from __future__ import annotations

import threading

import openai
import pytest

from tests.gemma3_model import ensure_gemma3_model
from tests.helpers import ServerProcess, running, shared_models_dir

WORDS = ("river stone lantern orchard copper meadow signal harbor velvet compass thunder maple "
         "circuit falcon glacier ember violet summit quartz anchor").split()


def text(n_words: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def model_dir():
    return ensure_gemma3_model(shared_models_dir())


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("gemma3-cache")
    with running(ServerProcess(["--model", str(model_dir), "--block-size", "64"], base_path=home / "cached"),
                 ServerProcess(["--model", str(model_dir), "--no-cache"], base_path=home / "plain")) as pair:
        yield pair


def complete(s: ServerProcess, prompt: str, max_tokens: int = 12):
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=max_tokens)
    details = r.usage.prompt_tokens_details
    extra = getattr(details, "model_extra", None) or {}
    return r.choices[0].text, details.cached_tokens or 0, extra.get("cached_tokens_cold", 0), r.usage.prompt_tokens


def test_the_layout_is_reported(servers):
    import httpx

    cached, _ = servers
    (m,) = httpx.get(cached.url + "/health").json()["models"]
    assert m["prefix_cache"] == "on" and "W512k0" in m["cache_layout"] and "A" in m["cache_layout"], m


def test_hits_on_a_sliding_window_model_are_exact(servers):
    cached, plain = servers
    long = text(640, seed=1)  # 641 tokens: past the 512-token window
    first, hit0, _, n = complete(cached, long)
    assert n > 600 and hit0 < 64  # at most the BOS (the warm-up request began with it too)
    assert first == complete(plain, long)[0]
    again, hit, _, _ = complete(cached, long)
    assert again == first and hit >= n - 64
    for prompt in (long + " " + text(30, seed=2),  # the hit ends mid-window
                   long + first + " " + text(20, seed=3),  # the next turn, over the answer
                   text(60, seed=4) + " " + text(10, seed=5)):  # under one window
        got, hit, _, n = complete(cached, prompt)
        assert got == complete(plain, prompt)[0], prompt[-80:]
    assert hit < 64  # the last prompt shares nothing but the BOS


def test_eight_concurrent_requests_sharing_a_prefix_are_exact(servers):
    cached, plain = servers
    shared = text(400, seed=6)
    prompts = [shared + " " + text(5 + i, seed=10 + i) for i in range(8)]
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, complete(cached, prompts[i], 8)))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(out) == 8
    for i, p in enumerate(prompts):
        assert out[i][0] == complete(plain, p, 8)[0], i
    assert sum(hit >= 256 for _, hit, _, _ in out.values()) >= 7


def test_after_a_restart_blocks_come_back_from_disk_exactly(servers):
    cached, plain = servers
    long = text(640, seed=1)  # cached by the test above
    cached.stop()
    cached.start()
    prompt = long + " " + text(25, seed=7)
    got, hit, cold, _ = complete(cached, prompt)
    assert got == complete(plain, prompt)[0]
    assert cold >= 512 and hit >= cold, (hit, cold)

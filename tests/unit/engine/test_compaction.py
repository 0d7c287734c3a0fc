"""Dead rows in the runner's merged decode batch (`omlx.engine.compaction`), in-process.

Differential: sequences finish at different steps while others go on decoding and new ones
join a batch that still holds dead rows; every sequence's greedy tokens equal mlx-lm's own
``generate_step`` for its prompt, and a finished sequence's caches hold its own KV, whatever the
compaction policy. Tiny random models of real architectures: llama (plain ``KVCache``),
gemma3 (sliding-window layers, ``BatchRotatingKVCache``) and qwen3-next (gated delta-net state
layers, ``ArraysCache``).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from omlx.engine.compaction import Compaction
from omlx.engine.runner import BatchRunner
from tests.unit.engine.archs import tiny

#: (name, step it is inserted at, prompt length, max_tokens): eight rows that finish one by
#: one, and three that join while dead rows are in the batch.
SCHEDULE = [("a", 0, 5, 4), ("b", 0, 9, 30), ("c", 0, 3, 7), ("d", 0, 12, 11), ("e", 0, 6, 26),
            ("f", 0, 4, 15), ("g", 0, 8, 19), ("h", 0, 7, 23), ("i", 9, 10, 9), ("j", 12, 5, 14),
            ("k", 16, 20, 6)]


def reference(model, prompt: list[int], n: int) -> list[int]:
    return [tok for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def run(model, vocab: int, compaction: Compaction) -> tuple[BatchRunner, dict[str, list[int]], dict[str, list[int]], int]:
    """Drive a runner through `SCHEDULE`; returns it, each name's prompt and tokens, and how
    many sequences finished while two or more rows decoded."""
    rng = random.Random(7)
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=128, mixed_step_size=32, block_size=64,
                         compaction=compaction)
    prompts = {name: [rng.randrange(3, vocab) for _ in range(n)] for name, _, n, _ in SCHEDULE}
    got: dict[str, list[int]] = {}
    name_of: dict[int, str] = {}
    num_merged_finishes = 0
    step = 0
    while step <= max(at for _, at, _, _ in SCHEDULE) or len(runner):
        for name, at, _, m in SCHEDULE:
            if at == step:
                (uid,) = runner.insert_segments([[prompts[name]]], max_tokens=[m])
                name_of[uid], got[name] = name, []
        _, gen = runner.next()
        for r in gen:
            got[name_of[r.uid]].append(r.token)
            if r.finish_reason is None:
                continue
            num_merged_finishes += len(gen) > 1
            # The finished sequence's own KV, not a neighbour's: that of a fresh prefill of its tokens.
            ref_cache = make_prompt_cache(model)
            model(mx.array(r.all_tokens)[None], cache=ref_cache)
            for mine, want in zip(r.prompt_cache, ref_cache):
                if type(want) is KVCache:
                    n = len(r.all_tokens)
                    assert mine.offset == want.offset == n
                    pairs = [(mine.keys[..., :n, :], want.keys[..., :n, :]),
                             (mine.values[..., :n, :], want.values[..., :n, :])]
                elif type(want) is ArraysCache:
                    pairs = list(zip(mine.cache, want.cache))
                else:  # a window layer's buffer is rotated in its own order
                    assert mine.offset == want.offset == len(r.all_tokens)
                    pairs = []
                for x, y in pairs:
                    assert mx.allclose(x, y, atol=1e-4).item(), name_of[r.uid]
        step += 1
        assert step < 500
    return runner, prompts, got, num_merged_finishes


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_next"])
def arch_model(request, model):
    if request.param == "llama":
        return model, 49152
    return tiny(request.param), 512


@pytest.mark.parametrize("fraction", [0.25, 0.0])
def test_rows_finishing_at_different_steps_and_joiners_beside_dead_rows_match_generate_step(arch_model, fraction):
    model, vocab = arch_model
    runner, prompts, got, num_merged_finishes = run(model, vocab, Compaction(fraction))
    for name, _, _, m in SCHEDULE:
        assert got[name] == reference(model, prompts[name], m), name
    assert len(runner) == 0 and runner._rows == [] and runner._num_dead == 0
    if fraction == 0.0:  # every finish in a merged batch of three or more rows is a filter
        assert runner.num_compactions >= num_merged_finishes - 2
    else:  # finished rows waited as dead rows: far fewer filters than finishes
        assert 0 < runner.num_compactions <= num_merged_finishes // 2


def test_the_policy_compacts_at_its_share_of_dead_rows():
    c = Compaction(0.25)
    assert not c.due(32, 0)
    assert not c.due(32, 7)
    assert c.due(32, 8)
    assert c.due(4, 1)
    assert Compaction(0.0).due(32, 1)
    with pytest.raises(ValueError):
        Compaction(1.0)
    # A batch of 32 whose rows finish one at a time is filtered 8 times, not 30 (with two
    # live rows left, the next finish extracts the last one to its own caches instead).
    rows, dead, filters = 32, 0, 0
    for _ in range(31):
        dead += 1
        if rows - dead > 1 and c.due(rows, dead):
            rows, dead, filters = rows - dead, 0, filters + 1
    assert filters == 8

"""`omlx bench` pieces without a server: spreads, ratio orientation, the min-ratio gate, seeded
prompts sized by a counter, and the workloads' shapes."""

from __future__ import annotations

import math

import pytest

from omlx.bench import report
from omlx.bench.prompts import EstimateCounter, PromptFactory
from omlx.bench.workloads import WorkloadConfig, build


def test_summarize_ignores_missing_values():
    assert report.summarize([3.0, None, 1.0, 2.0, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert report.summarize([None]) == {"median": None, "min": None, "max": None, "n": 0}


@pytest.mark.parametrize("figure,base,other,expected", [
    ("ttft_s", 0.5, 1.0, 2.0),          # base twice as fast to first token: 2x
    ("tpot_s", 0.02, 0.01, 0.5),        # base twice as slow per token: 0.5x
    ("decode_tps", 30.0, 10.0, 3.0),    # base 3x the tokens per second
    ("aggregate_tps", 10.0, 40.0, 0.25),
    ("peak_memory_bytes", 2e9, 1e9, 0.5),
    ("cached_tokens", 100, 50, None),   # not a better/worse figure
    ("ttft_s", None, 1.0, None),
    ("decode_tps", 0.0, 1.0, None),
])
def test_ratio_above_one_means_base_is_better(figure, base, other, expected):
    assert report.ratio(figure, base, other) == expected


def test_min_ratio_gate_uses_geometric_means():
    scenarios = {"a": {"s1": {"ratio": {"ttft_s": 2.0, "decode_tps": 0.5}},
                       "s2": {"ratio": {"ttft_s": 0.5, "decode_tps": 0.5}}}}
    overall = report.overall_ratios(scenarios)
    assert overall == {"ttft_s": 1.0, "decode_tps": 0.5}
    assert report.check_min_ratio(overall, 0.9) == ["tpot_s", "decode_tps", "aggregate_tps"]  # missing fails too
    assert math.isclose(report.geomean([1.0, 4.0, None]), 2.0)


def test_prompts_are_seeded_and_sized():
    counter = EstimateCounter()
    pf = PromptFactory(counter)
    a = pf.text("s1", 500)
    assert a == pf.text("s1", 500)
    assert a != pf.text("s2", 500) and a.split()[0] != pf.text("s2", 500).split()[0]
    assert 500 - 25 <= counter.count(a) <= 500  # within one sentence of the target


def test_workload_shapes():
    pf = PromptFactory(EstimateCounter())
    cfg = WorkloadConfig(prompt_tokens=200, concurrency=(1, 3), agent_turns=4, tool_result_tokens=30)
    assert [len(s.bodies) for s in build("concurrency", pf, cfg, 0)] == [1, 3]
    cold, same, suffix, edit = build("cache", pf, cfg, 0)
    text = lambda step: step.bodies[0]["messages"][0]["content"]  # noqa: E731
    assert text(cold) == text(same) and text(suffix).startswith(text(cold)[: -60])
    assert text(edit) != text(cold) and len(text(edit)) > len(text(cold)) // 2
    assert text(build("cache", pf, cfg, 1)[0]) != text(cold)  # each repeat is cold again
    agent = build("agent", pf, cfg, 0)
    assert [s.name for s in agent] == ["turn-1", "turn-2", "turn-3-edit", "turn-4"]
    sizes = [len(s.bodies[0]["messages"]) for s in agent]
    assert sizes == [2, 4, 6, 8] and all(s.bodies[0]["tools"] for s in agent)
    assert agent[2].bodies[0]["messages"][3]["content"] == "[output elided to save context]"
    assert agent[1].bodies[0]["messages"][3]["content"] != "[output elided to save context]"
    (edit,) = build("edit", pf, WorkloadConfig(max_tokens=150), 0)
    ask = edit.bodies[0]["messages"][0]["content"]
    source = ask.split("```python\n")[1].split("\n```")[0]
    compile(source, "edit", "exec")  # real Python, so a model can copy it back
    assert 250 <= EstimateCounter().count(source) <= 300 and edit.bodies[0]["max_tokens"] == 150
    assert "`" + source.split("def ")[1].split("(")[0] + "` is renamed" in ask
    assert ask != build("edit", pf, WorkloadConfig(max_tokens=150), 1)[0].bodies[0]["messages"][0]["content"]
    restart = build("restart", pf, cfg, 0)
    assert [s.restart_before for s in restart] == [False, True]
    with pytest.raises(ValueError, match="unknown scenario"):
        build("nope", pf, cfg, 0)

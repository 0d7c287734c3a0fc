"""omlx.cluster.plan: the DP against brute force, caps, errors, tables and the --nodes parser."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omlx.cluster.plan import (
    GB,
    ModelLayout,
    NodeSpec,
    Plan,
    PlanRequest,
    even_split,
    format_plan_table,
    parse_bytes,
    parse_nodes_spec,
    parse_rate,
    parse_seconds,
    plan_from_counts,
    plan_pipeline,
)
from omlx.errors import ClusterError, OmlxError, PlanError

# --------------------------------------------------------------------------------------------
# Independent reference: the cost model written out from the spec, and brute force over splits.


@dataclass
class RefStage:
    node: NodeSpec
    start: int
    end: int
    total_bytes: int
    time_s: float


def ref_stages(
    layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest, counts: tuple[int, ...]
) -> list[RefStage]:
    num_layers = len(layout.layer_bytes)
    kv_layer = req.context_tokens * req.max_concurrent * layout.kv_bytes_per_token_per_layer
    out: list[RefStage] = []
    start = 0
    for node, n in zip(nodes, counts, strict=True):
        if n == 0:
            continue
        end = start + n
        first, last = start == 0, end == num_layers
        weights = sum(layout.layer_bytes[start:end])
        kv = kv_layer * n
        fixed = 0
        if first:
            fixed += layout.embed_bytes
        if last:
            fixed += layout.norm_bytes + layout.head_bytes
            if layout.tied_embeddings and not first:
                fixed += layout.embed_bytes
        streamed = weights + kv
        if last:
            streamed += (
                layout.norm_bytes
                + layout.head_bytes
                + (layout.embed_bytes if layout.tied_embeddings else 0)
            )
        t = streamed / node.mem_bandwidth_bytes_s
        if not last:
            t += req.activation_bytes_per_token * req.max_concurrent / node.link_bandwidth_bytes_s
            t += node.link_latency_s
        out.append(RefStage(node, start, end, weights + kv + fixed, t))
        start = end
    assert start == num_layers
    return out


def ref_cap(node: NodeSpec) -> int:
    cap = (
        node.available_bytes
        if node.configured_cap_bytes is None
        else min(node.available_bytes, node.configured_cap_bytes)
    )
    return cap - node.headroom_bytes


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """All tuples of `parts` non-negative ints summing to `total`."""
    out = []
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0, *cuts, total)
        out.append(tuple(bounds[i + 1] - bounds[i] for i in range(parts)))
    return out


def brute_force(layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest) -> tuple[float, int]:
    """(optimal bottleneck or inf, smallest total overflow over all splits)."""
    best, min_over = math.inf, None
    for counts in compositions(len(layout.layer_bytes), len(nodes)):
        stages = ref_stages(layout, nodes, req, counts)
        over = sum(max(0, s.total_bytes - ref_cap(s.node)) for s in stages)
        min_over = over if min_over is None else min(min_over, over)
        if over == 0:
            best = min(best, max(s.time_s for s in stages))
    assert min_over is not None
    return best, min_over


def assert_valid(
    plan: Plan, layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest, *, same_order: bool
) -> None:
    """Contiguous, covers every layer once, ranks in order, under caps, fields match the ref."""
    stages = plan.stages
    assert stages, "a plan has at least one stage"
    assert [s.rank for s in stages] == list(range(len(stages)))
    assert stages[0].layer_start == 0 and stages[-1].layer_end == len(layout.layer_bytes)
    for a, b in itertools.pairwise(stages):
        assert a.layer_end == b.layer_start
    assert all(s.layer_end > s.layer_start for s in stages)
    by_id = {n.node_id: n for n in nodes}
    ids = [s.node_id for s in stages] + plan.unused_node_ids
    assert sorted(ids) == sorted(by_id), "every node is a stage or listed unused, once"
    if same_order:
        order = [n.node_id for n in nodes]
        assert [order.index(s.node_id) for s in stages] == sorted(
            order.index(s.node_id) for s in stages
        )
    for s in stages:
        assert s.cap_bytes == ref_cap(by_id[s.node_id])
        assert s.total_bytes == s.weight_bytes + s.kv_reserve_bytes + s.fixed_bytes
        assert s.total_bytes <= s.cap_bytes, f"{s.node_id} over cap"
    # Recompute with the reference in the plan's own order.
    stage_nodes = [by_id[s.node_id] for s in stages]
    ref = ref_stages(layout, stage_nodes, req, tuple(s.num_layers for s in stages))
    for s, r in zip(stages, ref, strict=True):
        assert s.total_bytes == r.total_bytes
        assert math.isclose(s.predicted_s, r.time_s, rel_tol=1e-12, abs_tol=1e-15)
    assert plan.predicted_step_s == max(s.predicted_s for s in stages)
    assert plan.fits


# --------------------------------------------------------------------------------------------
# Strategies: small integers so that caps bind often and both outcomes (fit / no fit) occur.


@st.composite
def layouts(draw: st.DrawFn, max_layers: int = 8) -> ModelLayout:
    tied = draw(st.booleans())
    return ModelLayout(
        layer_bytes=draw(st.lists(st.integers(0, 100), min_size=1, max_size=max_layers)),
        embed_bytes=draw(st.integers(0, 80)),
        head_bytes=0 if tied else draw(st.integers(0, 80)),
        norm_bytes=draw(st.integers(0, 10)),
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=draw(st.integers(0, 5)),
    )


@st.composite
def node_lists(draw: st.DrawFn, max_nodes: int = 3, min_available: int = 0) -> list[NodeSpec]:
    n = draw(
        st.sampled_from(list(range(max_nodes, 0, -1)))
    )  # hypothesis favours the first: many nodes
    nodes = []
    for i in range(n):
        nodes.append(
            NodeSpec(
                node_id=f"n{i}",
                available_bytes=draw(st.integers(min_available, 900)),
                configured_cap_bytes=draw(st.none() | st.integers(0, 700)),
                headroom_bytes=draw(st.integers(0, 60)),
                mem_bandwidth_bytes_s=float(draw(st.integers(1, 100))),
                link_bandwidth_bytes_s=float(draw(st.integers(1, 1000))),
                link_latency_s=draw(st.sampled_from([0.0, 0.01, 0.1, 1.0])),
            )
        )
    return nodes


requests = st.builds(
    PlanRequest,
    context_tokens=st.integers(0, 4),
    max_concurrent=st.integers(1, 3),
    activation_bytes_per_token=st.integers(0, 20),
)

FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_against_brute_force(layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest) -> None:
    """PlanError exactly when no split fits (with the exact shortfall), else a valid optimum."""
    optimum, min_over = brute_force(layout, nodes, req)
    if optimum == math.inf:
        with pytest.raises(PlanError) as err:
            plan_pipeline(layout, nodes, req)
        assert err.value.shortfall_bytes == min_over > 0
        assert f"{min_over} bytes" in str(err.value) and "GB" in str(err.value)
        return
    plan = plan_pipeline(layout, nodes, req)
    assert_valid(plan, layout, nodes, req, same_order=True)
    assert math.isclose(plan.predicted_step_s, optimum, rel_tol=1e-9, abs_tol=1e-12)
    # The same split evaluated by the public evaluator gives the same plan.
    counts = [0] * len(nodes)
    for s in plan.stages:
        counts[[n.node_id for n in nodes].index(s.node_id)] = s.num_layers
    assert plan_from_counts(layout, nodes, req, counts) == plan


@FAST
@given(layouts(), node_lists(), requests)
def test_dp_matches_brute_force(
    layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest
) -> None:
    check_against_brute_force(layout, nodes, req)


@FAST
@given(layouts(), node_lists(min_available=150), requests)
def test_dp_matches_brute_force_on_roomy_nodes(
    layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest
) -> None:
    """Same check where most plans fit and splitting usually pays (multi-stage optima)."""
    check_against_brute_force(layout, nodes, req)


@settings(max_examples=150, deadline=None)
@given(layouts(max_layers=6), node_lists(max_nodes=3), requests)
def test_order_search_matches_brute_force(
    layout: ModelLayout, nodes: list[NodeSpec], req: PlanRequest
) -> None:
    per_order = [brute_force(layout, list(p), req)[0] for p in itertools.permutations(nodes)]
    optimum = min(per_order)
    if optimum == math.inf:
        with pytest.raises(PlanError):
            plan_pipeline(layout, nodes, req, search_order=True)
        return
    plan = plan_pipeline(layout, nodes, req, search_order=True)
    assert_valid(plan, layout, nodes, req, same_order=False)
    assert math.isclose(plan.predicted_step_s, optimum, rel_tol=1e-9, abs_tol=1e-12)
    assert plan.predicted_step_s <= per_order[0] * (1 + 1e-12), "never worse than the given order"


@FAST
@given(layouts(), node_lists())
def test_even_split_is_contiguous_and_marks_over_cap(
    layout: ModelLayout, nodes: list[NodeSpec]
) -> None:
    req = PlanRequest(context_tokens=2, max_concurrent=1, activation_bytes_per_token=8)
    plan = even_split(layout, nodes, req)
    sizes = [s.num_layers for s in plan.stages]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(layout.layer_bytes)
    assert plan.fits == all(s.total_bytes <= s.cap_bytes for s in plan.stages)
    if not plan.fits:
        assert "does not fit" in format_plan_table(plan)


# --------------------------------------------------------------------------------------------
# Examples with known answers.


def node(node_id: str, cap: int, bw: float = 1.0, **kw: float) -> NodeSpec:
    return NodeSpec(
        node_id=node_id,
        available_bytes=cap,
        configured_cap_bytes=None,
        headroom_bytes=0,
        mem_bandwidth_bytes_s=bw,
        link_bandwidth_bytes_s=kw.get("link", 1.0),
        link_latency_s=kw.get("latency", 0.0),
    )


FLAT = ModelLayout(
    layer_bytes=[10] * 10,
    embed_bytes=0,
    head_bytes=0,
    norm_bytes=0,
    tied_embeddings=False,
    kv_bytes_per_token_per_layer=0,
)
NO_KV = PlanRequest(context_tokens=0, max_concurrent=1, activation_bytes_per_token=0)


def test_exact_cap_fits_and_one_byte_less_moves_a_layer() -> None:
    nodes = [node("a", 50, bw=1.0), node("b", 1000, bw=1.0)]
    plan = plan_pipeline(FLAT, nodes, NO_KV)
    assert [(s.node_id, s.layer_start, s.layer_end, s.total_bytes) for s in plan.stages] == [
        ("a", 0, 5, 50),
        ("b", 5, 10, 50),
    ]
    tight = plan_pipeline(FLAT, [node("a", 49), node("b", 1000)], NO_KV)
    assert tight.stages[0].layer_end == 4 and tight.stages[0].total_bytes == 40


def test_faster_node_gets_more_layers() -> None:
    plan = plan_pipeline(FLAT, [node("slow", 1000, bw=1.0), node("fast", 1000, bw=4.0)], NO_KV)
    assert [s.num_layers for s in plan.stages] == [2, 8]
    assert plan.predicted_step_s == pytest.approx(20.0)


def test_zero_layer_node_is_listed_unused() -> None:
    # A node that cannot hold a single layer (headroom above memory) is dropped, explicitly.
    nodes = [node("a", 1000), NodeSpec("tiny", 5, None, 10, 1.0, 1.0, 0.0), node("c", 1000)]
    plan = plan_pipeline(FLAT, nodes, NO_KV)
    assert [s.node_id for s in plan.stages] == ["a", "c"]
    assert plan.unused_node_ids == ["tiny"]
    assert "unused nodes (0 layers): tiny" in format_plan_table(plan)


def test_tied_embedding_copy_goes_to_last_rank_only_when_distinct() -> None:
    layout = ModelLayout(
        [10] * 4,
        embed_bytes=7,
        head_bytes=0,
        norm_bytes=1,
        tied_embeddings=True,
        kv_bytes_per_token_per_layer=0,
    )
    one = plan_from_counts(layout, [node("a", 100)], NO_KV, [4])
    assert one.stages[0].fixed_bytes == 7 + 1
    two = plan_from_counts(layout, [node("a", 100), node("b", 100)], NO_KV, [2, 2])
    assert [s.fixed_bytes for s in two.stages] == [7, 1 + 7]


def test_kv_reserve_counts_per_layer_on_each_node() -> None:
    layout = ModelLayout([0] * 6, 0, 0, 0, False, kv_bytes_per_token_per_layer=3)
    req = PlanRequest(context_tokens=100, max_concurrent=2, activation_bytes_per_token=0)
    plan = plan_from_counts(layout, [node("a", 10**6), node("b", 10**6)], req, [4, 2])
    assert [s.kv_reserve_bytes for s in plan.stages] == [100 * 2 * 3 * 4, 100 * 2 * 3 * 2]


def test_does_not_fit_reports_shortfall_bytes_and_gb() -> None:
    layout = ModelLayout([3 * GB] * 4, GB, GB, 0, False, 0)
    with pytest.raises(PlanError) as err:
        plan_pipeline(layout, [node("a", 8 * GB), node("b", 6 * GB)], NO_KV)
    assert isinstance(err.value, ClusterError) and isinstance(err.value, OmlxError)  # one error tree
    # Needs 14 GB; best split 2+2 layers: a holds 7 GB (fits 8), b holds 7 GB over 6 -> short 1 GB.
    assert err.value.shortfall_bytes == GB
    assert f"short by {GB} bytes (1.00 GB)" in str(err.value)
    assert "b [2, 4) 1.00 GB over" in str(err.value)


def test_hop_cost_keeps_a_small_model_on_one_node() -> None:
    req = PlanRequest(context_tokens=0, max_concurrent=1, activation_bytes_per_token=100)
    nodes = [node("a", 1000, bw=1.0, link=1.0, latency=1.0), node("b", 1000, bw=1.0)]
    plan = plan_pipeline(FLAT, nodes, req)
    # Splitting would add a 101 s hop to a 100 s stage; one stage on a (or b) is faster.
    assert len(plan.stages) == 1 and plan.predicted_step_s == pytest.approx(100.0)


def test_min_sum_tie_break_prefers_fewer_hops() -> None:
    # Bottleneck is the same with or without the second node; the planner avoids the extra hop.
    req = PlanRequest(context_tokens=0, max_concurrent=1, activation_bytes_per_token=1)
    layout = ModelLayout([10, 1], 0, 0, 0, False, 0)
    nodes = [node("a", 1000, bw=1.0, link=1.0, latency=0.0), node("b", 1000, bw=1.0)]
    plan = plan_pipeline(layout, nodes, req)
    assert [s.node_id for s in plan.stages] == ["a"] and plan.unused_node_ids == ["b"]


def test_order_search_puts_big_node_where_the_head_is() -> None:
    # The head makes the last stage heavy and only "big" can hold it. In the given order big
    # must run everything (100 s); put last, it shares the layers with "small" (70 s).
    layout = ModelLayout([10] * 4, 0, 60, 0, False, 0)
    nodes = [node("big", 1000), node("small", 50)]
    fixed = plan_pipeline(layout, nodes, NO_KV)
    assert [s.node_id for s in fixed.stages] == ["big"] and fixed.predicted_step_s == pytest.approx(
        100.0
    )
    searched = plan_pipeline(layout, nodes, NO_KV, search_order=True)
    assert [(s.node_id, s.num_layers) for s in searched.stages] == [("small", 3), ("big", 1)]
    assert searched.predicted_step_s == pytest.approx(70.0)


def test_wrong_calls_raise_value_error() -> None:
    with pytest.raises(ValueError):
        ModelLayout([], 0, 0, 0, False, 0)
    with pytest.raises(ValueError):
        NodeSpec("a", 10, None, 0, 0.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        PlanRequest(10, 0, 0)
    with pytest.raises(ValueError, match="duplicate"):
        plan_pipeline(FLAT, [node("a", 100), node("a", 100)], NO_KV)
    with pytest.raises(ValueError):
        plan_pipeline(FLAT, [], NO_KV)
    with pytest.raises(ValueError):
        plan_from_counts(FLAT, [node("a", 100)], NO_KV, [9])


def test_large_model_is_fast() -> None:
    layout = ModelLayout(
        [400_000_000 + 1000 * i for i in range(128)], 10**9, 10**9, 10**4, False, 4096
    )
    nodes = [
        node(f"m{i}", (16 + 8 * i) * GB, bw=(100 + 50 * i) * 1e9, link=1.25e9, latency=2e-4)
        for i in range(8)
    ]
    req = PlanRequest(context_tokens=8192, max_concurrent=4, activation_bytes_per_token=8192)
    t0 = time.perf_counter()
    plan = plan_pipeline(layout, nodes, req)
    plan_pipeline(layout, nodes[:6], req, search_order=True)
    assert time.perf_counter() - t0 < 10.0
    assert plan.fits and sum(s.num_layers for s in plan.stages) == 128


def test_format_plan_table_lists_every_stage() -> None:
    nodes = [node("alpha", 1000, bw=2.0), node("beta", 1000, bw=1.0)]
    text = format_plan_table(plan_pipeline(FLAT, nodes, NO_KV))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["rank", "node", "layers"]
    assert "alpha" in lines[1] and "[0, " in lines[1] and "beta" in lines[2]
    assert lines[-1].startswith("predicted step:")


def test_plan_module_is_pure() -> None:
    code = (
        "import sys, omlx.cluster.plan; "
        "print(sorted({'mlx', 'numpy', 'safetensors'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# --nodes parsing


def test_parse_nodes_spec_positional_and_keys() -> None:
    a, b = parse_nodes_spec(
        "a:16GB:100GB/s,b:8GiB:50GB/s:cap=6GB:headroom=1GB:link=10Gbit/s:latency=150us"
    )
    assert (a.node_id, a.available_bytes, a.mem_bandwidth_bytes_s, a.configured_cap_bytes) == (
        "a",
        16 * GB,
        100e9,
        None,
    )
    assert a.headroom_bytes == 2 * GB  # default
    assert (b.available_bytes, b.configured_cap_bytes, b.headroom_bytes) == (8 * 2**30, 6 * GB, GB)
    assert b.link_bandwidth_bytes_s == pytest.approx(1.25e9)
    assert b.link_latency_s == pytest.approx(150e-6)
    assert b.cap_bytes == 5 * GB


def test_parse_nodes_spec_defaults_and_errors() -> None:
    (c,) = parse_nodes_spec("c:32GB", headroom_bytes=0, mem_bandwidth_bytes_s=400e9)
    assert (c.cap_bytes, c.mem_bandwidth_bytes_s) == (32 * GB, 400e9)
    for bad in ["", "a", "a:16XB", "a:16GB:100GB", "a:16GB:100GB/s:foo=1", "a:1GB,a:2GB"]:
        with pytest.raises(ValueError):
            parse_nodes_spec(bad)


def test_unit_parsers() -> None:
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("2KiB") == 2048 and parse_bytes("7") == 7
    assert parse_rate("800MB/s") == 800e6 and parse_rate("8Gbps") == 1e9
    assert parse_seconds("2ms") == pytest.approx(2e-3) and parse_seconds("1") == 1.0

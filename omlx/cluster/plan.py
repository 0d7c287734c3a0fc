"""Byte-aware pipeline planner: model layer bytes + node specs -> contiguous layer ranges.

Owns the choice of which node runs which layers and the prediction of the decode step time.
Pure Python: it must not import mlx, numpy or anything that touches the network; the inputs
come from ``omlx.cluster.layer_bytes`` (a model folder) and from discovery or ``--nodes``.

Cost model (one decode step of a full batch, at the full KV reservation, i.e. the worst case
the memory cap is sized for)::

    stage_s = streamed_bytes / mem_bandwidth_bytes_s + hop_s          (hop_s = 0 on the last stage)
    streamed_bytes = layer weights + KV reserve (+ final norm and head matrix on the last stage)
    hop_s = activation_bytes_per_token * max_concurrent / link_bandwidth_bytes_s + link_latency_s
    step_s = max(stage_s)                                             (the pipeline bottleneck)

Decode is memory-bound, so a stage's time is the bytes it reads per step over its memory
bandwidth. The embedding lookup reads one row per token and is not counted as streamed.
``NodeSpec.link_*`` describe the node's outbound link to whichever stage follows it.

Node order: stages follow the order of ``nodes`` as given (rank 0 = first node that gets layers)
unless ``plan_pipeline(..., search_order=True)``, which also tries every distinct ordering when
there are at most ``MAX_ORDER_SEARCH_NODES`` nodes and falls back to the given order above that.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from omlx.errors import PlanError
from omlx.units import BYTES_PER_UNIT, bytes_in, format_bytes

logger = logging.getLogger(__name__)

GB = BYTES_PER_UNIT["GB"]
"""Bytes per GB (decimal, omlx.units' convention for every size shown)."""

MAX_ORDER_SEARCH_NODES = 6
"""``search_order=True`` tries all node orders only up to this many nodes (6! = 720 orders)."""

DEFAULT_MEM_BANDWIDTH_BYTES_S = 100e9
"""Memory bandwidth assumed by ``parse_nodes_spec`` when a node gives none (base M-series class)."""

DEFAULT_HEADROOM_BYTES = 2 * GB
"""Bytes ``parse_nodes_spec`` keeps free for the OS and other apps unless given ``headroom=``."""

DEFAULT_LINK_BANDWIDTH_BYTES_S = 1.25e9
"""Link bandwidth ``parse_nodes_spec`` assumes without ``link=``: 10 Gbit/s Ethernet."""

DEFAULT_LINK_LATENCY_S = 200e-6
"""Per-hop latency ``parse_nodes_spec`` assumes without ``latency=``: a TCP ring hop on a LAN."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Bytes of a model's weights as a pipeline sees them.

    Attributes:
        layer_bytes: Bytes of each transformer layer's weights, in layer order (``model.layers.N``).
        embed_bytes: Bytes of the token embedding (``embed_tokens``), quantization scales included.
        head_bytes: Bytes of ``lm_head``; 0 when the embeddings are tied.
        norm_bytes: Bytes of the final norm.
        tied_embeddings: The head reuses the embedding matrix, so the last rank needs a copy of it.
        kv_bytes_per_token_per_layer: K and V bytes one token adds to one layer's cache
            (``2 * num_key_value_heads * head_dim * dtype_bytes``).
    """

    layer_bytes: list[int]
    embed_bytes: int
    head_bytes: int
    norm_bytes: int
    tied_embeddings: bool
    kv_bytes_per_token_per_layer: int

    def __post_init__(self) -> None:
        if not self.layer_bytes:
            raise ValueError("ModelLayout.layer_bytes is empty: a model needs at least one layer")
        if any(b < 0 for b in self.layer_bytes):
            raise ValueError("ModelLayout.layer_bytes must be >= 0")
        for name in ("embed_bytes", "head_bytes", "norm_bytes", "kv_bytes_per_token_per_layer"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelLayout.{name} must be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One machine that may run a pipeline stage.

    Attributes:
        node_id: Stable name of the node (hostname or discovery id).
        available_bytes: Memory omlx may use on the node, in bytes.
        configured_cap_bytes: A user-set cap in bytes; None = no cap beyond ``available_bytes``.
        headroom_bytes: Bytes kept free for the OS, activations and other processes.
        mem_bandwidth_bytes_s: Memory bandwidth in bytes/s (measured, or the chip's nominal figure).
        link_bandwidth_bytes_s: Bandwidth of the link to the next stage, in bytes/s.
        link_latency_s: One-way latency of a hop to the next stage, in seconds.
    """

    node_id: str
    available_bytes: int
    configured_cap_bytes: int | None
    headroom_bytes: int
    mem_bandwidth_bytes_s: float
    link_bandwidth_bytes_s: float
    link_latency_s: float

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("NodeSpec.node_id is empty")
        if self.available_bytes < 0 or self.headroom_bytes < 0:
            raise ValueError(
                f"node {self.node_id!r}: available_bytes and headroom_bytes must be >= 0"
            )
        if self.configured_cap_bytes is not None and self.configured_cap_bytes < 0:
            raise ValueError(f"node {self.node_id!r}: configured_cap_bytes must be >= 0 or None")
        if not (self.mem_bandwidth_bytes_s > 0 and self.link_bandwidth_bytes_s > 0):
            raise ValueError(f"node {self.node_id!r}: bandwidths must be > 0 bytes/s")
        if not self.link_latency_s >= 0:
            raise ValueError(f"node {self.node_id!r}: link_latency_s must be >= 0")

    @property
    def cap_bytes(self) -> int:
        """Bytes a stage may hold here: ``min(available, configured) - headroom``; may be < 0."""
        limit = self.available_bytes
        if self.configured_cap_bytes is not None:
            limit = min(limit, self.configured_cap_bytes)
        return limit - self.headroom_bytes


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What the plan must leave room for.

    Attributes:
        context_tokens: Tokens of KV reserved per sequence (prompt + generation).
        max_concurrent: Sequences decoded together (the batch of one decode step).
        activation_bytes_per_token: Bytes of hidden state one token sends between stages
            (``hidden_size * dtype_bytes``).
    """

    context_tokens: int
    max_concurrent: int
    activation_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.context_tokens < 0 or self.activation_bytes_per_token < 0:
            raise ValueError(
                "PlanRequest.context_tokens and activation_bytes_per_token must be >= 0"
            )
        if self.max_concurrent < 1:
            raise ValueError("PlanRequest.max_concurrent must be >= 1")


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: a node and the layer range ``[layer_start, layer_end)`` it runs.

    ``total_bytes = weight_bytes + kv_reserve_bytes + fixed_bytes``; ``fixed_bytes`` holds the
    embeddings (rank 0), final norm and head (last rank), and the tied embedding copy (last rank
    when it is not rank 0). ``predicted_s`` is this stage's decode step time including its hop.
    """

    node_id: str
    rank: int
    layer_start: int
    layer_end: int
    weight_bytes: int
    kv_reserve_bytes: int
    fixed_bytes: int
    total_bytes: int
    cap_bytes: int
    predicted_s: float

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.cap_bytes


@dataclass(frozen=True, slots=True)
class Plan:
    """Pipeline stages in rank order and the predicted decode step time.

    Attributes:
        stages: Non-empty stages, rank 0 first; their layer ranges tile ``[0, num_layers)``.
        predicted_step_s: Slowest stage's ``predicted_s`` (seconds per decode step).
        unused_node_ids: Nodes given zero layers, in input order; they take no part in the pipeline.
    """

    stages: list[Stage]
    predicted_step_s: float
    unused_node_ids: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Every stage is within its cap (always for ``plan_pipeline``; not for ``even_split``)."""
        return all(s.fits for s in self.stages)


# ---------------------------------------------------------------------------------------------
# Costs shared by the DP, plan_from_counts and even_split (one formula, so their floats agree).


@dataclass(frozen=True, slots=True)
class _Costs:
    prefix: list[int]  # prefix[m] = bytes of layers [0, m)
    kv_per_layer: int  # KV reserve bytes of one layer
    embed: int
    last_fixed_extra: int  # norm + head (+ tied embedding copy when the last rank is not rank 0)
    head_stream: int  # bytes the last stage reads per step beyond its layers: norm + head matrix
    tied: bool
    step_act_bytes: int  # activation bytes one hop carries per decode step

    @classmethod
    def build(cls, layout: ModelLayout, request: PlanRequest) -> _Costs:
        prefix = [0, *itertools.accumulate(layout.layer_bytes)]
        head_matrix = layout.head_bytes + (layout.embed_bytes if layout.tied_embeddings else 0)
        return cls(
            prefix=prefix,
            kv_per_layer=request.context_tokens
            * request.max_concurrent
            * layout.kv_bytes_per_token_per_layer,
            embed=layout.embed_bytes,
            last_fixed_extra=layout.norm_bytes + layout.head_bytes,
            head_stream=layout.norm_bytes + head_matrix,
            tied=layout.tied_embeddings,
            step_act_bytes=request.activation_bytes_per_token * request.max_concurrent,
        )

    def fixed(self, first: bool, last: bool) -> int:
        b = self.embed if first else 0
        if last:
            b += self.last_fixed_extra
            if self.tied and not first:
                b += self.embed
        return b


def _hop_s(node: NodeSpec, step_act_bytes: int) -> float:
    return step_act_bytes / node.link_bandwidth_bytes_s + node.link_latency_s


def _stage_s(streamed_bytes: int, node: NodeSpec, hop_s: float, last: bool) -> float:
    return streamed_bytes / node.mem_bandwidth_bytes_s + (0.0 if last else hop_s)


def _make_plan(costs: _Costs, nodes: Sequence[NodeSpec], counts: Sequence[int]) -> Plan:
    """Build a Plan from per-node layer counts (nodes in pipeline order; zeros allowed)."""
    num_layers = len(costs.prefix) - 1
    stages: list[Stage] = []
    unused: list[str] = []
    start = 0
    for node, n in zip(nodes, counts, strict=True):
        if n == 0:
            unused.append(node.node_id)
            continue
        end = start + n
        first, last = start == 0, end == num_layers
        weight = costs.prefix[end] - costs.prefix[start]
        kv = costs.kv_per_layer * n
        fixed = costs.fixed(first, last)
        streamed = weight + kv + (costs.head_stream if last else 0)
        stages.append(
            Stage(
                node_id=node.node_id,
                rank=len(stages),
                layer_start=start,
                layer_end=end,
                weight_bytes=weight,
                kv_reserve_bytes=kv,
                fixed_bytes=fixed,
                total_bytes=weight + kv + fixed,
                cap_bytes=node.cap_bytes,
                predicted_s=_stage_s(streamed, node, _hop_s(node, costs.step_act_bytes), last),
            )
        )
        start = end
    if start != num_layers:
        raise ValueError(f"layer counts sum to {start}, the model has {num_layers} layers")
    return Plan(
        stages=stages, predicted_step_s=max(s.predicted_s for s in stages), unused_node_ids=unused
    )


def _check_nodes(nodes: Sequence[NodeSpec]) -> None:
    if not nodes:
        raise ValueError("no nodes to plan over")
    ids = [n.node_id for n in nodes]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate node ids: {', '.join(dupes)}")


# ---------------------------------------------------------------------------------------------
# Dynamic programme. best[m] after node i = the smallest bottleneck that covers layers [0, m)
# with nodes 0..i (any of them may be empty). A stage starting at layer 0 is rank 0 and one
# ending at num_layers is the last rank, so (node, start, end) fixes a stage's bytes and time.


def _min_bottleneck(costs: _Costs, nodes: Sequence[NodeSpec], bound: float) -> float:
    """Smallest achievable max stage time, or inf when none fits or none is < ``bound``."""
    num_layers = len(costs.prefix) - 1
    prefix, kv_per_layer = costs.prefix, costs.kv_per_layer
    best = [math.inf] * (num_layers + 1)
    best[0] = 0.0
    for node in nodes:
        cap, hop = node.cap_bytes, _hop_s(node, costs.step_act_bytes)
        new = best[:]  # this node empty
        for start in range(num_layers):
            before = best[start]
            if before >= bound:
                continue
            first_fixed = costs.embed if start == 0 else 0
            # Middle ends: bytes and time grow with `end`, so stop at the first over cap or bound.
            for end in range(start + 1, num_layers):
                held = prefix[end] - prefix[start] + kv_per_layer * (end - start)
                if held + first_fixed > cap:
                    break
                t = _stage_s(held, node, hop, False)
                if t >= bound:
                    break
                c = before if before > t else t
                if c < new[end]:
                    new[end] = c
            # Last end: no hop, more bytes; checked on its own since its time is not monotone.
            held = prefix[num_layers] - prefix[start] + kv_per_layer * (num_layers - start)
            if held + costs.fixed(start == 0, True) <= cap:
                t = _stage_s(held + costs.head_stream, node, hop, True)
                c = before if before > t else t
                if c < bound and c < new[num_layers]:
                    new[num_layers] = c
        best = new
    return best[num_layers]


def _min_total_under(costs: _Costs, nodes: Sequence[NodeSpec], bound: float) -> list[int]:
    """Layer counts per node minimizing the sum of stage times with every stage <= ``bound``.

    The sum is one sequence's latency through the pipeline; minimizing it among the plans with
    the optimal bottleneck avoids needless hops and picks a deterministic plan.
    """
    num_layers = len(costs.prefix) - 1
    prefix, kv_per_layer = costs.prefix, costs.kv_per_layer
    best = [math.inf] * (num_layers + 1)
    best[0] = 0.0
    parents: list[list[int]] = []  # parents[i][end] = start of node i's stage, -1 if empty
    for node in nodes:
        cap, hop = node.cap_bytes, _hop_s(node, costs.step_act_bytes)
        new = best[:]
        parent = [-1] * (num_layers + 1)
        for start in range(num_layers):
            before = best[start]
            if before == math.inf:
                continue
            for end in range(start + 1, num_layers + 1):
                last = end == num_layers
                held = prefix[end] - prefix[start] + kv_per_layer * (end - start)
                if held + costs.fixed(start == 0, last) > cap:
                    break
                t = _stage_s(held + (costs.head_stream if last else 0), node, hop, last)
                if t > bound:
                    if last:
                        break
                    continue
                if before + t < new[end]:
                    new[end] = before + t
                    parent[end] = start
        parents.append(parent)
        best = new
    counts = [0] * len(nodes)
    end = num_layers
    for i in range(len(nodes) - 1, -1, -1):
        start = parents[i][end]
        if start >= 0:
            counts[i] = end - start
            end = start
    if end != 0:  # unreachable when `bound` came from _min_bottleneck on the same nodes
        raise AssertionError("planner lost the optimal split")
    return counts


def _min_overflow(costs: _Costs, nodes: Sequence[NodeSpec]) -> tuple[int, list[int]]:
    """Smallest sum over stages of bytes above cap, and the per-node counts that achieve it."""
    num_layers = len(costs.prefix) - 1
    prefix, kv_per_layer = costs.prefix, costs.kv_per_layer
    big = 1 << 62
    best = [big] * (num_layers + 1)
    best[0] = 0
    parents: list[list[int]] = []
    for node in nodes:
        cap = node.cap_bytes
        new = best[:]
        parent = [-1] * (num_layers + 1)
        for start in range(num_layers):
            if best[start] == big:
                continue
            for end in range(start + 1, num_layers + 1):
                held = prefix[end] - prefix[start] + kv_per_layer * (end - start)
                over = max(0, held + costs.fixed(start == 0, end == num_layers) - cap)
                if best[start] + over < new[end]:
                    new[end] = best[start] + over
                    parent[end] = start
        parents.append(parent)
        best = new
    counts = [0] * len(nodes)
    end = num_layers
    for i in range(len(nodes) - 1, -1, -1):
        start = parents[i][end]
        if start >= 0:
            counts[i] = end - start
            end = start
    return best[num_layers], counts


def _fmt_gb(num_bytes: float) -> str:
    return format_bytes(num_bytes, "GB")  # one unit across a plan error's figures


def _plan_error(
    layout: ModelLayout, nodes: Sequence[NodeSpec], request: PlanRequest, costs: _Costs
) -> PlanError:
    shortfall, counts = _min_overflow(costs, nodes)
    short_plan = _make_plan(costs, nodes, counts)
    # Several splits may share the minimum; this one shows where the bytes are missing.
    per_node = ", ".join(
        f"{s.node_id} [{s.layer_start}, {s.layer_end}) {_fmt_gb(s.total_bytes - s.cap_bytes)} over"
        for s in short_plan.stages
        if not s.fits
    )
    weights = sum(layout.layer_bytes)
    kv = costs.kv_per_layer * layout.num_layers
    fixed = layout.embed_bytes + layout.norm_bytes + layout.head_bytes
    offered = sum(max(0, n.cap_bytes) for n in nodes)
    message = (
        f"model does not fit: the best split of {layout.num_layers} layers over "
        f"{len(nodes)} node(s) ({', '.join(n.node_id for n in nodes)}) is short by "
        f"{shortfall} bytes ({_fmt_gb(shortfall)}), e.g. {per_node}. "
        f"It needs layers {_fmt_gb(weights)} + KV reserve {_fmt_gb(kv)} "
        f"({request.context_tokens} tokens x {request.max_concurrent} concurrent) "
        f"+ embeddings/norm/head {_fmt_gb(fixed)}; the caps offer {_fmt_gb(offered)}. "
        "Lower context_tokens or max_concurrent, raise the nodes' caps or lower their headroom, "
        "use a smaller quantization, or add a node."
    )
    return PlanError(message, shortfall_bytes=shortfall)


def _distinct_orders(nodes: Sequence[NodeSpec]) -> list[list[NodeSpec]]:
    """Every ordering of ``nodes``, the given one first, skipping orders of identical specs."""
    seen: set[tuple[tuple[int, int | None, int, float, float, float], ...]] = set()
    orders: list[list[NodeSpec]] = []
    for perm in itertools.permutations(nodes):
        key = tuple(
            (
                n.available_bytes,
                n.configured_cap_bytes,
                n.headroom_bytes,
                n.mem_bandwidth_bytes_s,
                n.link_bandwidth_bytes_s,
                n.link_latency_s,
            )
            for n in perm
        )
        if key not in seen:
            seen.add(key)
            orders.append(list(perm))
    return orders


# ---------------------------------------------------------------------------------------------
# Public API


def plan_pipeline(
    layout: ModelLayout,
    nodes: Sequence[NodeSpec],
    request: PlanRequest,
    *,
    search_order: bool = False,
) -> Plan:
    """Split the model's layers into contiguous stages that fit every node and minimize step time.

    Exact: a dynamic programme over (node, first layer) finds the split whose slowest stage
    (see the module docstring for the cost model) is smallest; among those it takes the one with
    the smallest sum of stage times. Every stage's ``total_bytes`` is <= its node's ``cap_bytes``
    (integer bytes, no rounding). Nodes may get zero layers; they are listed in
    ``Plan.unused_node_ids`` and get no stage. Runs in O(num_nodes * num_layers^2) time.

    Args:
        layout: Per-layer and fixed weight bytes of the model.
        nodes: Candidate nodes; stage order follows this order unless ``search_order``.
        request: Context length, concurrency and activation size to reserve and predict for.
        search_order: Also try every distinct node order when ``len(nodes) <=
            MAX_ORDER_SEARCH_NODES`` and keep the fastest (the given order wins ties); with more
            nodes the given order is used.

    Returns:
        The plan, stages in rank order.

    Raises:
        PlanError: No contiguous split fits the caps; the message gives the shortfall in bytes
            and GB (``shortfall_bytes`` holds it) for the given node order.
        ValueError: ``nodes`` is empty or has duplicate ids.
    """
    _check_nodes(nodes)
    costs = _Costs.build(layout, request)
    orders = [list(nodes)]
    if search_order:
        if len(nodes) <= MAX_ORDER_SEARCH_NODES:
            orders = _distinct_orders(nodes)
        else:
            logger.info(
                "planning %d nodes in the given order: order search is limited to %d nodes",
                len(nodes),
                MAX_ORDER_SEARCH_NODES,
            )
    best_s, best_order = math.inf, orders[0]
    for order in orders:
        s = _min_bottleneck(costs, order, best_s)
        if s < best_s:
            best_s, best_order = s, order
    if best_s == math.inf:
        raise _plan_error(layout, nodes, request, costs)
    counts = _min_total_under(costs, best_order, best_s)
    return _make_plan(costs, best_order, counts)


def plan_from_counts(
    layout: ModelLayout,
    nodes: Sequence[NodeSpec],
    request: PlanRequest,
    num_layers_per_node: Sequence[int],
) -> Plan:
    """Evaluate a given split: node i runs the next ``num_layers_per_node[i]`` layers.

    Caps are not enforced; check ``Plan.fits``. Zero counts become ``unused_node_ids``.

    Raises:
        ValueError: Counts are negative, of the wrong length, or do not sum to the layer count.
    """
    _check_nodes(nodes)
    if len(num_layers_per_node) != len(nodes) or any(n < 0 for n in num_layers_per_node):
        raise ValueError("num_layers_per_node needs one count >= 0 per node")
    return _make_plan(_Costs.build(layout, request), nodes, num_layers_per_node)


def even_split(layout: ModelLayout, nodes: Sequence[NodeSpec], request: PlanRequest) -> Plan:
    """The naive baseline: equal layer counts per node in the given order, caps ignored.

    The first ``num_layers % len(nodes)`` nodes get one extra layer. Check ``Plan.fits``.

    Raises:
        ValueError: ``nodes`` is empty or has duplicate ids.
    """
    _check_nodes(nodes)
    base, extra = divmod(layout.num_layers, len(nodes))
    counts = [base + (1 if i < extra else 0) for i in range(len(nodes))]
    return plan_from_counts(layout, nodes, request, counts)


def format_plan_table(plan: Plan) -> str:
    """Render a plan as a plain-text table (GB = 10^9 bytes, omlx.units; times in ms), one stage per row."""
    header = (
        "rank",
        "node",
        "layers",
        "n",
        "weights GB",
        "kv GB",
        "fixed GB",
        "total GB",
        "cap GB",
        "used",
        "step ms",
    )
    rows = [header]
    for s in plan.stages:
        used = f"{100 * s.total_bytes / s.cap_bytes:.0f}%" if s.cap_bytes > 0 else "-"
        rows.append(
            (
                str(s.rank),
                s.node_id,
                f"[{s.layer_start}, {s.layer_end})",
                str(s.num_layers),
                *(f"{bytes_in(n, 'GB'):.2f}" for n in (s.weight_bytes, s.kv_reserve_bytes, s.fixed_bytes,
                                                        s.total_bytes, s.cap_bytes)),
                used if s.fits else f"OVER {used}",
                f"{1000 * s.predicted_s:.2f}",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    left = {1, 2}  # text columns; numbers align right
    lines = [
        "  ".join(
            cell.ljust(w) if c in left else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    slowest = max(plan.stages, key=lambda s: s.predicted_s)
    lines.append(
        f"predicted step: {1000 * plan.predicted_step_s:.2f} ms (slowest stage: {slowest.node_id})"
    )
    if plan.unused_node_ids:
        lines.append(f"unused nodes (0 layers): {', '.join(plan.unused_node_ids)}")
    if not plan.fits:
        over = ", ".join(s.node_id for s in plan.stages if not s.fits)
        lines.append(f"does not fit: {over} over cap")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# `--nodes` spec parsing (for `omlx cluster plan MODEL --nodes SPEC`, no cluster needed)

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BIT_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s]*)\s*$")


def _split_num(text: str, what: str) -> tuple[float, str]:
    m = _NUM_UNIT.match(text)
    if m is None:
        raise ValueError(f"bad {what} {text!r}")
    return float(m.group(1)), m.group(2)


def parse_bytes(text: str) -> int:
    """``"16GB"`` -> 16_000_000_000. Units B, KB..TB (10^n) and KiB..TiB (2^n); bare = bytes.

    Raises:
        ValueError: Unknown unit or malformed number.
    """
    value, unit = _split_num(text, "size")
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"bad size unit in {text!r}: use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB")
    return int(value * factor)


def parse_rate(text: str) -> float:
    """``"100GB/s"`` -> 1e11 bytes/s; ``"10Gbit/s"`` or ``"10Gbps"`` -> 1.25e9 bytes/s.

    Raises:
        ValueError: Unknown unit or malformed number.
    """
    value, unit = _split_num(text, "rate")
    u = unit.lower()
    bits = re.fullmatch(r"([kmgt]?)(?:bit/s|bps)", u)
    if bits is not None:
        return value * _BIT_PREFIX[bits.group(1)] / 8
    if u.endswith("/s"):
        return value * parse_bytes("1" + unit[:-2])
    raise ValueError(f"bad rate {text!r}: use e.g. 100GB/s, 800MB/s or 10Gbit/s")


def parse_seconds(text: str) -> float:
    """``"200us"`` -> 2e-4. Units s, ms, us, ns; bare = seconds.

    Raises:
        ValueError: Unknown unit or malformed number.
    """
    value, unit = _split_num(text, "time")
    factor = _TIME_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"bad time unit in {text!r}: use s, ms, us or ns")
    return value * factor


def parse_nodes_spec(
    spec: str,
    *,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    mem_bandwidth_bytes_s: float = DEFAULT_MEM_BANDWIDTH_BYTES_S,
    link_bandwidth_bytes_s: float = DEFAULT_LINK_BANDWIDTH_BYTES_S,
    link_latency_s: float = DEFAULT_LINK_LATENCY_S,
) -> list[NodeSpec]:
    """Parse ``--nodes`` for planning without a cluster.

    Grammar: nodes separated by ``,``; a node is ``ID:MEMORY[:MEM_BANDWIDTH][:key=value...]`` with
    keys ``cap`` (configured cap), ``headroom``, ``link`` (bandwidth) and ``latency``, e.g.
    ``"a:16GB:100GB/s,b:8GB:50GB/s:headroom=1GB:link=10Gbit/s:latency=200us"``, or the short form
    ``MEMORY[@MEM_BANDWIDTH]`` (no ``:``), e.g. ``"64GB@400GB/s,32GB@200GB/s"``, whose node ids are
    ``node0``, ``node1``... by position. MEMORY is the node's ``available_bytes``; omitted fields
    take the keyword defaults.

    Returns:
        One NodeSpec per node, in the order given (which is the pipeline order).

    Raises:
        ValueError: Malformed spec, unknown key, or duplicate node id (the message names the part).
    """
    nodes: list[NodeSpec] = []
    for i, part in enumerate(spec.split(",")):
        if part.strip() and ":" not in part:
            memory, _, rate = part.strip().partition("@")
            part = f"node{i}:{memory}" + (f":{rate}" if rate else "")
        fields = [f.strip() for f in part.strip().split(":")]
        if len(fields) < 2 or not fields[0] or not fields[1]:
            raise ValueError(
                f"bad node {part.strip()!r}: expected ID:MEMORY[:MEM_BANDWIDTH][:key=value...]"
            )
        node_id, memory, rest = fields[0], fields[1], fields[2:]
        mem_bw = mem_bandwidth_bytes_s
        if rest and "=" not in rest[0]:
            mem_bw = parse_rate(rest.pop(0))
        opts: dict[str, str] = {}
        for item in rest:
            key, sep, value = item.partition("=")
            if not sep or key not in {"cap", "headroom", "link", "latency"}:
                raise ValueError(
                    f"bad field {item!r} in node {node_id!r}: keys are cap, headroom, link, latency"
                )
            opts[key] = value
        nodes.append(
            NodeSpec(
                node_id=node_id,
                available_bytes=parse_bytes(memory),
                configured_cap_bytes=parse_bytes(opts["cap"]) if "cap" in opts else None,
                headroom_bytes=parse_bytes(opts["headroom"])
                if "headroom" in opts
                else headroom_bytes,
                mem_bandwidth_bytes_s=mem_bw,
                link_bandwidth_bytes_s=parse_rate(opts["link"])
                if "link" in opts
                else link_bandwidth_bytes_s,
                link_latency_s=parse_seconds(opts["latency"])
                if "latency" in opts
                else link_latency_s,
            )
        )
    _check_nodes(nodes)
    return nodes

"""Prefix cache on a hybrid model (sliding window, recurrent state): the agent trace, three servers.

One run serves ``--model-dir`` three times, one server at a time, each building its history from
its own replies over the same 8-turn agent trace (``common.AgentTrace``: a system prompt, then a
~300-token user message per turn; at ``--edit-turn`` a line in the middle of an earlier message
changes):

1. omlx with the prefix cache, **restarted after turn ``--restart-after``** (clean shutdown: the
   hot tier is written to the SSD tier; the new process reads blocks and state snapshots back);
2. the same omlx with ``--no-cache``;
3. mlx_lm.server (its own prompt cache, which keeps mlx-lm's whole cache objects).

Figures: TTFT per turn and in total; the targets of issue 19: total TTFT with the cache <= 0.3x
without it and <= 1.0x mlx_lm.server's; after the restart, the next turn <= 1.5x the turn
before it; resident hot-tier bytes (``/v1/cache/stats``, before the restart) <= 1.1x unique
cached tokens x per-token KV bytes + snapshots x snapshot bytes, both sizes measured on the
model's own mlx-lm caches in-process (attention and window layers keep every token's KV in
omlx's blocks; a state layer's snapshot is its arrays' bytes).

Usage:
    python benchmarks/bench_hybrid_cache.py --model-dir DIR [--quick]
    (DIR: e.g. ``python benchmarks/make_hybrid_model.py /tmp/q35 qwen3_5-2b TOKDIR``)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from bench_prefix_cache import Tracker, send  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="mlx-lm model folder")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--system-tokens", type=int, default=None, help="system prompt (default 2000, quick 300)")
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens added per turn (default 300, quick 60)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--edit-turn", type=int, default=6, help="the turn (1-based) that edits a line in the middle")
    p.add_argument("--restart-after", type=int, default=4, help="restart omlx after this turn (0: never)")
    p.add_argument("--reply-tokens", type=int, default=None, help="max_tokens per reply (default 32, quick 8)")
    p.add_argument("--omlx-arg", action="append", default=[], help="extra argument for omlx serve (repeatable)")
    p.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    p.add_argument("--out-dir", type=Path, default=C.RESULTS_DIR)
    a = p.parse_args()
    a.system_tokens = a.system_tokens or (300 if a.quick else 2000)
    a.turn_tokens = a.turn_tokens or (60 if a.quick else 300)
    a.reply_tokens = a.reply_tokens or (8 if a.quick else 32)
    return a


def cache_sizes(model_dir: Path) -> dict[str, Any]:
    """Per-token KV bytes (attention + window layers) and one snapshot's bytes (state layers),
    from the model's own mlx-lm caches after a 4-token forward pass."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from omlx.engine.cache_spec import STATE, layer_specs

    model, _ = load(str(model_dir))
    caches = make_prompt_cache(model)
    specs = layer_specs(caches)
    model(mx.array([[11, 12, 13, 14]]), cache=caches)
    per_token, snapshot = 0, 0
    for spec, c in zip(specs, caches):
        if spec.kind == STATE:
            snapshot += sum(a.nbytes for a in c.cache if a is not None)
        else:
            k, v = c.keys, c.values
            per_token += (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.dtype.size
    from omlx.engine.cache_spec import describe

    del model, caches
    mx.clear_cache()
    return {"per_token_bytes": per_token, "snapshot_bytes": snapshot, "layout": describe(specs)}


def run_trace(srv: C.Server, label: str, a: argparse.Namespace, trace: C.AgentTrace, prompts: C.Prompts,
              tracker: Tracker, rep: C.Report, restart_after: int = 0) -> tuple[list[dict[str, Any]], Any]:
    """The trace's turns on ``srv``; with ``restart_after``, the server restarts after that turn
    (its hot-tier stats just before are returned too)."""
    msgs = trace.start()
    turns: list[dict[str, Any]] = []
    before_restart = None
    for k in range(a.turns):
        if restart_after and k == restart_after:
            try:
                before_restart = srv.get_json("/v1/cache/stats")
            except Exception as e:
                rep.note(f"{label} /v1/cache/stats failed: {e}")
            srv.stop()
            srv.start()
            srv.wait_idle()
        trace.next_turn(msgs, k)
        ids = prompts.chat_ids(msgs)
        d = send(srv, tracker, f"{label}-turn-{k + 1}", ids=ids, messages=msgs, max_tokens=a.reply_tokens)
        d["after_restart"] = bool(restart_after) and k == restart_after
        turns.append(d)
        msgs.append({"role": "assistant", "content": d["text"]})
        rep.log(f"{label} turn {k + 1}: prompt {len(ids)} tokens, cached {d.get('cached_tokens')}, "
                f"TTFT {C.ms(d['ttft_s'])}")
    return turns, before_restart


def main() -> int:
    a = parse_args()
    model_dir = a.model_dir
    rep = C.Report("hybrid_cache", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()})
    log_dir = Path(tempfile.mkdtemp(prefix="omlx-bench-hybrid-"))
    rep.log(f"model {model_dir}; logs in {log_dir}")
    sizes = cache_sizes(model_dir)
    rep.data["cache"] = sizes
    rep.log(f"cache layout {sizes['layout']}: {sizes['per_token_bytes']} B per token, "
            f"{sizes['snapshot_bytes']} B per snapshot")
    prompts = C.Prompts(model_dir)
    tracker = Tracker(prompts, rep)
    trace = C.AgentTrace.build(prompts, 0, a.system_tokens, a.turn_tokens, a.turns, a.edit_turn)
    runs: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, Any] = {}
    plan = [("omlx", "omlx", a.omlx_arg), ("omlx --no-cache", "omlx", a.omlx_arg + ["--no-cache"])]
    if not a.no_peer:
        plan.append(("mlx_lm.server", "mlx_lm", []))
    for label, kind, args in plan:
        home = log_dir / ("home-" + label.replace(" ", "").replace("-", "")) if kind == "omlx" else None
        srv = C.Server(kind, model_dir, args, log_dir, label, base_path=home)  # a restart keeps its SSD tier
        rep.log(f"starting {label}")
        srv.start()
        srv.wait_idle()
        try:
            cached_run = label == "omlx"
            runs[label], before = run_trace(srv, label, a, trace, prompts, tracker if cached_run else Tracker(prompts, rep), rep,
                                            a.restart_after if cached_run else 0)
            if cached_run:
                stats["before_restart"] = before
                stats["end"] = srv.get_json("/v1/cache/stats")
            rep.data.setdefault("servers", {})[label] = srv.info()
        finally:
            srv.stop()
    rep.data["runs"] = runs
    rep.data["stats"] = stats

    total = {lb: sum(t["ttft_s"] or 0 for t in ts) for lb, ts in runs.items()}
    rows = []
    for k in range(a.turns):
        row = [k + 1, runs["omlx"][k]["local_prompt_tokens"]]
        for lb in runs:
            t = runs[lb][k]
            row.append(f"{C.ms(t['ttft_s'])}" + (f" ({t['cached_tokens']} cached)" if t.get("cached_tokens") else ""))
        row[-len(runs)] += " after restart" if runs["omlx"][k].get("after_restart") else ""
        rows.append(row)
    rows.append(["total", "", *[C.ms(total[lb]) for lb in runs]])
    rep.table("agent trace TTFT per turn", ["turn", "prompt tokens", *runs], rows)

    resident = _hot_bytes(stats.get("before_restart"))
    snapshots = _hot_field(stats.get("before_restart"), "num_snapshots")
    ideal = None
    if resident is not None:
        turns_before = runs["omlx"][: a.restart_after] if a.restart_after else runs["omlx"]
        unique_before = _unique_tokens(prompts, turns_before, trace, a)
        ideal = unique_before * sizes["per_token_bytes"] + (snapshots or 0) * sizes["snapshot_bytes"]
        rep.data["resident"] = {"resident_bytes": resident, "unique_tokens": unique_before, "snapshots": snapshots,
                                "ideal_bytes": ideal}
        rep.table("resident hot-tier bytes (before the restart)", ["figure", "value"], [
            ["resident (/v1/cache/stats hot num_bytes)", f"{resident / 1e6:.1f} MB"],
            ["unique tokens x per-token KV", f"{unique_before} x {sizes['per_token_bytes']} B"],
            ["snapshots x snapshot bytes", f"{snapshots} x {sizes['snapshot_bytes']} B"],
            ["ideal", f"{ideal / 1e6:.1f} MB"]])
    rep.target("trace total TTFT, cache on vs off", C.ratio(total.get("omlx"), total.get("omlx --no-cache")), "<=", 0.3,
               "omlx / omlx --no-cache")
    if "mlx_lm.server" in total:
        rep.target("trace total TTFT vs mlx_lm.server", C.ratio(total["omlx"], total["mlx_lm.server"]), "<=", 1.0,
                   "omlx / peer")
    if a.restart_after and a.restart_after < a.turns:
        o = runs["omlx"]
        rep.target("turn after the restart vs the turn before", C.ratio(o[a.restart_after]["ttft_s"],
                   o[a.restart_after - 1]["ttft_s"]), "<=", 1.5, f"turn {a.restart_after + 1} / turn {a.restart_after}")
    rep.target("resident bytes vs tokens x per-token KV + snapshots", C.ratio(resident, ideal), "<=", 1.1, "")
    rep.print()
    rep.write(a.out_dir, "quick" if a.quick else "")
    return 0


def _hot_field(stats: Any, key: str) -> Any:
    """``key`` of the (one) model's hot-tier stats in a ``/v1/cache/stats`` body."""
    if not isinstance(stats, dict):
        return None
    for v in (stats.get("models") or stats).values():
        if isinstance(v, dict) and isinstance(v.get("hot"), dict) and key in v["hot"]:
            return v["hot"][key]
        if isinstance(v, dict) and key in v:
            return v[key]
    return None


def _hot_bytes(stats: Any) -> int | None:
    return _hot_field(stats, "num_bytes")


def _unique_tokens(prompts: C.Prompts, turns: list[dict[str, Any]], trace: C.AgentTrace, a: argparse.Namespace) -> int:
    """Unique tokens among the turns' prompts and fed replies (a trie of token sequences)."""
    trie = C.Trie()
    msgs = trace.start()
    for k, t in enumerate(turns):
        trace.next_turn(msgs, k)
        ids = prompts.chat_ids(msgs)
        trie.add(ids + prompts.encode(t["text"])[: a.reply_tokens])
        msgs.append({"role": "assistant", "content": t["text"]})
    return trie.size


if __name__ == "__main__":
    sys.exit(main())

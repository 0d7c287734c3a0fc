"""Resident hot-tier bytes on a sliding-window model: whole blocks vs droppable window parts.

Replays the 8-turn agent trace of ``bench_hybrid_cache.py`` (a ~2,000-token system prompt, ~300
tokens a turn, an edit in the middle at turn 6, 32-token greedy replies) in-process through one
omlx engine, SSD tier off, three times:

1. budget unlimited: the hits every turn gets, the resident bytes at the end, and how many of
   them are window parts that no chain end reads (``BlockPool.window_droppable``);
2. budget = (1)'s resident bytes less those parts (plus one block): window parts are dropped
   under pressure before any leaf is evicted (this change);
3. the same budget with whole blocks only (window dropping off: the behaviour before it).

Prints per-turn hits and the pool's counters as JSON. The base gemma-3-270m has no chat
template: turns are rendered in Gemma's turn format here.

    python benchmarks/window_resident_replay.py --model-dir DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.common as C  # noqa: E402
from omlx.cli.common import config_from  # noqa: E402
from omlx.config import ModelSettings  # noqa: E402
from omlx.engine.factory import load_chat_model  # noqa: E402
from omlx.request import Request, SamplingParams, TextDelta  # noqa: E402


def render(msgs: list[dict[str, Any]]) -> str:
    """Gemma's turn format (the system prompt as the first user turn), with the generation prompt."""
    out = []
    for m in msgs:
        role = "model" if m["role"] == "assistant" else "user"
        out.append(f"<start_of_turn>{role}\n{m['content']}<end_of_turn>\n")
    return "".join(out) + "<start_of_turn>model\n"


def replay(md: Path, P: C.Prompts, trace: C.AgentTrace, turns: int, reply: int, budget: int | None,
           windows: bool, block_size: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cache.ssd_enabled": False, "cache.block_size": block_size,
                           "base_path": tempfile.mkdtemp(prefix="omlx-window-")}
    if budget is not None:
        cfg["cache.hot_cache_max_bytes"] = budget
    entry = load_chat_model("m", md, ModelSettings(), config_from(cfg, None), warmup=False)
    engine, tok = entry.engine, entry.loaded.tokenizer
    pool = engine.prefix_cache.pool  # type: ignore[union-attr]
    if not windows:
        pool._window_parts = None  # whole blocks only: the hot tier as it was before window parts
    hits: list[int] = []
    t0 = time.perf_counter()
    try:
        msgs = trace.start()
        for k in range(turns):
            trace.next_turn(msgs, k)
            ids = P.encode(render(msgs))
            evs = engine.run_sync(Request("m", ids, SamplingParams(max_tokens=reply, temperature=0.0)))
            gen = [t for ev in evs if isinstance(ev, TextDelta) for t in ev.token_ids]
            hits.append(evs[-1].usage.num_cached_tokens)
            msgs.append({"role": "assistant", "content": tok.decode(gen)})
        st = pool.stats()
        droppable = sum(b.window_bytes for b in pool.window_droppable()) if windows else None
        s = engine.prefix_cache.stats()  # type: ignore[union-attr]
    finally:
        engine.stop()
    return {"budget": budget, "window_parts": windows, "hits": hits, "num_bytes": st.num_bytes,
            "num_window_bytes": st.num_window_bytes, "num_droppable_window_bytes": droppable,
            "num_blocks": st.num_blocks, "num_evictions": st.num_evictions,
            "num_window_parts_dropped": st.num_window_parts_dropped,
            "num_hits_cut_to_window": s["num_hits_cut_to_window"], "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="300-token system prompt, 60-token turns, 8-token replies")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--budget", type=int, default=None, help="hot budget of runs 2 and 3 (skips run 1)")
    a = p.parse_args()
    system, per_turn, reply = (300, 60, 8) if a.quick else (2000, 300, 32)
    P = C.Prompts(a.model_dir)
    trace = C.AgentTrace.build(P, 0, system, per_turn, 8, 6)
    budget = a.budget
    if budget is None:
        full = replay(a.model_dir, P, trace, 8, reply, None, True, a.block_size)
        print(json.dumps(full), flush=True)
        block = full["num_bytes"] // max(1, full["num_blocks"])
        budget = full["num_bytes"] - full["num_droppable_window_bytes"] + block
    for windows in (True, False):
        print(json.dumps(replay(a.model_dir, P, trace, 8, reply, budget, windows, a.block_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

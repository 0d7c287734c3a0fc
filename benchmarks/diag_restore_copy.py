"""What building the caches of a long prefix hit costs: blocks to mlx-lm caches, then the first forward (issue 27).

A hit on Claude Code's ~18.7k-token first prompt leaves 15-20 tokens to prefill over the cached
prefix. Between the hot tier's blocks and that forward, omlx builds the per-layer ``KVCache``
objects (`omlx.engine.cache_spec.CacheSpec.materialize`). This script times that step and the
forward after it, in one process, for two ways of building them (their order swapped every repeat):

- ``views`` (omlx up to 9210a65): the blocks' block-major ``"kv"`` tensors concatenated along
  the token axis into one array, each layer's keys and values a view of it, exactly the prefix's
  size. mlx-lm's first update then copies every layer's KV into a grown buffer: two copies of
  the prefix's KV in all.
- ``room`` (this commit): each layer's keys and values copied once from the blocks into a buffer
  of its own with free room for the new tokens (`CacheSpec.materialize(parts, room=...)`): the
  forward's update writes in place; one copy in all.

The blocks hold random keys and values (attention's cost does not depend on them) in the hot
tier's format: ``--block-size``-token payloads ``{"kv": (layers, 2, kv_heads, tokens, head_dim)}``
in the model's dtype. Times: ``build`` (materialize, evaluated), ``forward`` (``--new-tokens``
tokens over the prefix, to the last position's logits), ``total`` (both), each ``--reps`` times.

Measured (2026-12-07 23:06 UTC, the 2-core AMD EPYC VM, OpenBLAS, MLX 0.32.4 CPU, other agents'
tests beside it, load 2.9-4.0; ``benchmarks/results/restore_copy-20261207-230647.json``), 18,688
tokens, 6 repeats: ``room`` build 0.28-0.36 s, total 2.51-4.35 s (median 2.85); ``views`` build
0.24-0.44 s, total 2.39-10.0 s (median 2.97). The second copy (459 MB) is within the load's noise
here; timed alone it took 0.18-0.62 s.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python benchmarks/diag_restore_copy.py \\
        [--model DIR] [--context 18688] [--new-tokens 15] [--reps 3]

Default model: Qwen2.5-Coder-0.5B-Instruct as imported for the tests (`.omlx-test/models`).
JSON to ``benchmarks/results/restore_copy-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from omlx.engine.cache_spec import spec_of_model  # noqa: E402


def blocks(model: Any, num_tokens: int, block_size: int) -> list[tuple[dict[str, mx.array], int]]:
    """Hot-tier parts ``(payload, tokens used)`` of ``num_tokens`` random positions."""
    args = model.args
    kv_heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    dtype = model.layers[0].self_attn.k_proj.weight.dtype
    parts = []
    for a in range(0, num_tokens, block_size):
        n = min(block_size, num_tokens - a)
        kv = mx.random.normal((len(model.layers), 2, kv_heads, block_size, head_dim)).astype(dtype)
        parts.append(({"kv": kv}, n))
    mx.eval([p["kv"] for p, _ in parts])
    return parts


def build_views(spec: Any, parts: list[tuple[dict[str, mx.array], int]]) -> list[Any]:
    """The caches as omlx built them up to 9210a65: views of one concatenation, no free room."""
    num_tokens = sum(n for _, n in parts)
    kvs = mx.concatenate([p["kv"] if n == p["kv"].shape[-2] else p["kv"][..., :n, :] for p, n in parts], axis=-2)
    caches = spec.make_cache()
    for j, c in enumerate(caches):
        c.state = (kvs[j, 0][None], kvs[j, 1][None], num_tokens)
    mx.eval([c.state for c in caches])
    return caches


def timed(model: Any, spec: Any, parts: list[tuple[dict[str, mx.array], int]], how: str,
          num_new: int) -> dict[str, float]:
    x = mx.array([[100 + i for i in range(num_new)]])
    t0 = time.perf_counter()
    caches = build_views(spec, parts) if how == "views" else spec.materialize(parts, room=num_new)
    t1 = time.perf_counter()
    mx.eval(model(x, cache=caches)[:, -1, :])
    t2 = time.perf_counter()
    del caches
    gc.collect()
    mx.clear_cache()
    return {"build": t1 - t0, "forward": t2 - t1, "total": t2 - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(C.TEST_HOME / "models" / "Qwen2.5-Coder-0.5B-Instruct"))
    ap.add_argument("--context", type=int, default=18688)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=15)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model, _ = load(a.model)
    spec = spec_of_model(model)
    parts = blocks(model, a.context, a.block_size)
    timed(model, spec, parts, "room", a.new_tokens)  # warm-up (weights paged in, kernels)
    load_start = os.getloadavg()
    rows: dict[str, list[dict[str, float]]] = {"views": [], "room": []}
    for i in range(a.reps):
        for how in (("views", "room") if i % 2 == 0 else ("room", "views")):
            r = timed(model, spec, parts, how, a.new_tokens)
            rows[how].append({k: round(v, 3) for k, v in r.items()})
            print(f"{how:>5}: build {r['build'] * 1000:.0f} ms, forward {r['forward'] * 1000:.0f} ms, "
                  f"total {r['total'] * 1000:.0f} ms", flush=True)
    out = {"benchmark": "restore_copy", "model": a.model, "device": str(mx.default_device()),
           "context_tokens": a.context, "new_tokens": a.new_tokens, "block_size": a.block_size,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": load_start,
           "loadavg_end": os.getloadavg(), "cores": os.cpu_count(), "rows": rows}
    path = C.RESULTS_DIR / f"restore_copy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)


if __name__ == "__main__":
    main()

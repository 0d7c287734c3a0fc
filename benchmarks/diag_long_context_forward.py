"""The floor under a long prefix hit's TTFT: mlx-lm alone, a few tokens over a long cached context.

Issue 27 asks for a TTFT of at most 3 s when Claude Code's ~18.7k-token first prompt is already
cached and 15-16 tokens are left to prefill. Whatever omlx does, that request runs one forward
pass of those tokens over the whole cached context, then reads its first token. This script times
exactly that in plain mlx-lm, with no omlx code: the model's own ``KVCache`` objects are filled
with random keys and values of ``--context`` tokens (attention's cost does not depend on the
values), then a ``--new-tokens``-token forward and a 1-token forward are timed, each ``--reps``
times, beside the same forwards with no context.

Usage::

    .venv/bin/python benchmarks/diag_long_context_forward.py [--model DIR] [--context 18700]
        [--new-tokens 15] [--reps 3]

Default model: Qwen2.5-Coder-0.5B-Instruct as imported for the tests (`.omlx-test/models`).
JSON to ``benchmarks/results/long_context_forward-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def filled_caches(model, num_tokens: int) -> list[KVCache]:
    """One plain ``KVCache`` per layer holding ``num_tokens`` random positions (float32, the
    model's KV heads and head dim)."""
    args = model.args
    kv_heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    caches = []
    for _ in model.layers:
        c = KVCache()
        if num_tokens:
            k = mx.random.normal((1, kv_heads, num_tokens, head_dim))
            v = mx.random.normal((1, kv_heads, num_tokens, head_dim))
            mx.eval(k, v)
            c.state = (k, v, num_tokens)
        caches.append(c)
    return caches


def timed_forward(model, num_context: int, num_new: int) -> float:
    """Seconds of one ``num_new``-token forward over ``num_context`` cached positions, to its
    last position's logits on the host side of ``mx.eval``."""
    caches = filled_caches(model, num_context)
    x = mx.array([[100 + i for i in range(num_new)]])
    t = time.perf_counter()
    mx.eval(model(x, cache=caches)[:, -1, :])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(C.TEST_HOME / "models" / "Qwen2.5-Coder-0.5B-Instruct"))
    ap.add_argument("--context", type=int, default=18700)
    ap.add_argument("--new-tokens", type=int, default=15)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model, _ = load(a.model)
    load_start = os.getloadavg()
    rows = []
    for context in (0, a.context):
        for n in (a.new_tokens, 1):
            times = [timed_forward(model, context, n) for _ in range(a.reps)]
            rows.append({"context_tokens": context, "new_tokens": n, "seconds": [round(t, 3) for t in times]})
            print(f"context {context:>6}, {n:>3} new tokens: " + ", ".join(f"{t * 1000:.0f} ms" for t in times),
                  flush=True)
    out = {"benchmark": "long_context_forward", "model": a.model, "device": str(mx.default_device()),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": load_start,
           "loadavg_end": os.getloadavg(), "cores": os.cpu_count(), "rows": rows}
    path = C.RESULTS_DIR / f"long_context_forward-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)


if __name__ == "__main__":
    main()

"""What one verify step of prompt-lookup speculation costs, by draft width (issue 25, diagnosis).

A verify step feeds a sequence ``[y, d_1..d_k]`` (width ``N = k + 1``) in one forward pass and
reads the drawn tokens back (one host sync); a plain decode step feeds one token. Speculation
pays when a verify step costs little more than a plain step. This script measures, on one
batch-1 ``KVCache`` holding a prompt, for each width N in 1..``--max-width``: the first call
(which includes any kernel compilation the device does for a new shape) and the median of
``--reps`` later calls of ``model(x (1, N)) -> logsumexp/argmax -> .tolist()`` (the verify
step's device work and sync), trimming the cache back after each call so every call sees the
same context length. A plain pipelined decode step (``async_eval`` of the next step before
reading this one, as `omlx.engine.runner.BatchRunner` does) is timed the same way for
comparison.

    python benchmarks/diag_verify_cost.py --model DIR [--prompt-tokens 400] [--max-width 8] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-width", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, _ = load(a.model)
    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i) % 1000 + 10 for i in range(a.prompt_tokens)]], dtype=mx.uint32)
    mx.eval(model(prompt, cache=cache))
    out: dict = {"model": a.model, "device": str(mx.default_device()), "mlx": mx.__version__,
                 "prompt_tokens": a.prompt_tokens, "widths": {}}

    def verify_once(n: int) -> float:
        x = mx.array([[11 + j for j in range(n)]], dtype=mx.uint32)
        t = time.perf_counter()
        logits = model(x, cache=cache)[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.argmax(lp, axis=-1).tolist()
        dt = time.perf_counter() - t
        for c in cache:
            c.trim(n)
        return dt * 1e3

    for n in range(1, a.max_width + 1):
        first = verify_once(n)
        rest = [verify_once(n) for _ in range(a.reps)]
        out["widths"][n] = {"first_ms": round(first, 2), "median_ms": round(statistics.median(rest), 2),
                            "min_ms": round(min(rest), 2)}
        print(f"width {n}: first {first:7.2f} ms, median {statistics.median(rest):6.2f} ms, min {min(rest):6.2f} ms",
              flush=True)

    # Plain pipelined decode: queue step t+1 before reading step t.
    y = mx.array([[11]], dtype=mx.uint32)
    nxt = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)
    mx.async_eval(nxt)
    times = []
    for _ in range(a.reps + 5):
        t = time.perf_counter()
        nn = mx.argmax(model(nxt[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nn)
        nxt.tolist()
        nxt = nn
        times.append((time.perf_counter() - t) * 1e3)
    out["plain_pipelined_ms"] = round(statistics.median(times[5:]), 2)
    print(f"plain pipelined decode step: median {out['plain_pipelined_ms']:.2f} ms", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""What constrained decoding costs (issue 21), in-process on omlx's engine (no HTTP, no prefix cache).

Figures:
- decode TPOT of 8 concurrent constrained streams (a JSON Schema: an array of bounded integers, long
  enough that every stream runs to ``--max-tokens``) against 8 unconstrained streams (a counting
  prompt, also to ``--max-tokens`` unless one draws EOS: printed), each stream's TPOT = (its total
  time - its TTFT) / (tokens - 1) from the engine's `Usage`; target <= 1.15x;
- the first token of a request with a schema never seen before (its grammar compiled and
  validated on the way, the llguidance tokenizer already built) against an unconstrained
  request's TTFT on a prompt of the same length; target <= 1.2x;
- once: the first constrained request of the process (builds the llguidance tokenizer);
- per constrained step, the host's time consuming the fed tokens and computing the batch's masks
  (``Grammars.mask_host_s``), which overlaps the step's forward pass.

Usage:
    python benchmarks/bench_structured.py [--model PATH] [--max-tokens 96] [--reps 3] [--warmup-reps 1] [--out results/...json]

The default model is the embedded SmolLM2-135M (`tests.helpers.default_model_dir`). On a GPU
machine pass ``--model`` (e.g. the random-weight 3B model of ../shared/GPU.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omlx.kernels.blas import detect_blas, preload_env  # noqa: E402

_env = preload_env(dict(os.environ))
if _env is not None:  # as `omlx serve` does: OpenBLAS, not MLX's reference BLAS (~15x slower)
    os.execve(sys.executable, [sys.executable, *sys.argv], _env)

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from omlx.engine.engine import Engine  # noqa: E402
from omlx.request import Finished, Request, SamplingParams, TextDelta  # noqa: E402
from omlx.scheduler import Scheduler  # noqa: E402


def run_batch(eng: Engine, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[dict]:
    """Submit all at once; per request: arrival, token timestamps, finish reason."""
    out = [{"t": [], "reason": None} for _ in prompts]
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def sink_for(i: int):
        def sink(ev):
            now = time.perf_counter()
            if isinstance(ev, TextDelta):
                out[i]["t"].extend([now] * len(ev.token_ids))
            elif isinstance(ev, Finished) or not isinstance(ev, TextDelta) and hasattr(ev, "error"):
                out[i]["reason"] = getattr(ev, "finish_reason", "failed")
                out[i]["usage"] = getattr(ev, "usage", None)
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return sink

    t0 = time.perf_counter()
    for i, (p, s) in enumerate(zip(prompts, sampling)):
        out[i]["arrival"] = t0
        eng.submit(Request(eng.model_id, p, s), sink_for(i))
    if not done.wait(1800):
        raise RuntimeError("batch did not finish")
    return out


def tpot(rec: dict) -> float:
    """Seconds per output token after the first, from the engine's own clock (`Usage`): text
    deltas may hold a token back (a split UTF-8 character), so their arrival times would not do."""
    u = rec["usage"]
    return (u.total_s - u.ttft_s) / (u.num_completion_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup-reps", type=int, default=1, help="whole reps run first and not counted (kernel JIT)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from tests.helpers import default_model_dir

        args.model = str(default_model_dir())
    model, tok = load(args.model)
    eng = Engine("bench", model, tok, scheduler=Scheduler(max_running=args.streams))
    eng.start()
    n = args.max_tokens

    def chat(text: str) -> list[int]:
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))

    count = chat("Count from 1 to 1000, separated by commas.")
    greedy = SamplingParams(max_tokens=n, temperature=0.0)
    array_schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 400,
                    "maxItems": 1000}

    # warm-up: compile kernels, build the llguidance tokenizer (timed: the first request's extra cost)
    run_batch(eng, [count], [SamplingParams(max_tokens=4, temperature=0.0)])
    t = time.perf_counter()
    first = eng.grammars.json_schema({"type": "object"}, label="warm", param="p")
    tokenizer_build_s = time.perf_counter() - t
    run_batch(eng, [count], [SamplingParams(max_tokens=4, temperature=0.0, constraint=first)])

    rows = []
    for rep in range(args.warmup_reps + args.reps):
        c = eng.grammars.json_schema(array_schema, label="array", param="p")
        tied_params = [SamplingParams(max_tokens=n, temperature=0.0, constraint=c)] * args.streams
        steps0, host0 = eng.grammars.num_masked_steps, eng.grammars.mask_host_s
        if rep % 2:  # alternate which runs first (clocks, allocator state)
            tied = run_batch(eng, [count] * args.streams, tied_params)
            free = run_batch(eng, [count] * args.streams, [greedy] * args.streams)
        else:
            free = run_batch(eng, [count] * args.streams, [greedy] * args.streams)
            tied = run_batch(eng, [count] * args.streams, tied_params)
        masked_steps = eng.grammars.num_masked_steps - steps0
        host_ms = (eng.grammars.mask_host_s - host0) * 1e3 / max(masked_steps, 1)
        assert all(r["usage"].num_completion_tokens == n for r in tied), [r["usage"].num_completion_tokens for r in tied]
        short = [r["usage"].num_completion_tokens for r in free if r["usage"].num_completion_tokens < n]
        if short:
            print(f"note: {len(short)} unconstrained stream(s) ended early at {short} tokens", flush=True)
        f, g = statistics.mean(tpot(r) for r in free), statistics.mean(tpot(r) for r in tied)
        # a schema never seen before (a fresh property name), compiled on the request's way in
        prompt = chat(f"Give a JSON object with the field f{rep}.")
        free1 = run_batch(eng, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)])[0]
        t = time.perf_counter()
        new = eng.grammars.json_schema({"type": "object", "properties": {f"f{rep}_{time.time_ns()}": {"type": "integer"}}},
                                       label="new", param="p")
        compile_s = time.perf_counter() - t
        tied1 = run_batch(eng, [prompt], [SamplingParams(max_tokens=2, temperature=0.0, constraint=new)])[0]
        ttft_free = free1["usage"].ttft_s
        ttft_new = tied1["usage"].ttft_s + compile_s
        if rep < args.warmup_reps:
            continue
        rows.append({"tpot_free_ms": f * 1e3, "tpot_constrained_ms": g * 1e3, "tpot_ratio": g / f,
                     "ttft_free_ms": ttft_free * 1e3, "ttft_new_schema_ms": ttft_new * 1e3,
                     "schema_compile_ms": compile_s * 1e3, "ttft_ratio": ttft_new / ttft_free,
                     "mask_host_ms_per_step": host_ms})
        print(json.dumps(rows[-1]), flush=True)
    eng.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "device": str(mx.default_device()),
              "blas": detect_blas().name,
              "model": args.model, "streams": args.streams, "max_tokens": n, "reps": rows, "median": med,
              "llguidance_tokenizer_build_ms": tokenizer_build_s * 1e3,
              "targets": {"tpot_ratio<=1.15": med["tpot_ratio"] <= 1.15, "ttft_ratio<=1.2": med["ttft_ratio"] <= 1.2}}
    print(json.dumps({"median": med, "targets": result["targets"],
                      "llguidance_tokenizer_build_ms": result["llguidance_tokenizer_build_ms"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

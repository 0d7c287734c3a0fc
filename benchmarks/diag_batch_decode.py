"""Where a 32-stream decode step of `BatchRunner` loses its time against mlx-lm's `BatchGenerator`.

`bench_runner.py` measured (H200, 3B-shaped bf16 model, 256-token prompts) 2,806 tok/s for
`BatchGenerator` at 32 streams against 1,459 for the runner, while at 8 streams the runner was
ahead (832 vs 653). This attributes the gap, in-process, for B streams of P-token prompts:

- ``batchgen``: `BatchGenerator`'s steady-state tok/s (all B prefilled in one batch).
- ``runner``: the runner's steady-state tok/s (sequences prefilled one at a time, as served),
  with the merged cache's length (``_idx``) and largest left padding when the timing starts,
  and the host time of ``next()`` split by cProfile (top functions by own time).
- ``raw_runner_cache``: the model's forward + argmax, pipelined with ``mx.async_eval``, over
  a copy of the runner's merged cache: the step without any runner code.
- ``raw_aligned_cache``: the same over B equal-length caches merged at once (no padding).

    python benchmarks/diag_batch_decode.py --model /tmp/model-3b [--batch 32] [--prompt-tokens 256]
        [--steps 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()

    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from omlx.engine.runner import BatchRunner
    from omlx.engine.step_sizes import measured_step_sizes

    model, _ = load(a.model)
    rng = random.Random(0)
    B, P, S = a.batch, a.prompt_tokens, a.steps

    def prompt() -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(P)]

    res: dict = {"model": a.model, "device": str(mx.default_device()), "mlx": mx.__version__, "batch": B,
                 "prompt_tokens": P, "steps": S, "date": time.strftime("%Y-%m-%d %H:%M")}

    # BatchGenerator, steady state.
    gen = BatchGenerator(model, max_tokens=S + 8, completion_batch_size=B, prefill_batch_size=B)
    gen.insert([prompt() for _ in range(B)], max_tokens=[S + 8] * B)
    t0, n = None, 0
    for _ in range(100 * (S + B)):
        _, resps = gen.next()
        if t0 is None and len(resps) == B:
            t0, n = time.perf_counter(), 0
            continue
        if t0 is not None:
            n += len(resps)
            if n >= B * S:
                break
    res["batchgen_tok_s"] = round(n / (time.perf_counter() - t0), 1)
    gen.close()
    print("batchgen", res["batchgen_tok_s"], flush=True)

    sizes, _ = measured_step_sizes(model, 256)
    res["step_sizes"] = {"prefill": sizes.prefill_step_size, "mixed": sizes.mixed_step_size}
    runner = BatchRunner(model, stop_tokens=[], prefill_step_size=sizes.prefill_step_size,
                         mixed_step_size=sizes.mixed_step_size)
    uids = [runner.insert_segments([[prompt()]], max_tokens=[10**6])[0] for _ in range(B)]
    ramp = 0
    while True:
        _, out = runner.next()
        ramp += 1
        if len(out) == B:
            break
    c0 = runner._cache[0]
    res["runner_ramp_steps"] = ramp
    res["runner_cache_idx"] = int(c0._idx)
    res["runner_max_left_padding"] = int(mx.max(c0.left_padding).item())
    t0 = time.perf_counter()
    for _ in range(S):
        runner.next()
    res["runner_tok_s"] = round(B * S / (time.perf_counter() - t0), 1)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(S // 2):
        runner.next()
    prof.disable()
    res["runner_profiled_step_ms"] = round((time.perf_counter() - t0) * 1e3 / (S // 2), 2)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    res["runner_profile"] = [ln for ln in buf.getvalue().splitlines() if ln.strip()][:30]
    print("runner", res["runner_tok_s"], "idx", res["runner_cache_idx"], "pad", res["runner_max_left_padding"],
          flush=True)

    def raw(cache: list, y: mx.array) -> float:
        for _ in range(8):  # warm
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        t0 = time.perf_counter()
        for _ in range(S):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            y.tolist()
            y = nxt
        mx.eval(y)
        return round(B * S / (time.perf_counter() - t0), 1)

    copy = []
    for c in runner._cache:
        k = BatchKVCache([0] * B)
        k.keys, k.values = mx.array(c.keys), mx.array(c.values)
        k.offset, k.left_padding, k._idx = mx.array(c.offset), mx.array(c.left_padding), c._idx
        copy.append(k)
    y = mx.zeros((B,), dtype=mx.uint32)
    res["raw_runner_cache_tok_s"] = raw(copy, y)
    runner.remove(uids)
    del copy
    print("raw runner cache", res["raw_runner_cache_tok_s"], flush=True)

    own = []
    for _ in range(B):
        c = make_prompt_cache(model)
        model(mx.array(prompt(), dtype=mx.uint32)[None], cache=c)
        mx.eval([x.state for x in c])
        own.append(c)
    aligned = [own[0][i].merge([c[i] for c in own]) for i in range(len(own[0]))]
    del own
    res["raw_aligned_cache_tok_s"] = raw(aligned, y)
    print("raw aligned", res["raw_aligned_cache_tok_s"], flush=True)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

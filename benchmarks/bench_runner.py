"""omlx's step loop against mlx-lm's, in one process, no HTTP: where the engine's time goes.

Measures on one model, greedy, random prompts:
- decode tok/s of one stream: ``mlx_lm.stream_generate`` vs omlx's ``BatchRunner`` vs the
  whole omlx ``Engine`` (runner + detokenizer + events; prefix cache off and on);
- aggregate decode tok/s of B streams (8, 32): mlx-lm's ``BatchGenerator`` vs ``BatchRunner``;
- cold prefill of a ``--prompt-tokens`` prompt: ``generate_step`` time to first token vs the
  runner's (with the chunk sizes ``measure_step_sizes`` picks on this device).

Usage: python benchmarks/bench_runner.py --model DIR [--prompt-tokens 4096] [--decode-tokens 256]
Writes benchmarks/results/runner-<date>.json (and $OUT/ when OUT is set). A measurement, not a
test: figures go to the README by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import threading
import time
from pathlib import Path

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--batch-prompt-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    from mlx_lm import load, stream_generate
    from mlx_lm.generate import BatchGenerator, generate_step

    from omlx.engine.runner import BatchRunner
    from omlx.engine.step_sizes import measure_step_sizes

    model, tok = load(a.model)
    vocab = model.args.vocab_size if hasattr(model, "args") else 32000
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, min(vocab, 49000)) for _ in range(n)]

    res: dict = {"model": a.model, "device": str(mx.default_device()), "machine": platform.node(),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mlx": mx.__version__}
    sizes = measure_step_sizes(model, 256)
    res["step_sizes"] = {"prefill": sizes.prefill_step_size, "mixed": sizes.mixed_step_size,
                         "decode_step_ms": sizes.decode_step_ms, "chunk_ms": sizes.chunk_ms}
    print("step sizes", res["step_sizes"], flush=True)

    # ---- one stream -------------------------------------------------------------------------
    def mlx_decode() -> float:
        p = prompt(64)
        t0, n = None, 0
        for r in stream_generate(model, tok, p, max_tokens=a.decode_tokens):
            if t0 is None:
                t0 = time.perf_counter()
            n += 1
        return (n - 1) / (time.perf_counter() - t0)

    def runner_decode(b: int, plen: int) -> float:
        """Steady-state decode of b sequences: the runner prefills them one at a time, so each
        may run long; timed over ``decode_tokens`` steps once all b decode together."""
        runner = BatchRunner(model, stop_tokens=[], prefill_step_size=sizes.prefill_step_size,
                             mixed_step_size=sizes.mixed_step_size)
        uids = [runner.insert_segments([[prompt(plen)]], max_tokens=[10**6])[0] for _ in range(b)]
        t0, n = None, 0
        while n < b * a.decode_tokens:
            _, gen = runner.next()
            if len(gen) == b:
                if t0 is None:
                    t0 = time.perf_counter()
                    continue
                n += b
        dt = time.perf_counter() - t0
        runner.remove(uids)
        return n / dt

    def runner_decode_in_thread(b: int, plen: int) -> float:
        out: list[float] = []
        t = threading.Thread(target=lambda: out.append(runner_decode(b, plen)))
        t.start()
        t.join()
        return out[0]

    def batchgen_decode(b: int, plen: int) -> float:
        gen = BatchGenerator(model, max_tokens=a.decode_tokens, completion_batch_size=b, prefill_batch_size=b)
        gen.insert([prompt(plen) for _ in range(b)], max_tokens=[a.decode_tokens] * b)
        t0, n, left = None, 0, b
        while left:
            _, resps = gen.next()
            left -= sum(1 for r in resps if r.finish_reason is not None)
            if resps and t0 is None and len(resps) == b:
                t0, n = time.perf_counter(), 0
                continue
            if t0 is not None:
                n += len(resps)
        dt = time.perf_counter() - t0
        gen.close()
        return n / dt

    def engine_decode(cache: bool) -> float:
        from omlx.engine.engine import Engine
        from omlx.request import Failed, Finished, Request, SamplingParams, TextDelta
        from omlx.scheduler import Scheduler

        pc = None
        if cache:
            from omlx.cache.hashing import Namespace, make_kv_format
            from omlx.cache.paged import BlockPool
            from omlx.cache.tiered import TieredCache
            from omlx.engine.cache_spec import CacheSpec
            from omlx.engine.kv_cache import MlxPayloadCodec, PrefixCacheTiers
            from mlx.utils import tree_flatten
            dt = str(tree_flatten(model.parameters())[0][1].dtype).removeprefix("mlx.core.")
            ns = Namespace("bench", "tok", make_kv_format(dt, None, None, "KVCache"), 0, len(model.layers))
            pc = PrefixCacheTiers(TieredCache(BlockPool(max_bytes=8 * 10**9, block_size=256), ns,
                                              MlxPayloadCodec(dt)), CacheSpec.plain(len(model.layers)))
        eng = Engine("bench", model, tok, scheduler=Scheduler(8, 64), prefix_cache=pc,
                     prefill_step_size=sizes.prefill_step_size, mixed_step_size=sizes.mixed_step_size)
        eng.start()
        times: list[float] = []
        done = threading.Event()

        def sink(ev):
            if isinstance(ev, TextDelta):
                times.append(time.perf_counter())
            elif isinstance(ev, (Finished, Failed)):
                done.set()

        eng.submit(Request("bench", prompt(64), SamplingParams(max_tokens=a.decode_tokens, temperature=0.0)), sink)
        done.wait(300)
        eng.stop()
        return (len(times) - 1) / (times[-1] - times[0])

    def profiled_engine() -> None:
        import cProfile
        import io
        import pstats

        from omlx.engine.engine import Engine
        orig = Engine._loop
        pr = cProfile.Profile()

        def loop(self):
            pr.enable()
            try:
                orig(self)
            finally:
                pr.disable()
        Engine._loop = loop
        try:
            rate = engine_decode(False)
        finally:
            Engine._loop = orig
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(f"engine under cProfile: {rate:.0f} tok/s", s.getvalue()[-3500:], flush=True)

    def engine_beside_busy_thread(switch_ms: float) -> float:
        """The engine while another Python thread keeps wanting the GIL (as the server's event
        loop does while it frames SSE): shows the GIL hand-over latency (``sys.setswitchinterval``)."""
        import sys

        old = sys.getswitchinterval()
        sys.setswitchinterval(switch_ms / 1e3)
        stop = threading.Event()

        def busy() -> None:
            payload = {"id": "x", "choices": [{"delta": {"content": "tok"}, "index": 0}]}
            while not stop.is_set():
                for _ in range(200):
                    json.dumps(payload)
                time.sleep(0.0002)

        t = threading.Thread(target=busy, daemon=True)
        t.start()
        try:
            return engine_decode(False)
        finally:
            stop.set()
            t.join()
            sys.setswitchinterval(old)

    def best(f, *args) -> float:
        return max(f(*args) for _ in range(a.reps))

    res["decode_1"] = {"stream_generate": best(mlx_decode), "runner": best(runner_decode, 1, 64),
                       "runner_in_thread": best(runner_decode_in_thread, 1, 64),
                       "engine_cache_off": best(engine_decode, False), "engine_cache_on": best(engine_decode, True)}
    res["decode_1"]["engine_busy_thread_switch_5ms"] = best(engine_beside_busy_thread, 5.0)
    res["decode_1"]["engine_busy_thread_switch_0.5ms"] = best(engine_beside_busy_thread, 0.5)
    print("decode, 1 stream", res["decode_1"], flush=True)
    if os.environ.get("PROFILE_ENGINE"):
        profiled_engine()
    res["decode_batch"] = {}
    for b in a.batch:
        res["decode_batch"][b] = {"BatchGenerator": best(batchgen_decode, b, a.batch_prompt_tokens),
                                  "runner": best(runner_decode, b, a.batch_prompt_tokens)}
        print(f"decode, {b} streams", res["decode_batch"][b], flush=True)

    # ---- cold prefill -------------------------------------------------------------------------
    def mlx_ttft() -> float:
        p = mx.array(prompt(a.prompt_tokens))
        t0 = time.perf_counter()
        for tok_id, _ in generate_step(p, model, max_tokens=1, prefill_step_size=2048):
            break
        return time.perf_counter() - t0

    def runner_ttft() -> float:
        runner = BatchRunner(model, stop_tokens=[], prefill_step_size=sizes.prefill_step_size,
                             mixed_step_size=sizes.mixed_step_size)
        p = prompt(a.prompt_tokens)
        t0 = time.perf_counter()
        runner.insert_segments([[p]], max_tokens=[1])
        while True:
            _, gen = runner.next()
            if gen:
                return time.perf_counter() - t0

    res["prefill_ttft_s"] = {"generate_step": min(mlx_ttft() for _ in range(a.reps)),
                             "runner": min(runner_ttft() for _ in range(a.reps))}
    print("cold prefill TTFT", res["prefill_ttft_s"], flush=True)

    out = Path(__file__).parent / "results" / f"runner-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    if os.environ.get("OUT"):
        shutil.copy(out, os.environ["OUT"])
    print("wrote", out)
    os._exit(0)


if __name__ == "__main__":
    main()

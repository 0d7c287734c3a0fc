"""The cost of requests finishing, in-process (issue #18): many short streams that end at
different steps, with the prefix cache and its SSD tier on, as ``omlx serve`` loads them.

Loads ``--model`` with ``load_chat_model`` (prefix cache, SSD tier under a temporary base path,
measured chunk sizes), then runs ``--waves`` waves of ``--streams`` greedy requests sent at once:
random ``--prompt-tokens`` prompts, stream i asking ``--max-tokens + i * --stagger`` tokens, so
rows finish one by one while the others decode. Per wave: aggregate tok/s (tokens / wall), the
engine thread's CPU time (all of it, and inside the finishing path: ``Engine._finish`` and the
runner's ``_drop_rows``, timed by wrapping them in this process only) and the SSD tier's writes.
CPU time of the engine thread, not wall time, is the figure to compare on a shared machine: the
model's forward passes run on MLX's stream threads, so it is the host work a GPU step waits on,
and other processes' load inflates it far less than wall time. With ``--profile``, the engine
thread's top functions by own time (cProfile; slows it).

Usage: python benchmarks/bench_finish.py --model DIR [--streams 16] [--waves 3] [--no-cache]
Prints one JSON line per wave and a summary line; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=110)
    ap.add_argument("--stagger", type=int, default=4, help="stream i asks max-tokens + i * stagger tokens")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--no-ssd", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()

    from omlx.config import ModelSettings, load_config
    from omlx.engine.engine import Engine
    from omlx.engine.factory import load_chat_model
    from omlx.engine.runner import BatchRunner
    from omlx.request import Failed, Finished, Request, SamplingParams, TextDelta

    spent = {"finish": 0.0, "drop_rows": 0.0}
    calls = {"finish": 0, "drop_rows": 0}

    def timed(cls, name: str, key: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*args, **kw):
            t = time.thread_time()  # the engine thread's CPU time
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.thread_time() - t
                calls[key] += 1
        setattr(cls, name, wrapper)

    timed(Engine, "_finish", "finish")
    timed(BatchRunner, "_drop_rows", "drop_rows")
    prof = cProfile.Profile()
    if a.profile:
        loop = Engine._loop

        def profiled(self):
            prof.enable()
            try:
                loop(self)
            finally:
                prof.disable()
        Engine._loop = profiled

    base = tempfile.mkdtemp(prefix="omlx-bench-finish-")
    cfg = load_config({"base_path": base, "cache.enabled": False if a.no_cache else None,
                       "cache.ssd_enabled": False if a.no_ssd else None}, env={})
    entry = load_chat_model("bench", Path(a.model), ModelSettings(), cfg, warmup=True)
    eng = entry.engine
    rng = random.Random(0)
    rates, cpus = [], []
    for wave in range(a.waves):
        for k in spent:
            spent[k], calls[k] = 0.0, 0
        cold0 = _cold(eng)
        clock = time.pthread_getcpuclockid(eng._thread.ident)
        cpu0 = time.clock_gettime(clock)
        left = [a.streams]
        done = threading.Event()
        counts = [0] * a.streams

        def sink_of(i: int):
            def sink(ev):
                if isinstance(ev, TextDelta):
                    counts[i] += len(ev.token_ids)
                elif isinstance(ev, (Finished, Failed)):
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return sink

        reqs = [Request("bench", [rng.randrange(100, 49000) for _ in range(a.prompt_tokens)],
                        SamplingParams(max_tokens=a.max_tokens + i * a.stagger, temperature=0.0))
                for i in range(a.streams)]
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            eng.submit(r, sink_of(i))
        done.wait(900)
        wall = time.perf_counter() - t0
        cpu = time.clock_gettime(clock) - cpu0
        cold1 = _cold(eng)
        row = {"wave": wave + 1, "streams": a.streams, "tokens": sum(counts), "wall_s": round(wall, 3),
               "tok_s": round(sum(counts) / wall, 1), "engine_cpu_s": round(cpu, 3),
               "engine_cpu_ms_per_token": round(1e3 * cpu / max(1, sum(counts)), 3),
               **{f"{k}_cpu_ms": round(1e3 * v, 1) for k, v in spent.items()},
               **{f"{k}_calls": v for k, v in calls.items()},
               "ssd_writes": cold1.get("num_writes", 0) - cold0.get("num_writes", 0),
               "ssd_written_mb": round((cold1.get("num_written_bytes", 0) - cold0.get("num_written_bytes", 0)) / 1e6, 1)}
        rates.append(row["tok_s"])
        cpus.append(row["engine_cpu_ms_per_token"])
        print(json.dumps(row), flush=True)
        time.sleep(0.5)
    gen = eng._gen
    eng.stop()
    print(json.dumps({"summary": "per wave", "tok_s": rates, "engine_cpu_ms_per_token": cpus,
                      "runner": type(gen).__name__, "compactions": getattr(gen, "num_compactions", None)}),
          flush=True)
    if a.profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print(s.getvalue()[-5000:], flush=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats("omlx", 25)
        print(s.getvalue()[-5000:], flush=True)
    import os
    os._exit(0)


def _cold(eng) -> dict:
    pc = eng.prefix_cache
    cold = pc.cold_stats() if pc is not None and hasattr(pc, "cold_stats") else None
    return cold or {}


if __name__ == "__main__":
    main()

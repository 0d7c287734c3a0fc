"""Where the engine thread's time goes with the prefix cache on (in-process, no HTTP).

Loads a model the way ``omlx serve`` does (``load_chat_model``: prefix cache, SSD tier in a
temporary base path, measured chunk sizes), then under cProfile on the engine thread:
1. three cold ``--prompt-tokens`` prompts, one at a time (TTFT each);
2. one decode stream alone, then the same with a cold long prompt arriving mid-stream (the
   stream's inter-token gaps while the other prefills).
With ``--turns N`` instead: an agent-like trace, a ``--prompt-tokens`` prompt and then N - 1
turns that each append ``--turn-tokens`` new tokens to the last prompt (prefix hits on every
turn after the first), TTFT per turn. With ``--streams N``: N 64-token prompts sent at once, 256
tokens each, three times: aggregate tok/s per wave (as bench_gpu.py's 8-stream figure, in-process).
Prints TTFTs, gap statistics and the engine thread's top functions by own time.
Usage: python benchmarks/diag_engine_cache.py --model DIR [--no-ssd] [--no-cache] [--turns N | --streams N]
A diagnostic, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--no-ssd", action="store_true")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--turns", type=int, default=0, help="run the growing-prompt trace instead")
    ap.add_argument("--turn-tokens", type=int, default=345)
    ap.add_argument("--streams", type=int, default=0, help="run N concurrent 256-token streams instead")
    ap.add_argument("--waves", type=int, default=3, help="with --streams: how many waves")
    ap.add_argument("--no-profile", action="store_true", help="no cProfile (it slows the step loop)")
    ap.add_argument("--trace", action="store_true",
                    help="print each engine step's wall time and the time spent caching blocks in it")
    a = ap.parse_args()

    from omlx.config import ModelSettings, load_config
    from omlx.engine.engine import Engine
    from omlx.engine.factory import load_chat_model
    from omlx.request import Failed, Finished, Request, SamplingParams, TextDelta

    base = tempfile.mkdtemp(prefix="omlx-diag-")
    flags = {"base_path": base, "cache.ssd_enabled": False if a.no_ssd else None,
             "cache.enabled": False if a.no_cache else None}
    cfg = load_config(flags, env={})
    prof = cProfile.Profile()
    orig = Engine._loop

    def loop(self):
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()

    if not a.no_profile:
        Engine._loop = loop
    steps: list[tuple[float, float, float, int, int]] = []  # (start, wall s, caching s, prompt resps, tokens)
    if a.trace:
        _trace_steps(steps)
    t_load = time.perf_counter()
    entry = load_chat_model("diag", Path(a.model), ModelSettings(), cfg, warmup=True)
    print(f"load with warm-up: {time.perf_counter() - t_load:.2f} s (ends at epoch {time.time():.2f})", flush=True)
    eng = entry.engine
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    def run(req: Request, times: list[float]) -> threading.Event:
        done = threading.Event()

        def sink(ev):
            if isinstance(ev, TextDelta):
                times.append(time.perf_counter())
            elif isinstance(ev, (Finished, Failed)):
                done.set()
        eng.submit(req, sink)
        return done

    if a.streams:
        for wave in range(a.waves):
            ts = [[] for _ in range(a.streams)]
            t0 = time.perf_counter()
            evs = [run(Request("diag", prompt(64), SamplingParams(max_tokens=256, temperature=0.0)), t) for t in ts]
            for e in evs:
                e.wait(300)
            wall = max(t[-1] for t in ts) - t0
            first = max(t[0] for t in ts) - t0
            gaps = sorted(b - x for t in ts for x, b in zip(t, t[1:]))
            cold = getattr(eng.prefix_cache, "cold_stats", lambda: None)() if eng.prefix_cache else None
            print(f"wave {wave + 1} (started at epoch {time.time() - (time.perf_counter() - t0):.2f}): {a.streams} streams, {sum(map(len, ts))} deltas, {wall:.2f} s, "
                  f"{256 * a.streams / wall:.0f} tok/s aggregate; last first token {1e3 * first:.0f} ms, "
                  f"max gap {1e3 * gaps[-1]:.0f} ms, gaps > 50 ms: {sum(g > 0.05 for g in gaps)}; "
                  f"SSD {cold and {k: cold[k] for k in cold if k in ('num_files', 'num_queued', 'num_writes', 'num_queue_drops')}}",
                  flush=True)
            time.sleep(0.5)
        report(eng, prof)
        return

    if a.turns:
        ids = prompt(a.prompt_tokens)
        for k in range(a.turns):
            t: list[float] = []
            t0 = time.perf_counter()
            run(Request("diag", list(ids), SamplingParams(max_tokens=1, temperature=0.0)), t).wait(120)
            print(f"turn {k + 1}: {len(ids)} tokens, TTFT {1e3 * (t[0] - t0):.1f} ms", flush=True)
            ids += prompt(a.turn_tokens)
            time.sleep(0.3)
        report(eng, prof)

    for i in range(3):
        t: list[float] = []
        t0 = time.perf_counter()
        run(Request("diag", prompt(a.prompt_tokens), SamplingParams(max_tokens=1, temperature=0.0)), t).wait(120)
        print(f"cold {a.prompt_tokens}-token TTFT {1e3 * (t[0] - t0):.1f} ms", flush=True)
        print_steps(steps, t0, t[0])
        time.sleep(0.5)

    def gaps(ts: list[float]) -> list[float]:
        return [1e3 * (b - x) for x, b in zip(ts, ts[1:])]

    alone: list[float] = []
    run(Request("diag", prompt(64), SamplingParams(max_tokens=200, temperature=0.0)), alone).wait(120)
    g = gaps(alone)
    print(f"decode alone: mean gap {statistics.mean(g):.2f} ms, p90 {sorted(g)[int(.9 * len(g))]:.2f}, "
          f"max {max(g):.1f}", flush=True)
    beside: list[float] = []
    d = run(Request("diag", prompt(64), SamplingParams(max_tokens=200, temperature=0.0)), beside)
    while len(beside) < 20:
        time.sleep(0.001)
    other: list[float] = []
    t0 = time.perf_counter()
    o = run(Request("diag", prompt(a.prompt_tokens), SamplingParams(max_tokens=1, temperature=0.0)), other)
    o.wait(120)
    d.wait(120)
    t1 = other[0]
    during = [1e3 * (b - x) for x, b in zip(beside, beside[1:]) if x >= t0 and b <= t1 + 0.001]
    print(f"beside a {a.prompt_tokens}-token prefill (TTFT {1e3 * (t1 - t0):.1f} ms): {len(during)} gaps, "
          f"mean {statistics.mean(during) if during else float('nan'):.2f} ms, max {max(during, default=0):.1f}",
          flush=True)
    print_steps(steps, t0, t1)
    report(eng, prof)


def _trace_steps(steps: list) -> None:
    """Time every ``BatchRunner.next`` and the ``Engine._cache_blocks`` calls inside each step."""
    from omlx.engine.engine import Engine
    from omlx.engine.runner import BatchRunner

    nxt, cb = BatchRunner.next, Engine._cache_blocks
    caching = [0.0]

    def next_(self):
        caching[0] = 0.0
        t = time.perf_counter()
        out = nxt(self)
        steps.append((t, time.perf_counter() - t, caching[0], len(out[0]), len(out[1])))
        return out

    def cache_blocks(self, *args, **kw):
        t = time.perf_counter()
        try:
            return cb(self, *args, **kw)
        finally:
            caching[0] += time.perf_counter() - t

    BatchRunner.next, Engine._cache_blocks = next_, cache_blocks


def print_steps(steps: list, t0: float, t1: float) -> None:
    """The traced steps that started in [t0, t1] (nothing without ``--trace``)."""
    sel = [s for s in steps if t0 <= s[0] <= t1]
    if sel:
        print("  steps (start ms, wall ms, caching ms, prompt resps, tokens): " + " ".join(
            f"({1e3 * (s[0] - t0):.0f},{1e3 * s[1]:.1f},{1e3 * s[2]:.1f},{s[3]},{s[4]})" for s in sel[:60]), flush=True)


def report(eng, prof) -> None:
    """Stop the engine, print its thread's profile, leave the process."""
    eng.stop()
    if prof.getstats() == []:  # --no-profile: nothing was recorded
        import os
        os._exit(0)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[-6000:], flush=True)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumtime").print_stats("omlx", 22)
    print(s.getvalue()[-5000:], flush=True)
    import os
    os._exit(0)


if __name__ == "__main__":
    main()

"""A decoding stream beside a long prefill, in the runner alone: the time of each step.

One sequence decodes; after 20 tokens a ``--prompt-tokens`` prompt arrives and is prefilled in
mixed-size chunks beside it. For each mixed chunk size given, prints the wall time of every
``BatchRunner.next()`` while the prefill runs (each size twice: the first pass of a size builds
its shapes' kernels and cuDNN attention graphs, the second shows the steady state), and the
median decode-only step after it.
Usage: python benchmarks/diag_interference.py --model DIR [--mixed 512 2048] [--prompt-tokens 4096]
A diagnostic, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--mixed", type=int, nargs="*", default=[512, 2048])
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from omlx.engine.runner import BatchRunner

    model, _ = load(a.model)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    for mixed in a.mixed * 2:  # the first pass of each size compiles kernels
        runner = BatchRunner(model, stop_tokens=[], prefill_step_size=2048, mixed_step_size=mixed)
        runner.insert_segments([[prompt(64)]], max_tokens=[400])
        n = 0
        while n < 20:
            _, gen = runner.next()
            n += len(gen)
        runner.insert_segments([[prompt(a.prompt_tokens)]], max_tokens=[1])
        steps: list[tuple[float, int, int]] = []
        while runner.num_prefilling or runner._joining:
            t0 = time.perf_counter()
            pr, gen = runner.next()
            steps.append((1e3 * (time.perf_counter() - t0), len(pr), len(gen)))
        t_alone = []
        for _ in range(10):
            t0 = time.perf_counter()
            runner.next()
            t_alone.append(1e3 * (time.perf_counter() - t0))
        print(f"mixed {mixed}: {len(steps)} steps while prefilling, ms each {[round(s[0], 1) for s in steps]}; "
              f"decode-only steps after: median {statistics.median(t_alone):.1f} ms", flush=True)
        runner.remove(list(range(100)))
        mx.clear_cache()
    import os
    os._exit(0)


if __name__ == "__main__":
    main()

"""Micro-benchmark: how long the SSD writer thread keeps other Python threads (the engine's step
loop) from running, per block written.

No server and no model: blocks shaped like Qwen2.5-3B's KV (36 layers, 2 KV heads, head dim 128,
bfloat16, 256-token blocks: 9.4 MB each) are queued on an ``SSDStore`` in a temp folder while a
probe thread sleeps 1 ms in a loop; every wake-up later than asked is time the probe waited for
the GIL (or for a core). Printed: the writer's wall time per block and the probe's overshoot per
block above its idle median (~ GIL held per block), p99 and max. Compare runs on a quiet machine:
CPU contention from other processes inflates both.

Usage:
    python benchmarks/bench_ssd_writer_gil.py [--blocks 20] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from omlx.cache.blockfile import HostBlock
from omlx.cache.hashing import Namespace, hash_block
from omlx.cache.ssd import SSDStore

LAYERS, HEADS, HEAD_DIM, BLOCK = 36, 2, 128, 256


def probe(until: threading.Event, overshoots: list[float]) -> None:
    while not until.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        overshoots.append(time.perf_counter() - t0 - 0.001)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    a = p.parse_args()
    ns = Namespace("f" * 64, "t" * 64, "bfloat16;KVCache", 0, LAYERS)
    rng = np.random.default_rng(0)
    blocks = []
    parent = ns.key()
    for _ in range(a.blocks):
        tokens = [int(t) for t in rng.integers(10, 30000, BLOCK)]
        h = hash_block(parent, tokens)
        kv = rng.integers(0, 65535, (LAYERS, 2, HEADS, BLOCK, HEAD_DIM), dtype=np.uint16)
        blocks.append((h, parent, tokens, HostBlock("bfloat16", kv)))
        parent = h
    idle: list[float] = []
    done = threading.Event()
    t = threading.Thread(target=probe, args=(done, idle))
    t.start()
    time.sleep(1.0)
    done.set()
    t.join()
    base = float(np.median(idle))
    for rep in range(a.reps):
        with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
            store = SSDStore(Path(tmp), ns, dtype="bfloat16", max_bytes=10**12)
            over: list[float] = []
            done = threading.Event()
            t = threading.Thread(target=probe, args=(done, over))
            t.start()
            t0 = time.perf_counter()
            for h, parent, tokens, host in blocks:
                store.put(h, parent, tokens, host, high=True, wait=True)
            store.flush()
            wall = time.perf_counter() - t0
            done.set()
            t.join()
            store.close()
        o = np.array(over)
        excess = max(0.0, float(o.sum()) - len(o) * base)
        print(f"rep {rep}: {a.blocks} blocks of {blocks[0][3].num_bytes / 1e6:.1f} MB: writer {wall / a.blocks * 1e3:.1f} "
              f"ms/block; probe overshoot {excess / a.blocks * 1e3:.2f} ms/block over idle ({base * 1e6:.0f} us), "
              f"p99 {np.percentile(o, 99) * 1e3:.2f} ms, max {o.max() * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

"""Micro-benchmark of one cold-tier restore (issue 4): MB/s of the restore path against a plain read.

No server and no model: blocks shaped like SmolLM2-135M's KV (30 layers, 3 KV heads, head dim
64, float32, 256-token blocks: 11.8 MB each) are written to an ``SSDStore`` in a temp folder
(``--dir``, default the system temp dir), the files are dropped from the page cache with
``posix_fadvise(DONTNEED)``, and then the chain is restored through ``TieredCache.acquire``
with the engine's ``MlxPayloadCodec`` (read, validate, convert to mlx, register), as a request
after a restart does. For reference the same files, dropped again, are read with plain
``read()`` calls (the disk's cold bandwidth on this file set).

Usage:
    python benchmarks/bench_ssd_restore.py [--blocks 15] [--reps 3] [--profile]

Prints one line per repetition and the best; ``--profile`` prints a cProfile of one restore.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from omlx.cache.hashing import Namespace, hash_block
from omlx.cache.paged import BlockPool
from omlx.cache.ssd import SSDStore
from omlx.cache.tiered import RestoreCostModel, TieredCache, TierPolicy
from omlx.engine.kv_cache import MlxPayloadCodec

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 256


def drop(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=15)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    ns = Namespace("f" * 64, "t" * 64, "float32;KVCache", 0, LAYERS)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(10, 30000, a.blocks * BLOCK + 1)]
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        store = SSDStore(Path(tmp), ns, dtype="float32", max_bytes=10**12)
        parent = ns.key()
        from omlx.cache.blockfile import HostBlock

        for i in range(a.blocks):
            blk = tokens[i * BLOCK:(i + 1) * BLOCK]
            h = hash_block(parent, blk)
            kv = rng.standard_normal((LAYERS, 2, HEADS, BLOCK, HEAD_DIM), dtype=np.float32)
            store.put(h, parent, blk, HostBlock("float32", kv), high=True, wait=True)
            parent = h
        store.flush()
        num_bytes = store.stats().num_bytes
        best_restore = best_read = float("inf")
        for rep in range(a.reps):
            drop(Path(tmp))
            pool = BlockPool(max_bytes=10**11, block_size=BLOCK)
            tiers = TieredCache(pool, ns, MlxPayloadCodec("float32"), store, TierPolicy(),
                                RestoreCostModel(1.0, 1e9))  # always restore
            prof = cProfile.Profile() if a.profile and rep == a.reps - 1 else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            hit = tiers.acquire(tokens)
            if prof:
                prof.disable()
            dt = time.perf_counter() - t0
            assert hit.num_cached_tokens_cold == a.blocks * BLOCK, hit.num_cached_tokens_cold
            tiers.release(hit)
            drop(Path(tmp))
            t0 = time.perf_counter()
            for f in sorted(Path(tmp).rglob("*.safetensors")):
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass
            rt = time.perf_counter() - t0
            best_restore, best_read = min(best_restore, dt), min(best_read, rt)
            print(f"rep {rep}: restore {num_bytes / dt / 1e6:.0f} MB/s ({dt * 1e3:.0f} ms), "
                  f"plain cold read {num_bytes / rt / 1e6:.0f} MB/s ({rt * 1e3:.0f} ms), {num_bytes / 1e6:.0f} MB")
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
        print(f"best: restore {num_bytes / best_restore / 1e6:.0f} MB/s, plain cold read "
              f"{num_bytes / best_read / 1e6:.0f} MB/s; restore/(2 x bytes/read + 50 ms) = "
              f"{best_restore / (2 * best_read + 0.05):.2f}")
        store.close()


if __name__ == "__main__":
    main()

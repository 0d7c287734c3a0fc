"""Measure the KV gather kernel, and the block layouts, against the generic path on this GPU.

Operations, as omlx's hot tier runs them (omlx/engine/kv_cache.py):

* gather (admission): N cached blocks (the last one partial) -> one (1, H, T, D) array per
  layer and K/V. generic = one ``mx.concatenate`` per layer and K/V (``_materialize``);
  kernel = ``metal/kv_gather`` (one launch per group of layers); block-major = the same
  result if a block were ONE (L, 2, 1, H, bs, D) array: one concatenate, then per-layer views.
* split (finish): a request's KVCache buffers -> N full blocks + a tail, evaluated per block
  as ``store`` does. generic = ``mx.contiguous`` slice per layer and K/V; block-major = one
  stacked (L, 2, 1, H, len, D) array per block.

Each timing is the median of ``--repeat`` runs after 3 warm-ups, wall clock around
``mx.eval`` (which waits for the GPU). Shapes are those of real checkpoints (layers, KV heads,
head_dim, bfloat16); weights are not needed. Every alternative is checked equal to the
generic result before it is timed.

Usage: python metal/bench.py [--path cuda|metal] [--repeat 20] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from omlx.kernels import kv_blocks  # noqa: E402
from omlx.kernels.status import native_kernel_status  # noqa: E402

# (name, layers, kv heads, head_dim) of real checkpoints.
MODELS = [
    ("SmolLM2-135M", 30, 3, 64),
    ("Qwen2.5-0.5B", 24, 2, 64),
    ("Llama-3.1-8B", 32, 8, 128),
]
BLOCK_SIZE = 256
NUM_BLOCKS = (4, 16, 64)


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def equal(a, b) -> bool:
    fa, fb = tree_flatten(a), tree_flatten(b)
    return len(fa) == len(fb) and all(x.shape == y.shape and mx.array_equal(x, y).item() for (_, x), (_, y) in zip(fa, fb))


def _parts(layers: int, heads: int, dim: int, n: int):
    shape = (1, heads, BLOCK_SIZE, dim)
    parts = [tuple((mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
                   for _ in range(layers)) for _ in range(n)]
    blocks = [mx.stack([x for kv in p for x in kv]).reshape(layers, 2, *shape) for p in parts]
    mx.eval(parts, blocks)
    return parts, blocks


def bench_gather(path: str, layers: int, heads: int, dim: int, n: int, repeat: int) -> dict:
    parts, blocks = _parts(layers, heads, dim, n)
    takes = [BLOCK_SIZE] * (n - 1) + [BLOCK_SIZE - 56]

    def block_major():
        last = blocks[-1][..., :takes[-1], :]
        cat = mx.concatenate([*blocks[:-1], last], axis=4) if n > 1 else last
        return [(cat[layer, 0], cat[layer, 1]) for layer in range(layers)]

    t0 = time.perf_counter()
    got = kv_blocks.gather_kv_blocks(parts, takes, path=path)
    mx.eval(got)
    first_ms = (time.perf_counter() - t0) * 1e3
    want = kv_blocks.gather_reference(parts, takes)
    ok = equal(got, want) and equal(block_major(), want)
    ref = timed(lambda: kv_blocks.gather_reference(parts, takes), repeat)
    ker = timed(lambda: kv_blocks.gather_kv_blocks(parts, takes, path=path), repeat)
    bm = timed(block_major, repeat)
    nbytes = 2 * 2 * layers * heads * sum(takes) * dim * 2  # read + write, K and V, bf16
    return {"op": "gather", "equal": ok, "generic_ms": ref, "kernel_ms": ker, "kernel_speedup": ref / ker,
            "block_major_ms": bm, "block_major_speedup": ref / bm, "kernel_first_call_ms": first_ms,
            "bytes_moved": nbytes, "kernel_gb_s": nbytes / ker / 1e6, "block_major_gb_s": nbytes / bm / 1e6}


def bench_split(path: str, layers: int, heads: int, dim: int, n: int, repeat: int) -> dict:
    total = n * BLOCK_SIZE + 100
    cap = (total // BLOCK_SIZE + 1) * BLOCK_SIZE
    shape = (1, heads, cap, dim)
    keys = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(layers)]
    values = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(keys, values)
    bounds = [(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n)] + [(n * BLOCK_SIZE, total)]

    def generic():
        out = []
        for a, b in bounds:
            p = tuple((mx.contiguous(k[:, :, a:b]), mx.contiguous(v[:, :, a:b])) for k, v in zip(keys, values))
            mx.eval(p)
            out.append(p)
        return out

    def block_major():
        out = []
        for a, b in bounds:
            blk = mx.stack([x for k, v in zip(keys, values) for x in (k[:, :, a:b], v[:, :, a:b])])
            blk = blk.reshape(layers, 2, 1, heads, b - a, dim)
            mx.eval(blk)
            out.append(blk)
        return out

    ok = all(mx.array_equal(blk[layer, j], p[layer][j]).item()
             for blk, p in zip(block_major(), generic()) for layer in (0, layers - 1) for j in (0, 1))
    ref = timed(generic, repeat)
    bm = timed(block_major, repeat)
    nbytes = 2 * 2 * layers * heads * total * dim * 2
    return {"op": "split", "equal": ok, "generic_ms": ref, "block_major_ms": bm, "block_major_speedup": ref / bm,
            "bytes_moved": nbytes, "block_major_gb_s": nbytes / bm / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="cuda or metal (default: this machine's GPU backend)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    status = native_kernel_status(refresh=True)
    path = args.path or status["kv_gather"].backend
    print(json.dumps({n: s.as_dict() for n, s in status.items()}, indent=1))
    print("device:", mx.default_device(), mx.device_info() if hasattr(mx, "device_info") else "")
    if path not in ("cuda", "metal"):
        sys.exit(f"no GPU backend here ({path}); nothing to measure")
    mx.random.seed(0)
    rows = []
    for name, layers, heads, dim in MODELS:
        for n in NUM_BLOCKS:
            for fn in (bench_gather, bench_split):
                r = {"model": name, "layers": layers, "kv_heads": heads, "head_dim": dim, "num_blocks": n,
                     "tokens": n * BLOCK_SIZE, **fn(path, layers, heads, dim, n, args.repeat)}
                rows.append(r)
                ker = (f"kernel {r['kernel_ms']:8.3f} ms x{r['kernel_speedup']:5.2f} (first {r['kernel_first_call_ms']:5.0f} ms)"
                       if r["op"] == "gather" else " " * 43)
                print(f"{name:13s} {r['op']:6s} N={n:3d} generic {r['generic_ms']:8.3f} ms  {ker}  block-major "
                      f"{r['block_major_ms']:7.3f} ms x{r['block_major_speedup']:5.2f} {r['block_major_gb_s']:7.1f} GB/s"
                      f"  equal={r['equal']}", flush=True)
    try:
        device_name = str(mx.device_info().get("device_name", ""))
    except Exception:  # older MLX
        device_name = ""
    report = {"machine": platform.node(), "gpu": device_name, "path": path, "mlx": mx.__version__, "device": str(mx.default_device()),
              "date": time.strftime("%Y-%m-%d"), "block_size": BLOCK_SIZE, "repeat": args.repeat, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

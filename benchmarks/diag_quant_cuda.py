"""Time MLX's quantized attention pieces on a device, step by step (each printed as it ends):
mx.quantize of KV, quantized_matmul as mlx-lm's quantized SDPA calls it (GQA, 5-D), and mlx-lm's
own generate_step over QuantizedKVCache. Usage: python benchmarks/diag_quant_cuda.py MODEL_DIR.
A diagnostic for `--kv-bits` on CUDA."""
import sys
import time

import mlx.core as mx


def timed(label, fn):
    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    print(f"{label}: {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
    return out


print(mx.default_device(), flush=True)
for T in (2, 512):
    k = mx.random.normal((1, 1, T, 256)).astype(mx.bfloat16)
    qk = timed(f"quantize (1,1,{T},256) bits 8", lambda: mx.quantize(k, group_size=64, bits=8))
    q = mx.random.normal((1, 1, 4, T, 256)).astype(mx.bfloat16)
    qk5 = tuple(mx.expand_dims(x, -3) for x in qk)
    s = timed(f"quantized_matmul scores T={T}", lambda: mx.quantized_matmul(q, *qk5, transpose=True, group_size=64, bits=8))
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(mx.bfloat16)
    timed(f"quantized_matmul values T={T}", lambda: mx.quantized_matmul(p, *qk5, transpose=False, group_size=64, bits=8))
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

m, _ = load(sys.argv[1])
cache = [QuantizedKVCache(64, 8) if type(c).__name__ == "KVCache" else c for c in make_prompt_cache(m)]
t = time.perf_counter()
for i, (tok, _) in enumerate(generate_step(mx.array(list(range(100, 400))), m, max_tokens=4, prompt_cache=cache)):
    print(f"mlx-lm generate_step quantized token {i} at {1e3 * (time.perf_counter() - t):.0f} ms", flush=True)

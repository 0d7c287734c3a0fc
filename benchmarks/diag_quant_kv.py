"""Check on a device that quantized KV (--kv-bits) batches exactly: 3 prompts batched give the
same greedy tokens as each alone. Usage: python benchmarks/diag_quant_kv.py MODEL_DIR. A diagnostic."""
import sys, time, mlx.core as mx
from mlx_lm import load
from omlx.engine.cache_spec import spec_of_model
from omlx.engine.runner import BatchRunner
m, tok = load(sys.argv[1])
print('loaded', sys.argv[1], flush=True)
for bits in (8, 4):
    spec = spec_of_model(m).with_kv_bits(bits, 64)
    prompts = [[100 + (i * 37 + j * 11) % 40000 for i in range(n)] for j, n in enumerate((700, 90, 1500))]
    def run(ps):
        r = BatchRunner(m, stop_tokens=[], block_size=256, prefill_step_size=512, make_cache=spec.make_cache)
        uids = r.insert_segments([[p] for p in ps], max_tokens=[16] * len(ps))
        out = {u: [] for u in uids}
        while len(r):
            for g in r.next()[1]:
                out[g.uid].append(g.token)
        return [out[u] for u in uids]
    t = time.perf_counter(); alone = [run([p])[0] for p in prompts]
    print(f'kv_bits {bits}: alone runs {time.perf_counter() - t:.2f} s', flush=True)
    t = time.perf_counter(); batch = run(prompts); dt = time.perf_counter() - t
    print(f"kv_bits {bits} on {mx.default_device()}: layout {spec.describe()}; batch == alone: {batch == alone} ({dt:.2f} s)", flush=True)

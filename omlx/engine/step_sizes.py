"""Prefill chunk sizes chosen by measuring the model on this device (`measured_step_sizes`).

Owns: timing a model's forward passes at a few chunk lengths, the rule that picks the chunk
size used alone and the one used beside decoding streams (`StepSizes`), and a per-process
memo of the result by model shape and device. The engine calls it once on its thread when it
starts (MLX belongs to that thread). Must not: keep any model or cache past the measurement.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache


@dataclass(frozen=True, slots=True)
class StepSizes:
    """Prefill chunk sizes chosen for this model on this device (`measure_step_sizes`).

    Attributes:
        prefill_step_size: tokens per chunk while nothing decodes (multiple of the block size).
        mixed_step_size: tokens per chunk while other sequences decode (about one decode step).
        decode_step_ms: one batch-1 decode step, measured.
        chunk_ms: measured time of one chunk, by chunk size in tokens.
    """

    prefill_step_size: int
    mixed_step_size: int
    decode_step_ms: float
    chunk_ms: dict[int, float]


def measure_step_sizes(model: Any, block_size: int, *, max_step: int = 4096, min_gain: float = 1.1,
                       max_probe_s: float = 0.25) -> StepSizes:
    """Choose the prefill chunk sizes by timing forward passes of this model on this device.

    Chunks of 32, 64, 128, ... tokens are timed (best of two: the first run of a shape may
    include compiling its kernels) until one takes over
    ``max_probe_s`` or ``max_step`` is reached. The alone size is the shortest chunk, at least
    ``block_size``, whose tokens/s is within ``min_gain`` of the best size's: an accelerator
    needs long chunks to be efficient, a CPU is compute-bound long before a block and keeps
    ``block_size``. (Stopping at the first doubling that gained too little let one slow probe
    decide: on an H200, 1,024 tokens once timed 30 ms against 10 ms for 512 and the alone size
    came out at 512, where 2,048 runs at 25 ms.) The mixed size is the longest chunk (at least 32 tokens) that costs at
    most twice the larger of a batch-1 decode step and the cheapest chunk: on an accelerator a
    short chunk is nearly all fixed cost (3B model, H200: 32 to 512 tokens ~11 ms, 2048 ~26 ms;
    beside a decoding stream a step took 22-27 ms with a 128-token chunk and 30 ms with 2048,
    `benchmarks/diag_interference.py`), so tiny chunks would only stretch a prefill over many
    slowed steps; on a CPU, where time grows with every token, it stays short. Costs a few forward passes (a fraction of a second on an
    accelerator; ~1.5 s on 2 CPU cores with a 135M model).
    """
    def timed(n: int, cache_tokens: int = 0) -> float:
        best = float("inf")
        for _ in range(2):  # the first run of a shape may include compiling its kernels (CUDA JIT)
            cache = make_prompt_cache(model)
            if cache_tokens:
                model(mx.array([[11 + i for i in range(cache_tokens)]]), cache=cache)
                mx.eval([c.state for c in cache])
            x = mx.array([[11 + (i * 7919) % 997 for i in range(n)]])
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache)[:, -1, :])
            best = min(best, time.perf_counter() - t0)
        return best

    with mx.stream(generation_stream):
        timed(8)  # compile / warm up kernels
        decode_s = timed(1, cache_tokens=16)
        chunk: dict[int, float] = {}
        mixed, n = 32, 32
        while n <= max_step:
            chunk[n] = t = timed(n)
            if t <= 2 * max(decode_s, min(chunk.values())):
                mixed = n
            if t > max_probe_s:
                break
            n *= 2
    mx.clear_cache()
    alone = alone_step_size(chunk, block_size, min_gain)
    return StepSizes(alone, min(mixed, alone), decode_s * 1e3, {k: v * 1e3 for k, v in sorted(chunk.items())})


def alone_step_size(chunk_s: dict[int, float], block_size: int, min_gain: float = 1.1) -> int:
    """The shortest chunk size (tokens, at least ``block_size``) whose tokens/s, by the timings
    ``chunk_s`` (size -> seconds), is within ``min_gain`` of the best size's."""
    rates = {k: k / v for k, v in chunk_s.items() if k >= block_size and v > 0}
    if not rates:
        return block_size
    best = max(rates.values())
    return max(block_size, min(k for k, r in rates.items() if r * min_gain >= best))


_MEASURED: dict[tuple, StepSizes] = {}
_MEASURED_LOCK = threading.Lock()


def model_shape_key(model: Any) -> tuple:
    """What decides a model's step times on this device: its class, its arguments (mlx-lm's
    ``model.args``), the dtypes and byte count of its weights, and MLX's default device.
    Two loads of the same model (or of copies of it) have the same key."""
    params = tree_flatten(model.parameters())
    dtypes = tuple(sorted({str(v.dtype) for _, v in params}))
    nbytes = sum(v.nbytes for _, v in params)
    return (type(model).__module__, type(model).__qualname__, repr(getattr(model, "args", None)),
            dtypes, nbytes, str(mx.default_device()))


def measured_step_sizes(model: Any, block_size: int, *, max_step: int = 4096) -> tuple[StepSizes, bool]:
    """`measure_step_sizes`, once per model shape and device in this process.

    Returns:
        (sizes, reused): ``reused`` is True when an earlier load of a model with the same
        `model_shape_key` was measured. Measuring again on every load would cost ~2 s on a
        CPU and, each time, leave a few MB of freed chunk buffers fragmented in the process's
        heap (RSS grew ~8 MB per load of a 135M model on Linux).
    """
    key = (model_shape_key(model), block_size, max_step)
    with _MEASURED_LOCK:
        if key in _MEASURED:
            return _MEASURED[key], True
    sizes = measure_step_sizes(model, block_size, max_step=max_step)
    with _MEASURED_LOCK:
        _MEASURED[key] = sizes
    return sizes, False

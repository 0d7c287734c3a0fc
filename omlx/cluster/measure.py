"""The weight-streaming probe: how fast this node reads weight-sized buffers (bytes/s).

Owns one measurement the planner needs per node, taken once when the agent starts: decode is
memory-bound, so a stage's step time is the bytes it streams over this rate. Imports mlx; it
must run on the thread that owns MLX in the process (the CLI calls it before the server starts).
"""

from __future__ import annotations

import logging
import time

from omlx.units import format_bytes, format_rate

logger = logging.getLogger(__name__)


def measure_stream_rate(num_bytes: int = 128 << 20, num_repeats: int = 5) -> float:
    """Bytes/s of a full reduction (``mx.sum``) over a ``num_bytes`` float16 buffer, best of N.

    The buffer is evaluated before timing, so only the read is timed. The best repeat is kept
    (the others include scheduler noise). ``num_bytes`` should be well above the last-level
    cache (128 MiB by default) so the figure is memory, not cache, bandwidth.

    Raises:
        ValueError: ``num_bytes`` < 2 or ``num_repeats`` < 1.
    """
    import mlx.core as mx

    if num_bytes < 2 or num_repeats < 1:
        raise ValueError("measure_stream_rate needs num_bytes >= 2 and num_repeats >= 1")
    buf = mx.ones((num_bytes // 2,), dtype=mx.float16)
    mx.eval(buf)
    mx.eval(mx.sum(buf))  # warm-up
    best = float("inf")
    for _ in range(num_repeats):
        t0 = time.perf_counter()
        mx.eval(mx.sum(buf))
        best = min(best, time.perf_counter() - t0)
    del buf
    rate = (num_bytes // 2) * 2 / max(best, 1e-9)
    logger.info("weight-streaming probe: %s over %s", format_rate(rate, "GB", 1), format_bytes(num_bytes))
    return rate


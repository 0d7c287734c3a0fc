"""Prefill pacing: how often a prefill chunk may join the decode batch's steps.

A step that carries a prefill chunk beside decoding sequences costs the chunk's forward pass
on top of the decode step (3B model on an H200: a decode step ~4 ms, with a 1,024-token chunk
15-85 ms, `benchmarks/diag_interference.py`), and every decoding sequence waits for it. Chunked
prefill alone bounds one step's cost by a token budget (Sarathi-Serve's stall-free batching,
Agrawal et al., OSDI 2024); `PrefillPacer` bounds the *mean* time per output token of the
decoding sequences while prompts prefill, measured rather than estimated: it lets a chunk into
a step only while the decode steps of the current contention episode have, on average, taken
at most ``max_slowdown`` times a decode-only step. Decode-only steps between chunks pay the
excess back; a prompt arriving while nothing decodes is never held.

A chunk that is a whole prompt (one that fits one chunk, such as a new turn on a cached
conversation) is never held either (``whole_prompt``): holding it would delay that request's
first token by the whole pay-back, dozens of steps for one chunk (on the H200, 8
turns on cached 2k-token conversations sent at once waited 1.3-1.5 s median for their first
token with it held, 0.4-0.7 s unpaced, `benchmarks/bench_hol.py`). Its cost is still measured
and paid back, by holding the long prompts' chunks after it, so the long prefills are what
wait; a burst of short prompts with no long one behind them goes over the bound for the
burst's steps (one chunk each), as a token-budget scheduler without pacing would.

The runner pipelines its steps (step k's graph is queued before step k-1's tokens are read),
so a chunk queued in step k shows in the wall time of step k+2; the pacer charges each chunk
not yet seen at its last measured cost.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

#: A decode-only step's time is the median of this many latest chunk-free steps (the first
#: after a prefill can take 10x a steady one: on 2 CPU cores ~950 ms against 60-80).
DECODE_WINDOW = 9
#: Steps over which a chunk's extra cost is estimated: (their time - as many decode-only
#: steps) / the chunks among them. Which step shows a chunk's cost depends on what syncs the
#: host (the prefix cache's block copies do, at once), so the cost is not read off one step.
CHUNK_WINDOW = 16
#: Steps after a chunk before an interval no longer contains its cost (the pipeline's depth).
PIPELINE_DEPTH = 2


class PrefillPacer:
    """Decides, at the start of each runner step, whether that step may run a prefill chunk.

    Args:
        max_slowdown: the bound on (mean step time while prompts prefill beside decoding
            sequences) / (decode-only step time); values <= 1 turn pacing off (every step may
            carry a chunk, as without a pacer).
        clock: seconds, monotonic (tests pass a fake one).

    Attributes:
        decode_step_s: a decode-only step's wall time, seconds: the median of the latest
            `DECODE_WINDOW` steps with no chunk in the pipeline (None until one is seen: no
            pacing before).
        chunk_extra_s: what a chunk costs beyond the decode-only steps, seconds, over the
            latest `CHUNK_WINDOW` steps that decoded (None until a chunk ran beside decoding).
        num_held: steps in which a waiting chunk was held back, all time.
    """

    def __init__(self, max_slowdown: float, *, clock: Callable[[], float] = time.perf_counter):
        self.max_slowdown = float(max_slowdown)
        self.clock = clock
        self.decode_step_s: float | None = None
        self.chunk_extra_s: float | None = None
        self.num_held = 0
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._recent: deque[tuple[float, bool]] = deque(maxlen=CHUNK_WINDOW)  # (wall s, chunk queued)
        self._debt = 0.0  # seconds over budget in this contention episode (<= 0: may run a chunk)
        self._last: float | None = None  # start of the previous step
        self._last_decoding = False
        self._last_contended = False
        self._chunks: deque[bool] = deque([False] * (PIPELINE_DEPTH + 1), maxlen=PIPELINE_DEPTH + 1)

    @property
    def enabled(self) -> bool:
        return self.max_slowdown > 1.0

    def allow(self, *, decoding: bool, waiting: bool, whole_prompt: bool = False) -> bool:
        """Call once at the start of every step.

        Args:
            decoding: the step decodes at least one sequence.
            waiting: a prefill chunk is waiting to run.
            whole_prompt: that chunk is all of its prompt (never held; its cost is paid back
                by holding later chunks).

        Returns:
            True when the step may run the waiting chunk (always when nothing decodes, nothing
            waits, the chunk is a whole prompt or pacing is off).
        """
        if not self.enabled:
            return True  # nothing to measure for: no clock read or window work per step
        now = self.clock()
        dt = None if self._last is None or not self._last_decoding else now - self._last
        if dt is not None:
            self._observe(dt)
        contended = decoding and waiting
        ok = True
        if contended and self.decode_step_s is not None:
            budget = self.max_slowdown * self.decode_step_s
            # What one chunk costs the budget: its extra time beyond the slack of its own step.
            charge = max(0.0, (self.chunk_extra_s or 0.0) - (budget - self.decode_step_s))
            if self._last_contended and dt is not None:
                # Credit is banked only up to one chunk's charge (or one step's budget): a
                # quiet stretch does not buy a burst.
                self._debt = max(self._debt + dt - budget, -max(budget, charge))
            else:
                self._debt = 0.0
            # Pay before running: the chunks queued but not yet seen in a step's time, and
            # this one, are charged now, so the mean holds at every point of the episode.
            unseen = sum(list(self._chunks)[-PIPELINE_DEPTH:])
            ok = whole_prompt or self._debt + (unseen + 1) * charge <= 0.0
            if not ok:
                self.num_held += 1
        else:
            self._debt = 0.0
        self._chunks.append(ok and waiting)
        self._last, self._last_decoding, self._last_contended = now, decoding, contended
        return ok

    def _observe(self, dt: float) -> None:
        """Fold the previous step's wall time in: a decode-only step when no chunk ran in the
        pipeline-depth steps before it; and into the window a chunk's extra cost is read from."""
        chunks = list(self._chunks)  # oldest first; chunks[-1] = the step that just ended
        if not any(chunks):
            self._decode_steps.append(dt)
            self.decode_step_s = statistics.median(self._decode_steps)
        self._recent.append((dt, chunks[-1]))
        # The window's chunks against the steps their costs land in, pipeline-depth steps later
        # (a step that syncs early shows a cost sooner; over the window that evens out).
        recent = list(self._recent)
        times, flags = recent[PIPELINE_DEPTH:], recent[:-PIPELINE_DEPTH]
        n_chunks = sum(c for _, c in flags)
        if n_chunks and self.decode_step_s is not None:
            extra = sum(t for t, _ in times) - len(times) * self.decode_step_s
            self.chunk_extra_s = max(0.0, extra) / n_chunks

"""ProcessMemoryEnforcer: measures the process and keeps it under its memory ceiling.

Owns: measuring (psutil RSS and MLX's active + cache memory), the ceiling and its two
watermarks, the escalation ladder run on every check, and giving freed memory back to the OS.
Must not: know what a model, an engine or a request is. It acts only through `MemoryActions`,
which the pool implements, so the policy is testable with a fake meter and fake actions.

Ladder (one `enforce` call):
  below soft          resume admission.
  soft <= used        pause admission; drop MLX's buffer cache; evict idle models, LRU first,
                      until below soft. If still above soft and nothing is running that could
                      finish and free memory, resume admission (waiting could never end).
  hard <= used        first shrink the hot KV caches, then evict idle models, then abort the
                      youngest request with a clear error (one per check).

Measured figure: ``used_bytes = max(RSS, MLX active + cache)``. On Linux (CPU) MLX's buffers are
part of RSS; on macOS Metal buffers may not be, and on CUDA they are device memory; the max is a
lower bound of the real footprint on every platform.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import gc
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import psutil

from omlx.config import MemoryConfig
from omlx.errors import InsufficientMemoryError
from omlx.units import BYTES_PER_UNIT, format_bytes

logger = logging.getLogger(__name__)

GB = BYTES_PER_UNIT["GB"]
#: Headroom the default ceiling leaves to the OS and other apps.
OS_RESERVE_BYTES = 8 * GB


def default_ceiling_bytes(total_bytes: int) -> int:
    """Total RAM - 8 GB, but never below half of RAM (an 8 GB machine gets 4 GB, 16 GB gets 8 GB)."""
    return max(total_bytes - OS_RESERVE_BYTES, total_bytes // 2)


def gb(num_bytes: float) -> str:
    """``1234567890`` -> ``"1.23 GB"``: memory messages and logs keep one unit, so the used, soft,
    hard and ceiling figures compare at a glance (``omlx.units.format_bytes``)."""
    return format_bytes(num_bytes, "GB")


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """One measurement, in bytes.

    Attributes:
        process_bytes: resident set size of this process.
        mlx_active_bytes: memory in live MLX arrays.
        mlx_cache_bytes: memory MLX keeps for reuse (freed arrays, not yet returned).
    """

    process_bytes: int
    mlx_active_bytes: int
    mlx_cache_bytes: int

    @property
    def used_bytes(self) -> int:
        return max(self.process_bytes, self.mlx_active_bytes + self.mlx_cache_bytes)

    def as_dict(self) -> dict[str, int]:
        return {
            "used_bytes": self.used_bytes,
            "process_bytes": self.process_bytes,
            "mlx_active_bytes": self.mlx_active_bytes,
            "mlx_cache_bytes": self.mlx_cache_bytes,
        }


def measure_process() -> MemorySnapshot:
    """Measure this process now (a few microseconds)."""
    import mlx.core as mx

    return MemorySnapshot(psutil.Process().memory_info().rss, mx.get_active_memory(), mx.get_cache_memory())


_libc: ctypes.CDLL | None = None


def release_freed_memory() -> None:
    """Give memory of dropped objects back to the OS: gc, MLX's buffer cache, glibc's heap.

    Without ``malloc_trim`` glibc keeps the freed weights of an unloaded model in its heap (RSS
    stays ~0.5 GB higher per unload of a small model on Linux), which is how repeated load/evict
    cycles stopped releasing memory (case model-alias-fallback-load-thrash).
    """
    global _libc
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            if _libc is None:
                _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim(0)
        except (OSError, AttributeError):  # musl and others: nothing to trim
            pass


class MemoryPressure(enum.Enum):
    OK = "ok"
    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """The ceiling and the watermarks derived from it, in bytes."""

    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int

    @classmethod
    def from_config(cls, config: MemoryConfig, total_bytes: int | None = None) -> MemoryLimits:
        total = total_bytes if total_bytes is not None else psutil.virtual_memory().total
        ceiling = config.ceiling_bytes or default_ceiling_bytes(total)
        return cls(ceiling, int(ceiling * config.soft_watermark), int(ceiling * config.hard_watermark))

    def as_dict(self) -> dict[str, int]:
        return {"ceiling_bytes": self.ceiling_bytes, "soft_bytes": self.soft_bytes, "hard_bytes": self.hard_bytes}


class MemoryActions(Protocol):
    """What the enforcer may do; implemented by the EnginePool."""

    def set_admission_paused(self, paused: bool) -> None:
        """Hold (True) or let through (False) new requests."""

    def num_running_requests(self) -> int:
        """Requests decoding or waiting in any engine (their memory may be freed when they end)."""

    def evict_idle_model(self, reason: str) -> str | None:
        """Unload the least recently used idle, unpinned model. Returns its id, None when none."""

    def shrink_hot_caches(self) -> int:
        """Drop hot KV cache blocks not in use. Returns the bytes they held."""

    def abort_youngest_request(self, error: InsufficientMemoryError) -> str | None:
        """Fail the most recently arrived request with ``error``. Returns its id, None when none."""


@dataclass(frozen=True, slots=True)
class EnforcementReport:
    """What one `enforce` call saw and did (for logs and tests)."""

    before: MemorySnapshot
    after: MemorySnapshot
    pressure: MemoryPressure
    paused: bool
    evicted: tuple[str, ...] = ()
    shrunk_bytes: int = 0
    aborted: str | None = None


class ProcessMemoryEnforcer:
    """Keeps the process under ``limits`` through `MemoryActions`.

    Args:
        limits: ceiling and watermarks.
        measure: the meter (default: `measure_process`); tests pass a fake.
        release: gives freed memory back (default: `release_freed_memory`).
    """

    def __init__(self, limits: MemoryLimits, measure: Callable[[], MemorySnapshot] = measure_process,
                 release: Callable[[], None] = release_freed_memory):
        self.limits = limits
        self._measure = measure
        self._release = release
        self._lock = threading.Lock()
        self.num_aborted = 0

    def snapshot(self) -> MemorySnapshot:
        return self._measure()

    def release(self) -> None:
        self._release()

    def pressure(self, snap: MemorySnapshot) -> MemoryPressure:
        used = snap.used_bytes
        if used >= self.limits.hard_bytes:
            return MemoryPressure.HARD
        if used >= self.limits.soft_bytes:
            return MemoryPressure.SOFT
        return MemoryPressure.OK

    def room_bytes(self, snap: MemorySnapshot | None = None) -> int:
        """Bytes a model load may still add while staying under the soft watermark (may be < 0)."""
        snap = snap or self._measure()
        return self.limits.soft_bytes - snap.used_bytes

    def enforce(self, actions: MemoryActions) -> EnforcementReport:
        """Run the ladder once (see the module docstring). Thread-safe; calls never overlap."""
        with self._lock:
            return self._enforce(actions)

    def _enforce(self, actions: MemoryActions) -> EnforcementReport:
        before = snap = self._measure()
        level = self.pressure(snap)
        if level is MemoryPressure.OK:
            actions.set_admission_paused(False)
            return EnforcementReport(before, snap, level, False)
        actions.set_admission_paused(True)
        evicted: list[str] = []
        shrunk = 0
        aborted = None
        self._release()  # MLX's buffer cache and the C heap first: costs nothing to rebuild
        snap = self._measure()
        if self.pressure(snap) is MemoryPressure.HARD:
            shrunk = actions.shrink_hot_caches()
            if shrunk:
                self._release()
                snap = self._measure()
        while snap.used_bytes >= self.limits.soft_bytes:
            victim = actions.evict_idle_model(f"memory above the soft watermark ({gb(snap.used_bytes)} used)")
            if victim is None:
                break
            evicted.append(victim)
            snap = self._measure()
        if snap.used_bytes >= self.limits.hard_bytes:
            err = InsufficientMemoryError(
                f"request aborted: the server's memory use ({gb(snap.used_bytes)}) reached the hard limit "
                f"({gb(self.limits.hard_bytes)} of a {gb(self.limits.ceiling_bytes)} ceiling) and nothing idle "
                "was left to evict; retry with a shorter prompt or fewer parallel requests, or raise --memory-ceiling"
            )
            aborted = actions.abort_youngest_request(err)
            if aborted is not None:
                self.num_aborted += 1
                logger.warning("memory hard limit: aborted request %s (%s used)", aborted, gb(snap.used_bytes))
        paused = snap.used_bytes >= self.limits.soft_bytes and actions.num_running_requests() > 0
        actions.set_admission_paused(paused)
        if evicted or shrunk or aborted:
            logger.info("memory %s -> %s: evicted %s, shrank hot caches by %s, aborted %s",
                        gb(before.used_bytes), gb(snap.used_bytes), evicted or "none", gb(shrunk), aborted or "none")
        return EnforcementReport(before, snap, level, paused, tuple(evicted), shrunk, aborted)

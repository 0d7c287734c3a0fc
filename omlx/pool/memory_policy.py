"""The pool's memory policy: making room for a load, and the actions the enforcer calls.

Owns: the room a load needs (its weights' bytes times `LOAD_MARGIN`, under the soft
watermark), the choice of what to evict (the least recently used idle unpinned model, never a
busy or pinned one), the 507s that say why a model cannot fit, and `omlx.memory.MemoryActions`
for the `ProcessMemoryEnforcer`: pausing admission, evicting an idle model, emptying the hot KV
tiers, aborting the youngest request.
Must not: measure memory (the enforcer does), load models, or decide when to act on pressure
(the enforcer's ladder does).
Locking: the pool's lock, shared; it is never held across an unload.
"""

from __future__ import annotations

import logging
import threading
import time

from omlx.config import MemoryConfig
from omlx.errors import InsufficientMemoryError, OverloadedError
from omlx.memory import ProcessMemoryEnforcer, gb
from omlx.pool.loaded import LoadedSet
from omlx.pool.model import ModelRecord, ModelState, hot_cache_bytes, num_requests

logger = logging.getLogger(__name__)

#: Planning margin over the weights' bytes for a load (activations, buffers).
LOAD_MARGIN = 1.10


class MemoryPolicy:
    """Room for loads and the enforcer's `MemoryActions`, over the pool's loaded set.

    Args:
        config: ``[memory]`` (soft watermark and load wait, named in messages).
        lock: the pool's lock; waiters on it are notified when admission pauses or resumes.
        loaded: the loaded set (what is busy; unloading).
        enforcer: the memory enforcer (measurements and limits).
    """

    def __init__(self, config: MemoryConfig, lock: threading.Condition, loaded: LoadedSet,
                 enforcer: ProcessMemoryEnforcer):
        self._config = config
        self._lock = lock
        self._loaded = loaded
        self._enforcer = enforcer
        self.paused = False  # admission; read under the lock

    def paused_error(self, wait_s: float) -> OverloadedError:
        """The 529 for a request that waited ``wait_s`` while admission stayed paused."""
        snap = self._enforcer.snapshot()
        return OverloadedError(
            f"memory is above the soft limit ({gb(snap.used_bytes)} used of {gb(self._enforcer.limits.soft_bytes)}); "
            f"new requests were held {wait_s:.0f} s for running ones to finish. Retry later")

    def make_room(self, rec: ModelRecord, deadline: float) -> None:
        """Evict idle unpinned models (LRU) until ``rec``'s weights (``rec.weights_bytes``, times
        `LOAD_MARGIN`) fit under the soft watermark; empty the hot KV tiers once if that is not enough.

        Raises:
            InsufficientMemoryError: it can never fit (at once), or busy models did not become
                idle before ``deadline`` (``time.monotonic()``).
        """
        need = int(rec.weights_bytes * LOAD_MARGIN)
        limits = self._enforcer.limits
        shrunk = False
        while True:
            snap = self._enforcer.snapshot()
            room = limits.soft_bytes - snap.used_bytes
            if need <= room:
                return
            with self._lock:
                others = [r for r in self._loaded.loaded() if r is not rec]
                reclaimable = sum(r.num_bytes for r in others if not r.pinned)
                reclaimable += sum(hot_cache_bytes(r.entry) for r in others)
                pinned = [(r.model_id, r.num_bytes) for r in others if r.pinned]
                busy = [r.model_id for r in others if not r.pinned and self._loaded.busy(r)]
            numbers = (f"model '{rec.model_id}' needs about {gb(need)}; the soft limit is {gb(limits.soft_bytes)} "
                       f"({self._config.soft_watermark:.0%} of a {gb(limits.ceiling_bytes)} ceiling) and the process "
                       f"uses {gb(snap.used_bytes)}, of which pinned models hold "
                       f"{', '.join(f'{m} {gb(b)}' for m, b in pinned) or 'nothing'}")
            if need > room + reclaimable:
                raise InsufficientMemoryError(
                    f"{numbers}. It cannot fit even with every unpinned model unloaded: raise the ceiling "
                    "([memory] ceiling or --memory-ceiling), unpin a model, or use a smaller or quantized model")
            victim = self.pick_victim(exclude=rec)
            if victim is not None:
                self._loaded.unload(victim, reason=f"LRU: making room for {rec.model_id}")
                continue
            if not shrunk:
                shrunk = True
                if self.shrink_hot_caches():
                    self._enforcer.release()
                    continue
            if time.monotonic() >= deadline:
                raise InsufficientMemoryError(
                    f"{numbers}. Models {', '.join(busy) or '(none)'} were serving requests for "
                    f"{self._config.load_wait_s:.0f} s and could not be unloaded; retry later")
            with self._lock:
                self._lock.wait(0.2)

    def pick_victim(self, exclude: ModelRecord | None = None) -> ModelRecord | None:
        """The least recently used idle unpinned loaded model, now marked UNLOADING (the caller
        unloads it); None when every loaded model is busy, pinned or ``exclude``."""
        with self._lock:
            cands = [r for r in self._loaded.loaded() if r is not exclude and not r.pinned and not self._loaded.busy(r)]
            if not cands:
                return None
            victim = min(cands, key=lambda r: r.last_used_s)
            victim.state = ModelState.UNLOADING
            return victim

    # ---- MemoryActions (called by the enforcer on the watchdog thread) ---------------------

    def set_admission_paused(self, paused: bool) -> None:
        with self._lock:
            if paused != self.paused:
                logger.warning("admission %s (memory %s the soft watermark)", "paused" if paused else "resumed",
                               "above" if paused else "below")
            self.paused = paused
            self._lock.notify_all()

    def num_running_requests(self) -> int:
        with self._lock:
            entries = [r.entry for r in self._loaded.loaded()]
        return sum(num_requests(e) for e in entries)

    def evict_idle_model(self, reason: str) -> str | None:
        victim = self.pick_victim()
        if victim is None:
            return None
        self._loaded.unload(victim, reason=reason)
        return victim.model_id

    def shrink_hot_caches(self) -> int:
        """Empty every model's hot KV tier (blocks in use stay until released; the SSD tier keeps
        its copies). Returns the bytes the tiers held."""
        freed = 0
        for e in self._loaded.entries():
            pc = e.engine.prefix_cache
            if pc is None:
                continue
            try:
                n = hot_cache_bytes(e)
                if n:
                    pc.clear()
                    freed += n
            except Exception:
                logger.exception("could not shrink the hot KV cache of %s", e.loaded.model_id)
        return freed

    def abort_youngest_request(self, error: InsufficientMemoryError) -> str | None:
        youngest = None
        for e in self._loaded.entries():
            for req in e.engine.active_requests():
                if youngest is None or req.arrival_s > youngest[1].arrival_s:
                    youngest = (e.engine, req)
        if youngest is None:
            return None
        youngest[0].abort(youngest[1].request_id, error)
        return youngest[1].request_id

"""The pool's loaded set: which models are loaded, who holds a lease on them, and their TTLs.

Owns: the leases (`ModelLease`), whether a model is busy, a model's move into LOADED once its
entry is built and out again (stopping its engine, flushing its hot KV tier, giving the memory
back), TTL unloads, the load and unload counters and the recent `PoolEvent`s.

Rules:
  - a model is busy while a request holds a `ModelLease` on it (taken before the route resolves
    it, released when the route ends, on every path: ``omlx.api.holds``) or its engine has
    requests: busy models are never evicted, so a request is never cut off by an eviction;
  - a lease not released within `LEASE_TIMEOUT_S` while its engine is idle is dropped as a
    safety net, and that is a bug: logged as an ERROR naming the request that held it, and
    counted (``num_expired_leases``; ``omlx_leases_expired_total`` in /metrics).
Must not: find or resolve models (`omlx.pool.catalogue`), choose what to evict for memory
(`omlx.pool.memory_policy`), build entries (the pool's loader does), or speak HTTP.
Locking: the pool's lock, shared; methods that say "caller holds the lock" do not take it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from omlx.engine.factory import EncoderEntry, Entry, PoolEntry
from omlx.errors import InvalidRequestError, ModelNotFoundError, OmlxError
from omlx.memory import ProcessMemoryEnforcer, gb
from omlx.pool.model import LeaseHolder, ModelRecord, ModelState, PoolEvent, is_working, last_work_s
from omlx.profiles import effective_settings

logger = logging.getLogger(__name__)

#: A lease older than this, while its engine is idle, no longer protects its model: a safety
#: net only (every request releases its lease when its route ends), so each expiry is an ERROR.
LEASE_TIMEOUT_S = 120.0


@dataclass(slots=True)
class ModelLease:
    """A request's hold on a loaded model: it is not evicted until released.

    Attributes:
        owner: who holds it (``request <id> (<method> <path>)``), named in the log if it expires.
    """

    model_id: str
    token: int
    entry: Entry
    owner: str = ""


def chat_entry(lease: ModelLease, model: str) -> PoolEntry:
    """The chat entry a lease holds.

    Raises:
        InvalidRequestError: ``model`` (as the request named it) is an encoder model.
    """
    if not isinstance(lease.entry, PoolEntry):
        raise InvalidRequestError(
            f"model '{model}' is an {lease.entry.task} model; use POST /v1/{lease.entry.task}", param="model")
    return lease.entry


def encoder_entry(lease: ModelLease, model: str, task: str) -> EncoderEntry:
    """The embeddings or rerank entry a lease holds.

    Raises:
        InvalidRequestError: ``model`` does not do ``task``.
    """
    e = lease.entry
    if not isinstance(e, EncoderEntry) or e.task != task:
        kind = e.task if isinstance(e, EncoderEntry) else "chat"
        hint = {"embeddings": "an embedding model (BERT family)",
                "rerank": "a cross-encoder (BERT/XLM-R/ModernBERT *ForSequenceClassification)"}[task]
        raise InvalidRequestError(f"model '{model}' is a {kind} model; {task} needs {hint}", param="model")
    return e


class LoadedSet:
    """The loaded models among ``records`` and the leases on them.

    Args:
        records: the catalogue's records by id (read here; the catalogue adds to it).
        lock: the pool's lock; waiters on it are notified at every change of state.
        enforcer: measures what an unload freed, and gives it back to the OS.
    """

    def __init__(self, records: dict[str, ModelRecord], lock: threading.Condition, enforcer: ProcessMemoryEnforcer):
        self._records = records
        self._lock = lock
        self._enforcer = enforcer
        self._tokens = itertools.count(1)
        self.events: deque[PoolEvent] = deque(maxlen=200)
        self.num_loads = 0
        self.num_unloads = 0
        self.num_expired_leases = 0

    def loaded(self) -> list[ModelRecord]:
        """The LOADED records. Caller holds the lock."""
        return [r for r in self._records.values() if r.state is ModelState.LOADED]

    # ---- leases ---------------------------------------------------------------------------

    def lease(self, rec: ModelRecord, profile: str | None, asked: str, owner: str, token: int | None = None) -> ModelLease:
        """A lease on a LOADED record (``token``: one `mark_loaded` already holds for the
        caller). Caller holds the lock.

        Raises:
            ModelNotFoundError: ``profile`` is not one of the model's (``asked``: the name requested).
        """
        entry = rec.profile_entries.get(profile)
        if entry is None:
            entry = rec.entry
            if profile is not None:
                s = effective_settings(rec.settings, profile)
                if s is None:
                    raise ModelNotFoundError(asked)
                if isinstance(entry, PoolEntry):
                    entry = replace(entry, settings=s, profile=profile, tool_dialect=s.tool_dialect or entry.tool_dialect)
                else:
                    entry = replace(entry, settings=s)
            rec.profile_entries[profile] = entry
        now = time.monotonic()
        if token is None:
            token = next(self._tokens)
            rec.leases[token] = LeaseHolder(now, owner)
        rec.last_used_s = now
        return ModelLease(rec.model_id, token, entry, owner)

    def release(self, lease: ModelLease) -> None:
        """End a lease (idempotent)."""
        with self._lock:
            rec = self._records.get(lease.model_id)
            if rec is not None and rec.leases.pop(lease.token, None) is not None:
                rec.last_used_s = time.monotonic()

    def drop_hold(self, rec: ModelRecord, token: int) -> None:
        """End the hold `mark_loaded` took, when it will not become a lease. Caller holds the lock."""
        rec.leases.pop(token, None)

    def busy(self, rec: ModelRecord) -> bool:
        """Leased or serving; drops (and logs as an ERROR) leases held past `LEASE_TIMEOUT_S`
        while the engine is idle. Caller holds the lock."""
        if is_working(rec.entry):  # a long non-streaming request keeps its lease however long it runs
            return True
        now = time.monotonic()
        # Idle time counts from the engine's last working step, not from the lease: a request that
        # ran 24 minutes still writes its last frames after the engine went idle, and its lease
        # was taken 24 minutes ago (the real Claude Code's long first prompt met this).
        last = last_work_s(rec.entry)
        for tok, held in list(rec.leases.items()):
            if now - max(held.since_s, last) > LEASE_TIMEOUT_S:
                del rec.leases[tok]
                rec.num_expired_leases += 1
                self.num_expired_leases += 1
                logger.error("a lease on %s held by %s expired after %.0f s with its engine idle: its holder "
                             "never released it (a bug: every path out of a request releases its lease)",
                             rec.model_id, held.owner, LEASE_TIMEOUT_S)
        return bool(rec.leases)

    # ---- loading and unloading ------------------------------------------------------------

    def mark_loaded(self, rec: ModelRecord, entry: Entry, measured_bytes: int, *, owner: str, reason: str,
                    t0: float) -> int:
        """Make a record its loader just built LOADED, and record the load (``t0``: when it began,
        ``time.monotonic()``).

        Returns:
            A lease token already held for ``owner``, so that nothing (the watchdog) can
            evict the model between its load and its first use; release or reuse it.
        """
        with self._lock:
            rec.entry = entry
            rec.measured_bytes = measured_bytes
            rec.state = ModelState.LOADED
            rec.num_loads += 1
            rec.last_used_s = time.monotonic()
            rec.profile_entries.clear()
            token = next(self._tokens)
            rec.leases[token] = LeaseHolder(time.monotonic(), owner)
            self.num_loads += 1
            self._lock.notify_all()
        dt = time.monotonic() - t0
        self.events.append(PoolEvent(time.time(), rec.model_id, "load", reason, dt, rec.measured_bytes))
        logger.info("loaded %s (%s, %s) in %.1f s: %s", rec.model_id, rec.task, gb(rec.measured_bytes), dt, reason)
        return token

    def mark_failed(self, rec: ModelRecord, error: OmlxError) -> None:
        """A load failed: the record is UNLOADED with ``load_error``, and its waiters are woken."""
        with self._lock:
            rec.state = ModelState.UNLOADED
            rec.load_error = error
            self._lock.notify_all()
        logger.warning("could not load %s: %s", rec.model_id, error.message)

    def unload(self, rec: ModelRecord, *, reason: str, abort_error: Exception | None = None) -> PoolEvent:
        """Stop a record marked UNLOADING, drop every reference, give the memory back, record it.

        Args:
            abort_error: fail the engine's running requests with it first (up to 10 s for them
                to end); None: the caller made sure none is running.
        """
        t0 = time.monotonic()
        before = self._enforcer.snapshot()
        entry = rec.entry
        if isinstance(entry, PoolEntry):
            if abort_error is not None:
                for req in entry.engine.active_requests():
                    entry.engine.abort(req.request_id, abort_error)
                end = time.monotonic() + 10
                while entry.engine.num_active() and time.monotonic() < end:
                    time.sleep(0.02)
            entry.engine.stop()
            close = getattr(entry.engine.prefix_cache, "close", None)
            if close is not None:  # write the hot KV tier back to the SSD tier first
                try:
                    close()
                except Exception:
                    logger.exception("could not flush the KV cache of %s", rec.model_id)
        elif isinstance(entry, EncoderEntry):
            entry.engine.stop()
        with self._lock:
            rec.entry = None
            rec.profile_entries.clear()
            rec.leases.clear()
            rec.state = ModelState.UNLOADED
            self.num_unloads += 1
            self._lock.notify_all()
        del entry
        self._enforcer.release()
        after = self._enforcer.snapshot()
        ev = PoolEvent(time.time(), rec.model_id, "unload", reason, time.monotonic() - t0, rec.num_bytes,
                       before.mlx_active_bytes - after.mlx_active_bytes, before.process_bytes - after.process_bytes)
        self.events.append(ev)
        logger.info("unloaded %s (%s): freed %s MLX, %s process", rec.model_id, reason,
                    gb(ev.freed_mlx_bytes), gb(ev.freed_process_bytes))
        return ev

    def drain_and_unload(self, rec: ModelRecord, *, wait_s: float, drain_s: float, reason: str,
                         abort_error: Exception) -> PoolEvent | None:
        """Unload a model once its running requests finish: wait up to ``wait_s`` for a load or
        unload under way to end, mark it UNLOADING (new requests wait, then load it again), give
        its requests up to ``drain_s``, then fail the rest with ``abort_error`` and unload it.
        Returns the event, None if it was not loaded."""
        with self._lock:
            end = time.monotonic() + wait_s
            while rec.state in (ModelState.LOADING, ModelState.UNLOADING) and time.monotonic() < end:
                self._lock.wait(0.5)
            if rec.state is not ModelState.LOADED:
                return None
            rec.state = ModelState.UNLOADING
            end = time.monotonic() + drain_s
            while self.busy(rec) and time.monotonic() < end:
                self._lock.wait(0.1)
        return self.unload(rec, reason=reason, abort_error=abort_error)

    def unload_expired(self) -> None:
        """Unload every idle unpinned model past its ``ttl_s``; idle time counts from the end of
        the last request (a busy model's clock is reset here)."""
        now = time.monotonic()
        expired = []
        with self._lock:
            for r in self.loaded():
                if self.busy(r):
                    r.last_used_s = now
                elif r.settings.ttl_s and not r.pinned and now - r.last_used_s >= r.settings.ttl_s:
                    r.state = ModelState.UNLOADING
                    expired.append(r)
        for r in expired:
            self.unload(r, reason=f"idle for {r.settings.ttl_s:.0f} s (ttl_s)")

    def unload_all(self, reason: str) -> None:
        """Unload every loaded model (at stop); a failure is logged, and the rest still unload."""
        with self._lock:
            recs = self.loaded()
            for r in recs:
                r.state = ModelState.UNLOADING
        for r in recs:
            try:
                self.unload(r, reason=reason)
            except Exception:
                logger.exception("could not stop %s", r.model_id)

    # ---- reading --------------------------------------------------------------------------

    def entries(self) -> list[PoolEntry]:
        """The loaded chat entries (``/health``, ``/v1/cache/stats``)."""
        with self._lock:
            return [r.entry for r in self.loaded() if isinstance(r.entry, PoolEntry)]

    def loaded_ids(self) -> set[str]:
        """The ids of every loaded model, chat and encoder (``GET /v1/admin/models``)."""
        with self._lock:
            return {r.model_id for r in self.loaded()}

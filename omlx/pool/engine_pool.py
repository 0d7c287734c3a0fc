"""EnginePool: model id -> running engine; loads on demand, evicts LRU by bytes, TTL, pinning.

Owns: the pool's front: a request's lease (`acquire`: resolve, wait, load if needed, lease),
loading one model at a time, the admin load and unload, the start models, the watchdog thread
and stopping. It composes the parts that do each job, under one lock:
  - `Catalogue` (``omlx.pool.catalogue``): which ids exist and what a requested name (id,
    alias, ``<id>:<profile>``) resolves to;
  - `LoadedSet` (``omlx.pool.loaded``): the loaded models, the leases on them, TTL unloads;
  - `MemoryPolicy` (``omlx.pool.memory_policy``): room for a load (LRU eviction, 507s) and the
    `MemoryActions` the `ProcessMemoryEnforcer` calls;
  - ``omlx.pool.status``: the ``/v1/models/status`` document.

Rules:
  - one load at a time; a load must leave the process under the soft watermark, so idle
    unpinned models are unloaded LRU first until it fits; busy ones (leased or serving: see
    ``omlx.pool.loaded``) are waited for (up to ``memory.load_wait_s``) and never evicted; a
    model that could never fit gets a 507 with the numbers at once;
  - a request to a model being loaded or unloaded waits for it, then gets it (reloaded if
    needed) or a clear error; nothing is dropped silently;
  - pinned models load at start and are never evicted.
Must not: speak HTTP, or run MLX work itself (engines do; loading happens on the caller's thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from omlx.config import ModelSettings, ServerConfig
from omlx.engine.factory import Entry, PoolEntry, load_model
from omlx.errors import EngineError, InvalidRequestError, ModelImportError, OmlxError, OverloadedError
from omlx.memory import MemoryLimits, ProcessMemoryEnforcer
from omlx.pool.catalogue import Catalogue
from omlx.pool.loaded import LoadedSet, ModelLease, chat_entry
from omlx.pool.memory_policy import MemoryPolicy
from omlx.pool.model import ModelRecord, ModelState, PoolEvent, weights_bytes
from omlx.pool.status import model_row, pool_status

logger = logging.getLogger(__name__)

Loader = Callable[[str, Path, str, ModelSettings, bool], Entry]


class EnginePool:
    """Engines by model id: load on demand, LRU/TTL/pin eviction, memory enforcement.

    Args:
        config: the server config (models dir, aliases, per-model settings, memory limits).
        enforcer: the memory enforcer (default: one built from ``config.memory``).
        loader: ``(model_id, path, task, settings, warmup) -> Entry``; tests pass a fake.
        resolver: ``(model_id, source) -> (path, task)``; tests pass a fake.

    Attributes:
        catalogue: the servable ids, aliases and profiles.
        memory: the memory policy; the `MemoryActions` the enforcer acts through.
    """

    def __init__(self, config: ServerConfig, *, enforcer: ProcessMemoryEnforcer | None = None,
                 loader: Loader | None = None, resolver: Callable[[str, str | None], tuple[Path, str]] | None = None):
        self.config = config
        self.enforcer = enforcer or ProcessMemoryEnforcer(MemoryLimits.from_config(config.memory))
        self._lock = threading.Condition()
        self.catalogue = Catalogue(config, self._lock)
        self._loaded = LoadedSet(self.catalogue.records, self._lock, self.enforcer)
        self.memory = MemoryPolicy(config.memory, self._lock, self._loaded, self.enforcer)
        self._loader = loader or (lambda mid, path, task, s, warm: load_model(mid, path, task, s, config, warmup=warm))
        self._resolver = resolver or self.catalogue.resolve_path
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="pool-acquire")

    # ---- the parts' calls that callers make on the pool -------------------------------------

    def register(self, spec: str | None) -> str:
        """Make a ``--model`` spec known; returns the served id (`Catalogue.register`)."""
        return self.catalogue.register(spec)

    def resolve(self, model: str) -> tuple[str, str | None]:
        """(served id, profile or None) for a requested name (`Catalogue.resolve`). Raises ModelNotFoundError."""
        return self.catalogue.resolve(model)

    def resolve_id(self, model: str) -> str:
        """The served id for a requested name (`Catalogue.resolve`). Raises ModelNotFoundError."""
        return self.catalogue.resolve(model)[0]

    def listed_ids(self) -> list[str]:
        """Every servable id: models (default first), their profiles, then aliases."""
        return self.catalogue.listed_ids()

    def release(self, lease: ModelLease) -> None:
        """End a lease (idempotent)."""
        self._loaded.release(lease)

    def entries(self) -> list[PoolEntry]:
        """The loaded chat entries (``/health``, ``/v1/cache/stats``)."""
        return self._loaded.entries()

    def loaded_ids(self) -> set[str]:
        """The ids of every loaded model, chat and encoder (``GET /v1/admin/models``)."""
        return self._loaded.loaded_ids()

    # ---- leases ---------------------------------------------------------------------------

    def acquire(self, model: str, wait_s: float | None = None, *, task: str | None = None, gate: bool = True,
                owner: str = "unnamed") -> ModelLease:
        """Hold ``model`` loaded for one request, loading it first if needed (blocks).

        Args:
            task: what the route will do with it ("chat", "embeddings", "rerank"); a model of
                another kind is refused before it is loaded.
            gate: wait while admission is paused (memory above the soft watermark); False for
                a request that already holds a lease (it was admitted) and for admin calls.
            owner: who holds it ("request <id> (<method> <path>)"), named in the log should the
                lease ever expire.

        Raises:
            ModelNotFoundError: unknown name.
            InvalidRequestError: the model does not do ``task``.
            InsufficientMemoryError: it cannot fit, or not within ``wait_s`` (507).
            OverloadedError: admission stayed paused, or the model stayed busy loading or
                unloading, for ``wait_s`` (529).
            ModelImportError: the load failed.
        """
        wait_s = self.config.memory.load_wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        mid, profile = self.catalogue.resolve(model)
        if task is not None:
            self.catalogue.check_task(model, mid, task)
        seen_generation = None
        with self._lock:
            while True:
                rec = self.catalogue.records[mid]
                now = time.monotonic()
                if gate and self.memory.paused and now < deadline:
                    self._lock.wait(min(0.5, deadline - now))
                    continue
                if gate and self.memory.paused:
                    raise self.memory.paused_error(wait_s)
                if rec.state is ModelState.LOADED:
                    return self._loaded.lease(rec, profile, model, owner)
                if rec.state is ModelState.UNLOADED:
                    if rec.load_error is not None and rec.generation == seen_generation:
                        raise rec.load_error  # the load this request waited for failed
                    rec.state = ModelState.LOADING
                    rec.generation += 1
                    rec.load_error = None
                    break
                if seen_generation is None:
                    seen_generation = rec.generation
                if now >= deadline:
                    raise OverloadedError(f"model '{mid}' is still {rec.state.value} after {wait_s:.0f} s; retry later")
                self._lock.wait(min(1.0, deadline - now))
        token = self._load(rec, deadline, reason=f"requested as '{model}'", owner=owner)
        with self._lock:
            try:
                return self._loaded.lease(rec, profile, model, owner, token)
            except BaseException:  # the load's lease is this call's to end
                self._loaded.drop_hold(rec, token)
                raise

    async def acquire_async(self, model: str, *, task: str | None = None, owner: str = "unnamed",
                            then: Callable[[], None] | None = None) -> ModelLease:
        """`acquire` on the pool's threads, for the event loop (it never blocks the loop).

        The lease is the caller's once this returns; when the caller is cancelled first (its
        client left, perhaps while the model loads) the pool releases the lease the thread
        takes, as soon as it has it: a cancel can never leave a lease without an owner.

        Args:
            then: TEST ONLY (``omlx.api.park``): run on the pool's thread once the lease is
                taken, before it is handed over; None in production.
        """
        def take() -> ModelLease:
            lease = self.acquire(model, task=task, owner=owner)
            if then is not None:
                try:
                    then()
                except BaseException:
                    self.release(lease)
                    raise
            return lease

        job = self._executor.submit(take)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # Not ``wrap_future``'s future: the cancel cancelled that one, and the result the
            # thread still delivers would be dropped with it. A job not started is cancelled here
            # (no lease); one running or done releases what it got (now, or when it finishes).
            job.cancel()
            job.add_done_callback(self._release_result)
            raise

    def _release_result(self, job: Future[ModelLease]) -> None:
        """A done-callback for an `acquire` job whose caller is gone: release the lease it got."""
        if not job.cancelled() and job.exception() is None:
            self.release(job.result())

    async def call_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a blocking pool method (load, unload) on the pool's threads, for the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def get(self, model: str) -> PoolEntry:
        """The chat entry serving ``model`` (id, alias or ``<id>:<profile>``), loaded if needed.

        For callers outside a request (tools, tests): it may block while the model loads, and
        holds no lease when it returns. Routes take their entry from the lease their request
        holds (``omlx.api.holds``, `chat_entry`).

        Raises:
            ModelNotFoundError: unknown name. InvalidRequestError: not a chat model. And
            whatever `acquire` raises.
        """
        lease = self.acquire(model, task="chat", gate=False)
        self.release(lease)
        return chat_entry(lease, model)

    # ---- loading --------------------------------------------------------------------------

    def _load(self, rec: ModelRecord, deadline: float, *, reason: str, warmup: bool = False, owner: str = "start") -> int:
        """Load a record the caller marked LOADING; on failure it is UNLOADED with ``load_error``.

        Returns:
            A lease token already held for the caller (`LoadedSet.mark_loaded`).
        """
        try:
            if not self._load_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise OverloadedError(f"waited {self.config.memory.load_wait_s:.0f} s behind other model loads; retry later")
            try:
                t0 = time.monotonic()
                path, detected = self._resolver(rec.model_id, rec.source)
                rec.task = rec.settings.task or detected
                rec.weights_bytes = weights_bytes(path)
                self.memory.make_room(rec, deadline)
                before = self.enforcer.snapshot()
                entry = self._loader(rec.model_id, path, rec.task, rec.settings, warmup)
                after = self.enforcer.snapshot()
            finally:
                self._load_lock.release()
        except OmlxError as e:
            self._loaded.mark_failed(rec, e)
            raise
        except Exception as e:
            logger.exception("loading %s failed", rec.model_id)
            err = ModelImportError(f"cannot load model '{rec.model_id}': {type(e).__name__}: {e}")
            self._loaded.mark_failed(rec, err)
            raise err from e
        measured = max(0, after.mlx_active_bytes - before.mlx_active_bytes)
        return self._loaded.mark_loaded(rec, entry, measured, owner=owner, reason=reason, t0=t0)

    def load(self, model: str) -> dict[str, Any]:
        """``POST /v1/models/{id}/load``: load now (no-op when loaded). Returns its status row."""
        lease = self.acquire(model, gate=False, owner=f"POST /v1/models/{model}/load")
        self.release(lease)
        with self._lock:
            rec = self.catalogue.records[lease.model_id]
            return model_row(rec, self.catalogue.aliases_of(rec.model_id))

    def unload(self, model: str, *, drain_s: float = 30.0) -> PoolEvent | None:
        """``POST /v1/models/{id}/unload``: let running requests finish (up to ``drain_s``),
        fail the rest with a clear error, unload. Returns the event, None if it was not loaded.

        Raises:
            ModelNotFoundError: unknown name. InvalidRequestError: the model is pinned.
        """
        mid, _ = self.catalogue.resolve(model)
        rec = self.catalogue.records[mid]
        if rec.pinned:
            raise InvalidRequestError(f"model '{mid}' is pinned; remove pin = true from its settings to unload it", param="model")
        err = EngineError(f"model '{mid}' was unloaded (POST /v1/models/{mid}/unload) while this request was running; retry it")
        return self._loaded.drain_and_unload(rec, wait_s=self.config.memory.load_wait_s, drain_s=drain_s,
                                             reason="unload requested", abort_error=err)

    # ---- life cycle -----------------------------------------------------------------------

    def preload(self, *, warmup: bool = True) -> None:
        """Load the start models (``--model``, in order) and every pinned model, warmed up.

        Raises:
            OmlxError: one could not be found or loaded (the server should not start).
        """
        for line in self.catalogue.unmatched_settings():
            logger.warning("%s", line)
        for mid in dict.fromkeys(self.catalogue.start_order()):
            rec = self.catalogue.records[mid]
            with self._lock:
                if rec.state is not ModelState.UNLOADED:
                    continue
                rec.state = ModelState.LOADING
                rec.generation += 1
            token = self._load(rec, time.monotonic() + self.config.memory.load_wait_s, reason="start", warmup=warmup)
            with self._lock:
                self._loaded.drop_hold(rec, token)

    def start_watchdog(self) -> None:
        """Start the thread that enforces memory and TTLs every ``memory.check_interval_s``."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="pool-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.memory.check_interval_s):
            try:
                self.check_once()
            except Exception:
                logger.exception("pool watchdog check failed")

    def check_once(self) -> None:
        """One watchdog round: TTL unloads, then the memory ladder."""
        self._loaded.unload_expired()
        self.enforcer.enforce(self.memory)

    def stop(self) -> None:
        """Stop the watchdog and every engine (the KV hot tier is flushed to the SSD tier)."""
        self._stop.set()
        self._loaded.unload_all("server stopping")
        self._executor.shutdown(wait=False, cancel_futures=True)

    def status(self) -> dict[str, Any]:
        """``GET /v1/models/status``: memory figures, every known model, recent loads/unloads."""
        return pool_status(self._lock, self.catalogue, self._loaded, self.memory, self.enforcer)

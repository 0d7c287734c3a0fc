"""EnginePool: model id -> running engine; loads on demand, evicts LRU by bytes, TTL, pinning.

Owns: which models exist (``--model`` specs, ``[models."<id>"]`` tables, folders under
``<base-path>/models``, mlx-lm models in the Hugging Face hub cache as ``ORG/NAME``, the
embedded defaults), resolving what a request names (id, alias,
``<id>:<profile>``) to one, loading it when first asked, and unloading it again: least recently
used first when memory is needed, after its TTL, on ``POST /v1/models/{id}/unload``, or when
the `ProcessMemoryEnforcer` asks (the pool implements its `MemoryActions`).

Rules:
  - one load at a time; a load must leave the process under the soft watermark, so idle
    unpinned models are unloaded LRU first until it fits; busy ones are waited for (up to
    ``memory.load_wait_s``); a model that could never fit gets a 507 with the numbers at once;
  - a model is busy while a request holds a `Lease` on it (taken before the route resolves it,
    released when the route ends, on every path: ``omlx.api.holds``) or its engine has
    requests: busy models are never evicted, so a request is never cut off by an eviction;
  - a lease not released within `LEASE_TIMEOUT_S` while its engine is idle is dropped as a
    safety net, and that is a bug: logged as an ERROR naming the request that held it, and
    counted (``num_expired_leases``; ``omlx_leases_expired_total`` in /metrics);
  - a request to a model being loaded or unloaded waits for it, then gets it (reloaded if
    needed) or a clear error; nothing is dropped silently;
  - pinned models load at start and are never evicted.
Must not: speak HTTP, or run MLX work itself (engines do; loading happens on the caller's thread).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from omlx.config import ModelSettings, ServerConfig
from omlx.engine.encoder import folder_task
from omlx.engine.factory import EncoderEntry, Entry, PoolEntry, load_model
from omlx.engine.hub import HubModel
from omlx.engine.loader import is_safe_model_id
from omlx.errors import (
    EngineError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelImportError,
    ModelNotFoundError,
    OmlxError,
    OverloadedError,
)
from omlx.memory import MemoryLimits, ProcessMemoryEnforcer, gb
from omlx.profiles import describe, effective_settings, profile_id, split_profile_id

logger = logging.getLogger(__name__)

#: A lease older than this, while its engine is idle, no longer protects its model: a safety
#: net only (every request releases its lease when its route ends), so each expiry is an ERROR.
LEASE_TIMEOUT_S = 120.0
#: Planning margin over the weights' bytes for a load (activations, buffers).
LOAD_MARGIN = 1.10


class SlotState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class _Held:
    """One lease as its slot records it: since when (``time.monotonic()``) and for whom (a
    request, "start", or an admin call such as "POST /v1/models/<id>/load")."""

    since_s: float
    owner: str


@dataclass(slots=True)
class _Slot:
    """What the pool knows about one model id (loaded or not)."""

    model_id: str
    source: str | None  # a path or spec to resolve; None: the id itself
    settings: ModelSettings
    state: SlotState = SlotState.UNLOADED
    entry: Entry | None = None
    task: str | None = None
    weights_bytes: int = 0
    measured_bytes: int = 0
    last_used_s: float = 0.0
    leases: dict[int, _Held] = field(default_factory=dict)  # lease token -> since when, for whom
    num_expired_leases: int = 0
    num_loads: int = 0
    generation: int = 0
    load_error: OmlxError | None = None
    profile_entries: dict[str | None, Entry] = field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        return self.settings.pin


@dataclass(slots=True)
class Lease:
    """A request's hold on a loaded model: it is not evicted until released.

    Attributes:
        owner: who holds it (``request <id> (<method> <path>)``), named in the log if it expires.
    """

    model_id: str
    token: int
    entry: Entry
    owner: str = ""


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """One load or unload, with what it cost or freed (``/v1/models/status`` "events").

    ``freed_*`` are measured before and after the unload (MLX active memory, process RSS)
    once freed memory was given back; negative values would mean memory was not freed.
    """

    at_s: float
    model_id: str
    kind: str
    reason: str
    duration_s: float
    num_bytes: int = 0
    freed_mlx_bytes: int = 0
    freed_process_bytes: int = 0


Loader = Callable[[str, Path, str, ModelSettings, bool], Entry]


class EnginePool:
    """Engines by model id: load on demand, LRU/TTL/pin eviction, memory enforcement.

    Args:
        config: the server config (models dir, aliases, per-model settings, memory limits).
        enforcer: the memory enforcer (default: one built from ``config.memory``).
        loader: ``(model_id, path, task, settings, warmup) -> Entry``; tests pass a fake.
        resolver: ``(model_id, source) -> (path, task)``; tests pass a fake.
    """

    def __init__(self, config: ServerConfig, *, enforcer: ProcessMemoryEnforcer | None = None,
                 loader: Loader | None = None, resolver: Callable[[str, str | None], tuple[Path, str]] | None = None):
        self.config = config
        self.enforcer = enforcer or ProcessMemoryEnforcer(MemoryLimits.from_config(config.memory))
        self._loader = loader or (lambda mid, path, task, s, warm: load_model(mid, path, task, s, config, warmup=warm))
        self._resolver = resolver or self._resolve_path
        self._slots: dict[str, _Slot] = {}
        self._aliases: dict[str, str] = dict(config.aliases)
        self._cond = threading.Condition()
        self._load_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._paused = False
        self._events: deque[PoolEvent] = deque(maxlen=200)
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="pool-acquire")
        self.default_id: str | None = None
        self._start: list[str] = []
        self.num_loads = 0
        self.num_unloads = 0
        self.num_expired_leases = 0
        for mid, s in config.model_settings.items():
            for a in s.aliases:
                self._aliases.setdefault(a, mid)
            if s.path or s.pin:
                self._slots[mid] = _Slot(mid, s.path, s)

    # ---- catalogue ------------------------------------------------------------------------

    def _settings(self, model_id: str) -> ModelSettings:
        return self.config.model_settings.get(model_id) or ModelSettings()

    def register(self, spec: str | None) -> str:
        """Make a ``--model`` spec (id, folder, .gguf; None = the default chat model) known.

        A .gguf is imported into the models folder here. Returns the served id.

        Raises:
            ModelNotFoundError, ModelImportError: nothing matches, or it cannot be imported.
        """
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID
        from omlx.engine.loader import resolve_model

        if spec == DEFAULT_EMBEDDING_MODEL_ID:
            mid, source = spec, None
        else:
            mid, path = resolve_model(spec, self.config.models_dir, progress=False, hub_cache=self._hub_cache())
            source = None if path == self.config.models_dir / mid else str(path)
        with self._cond:
            if mid not in self._slots:
                self._slots[mid] = _Slot(mid, source or self._settings(mid).path, self._settings(mid))
            if self.default_id is None:
                self.default_id = mid
            if mid not in self._start:
                self._start.append(mid)
        return mid

    def _hub_cache(self) -> Path:
        from omlx.engine import hub

        return self.config.hub_cache or hub.cache_dir(None)

    def _discover(self, name: str) -> _Slot | None:
        """A slot for a model not yet known: a folder in the models dir, a model in the hub
        cache (``ORG/NAME[@REVISION]``, its snapshot folder as the source) or an embedded default."""
        from omlx.engine.embedded import DEFAULT_MODEL_ID
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID

        if not is_safe_model_id(name):
            from omlx.engine import hub

            ref = hub.parse_hub_id(name)
            if ref is not None and ref.model_id != name:  # ORG/NAME@main is served as ORG/NAME
                return self._slots.get(ref.model_id) or self._discover(ref.model_id)
            path = hub.find_cached(ref, self._hub_cache()) if ref is not None else None
            if path is None:
                return None
            slot = _Slot(name, str(path), self._settings(name))
            self._slots[name] = slot
            return slot
        if (self.config.models_dir / name / "config.json").is_file() or name in (DEFAULT_MODEL_ID, DEFAULT_EMBEDDING_MODEL_ID):
            slot = _Slot(name, None, self._settings(name))
            self._slots[name] = slot
            return slot
        return None

    def _hub_models(self) -> list[HubModel]:
        """The hub cache's servable models (`omlx.engine.hub.list_cached`): a scan of its folders, so
        callers run it before taking the lock and hand it to `_scan_models_dir`."""
        from omlx.engine import hub

        return hub.list_cached(self._hub_cache())

    def _scan_models_dir(self, hub_models: list[HubModel]) -> None:
        """Add slots for models that appeared in the models dir or the hub cache (``hub_models``)
        since the last look. Caller holds the lock."""
        d = self.config.models_dir
        try:
            names = sorted(p.name for p in d.iterdir() if (p / "config.json").is_file())
        except OSError:
            names = []
        for n in names:
            if n not in self._slots:
                self._discover(n)
        for m in hub_models:
            if m.model_id not in self._slots:
                self._slots[m.model_id] = _Slot(m.model_id, str(m.path), self._settings(m.model_id))

    def _lookup(self, name: str, *, depth: int = 0) -> tuple[_Slot, str | None] | None:
        """(slot, profile) for a requested name, or None. Caller holds the lock."""
        slot = self._slots.get(name)
        if slot is not None:
            return slot, None
        target = self._aliases.get(name)
        if target is not None and depth < 2:
            return self._lookup(target, depth=depth + 1)
        split = split_profile_id(name)
        if split is not None:
            found = self._lookup(split[0], depth=depth + 1)
            if found is not None and found[1] is None and split[1] in found[0].settings.profiles:
                return found[0], split[1]
            return None
        slot = self._discover(name)
        return (slot, None) if slot is not None else None

    def resolve(self, model: str) -> tuple[str, str | None]:
        """(served id, profile or None) for a requested id, alias or ``<id>:<profile>``.

        Raises:
            ModelNotFoundError: none of those (an unknown name never falls back to a default).
        """
        with self._cond:
            found = self._lookup(model)
        if found is None:
            raise ModelNotFoundError(model)
        return found[0].model_id, found[1]

    def resolve_id(self, model: str) -> str:
        """The served id for a requested name (see `resolve`). Raises ModelNotFoundError."""
        return self.resolve(model)[0]

    def listed_ids(self) -> list[str]:
        """Every servable id: models (default first), their profiles, then aliases."""
        hub_models = self._hub_models()
        with self._cond:
            self._scan_models_dir(hub_models)
            ids = sorted(self._slots, key=lambda m: (m != self.default_id, m))
            out = list(ids)
            for m in ids:
                out += [profile_id(m, p) for p in self._slots[m].settings.profiles]
            out += [a for a in sorted(self._aliases) if a not in self._slots and self._lookup(a) is not None]
            return out

    # ---- leases ---------------------------------------------------------------------------

    def acquire(self, model: str, wait_s: float | None = None, *, task: str | None = None, gate: bool = True,
                owner: str = "unnamed") -> Lease:
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
        mid, profile = self.resolve(model)
        if task is not None:
            self._check_task(model, mid, task)
        seen_generation = None
        with self._cond:
            while True:
                slot = self._slots[mid]
                now = time.monotonic()
                if gate and self._paused and now < deadline:
                    self._cond.wait(min(0.5, deadline - now))
                    continue
                if gate and self._paused:
                    snap = self.enforcer.snapshot()
                    raise OverloadedError(
                        f"memory is above the soft limit ({gb(snap.used_bytes)} used of {gb(self.enforcer.limits.soft_bytes)}); "
                        f"new requests were held {wait_s:.0f} s for running ones to finish. Retry later")
                if slot.state is SlotState.LOADED:
                    return self._lease(slot, profile, model, owner)
                if slot.state is SlotState.UNLOADED:
                    if slot.load_error is not None and slot.generation == seen_generation:
                        raise slot.load_error  # the load this request waited for failed
                    slot.state = SlotState.LOADING
                    slot.generation += 1
                    slot.load_error = None
                    break
                if seen_generation is None:
                    seen_generation = slot.generation
                if now >= deadline:
                    raise OverloadedError(f"model '{mid}' is still {slot.state.value} after {wait_s:.0f} s; retry later")
                self._cond.wait(min(1.0, deadline - now))
        token = self._load(slot, deadline, reason=f"requested as '{model}'", owner=owner)
        with self._cond:
            try:
                return self._lease(slot, profile, model, owner, token)
            except BaseException:  # the load's lease is this call's to end
                slot.leases.pop(token, None)
                raise

    def _check_task(self, asked: str, model_id: str, task: str) -> None:
        with self._cond:
            slot = self._slots[model_id]
            kind = slot.task or slot.settings.task
        if kind is None:
            kind = self._peek_task(slot)
        if kind is not None and kind != task:
            hint = {"chat": "POST /v1/chat/completions, /v1/messages or /v1/responses",
                    "embeddings": "POST /v1/embeddings", "rerank": "POST /v1/rerank"}[kind]
            raise InvalidRequestError(f"model '{asked}' serves {kind}, not {task}; use {hint}", param="model")

    def _peek_task(self, slot: _Slot) -> str | None:
        """A slot's task from its files, without loading it (None when they are not there yet)."""
        from omlx.engine.embedded import DEFAULT_MODEL_ID
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID

        if slot.source is None and slot.model_id in (DEFAULT_MODEL_ID, DEFAULT_EMBEDDING_MODEL_ID):
            return "chat" if slot.model_id == DEFAULT_MODEL_ID else "embeddings"
        folder = Path(slot.source) if slot.source else self.config.models_dir / slot.model_id
        return folder_task(folder) if (folder / "config.json").is_file() else None

    def _lease(self, slot: _Slot, profile: str | None, asked: str, owner: str, token: int | None = None) -> Lease:
        """A lease on a LOADED slot (``token``: one `_load` already holds for the caller). Caller holds the lock."""
        entry = slot.profile_entries.get(profile)
        if entry is None:
            entry = slot.entry
            if profile is not None:
                s = effective_settings(slot.settings, profile)
                if s is None:
                    raise ModelNotFoundError(asked)
                if isinstance(entry, PoolEntry):
                    entry = replace(entry, settings=s, profile=profile, tool_dialect=s.tool_dialect or entry.tool_dialect)
                else:
                    entry = replace(entry, settings=s)
            slot.profile_entries[profile] = entry
        now = time.monotonic()
        if token is None:
            token = next(self._tokens)
            slot.leases[token] = _Held(now, owner)
        slot.last_used_s = now
        return Lease(slot.model_id, token, entry, owner)

    def release(self, lease: Lease) -> None:
        """End a lease (idempotent)."""
        with self._cond:
            slot = self._slots.get(lease.model_id)
            if slot is not None and slot.leases.pop(lease.token, None) is not None:
                slot.last_used_s = time.monotonic()

    async def acquire_async(self, model: str, *, task: str | None = None, owner: str = "unnamed",
                            then: Callable[[], None] | None = None) -> Lease:
        """`acquire` on the pool's threads, for the event loop (it never blocks the loop).

        The lease is the caller's once this returns; when the caller is cancelled first (its
        client left, perhaps while the model loads) the pool releases the lease the thread
        takes, as soon as it has it: a cancel can never leave a lease without an owner.

        Args:
            then: TEST ONLY (``omlx.api.park``): run on the pool's thread once the lease is
                taken, before it is handed over; None in production.
        """
        def take() -> Lease:
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
            job.add_done_callback(_release_result(self))
            raise

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

    def get_encoder(self, model: str, task: str) -> EncoderEntry:
        """The embeddings or rerank entry serving ``model`` (see `get`).

        Raises:
            InvalidRequestError: the model does not do ``task``.
        """
        lease = self.acquire(model, task=task, gate=False)
        self.release(lease)
        return encoder_entry(lease, model, task)

    def entries(self) -> list[PoolEntry]:
        """The loaded chat entries (``/health``, ``/v1/cache/stats``)."""
        with self._cond:
            return [s.entry for s in self._slots.values() if s.state is SlotState.LOADED and isinstance(s.entry, PoolEntry)]

    def loaded_ids(self) -> set[str]:
        """The ids of every loaded model, chat and encoder (``GET /v1/admin/models``)."""
        with self._cond:
            return {s.model_id for s in self._slots.values() if s.state is SlotState.LOADED}

    # ---- loading --------------------------------------------------------------------------

    def _resolve_path(self, model_id: str, source: str | None) -> tuple[Path, str]:
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID, ensure_default_embedding_model
        from omlx.engine.loader import resolve_model

        if source is None and model_id == DEFAULT_EMBEDDING_MODEL_ID:
            path = ensure_default_embedding_model(self.config.models_dir)
        else:
            _, path = resolve_model(source or model_id, self.config.models_dir, progress=False,
                                    hub_cache=self._hub_cache())
        return path, folder_task(path)

    def _load(self, slot: _Slot, deadline: float, *, reason: str, warmup: bool = False, owner: str = "start") -> int:
        """Load a slot the caller marked LOADING; on failure it is UNLOADED with ``load_error``.

        Returns:
            A lease token already held for the caller, so that nothing (the watchdog) can
            evict the model between its load and its first use; release or reuse it.
        """
        try:
            if not self._load_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise OverloadedError(f"waited {self.config.memory.load_wait_s:.0f} s behind other model loads; retry later")
            try:
                t0 = time.monotonic()
                path, detected = self._resolver(slot.model_id, slot.source)
                slot.task = slot.settings.task or detected
                slot.weights_bytes = weights_bytes(path)
                self._make_room(slot, int(slot.weights_bytes * LOAD_MARGIN), deadline)
                before = self.enforcer.snapshot()
                entry = self._loader(slot.model_id, path, slot.task, slot.settings, warmup)
                after = self.enforcer.snapshot()
            finally:
                self._load_lock.release()
        except OmlxError as e:
            self._load_failed(slot, e)
            raise
        except Exception as e:
            logger.exception("loading %s failed", slot.model_id)
            err = ModelImportError(f"cannot load model '{slot.model_id}': {type(e).__name__}: {e}")
            self._load_failed(slot, err)
            raise err from e
        with self._cond:
            slot.entry = entry
            slot.measured_bytes = max(0, after.mlx_active_bytes - before.mlx_active_bytes)
            slot.state = SlotState.LOADED
            slot.num_loads += 1
            slot.last_used_s = time.monotonic()
            slot.profile_entries.clear()
            token = next(self._tokens)
            slot.leases[token] = _Held(time.monotonic(), owner)
            self.num_loads += 1
            self._cond.notify_all()
        dt = time.monotonic() - t0
        self._events.append(PoolEvent(time.time(), slot.model_id, "load", reason, dt, slot.measured_bytes))
        logger.info("loaded %s (%s, %s) in %.1f s: %s", slot.model_id, slot.task, gb(slot.measured_bytes), dt, reason)
        return token

    def _load_failed(self, slot: _Slot, error: OmlxError) -> None:
        with self._cond:
            slot.state = SlotState.UNLOADED
            slot.load_error = error
            self._cond.notify_all()
        logger.warning("could not load %s: %s", slot.model_id, error.message)

    def _make_room(self, slot: _Slot, need: int, deadline: float) -> None:
        """Evict idle unpinned models (LRU) until ``need`` bytes fit under the soft watermark.

        Raises:
            InsufficientMemoryError: it can never fit (at once), or busy models did not become
                idle before ``deadline``.
        """
        limits = self.enforcer.limits
        shrunk = False
        while True:
            snap = self.enforcer.snapshot()
            room = limits.soft_bytes - snap.used_bytes
            if need <= room:
                return
            with self._cond:
                others = [s for s in self._slots.values() if s is not slot and s.state is SlotState.LOADED]
                reclaimable = sum(max(s.weights_bytes, s.measured_bytes) for s in others if not s.pinned)
                reclaimable += sum(hot_cache_bytes(s.entry) for s in others)
                pinned = [(s.model_id, max(s.weights_bytes, s.measured_bytes)) for s in others if s.pinned]
                busy = [s.model_id for s in others if not s.pinned and self._busy(s)]
            numbers = (f"model '{slot.model_id}' needs about {gb(need)}; the soft limit is {gb(limits.soft_bytes)} "
                       f"({self.config.memory.soft_watermark:.0%} of a {gb(limits.ceiling_bytes)} ceiling) and the process "
                       f"uses {gb(snap.used_bytes)}, of which pinned models hold "
                       f"{', '.join(f'{m} {gb(b)}' for m, b in pinned) or 'nothing'}")
            if need > room + reclaimable:
                raise InsufficientMemoryError(
                    f"{numbers}. It cannot fit even with every unpinned model unloaded: raise the ceiling "
                    "([memory] ceiling or --memory-ceiling), unpin a model, or use a smaller or quantized model")
            victim = self._pick_victim(exclude=slot)
            if victim is not None:
                self._unload_slot(victim, reason=f"LRU: making room for {slot.model_id}")
                continue
            if not shrunk:
                shrunk = True
                if self.shrink_hot_caches():
                    self.enforcer.release()
                    continue
            if time.monotonic() >= deadline:
                raise InsufficientMemoryError(
                    f"{numbers}. Models {', '.join(busy) or '(none)'} were serving requests for "
                    f"{self.config.memory.load_wait_s:.0f} s and could not be unloaded; retry later")
            with self._cond:
                self._cond.wait(0.2)

    def _busy(self, slot: _Slot) -> bool:
        """Leased or serving. Caller holds the lock."""
        e = slot.entry
        working = False
        if isinstance(e, PoolEntry):
            working = e.engine.scheduler.has_work or e.engine.num_active() > 0
        elif isinstance(e, EncoderEntry):
            working = e.engine.num_pending > 0
        if working:  # a long non-streaming request keeps its lease however long it runs
            return True
        now = time.monotonic()
        for tok, held in list(slot.leases.items()):
            if now - held.since_s > LEASE_TIMEOUT_S:
                del slot.leases[tok]
                slot.num_expired_leases += 1
                self.num_expired_leases += 1
                logger.error("a lease on %s held by %s expired after %.0f s with its engine idle: its holder "
                             "never released it (a bug: every path out of a request releases its lease)",
                             slot.model_id, held.owner, LEASE_TIMEOUT_S)
        return bool(slot.leases)

    def _pick_victim(self, exclude: _Slot | None = None) -> _Slot | None:
        """The least recently used idle unpinned loaded slot, now marked UNLOADING; or None."""
        with self._cond:
            cands = [s for s in self._slots.values() if s is not exclude and s.state is SlotState.LOADED
                     and not s.pinned and not self._busy(s)]
            if not cands:
                return None
            victim = min(cands, key=lambda s: s.last_used_s)
            victim.state = SlotState.UNLOADING
            return victim

    # ---- unloading ------------------------------------------------------------------------

    def _unload_slot(self, slot: _Slot, *, reason: str, abort_error: Exception | None = None) -> PoolEvent:
        """Stop a slot marked UNLOADING, drop every reference, give the memory back, record it."""
        t0 = time.monotonic()
        before = self.enforcer.snapshot()
        entry = slot.entry
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
                    logger.exception("could not flush the KV cache of %s", slot.model_id)
        elif isinstance(entry, EncoderEntry):
            entry.engine.stop()
        with self._cond:
            slot.entry = None
            slot.profile_entries.clear()
            slot.leases.clear()
            slot.state = SlotState.UNLOADED
            self.num_unloads += 1
            self._cond.notify_all()
        del entry
        self.enforcer.release()
        after = self.enforcer.snapshot()
        ev = PoolEvent(time.time(), slot.model_id, "unload", reason, time.monotonic() - t0,
                       max(slot.weights_bytes, slot.measured_bytes),
                       before.mlx_active_bytes - after.mlx_active_bytes, before.process_bytes - after.process_bytes)
        self._events.append(ev)
        logger.info("unloaded %s (%s): freed %s MLX, %s process", slot.model_id, reason,
                    gb(ev.freed_mlx_bytes), gb(ev.freed_process_bytes))
        return ev

    def load(self, model: str) -> dict[str, Any]:
        """``POST /v1/models/{id}/load``: load now (no-op when loaded). Returns its status row."""
        lease = self.acquire(model, gate=False, owner=f"POST /v1/models/{model}/load")
        self.release(lease)
        with self._cond:
            return self._row(self._slots[lease.model_id])

    def unload(self, model: str, *, drain_s: float = 30.0) -> PoolEvent | None:
        """``POST /v1/models/{id}/unload``: let running requests finish (up to ``drain_s``),
        fail the rest with a clear error, unload. Returns the event, None if it was not loaded.

        Raises:
            ModelNotFoundError: unknown name. InvalidRequestError: the model is pinned.
        """
        mid, _ = self.resolve(model)
        with self._cond:
            slot = self._slots[mid]
            if slot.pinned:
                raise InvalidRequestError(f"model '{mid}' is pinned; remove pin = true from its settings to unload it", param="model")
            end = time.monotonic() + self.config.memory.load_wait_s
            while slot.state in (SlotState.LOADING, SlotState.UNLOADING) and time.monotonic() < end:
                self._cond.wait(0.5)
            if slot.state is not SlotState.LOADED:
                return None
            slot.state = SlotState.UNLOADING  # new requests wait, then load it again
            end = time.monotonic() + drain_s
            while self._busy(slot) and time.monotonic() < end:
                self._cond.wait(0.1)
        err = EngineError(f"model '{mid}' was unloaded (POST /v1/models/{mid}/unload) while this request was running; retry it")
        return self._unload_slot(slot, reason="unload requested", abort_error=err)

    # ---- MemoryActions (called by the enforcer on the watchdog thread) ---------------------

    def set_admission_paused(self, paused: bool) -> None:
        with self._cond:
            if paused != self._paused:
                logger.warning("admission %s (memory %s the soft watermark)", "paused" if paused else "resumed",
                               "above" if paused else "below")
            self._paused = paused
            self._cond.notify_all()

    def num_running_requests(self) -> int:
        with self._cond:
            entries = [s.entry for s in self._slots.values() if s.state is SlotState.LOADED]
        n = 0
        for e in entries:
            if isinstance(e, PoolEntry):
                st = e.engine.scheduler.stats()
                n += st.num_running + st.num_waiting
            elif isinstance(e, EncoderEntry):
                n += e.engine.num_pending
        return n

    def evict_idle_model(self, reason: str) -> str | None:
        victim = self._pick_victim()
        if victim is None:
            return None
        self._unload_slot(victim, reason=reason)
        return victim.model_id

    def shrink_hot_caches(self) -> int:
        """Empty every model's hot KV tier (blocks in use stay until released; the SSD tier keeps
        its copies). Returns the bytes the tiers held."""
        freed = 0
        for e in self.entries():
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
        for e in self.entries():
            for req in e.engine.active_requests():
                if youngest is None or req.arrival_s > youngest[1].arrival_s:
                    youngest = (e.engine, req)
        if youngest is None:
            return None
        youngest[0].abort(youngest[1].request_id, error)
        return youngest[1].request_id

    # ---- life cycle -----------------------------------------------------------------------

    def preload(self, *, warmup: bool = True) -> None:
        """Load the start models (``--model``, in order) and every pinned model, warmed up.

        Raises:
            OmlxError: one could not be found or loaded (the server should not start).
        """
        with self._cond:
            order = list(self._start)
            for m, s in self.config.model_settings.items():
                if s.pin:
                    found = self._lookup(m)
                    if found is None:
                        raise ModelNotFoundError(m)
                    order.append(found[0].model_id)
            if self.default_id is None and order:
                self.default_id = order[0]
        for mid in dict.fromkeys(order):
            slot = self._slots[mid]
            with self._cond:
                if slot.state is not SlotState.UNLOADED:
                    continue
                slot.state = SlotState.LOADING
                slot.generation += 1
            token = self._load(slot, time.monotonic() + self.config.memory.load_wait_s, reason="start", warmup=warmup)
            with self._cond:
                slot.leases.pop(token, None)

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
        now = time.monotonic()
        expired = []
        with self._cond:
            for s in self._slots.values():
                if s.state is not SlotState.LOADED:
                    continue
                if self._busy(s):
                    s.last_used_s = now  # idle time counts from the end of the last request
                elif s.settings.ttl_s and not s.pinned and now - s.last_used_s >= s.settings.ttl_s:
                    s.state = SlotState.UNLOADING
                    expired.append(s)
        for s in expired:
            self._unload_slot(s, reason=f"idle for {s.settings.ttl_s:.0f} s (ttl_s)")
        self.enforcer.enforce(self)

    def stop(self) -> None:
        """Stop the watchdog and every engine (the KV hot tier is flushed to the SSD tier)."""
        self._stop.set()
        with self._cond:
            slots = [s for s in self._slots.values() if s.state is SlotState.LOADED]
            for s in slots:
                s.state = SlotState.UNLOADING
        for s in slots:
            try:
                self._unload_slot(s, reason="server stopping")
            except Exception:
                logger.exception("could not stop %s", s.model_id)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- status ---------------------------------------------------------------------------

    def _row(self, s: _Slot) -> dict[str, Any]:
        now = time.monotonic()
        e = s.entry
        active = 0
        if isinstance(e, PoolEntry):
            st = e.engine.scheduler.stats()
            active = st.num_running + st.num_waiting
        elif isinstance(e, EncoderEntry):
            active = e.engine.num_pending
        return {
            "id": s.model_id,
            "task": s.task or s.settings.task,
            "state": s.state.value,
            "pinned": s.pinned,
            "ttl_s": s.settings.ttl_s,
            "weights_bytes": s.weights_bytes,
            "measured_bytes": s.measured_bytes,
            "idle_s": round(now - s.last_used_s, 1) if s.state is SlotState.LOADED and s.last_used_s else None,
            "num_active_requests": active,
            "num_leases": len(s.leases),
            "num_expired_leases": s.num_expired_leases,
            "num_loads": s.num_loads,
            "profiles": {profile_id(s.model_id, p): describe(effective_settings(s.settings, p) or s.settings)
                         for p in s.settings.profiles},
            "aliases": sorted(a for a, t in self._aliases.items() if t == s.model_id),
            "last_error": s.load_error.message if s.load_error else None,
        }

    def status(self) -> dict[str, Any]:
        """``GET /v1/models/status``: memory figures, every known model, recent loads/unloads."""
        snap = self.enforcer.snapshot()
        hub_models = self._hub_models()
        with self._cond:
            self._scan_models_dir(hub_models)
            models = [self._row(s) for s in sorted(self._slots.values(), key=lambda s: s.model_id)]
            paused = self._paused
        return {
            "memory": {**self.enforcer.limits.as_dict(), **snap.as_dict(),
                       "pressure": self.enforcer.pressure(snap).value, "admission_paused": paused,
                       "num_aborted_requests": self.enforcer.num_aborted},
            "models": models,
            "num_loads": self.num_loads,
            "num_unloads": self.num_unloads,
            "num_expired_leases": self.num_expired_leases,
            "events": [_event_dict(ev) for ev in list(self._events)[-50:]],
        }


def chat_entry(lease: Lease, model: str) -> PoolEntry:
    """The chat entry a lease holds.

    Raises:
        InvalidRequestError: ``model`` (as the request named it) is an encoder model.
    """
    if not isinstance(lease.entry, PoolEntry):
        raise InvalidRequestError(
            f"model '{model}' is an {lease.entry.task} model; use POST /v1/{lease.entry.task}", param="model")
    return lease.entry


def encoder_entry(lease: Lease, model: str, task: str) -> EncoderEntry:
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


def _release_result(pool: EnginePool) -> Callable[[Any], None]:
    """A done-callback for an `acquire` job whose caller is gone: release the lease it got."""
    def done(job: Any) -> None:
        if not job.cancelled() and job.exception() is None:
            pool.release(job.result())
    return done


def _event_dict(ev: PoolEvent) -> dict[str, Any]:
    return {f: getattr(ev, f) for f in PoolEvent.__dataclass_fields__}


def hot_cache_bytes(entry: Entry | None) -> int:
    """Bytes in a chat model's hot KV tier (0 for encoders and models without a cache)."""
    pc = entry.engine.prefix_cache if isinstance(entry, PoolEntry) else None
    return int(pc.stats().get("num_bytes", 0)) if pc is not None else 0


def weights_bytes(path: Path) -> int:
    """Bytes of a model folder's weight files (what loading it will allocate, before margins)."""
    files = list(path.glob("*.safetensors")) + list(path.glob("*.gguf"))
    return sum(f.stat().st_size for f in files if f.is_file())

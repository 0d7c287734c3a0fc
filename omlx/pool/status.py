"""The pool's status: one row per model and the ``GET /v1/models/status`` document.

Owns: the shape of those rows and of the document (memory figures, models, counters, recent
events); ``omlx.api.metrics`` and the dashboard read the same rows.
Must not: change any state, or speak HTTP (``omlx.api.admin`` serves what this returns).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from omlx.memory import ProcessMemoryEnforcer
from omlx.pool.catalogue import Catalogue
from omlx.pool.loaded import LoadedSet
from omlx.pool.memory_policy import MemoryPolicy
from omlx.pool.model import ModelRecord, ModelState, num_requests
from omlx.profiles import describe, effective_settings, profile_id


def model_row(rec: ModelRecord, aliases: list[str]) -> dict[str, Any]:
    """One model's row (``aliases``: the names that point at it). Caller holds the pool's lock."""
    now = time.monotonic()
    return {
        "id": rec.model_id,
        "task": rec.task or rec.settings.task,
        "state": rec.state.value,
        "pinned": rec.pinned,
        "ttl_s": rec.settings.ttl_s,
        "weights_bytes": rec.weights_bytes,
        "measured_bytes": rec.measured_bytes,
        "idle_s": round(now - rec.last_used_s, 1) if rec.state is ModelState.LOADED and rec.last_used_s else None,
        "num_active_requests": num_requests(rec.entry),
        "num_leases": len(rec.leases),
        "num_expired_leases": rec.num_expired_leases,
        "num_loads": rec.num_loads,
        "profiles": {profile_id(rec.model_id, p): describe(effective_settings(rec.settings, p) or rec.settings)
                     for p in rec.settings.profiles},
        "aliases": aliases,
        "last_error": rec.load_error.message if rec.load_error else None,
    }


def pool_status(lock: threading.Condition, catalogue: Catalogue, loaded: LoadedSet, memory: MemoryPolicy,
                enforcer: ProcessMemoryEnforcer) -> dict[str, Any]:
    """``GET /v1/models/status``: memory figures, every known model (after a look for new
    ones), load and unload counters, the last 50 events. Takes the lock."""
    snap = enforcer.snapshot()
    hub_models = catalogue.hub_models()
    with lock:
        catalogue.scan_models_dir(hub_models)
        models = [model_row(r, catalogue.aliases_of(r.model_id))
                  for r in sorted(catalogue.records.values(), key=lambda r: r.model_id)]
        paused = memory.paused
    return {
        "memory": {**enforcer.limits.as_dict(), **snap.as_dict(),
                   "pressure": enforcer.pressure(snap).value, "admission_paused": paused,
                   "num_aborted_requests": enforcer.num_aborted},
        "models": models,
        "num_loads": loaded.num_loads,
        "num_unloads": loaded.num_unloads,
        "num_expired_leases": loaded.num_expired_leases,
        "events": [ev.as_dict() for ev in list(loaded.events)[-50:]],
    }

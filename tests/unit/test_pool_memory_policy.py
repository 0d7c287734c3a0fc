"""The pool's memory policy on its own: which loaded model it evicts, in which order, and which
never (pinned, leased, serving, the one being loaded). Records are built by hand; nothing loads."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from omlx.config import MemoryConfig, ModelSettings
from omlx.engine.factory import PoolEntry
from omlx.pool.loaded import LoadedSet
from omlx.pool.memory_policy import MemoryPolicy
from omlx.pool.model import LeaseHolder, ModelRecord, ModelState


def _policy(*records: ModelRecord) -> tuple[MemoryPolicy, LoadedSet]:
    lock = threading.Condition()
    loaded = LoadedSet({r.model_id: r for r in records}, lock, enforcer=None)  # type: ignore[arg-type]
    return MemoryPolicy(MemoryConfig(), lock, loaded, enforcer=None), loaded  # type: ignore[arg-type]


def _loaded(model_id: str, last_used_s: float, *, pin: bool = False) -> ModelRecord:
    return ModelRecord(model_id, None, ModelSettings(pin=pin), state=ModelState.LOADED, last_used_s=last_used_s)


def test_victims_are_idle_unpinned_loaded_models_least_recently_used_first():
    leased = _loaded("leased", 0.5)
    leased.leases[1] = LeaseHolder(time.monotonic(), "request r1")
    unloaded = ModelRecord("unloaded", None, ModelSettings(), last_used_s=0.1)
    policy, _ = _policy(_loaded("c", 3.0), _loaded("pinned", 0.2, pin=True), leased, _loaded("a", 1.0),
                        unloaded, _loaded("b", 2.0))
    order = []
    while (victim := policy.pick_victim()) is not None:
        assert victim.state is ModelState.UNLOADING  # marked for the caller to unload
        order.append(victim.model_id)
    assert order == ["a", "b", "c"]


def test_the_model_being_loaded_and_a_serving_engine_are_never_victims():
    serving = _loaded("serving", 0.0)  # the least recently used, but its engine has a request (no lease)
    engine = SimpleNamespace(scheduler=SimpleNamespace(has_work=True), num_active=lambda: 1)
    serving.entry = PoolEntry(SimpleNamespace(model_id="serving"), engine)
    loading = _loaded("loading", 1.0)
    policy, _ = _policy(serving, loading, _loaded("idle", 2.0))
    assert policy.pick_victim(exclude=loading).model_id == "idle"
    assert policy.pick_victim(exclude=loading) is None


def test_a_lease_past_its_timeout_no_longer_protects_its_model(monkeypatch):
    import omlx.pool.loaded

    stale = _loaded("stale", 1.0)
    stale.leases[1] = LeaseHolder(time.monotonic() - 1.0, "request r9")
    policy, loaded = _policy(stale)
    assert policy.pick_victim() is None  # a second-old lease is young under the 120 s default
    monkeypatch.setattr(omlx.pool.loaded, "LEASE_TIMEOUT_S", 0.5)
    assert policy.pick_victim() is stale
    assert (stale.leases, stale.num_expired_leases, loaded.num_expired_leases) == ({}, 1, 1)

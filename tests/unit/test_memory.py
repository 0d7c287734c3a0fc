"""ProcessMemoryEnforcer: the ceiling default and the soft/hard ladder, with a fake meter."""

from __future__ import annotations

from omlx.config import MemoryConfig
from omlx.errors import InsufficientMemoryError
from omlx.memory import (
    GB,
    MemoryLimits,
    MemoryPressure,
    MemorySnapshot,
    ProcessMemoryEnforcer,
    default_ceiling_bytes,
    measure_process,
    release_freed_memory,
)

MB = 10**6


def test_default_ceiling_is_ram_minus_8gb_with_a_floor_of_half():
    assert default_ceiling_bytes(64 * GB) == 56 * GB
    assert default_ceiling_bytes(24 * GB) == 16 * GB
    assert default_ceiling_bytes(16 * GB) == 8 * GB
    assert default_ceiling_bytes(8 * GB) == 4 * GB
    lim = MemoryLimits.from_config(MemoryConfig(), total_bytes=32 * GB)
    assert (lim.ceiling_bytes, lim.soft_bytes, lim.hard_bytes) == (24 * GB, int(24 * GB * 0.9), int(24 * GB * 0.97))
    lim = MemoryLimits.from_config(MemoryConfig(ceiling_bytes=2 * GB, soft_watermark=0.5, hard_watermark=0.75))
    assert (lim.soft_bytes, lim.hard_bytes) == (GB, int(1.5 * GB))


def test_used_is_the_larger_of_rss_and_mlx():
    assert MemorySnapshot(100, 30, 20).used_bytes == 100
    assert MemorySnapshot(10, 30, 20).used_bytes == 50  # Metal/CUDA buffers outside RSS
    snap = measure_process()
    assert snap.process_bytes > 10 * MB and snap.mlx_active_bytes >= 0
    release_freed_memory()  # gc + mx.clear_cache + malloc_trim: must not raise


class FakeActions:
    """A process whose memory is base + models (LRU order) + hot caches."""

    def __init__(self, base, models, cache=0, running=0):
        self.base, self.models, self.cache, self.running = base, dict(models), cache, running
        self.calls: list[str] = []
        self.paused = False
        self.aborted: list[InsufficientMemoryError] = []

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.base + sum(self.models.values()) + self.cache, 0, 0)

    def set_admission_paused(self, paused):
        self.paused = paused

    def num_running_requests(self):
        return self.running

    def evict_idle_model(self, reason):
        if not self.models:
            return None
        mid = next(iter(self.models))
        self.calls.append(f"evict {mid}")
        del self.models[mid]
        return mid

    def shrink_hot_caches(self):
        n, self.cache = self.cache, 0
        self.calls.append("shrink")
        return n

    def abort_youngest_request(self, error):
        self.calls.append("abort")
        self.aborted.append(error)
        return "req-9"


def enforcer(fa: FakeActions) -> ProcessMemoryEnforcer:
    return ProcessMemoryEnforcer(MemoryLimits(1000 * MB, 900 * MB, 970 * MB), measure=fa.snapshot, release=lambda: None)


def test_below_soft_does_nothing_and_resumes_admission():
    fa = FakeActions(100 * MB, {"a": 300 * MB})
    fa.paused = True
    rep = enforcer(fa).enforce(fa)
    assert rep.pressure is MemoryPressure.OK and not fa.paused and fa.calls == []


def test_soft_evicts_idle_models_lru_first_until_below():
    fa = FakeActions(350 * MB, {"a": 300 * MB, "b": 300 * MB}, running=1)  # 950 MB: soft, not hard
    rep = enforcer(fa).enforce(fa)
    assert rep.pressure is MemoryPressure.SOFT and rep.evicted == ("a",) and fa.calls == ["evict a"]
    assert not fa.paused and rep.after.used_bytes == 650 * MB


def test_soft_with_nothing_to_evict_pauses_only_while_requests_run():
    fa = FakeActions(950 * MB, {}, running=2)
    enforcer(fa).enforce(fa)
    assert fa.paused  # running requests may free their KV: hold new ones
    fa.running = 0
    enforcer(fa).enforce(fa)
    assert not fa.paused  # nothing could ever free memory: holding would never end


def test_hard_shrinks_caches_then_evicts_then_aborts_the_youngest():
    fa = FakeActions(700 * MB, {"a": 200 * MB}, cache=100 * MB, running=1)  # 1000 MB: above hard
    rep = enforcer(fa).enforce(fa)
    assert fa.calls == ["shrink", "evict a"] and rep.shrunk_bytes == 100 * MB and rep.aborted is None
    fa2 = FakeActions(990 * MB, {}, running=1)
    e2 = enforcer(fa2)
    rep = e2.enforce(fa2)
    assert fa2.calls == ["shrink", "abort"] and rep.aborted == "req-9" and e2.num_aborted == 1
    msg = fa2.aborted[0].message
    assert fa2.aborted[0].status == 507 and "0.99 GB" in msg and "hard limit (0.97 GB" in msg and "1.00 GB ceiling" in msg

"""EnginePool policy without a model: fake engines whose 'memory' is a counter.

Each fake model's folder holds a sparse weights file of its size (what the pool plans with);
loading adds that size to the fake meter and stopping its engine removes it, so eviction order,
pinning, TTL, waiting for busy models, 507s and leases are checked exactly and in milliseconds.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from omlx.config import MemoryConfig, ModelSettings, ServerConfig
from omlx.errors import InsufficientMemoryError, InvalidRequestError, ModelImportError, ModelNotFoundError, OmlxError
from omlx.memory import MemoryLimits, MemorySnapshot, ProcessMemoryEnforcer
from omlx.pool import EnginePool, PoolEntry
from omlx.scheduler import SchedulerStats

MB = 10**6


class Meter:
    def __init__(self, base: int):
        self.base = base
        self.loaded: dict[str, int] = {}
        self.lock = threading.Lock()

    def snapshot(self) -> MemorySnapshot:
        with self.lock:
            n = sum(self.loaded.values())
        return MemorySnapshot(self.base + n, n, 0)


class FakeScheduler:
    def __init__(self):
        self.num_running = 0

    @property
    def has_work(self) -> bool:
        return self.num_running > 0

    def stats(self) -> SchedulerStats:
        return SchedulerStats(self.num_running, 0, 8, 64)


class FakeEngine:
    def __init__(self, model_id: str, meter: Meter):
        self.model_id = model_id
        self.meter = meter
        self.scheduler = FakeScheduler()
        self.prefix_cache = None
        self.stopped = False

    def num_active(self) -> int:
        return self.scheduler.num_running

    def active_requests(self) -> list:
        return []

    def stop(self) -> None:
        self.stopped = True
        with self.meter.lock:
            self.meter.loaded.pop(self.model_id, None)


def make_pool(tmp_path: Path, sizes: dict[str, int], *, soft: int, base: int = 100 * MB,
              settings: dict[str, ModelSettings] | None = None, load_wait_s: float = 2.0, fail: set[str] | None = None,
              load_delay_s: float = 0.0, aliases: dict[str, str] | None = None):
    models = tmp_path / "models"
    for mid, size in sizes.items():
        d = models / mid
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        with open(d / "model.safetensors", "wb") as f:  # sparse: the size is what counts
            f.truncate(size)
    meter = Meter(base)
    log: list[str] = []

    def loader(mid, path, task, s, warm):
        time.sleep(load_delay_s)
        if fail and mid in fail:
            raise ModelImportError(f"broken model {mid}")
        with meter.lock:
            meter.loaded[mid] = sizes[mid]
        log.append(mid)
        return PoolEntry(SimpleNamespace(model_id=mid, context_length=1000), FakeEngine(mid, meter), settings=s)

    cfg = ServerConfig(base_path=str(tmp_path), model_settings=settings or {}, aliases=aliases or {},
                       memory=MemoryConfig(load_wait_s=load_wait_s, check_interval_s=0.05))
    limits = MemoryLimits(ceiling_bytes=int(soft / 0.9), soft_bytes=soft, hard_bytes=int(soft / 0.9 * 0.97))
    enforcer = ProcessMemoryEnforcer(limits, measure=meter.snapshot, release=lambda: None)
    pool = EnginePool(cfg, enforcer=enforcer, loader=loader, resolver=lambda mid, src: (models / mid, "chat"))
    return pool, meter, log


def loaded_ids(pool: EnginePool) -> list[str]:
    return sorted(m["id"] for m in pool.status()["models"] if m["state"] == "loaded")


def test_third_model_evicts_the_least_recently_used(tmp_path):
    # soft 1000 MB, base 100 MB, models 300 MB (x1.1 margin = 330): two fit, a third does not
    pool, meter, log = make_pool(tmp_path, {"a": 300 * MB, "b": 300 * MB, "c": 300 * MB}, soft=1000 * MB)
    pool.get("a")
    pool.get("b")
    pool.get("a")  # a is now more recent than b
    pool.get("c")
    assert loaded_ids(pool) == ["a", "c"]
    ev = [e for e in pool.status()["events"] if e["kind"] == "unload"]
    assert [(e["model_id"], e["freed_mlx_bytes"]) for e in ev] == [("b", 300 * MB)]
    assert "LRU" in ev[0]["reason"]
    assert log == ["a", "b", "c"]


def test_pinned_model_is_never_evicted(tmp_path):
    settings = {"p": ModelSettings(pin=True)}
    pool, meter, log = make_pool(tmp_path, {"p": 300 * MB, "a": 300 * MB, "b": 300 * MB}, soft=1000 * MB, settings=settings)
    pool.preload(warmup=False)
    assert loaded_ids(pool) == ["p"]
    pool.get("a")
    time.sleep(0.01)
    pool.get("p")  # p is the least recently used now, but pinned
    pool.get("b")
    assert loaded_ids(pool) == ["b", "p"]
    with pytest.raises(InvalidRequestError, match="pinned"):
        pool.unload("p")
    for _ in range(3):
        pool.check_once()
    assert "p" in loaded_ids(pool)


def test_ttl_unloads_an_idle_model(tmp_path):
    settings = {"t": ModelSettings(ttl_s=0.2), "p": ModelSettings(pin=True, ttl_s=0.2)}
    pool, meter, _ = make_pool(tmp_path, {"t": 100 * MB, "p": 100 * MB, "k": 100 * MB}, soft=2000 * MB, settings=settings)
    pool.preload(warmup=False)
    pool.get("t")
    pool.get("k")
    pool.check_once()
    assert loaded_ids(pool) == ["k", "p", "t"]
    time.sleep(0.3)
    pool.check_once()
    assert loaded_ids(pool) == ["k", "p"]  # no TTL on k; p is pinned
    ev = [e for e in pool.status()["events"] if e["kind"] == "unload"]
    assert ev[-1]["model_id"] == "t" and "ttl_s" in ev[-1]["reason"]


def test_ttl_counts_from_the_end_of_the_last_request(tmp_path):
    pool, _, _ = make_pool(tmp_path, {"t": 100 * MB}, soft=2000 * MB, settings={"t": ModelSettings(ttl_s=0.2)})
    entry = pool.get("t")
    entry.engine.scheduler.num_running = 1  # a long request
    time.sleep(0.3)
    pool.check_once()
    assert loaded_ids(pool) == ["t"]
    entry.engine.scheduler.num_running = 0
    pool.check_once()
    assert loaded_ids(pool) == ["t"]
    time.sleep(0.3)
    pool.check_once()
    assert loaded_ids(pool) == []


def test_too_large_model_gets_507_with_the_numbers_at_once(tmp_path):
    pool, _, log = make_pool(tmp_path, {"a": 300 * MB, "huge": 5000 * MB}, soft=1000 * MB, load_wait_s=30)
    pool.get("a")
    t0 = time.monotonic()
    with pytest.raises(InsufficientMemoryError) as ei:
        pool.get("huge")
    assert time.monotonic() - t0 < 1  # no waiting for something that can never fit
    msg = ei.value.message
    assert ei.value.status == 507
    assert "needs about 5.50 GB" in msg and "soft limit is 1.00 GB" in msg and "ceiling" in msg
    assert "uses 0.40 GB" in msg
    assert loaded_ids(pool) == ["a"]  # nothing was evicted for a hopeless load
    assert pool.status()["models"][1]["last_error"] == msg


def test_busy_model_is_waited_for_then_evicted(tmp_path):
    pool, _, _ = make_pool(tmp_path, {"a": 300 * MB, "b": 300 * MB, "c": 300 * MB}, soft=1000 * MB, load_wait_s=10)
    la = pool.acquire("a")
    lb = pool.acquire("b")
    threading.Timer(0.3, pool.release, [la]).start()
    t0 = time.monotonic()
    pool.get("c")
    assert 0.25 < time.monotonic() - t0 < 5
    assert loaded_ids(pool) == ["b", "c"]  # a became idle first; b stayed leased
    pool.release(lb)


def test_busy_models_that_stay_busy_give_507_naming_them(tmp_path):
    pool, _, _ = make_pool(tmp_path, {"a": 300 * MB, "b": 300 * MB, "c": 300 * MB}, soft=1000 * MB, load_wait_s=0.3)
    pool.acquire("a")
    pool.get("b").engine.scheduler.num_running = 2  # serving, no lease
    with pytest.raises(InsufficientMemoryError, match=r"Models .*a.*b.* were serving requests"):
        pool.get("c")
    assert loaded_ids(pool) == ["a", "b"]


def test_concurrent_requests_during_eviction_complete_or_fail_clearly(tmp_path):
    pool, meter, _ = make_pool(tmp_path, {m: 300 * MB for m in "abcd"}, soft=1000 * MB, load_wait_s=5, load_delay_s=0.01)
    results: list[object] = []
    peak = [0]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(15):
            m = rng.choice("abcd")
            try:
                lease = pool.acquire(m)
            except OmlxError as e:
                results.append(e)
                continue
            try:
                assert lease.entry.loaded.model_id == m and not lease.entry.engine.stopped
                peak[0] = max(peak[0], meter.snapshot().used_bytes)
                time.sleep(rng.random() * 0.01)
                assert not lease.entry.engine.stopped  # never evicted under a lease
                results.append(m)
            finally:
                pool.release(lease)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 * 15
    errors = [r for r in results if isinstance(r, OmlxError)]
    assert all(isinstance(e, InsufficientMemoryError) and "serving requests" in e.message for e in errors)
    assert len(errors) < len(results) / 2
    assert peak[0] <= 1000 * MB  # under the soft watermark throughout
    assert len(loaded_ids(pool)) <= 2
    st = pool.status()
    assert all(e["freed_mlx_bytes"] == 300 * MB for e in st["events"] if e["kind"] == "unload")


def test_unknown_model_is_404_and_never_loads_a_default(tmp_path):
    pool, _, log = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB, aliases={"main-model": "a"})
    with pytest.raises(ModelNotFoundError) as ei:
        pool.get("claude-haiku-x")
    assert ei.value.message == "The model 'claude-haiku-x' does not exist"
    assert log == []
    assert pool.get("main-model").loaded.model_id == "a"
    with pytest.raises(ModelNotFoundError):
        pool.get("../a")


def test_pinned_model_that_does_not_exist_refuses_the_start_naming_the_closest_id(tmp_path):
    """``[models."ghost"] pin = true`` made a record for the id, so the start loaded the other
    models and then failed loading ghost, with no word of which ids exist."""
    settings = {"qwen-07b": ModelSettings(pin=True), "ghost": ModelSettings(pin=True)}
    pool, _, log = make_pool(tmp_path, {"qwen-0.5b": 100 * MB}, soft=1000 * MB, settings=settings)
    with pytest.raises(ModelNotFoundError) as ei:
        pool.preload(warmup=False)
    msg = ei.value.message
    assert msg.startswith("The model 'qwen-07b' does not exist: [models.\"qwen-07b\"] in the config has pin = true"), msg
    assert "(did you mean qwen-0.5b?)" in msg and str(tmp_path / "models") in msg, msg
    assert log == []  # refused before anything loads
    assert "ghost" not in pool.listed_ids() and "qwen-07b" not in pool.listed_ids()


def test_pinned_hub_id_not_in_the_hub_cache_says_how_to_pull_it(tmp_path):
    settings = {"mlx-community/Ghost-4bit": ModelSettings(pin=True)}
    pool, _, log = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB, settings=settings)
    with pytest.raises(ModelNotFoundError, match="fetch it with `omlx models pull mlx-community/Ghost-4bit`"):
        pool.preload(warmup=False)
    assert log == []


def test_pinned_model_found_in_the_models_dir_loads_at_start(tmp_path):
    pool, _, log = make_pool(tmp_path, {"a": 100 * MB, "p": 100 * MB}, soft=1000 * MB,
                             settings={"p": ModelSettings(pin=True)})
    assert pool.catalogue.unmatched_settings() == []
    pool.preload(warmup=False)
    assert log == ["p"] and pool.catalogue.default_id == "p"


def test_profiles_overlay_settings_on_one_engine(tmp_path):
    settings = {"a": ModelSettings(default_temperature=0.7, default_max_tokens=100, profiles={
        "terse": ModelSettings(default_max_tokens=5), "cold": ModelSettings(default_temperature=0.0)})}
    pool, meter, log = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB, settings=settings)
    base, terse, cold = pool.get("a"), pool.get("a:terse"), pool.get("a:cold")
    assert log == ["a"] and meter.loaded == {"a": 100 * MB}
    assert base.engine is terse.engine is cold.engine
    assert (base.settings.default_max_tokens, base.settings.default_temperature) == (100, 0.7)
    assert (terse.settings.default_max_tokens, terse.settings.default_temperature, terse.profile) == (5, 0.7, "terse")
    assert (cold.settings.default_max_tokens, cold.settings.default_temperature) == (100, 0.0)
    assert pool.listed_ids() == ["a", "a:terse", "a:cold"]
    with pytest.raises(ModelNotFoundError):
        pool.get("a:nope")


def test_failed_load_reaches_every_waiter_and_can_be_retried(tmp_path):
    fail = {"x"}
    pool, _, _ = make_pool(tmp_path, {"x": 100 * MB}, soft=1000 * MB, fail=fail, load_delay_s=0.2)
    errors: list[Exception] = []

    def get() -> None:
        try:
            pool.get("x")
        except OmlxError as e:
            errors.append(e)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and all("broken model x" in e.message for e in errors)
    fail.clear()
    assert pool.get("x").loaded.model_id == "x"


def test_unload_drains_running_requests_first(tmp_path):
    pool, meter, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    entry = pool.get("a")
    entry.engine.scheduler.num_running = 1
    threading.Timer(0.2, lambda: setattr(entry.engine.scheduler, "num_running", 0)).start()
    t0 = time.monotonic()
    ev = pool.unload("a", drain_s=5)
    assert time.monotonic() - t0 >= 0.15
    assert ev is not None and ev.freed_mlx_bytes == 100 * MB
    assert pool.unload("a") is None
    assert meter.loaded == {}


def test_unload_fails_requests_still_running_after_the_drain(tmp_path):
    pool, meter, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    engine = pool.get("a").engine
    engine.scheduler.num_running = 1
    aborted: list[tuple[str, Exception]] = []
    engine.active_requests = lambda: [SimpleNamespace(request_id="r1", arrival_s=0.0)]

    def abort(rid, error=None):
        aborted.append((rid, error))
        engine.scheduler.num_running = 0

    engine.abort = abort
    assert pool.unload("a", drain_s=0.1) is not None
    assert aborted and aborted[0][0] == "r1" and "was unloaded" in str(aborted[0][1])


def test_soft_watermark_evicts_idle_models_lru_first(tmp_path):
    pool, meter, _ = make_pool(tmp_path, {"a": 300 * MB, "b": 300 * MB}, soft=1000 * MB)
    pool.get("a")
    pool.get("b")
    meter.base = 500 * MB  # something else grew: 1100 MB used
    pool.check_once()
    assert loaded_ids(pool) == ["b"]


def test_paused_admission_holds_new_requests_but_not_admitted_ones(tmp_path):
    from omlx.errors import OverloadedError

    pool, _, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    lease = pool.acquire("a")
    pool.memory.set_admission_paused(True)
    with pytest.raises(OverloadedError, match="above the soft limit"):
        pool.acquire("a", wait_s=0.2)
    assert pool.get("a").loaded.model_id == "a"  # the route of an admitted request is not held
    threading.Timer(0.2, pool.memory.set_admission_paused, [False]).start()
    t0 = time.monotonic()
    pool.release(pool.acquire("a", wait_s=5))
    assert 0.15 < time.monotonic() - t0 < 4
    pool.release(lease)


def test_wrong_kind_is_refused_before_loading(tmp_path):
    pool, _, log = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    with pytest.raises(InvalidRequestError, match="serves chat, not embeddings; use POST /v1/chat/completions"):
        pool.acquire("a", task="embeddings")
    assert log == []


def test_pinned_model_whose_path_does_not_exist_refuses_the_start_naming_the_table(tmp_path):
    """A pinned table with a ``path`` made its record up front, so the start loaded the other
    models and then failed with "The model '/nonexistent/dir' does not exist", naming no table."""
    missing = tmp_path / "nonexistent"
    pool, _, log = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB,
                             settings={"ghost": ModelSettings(pin=True, path=str(missing))})
    with pytest.raises(ModelNotFoundError) as ei:
        pool.preload(warmup=False)
    msg = ei.value.message
    assert msg.startswith("The model 'ghost' does not exist: [models.\"ghost\"] in the config has pin = true and "
                          f"path {missing}"), msg
    assert log == []  # refused before anything loads


def test_a_misspelled_model_id_is_404_naming_the_closest_served_id(tmp_path):
    """A typo (found by the fresh-user check) got a bare "does not exist", where a config typo
    gets a did-you-mean."""
    pool, _, log = make_pool(tmp_path, {"SmolLM2-135M-Instruct": 100 * MB}, soft=1000 * MB, aliases={"main-model": "x"})
    with pytest.raises(ModelNotFoundError) as ei:
        pool.get("SmolLM2-135M-Instruc")
    assert ei.value.message == ("The model 'SmolLM2-135M-Instruc' does not exist: did you mean SmolLM2-135M-Instruct?; "
                                "GET /v1/models lists the served ids")
    with pytest.raises(ModelNotFoundError) as ei:
        pool.get("main-modle")
    assert "did you mean main-model?" in ei.value.message and log == []

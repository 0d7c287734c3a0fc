"""Leases the pool hands to requests: a cancel never leaves one without an owner, and the 120 s
expiry, a safety net, is never silent (an ERROR naming the request, a counter in the status and
in /metrics). Fake engines, as in test_pool.py."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import omlx.pool.loaded
from omlx.api.metrics import Metrics
from tests.unit.test_pool import MB, make_pool


def _num_leases(pool, model: str) -> int:
    return next(m["num_leases"] for m in pool.status()["models"] if m["id"] == model)


def _wait_loaded(pool, model: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(m["id"] == model and m["state"] == "loaded" for m in pool.status()["models"]):
        assert time.monotonic() < deadline, pool.status()
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["while the model loads", "after the thread took the lease"])
def test_a_request_cancelled_while_the_pool_thread_takes_its_lease_leaves_none(tmp_path, where):
    pool, _, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB,
                           load_delay_s=0.3 if where == "while the model loads" else 0.0)
    took = []

    async def leave_early() -> None:
        then = None if where == "while the model loads" else (lambda: (took.append(1), time.sleep(0.3)))
        task = asyncio.create_task(pool.acquire_async("a", owner="req-1 (POST /v1/messages)", then=then))
        await asyncio.sleep(0.1)  # the pool's thread is loading the model, or holds the lease
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    _wait_loaded(pool, "a")
    deadline = time.monotonic() + 2.0
    while _num_leases(pool, "a") and time.monotonic() < deadline:  # released once the thread hands it over
        time.sleep(0.01)
    assert _num_leases(pool, "a") == 0
    assert took or where == "while the model loads"


def test_a_request_that_waits_gets_its_lease_and_releases_it(tmp_path):
    pool, _, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB, load_delay_s=0.1)

    async def use() -> None:
        lease = await pool.acquire_async("a", owner="req-2")
        assert lease.owner == "req-2" and _num_leases(pool, "a") == 1
        pool.release(lease)
        pool.release(lease)  # idempotent

    asyncio.run(use())
    assert _num_leases(pool, "a") == 0


def test_an_expired_lease_is_an_error_naming_its_request_and_is_counted(tmp_path, monkeypatch, caplog):
    pool, _, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    pool.acquire("a", owner="request req-7 (POST /v1/messages)")  # never released: a bug in a request path
    metrics = Metrics(pool)
    assert b'omlx_leases_expired_total{model="a"} 0.0' in metrics.exposition()
    pool.check_once()
    assert _num_leases(pool, "a") == 1  # young leases stay
    monkeypatch.setattr(omlx.pool.loaded, "LEASE_TIMEOUT_S", 0.01)
    time.sleep(0.02)
    with caplog.at_level(logging.WARNING, logger="omlx.pool"):
        pool.check_once()
    errors = [r for r in caplog.records if "expired" in r.getMessage()]
    assert [r.levelno for r in errors] == [logging.ERROR]
    assert "held by request req-7 (POST /v1/messages)" in errors[0].getMessage()
    row = next(m for m in pool.status()["models"] if m["id"] == "a")
    assert (row["num_leases"], row["num_expired_leases"], pool.status()["num_expired_leases"]) == (0, 1, 1)
    assert b'omlx_leases_expired_total{model="a"} 1.0' in metrics.exposition()


def test_a_lease_older_than_the_timeout_stays_while_its_engine_worked_just_now(tmp_path, monkeypatch, caplog):
    """A request that ran longer than the expiry (a 24-minute prefill of the real Claude Code's
    first prompt) still holds its lease for the moment its route writes its last frames after
    the engine went idle: idle time counts from the engine's last working step."""
    pool, _, _ = make_pool(tmp_path, {"a": 100 * MB}, soft=1000 * MB)
    pool.acquire("a", owner="request req-8 (POST /v1/messages)")
    monkeypatch.setattr(omlx.pool.loaded, "LEASE_TIMEOUT_S", 0.2)
    time.sleep(0.3)  # the lease is older than the expiry ...
    engine = pool.get("a").engine
    engine.last_step_s = time.monotonic()  # ... but its engine stepped a moment ago
    with caplog.at_level(logging.WARNING, logger="omlx.pool"):
        pool.check_once()
        assert _num_leases(pool, "a") == 1 and not [r for r in caplog.records if "expired" in r.getMessage()]
        time.sleep(0.3)  # idle longer than the expiry: now it is a leak
        pool.check_once()
    assert _num_leases(pool, "a") == 0
    assert [r.levelno for r in caplog.records if "expired" in r.getMessage()] == [logging.ERROR]

"""RequestHolds (omlx.api.holds): one release gives back everything a request holds, once, in
order (engine requests aborted, then the lease); the test-only park (omlx.api.park) is read only
when the server enables it; `requested_model` never raises."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from omlx.api import park as park_mod
from omlx.api.holds import RequestHolds
from omlx.api.park import Park
from omlx.api.params import requested_model
from omlx.errors import ModelNotFoundError


class FakePool:
    def __init__(self, log: list[str]):
        self.log = log

    def release(self, lease) -> None:
        self.log.append(f"release {lease}")


class FakeTurn:
    def __init__(self, name: str, log: list[str], *, fail: bool = False):
        self.name, self.log, self.fail = name, log, fail

    def start(self) -> None:
        if self.fail:
            raise RuntimeError("queue full")
        self.log.append(f"start {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")
        if self.name == "bad":
            raise RuntimeError("abort failed")


def test_release_aborts_every_turn_then_ends_the_lease_once():
    log: list[str] = []
    holds = RequestHolds(FakePool(log), "req-1", "req-1 (POST /v1/messages)", lease="L")
    holds.start(FakeTurn("a", log))
    holds.start(FakeTurn("bad", log))  # its abort raises: the rest is still released
    with pytest.raises(RuntimeError):
        holds.start(FakeTurn("full", log, fail=True))  # never submitted: not owned, not closed
    holds.release()
    holds.release()
    assert log == ["start a", "start bad", "close a", "close bad", "release L"]
    assert holds.lease is None and holds.turns == []


def test_an_entry_without_a_lease_is_model_not_found():
    holds = RequestHolds(FakePool([]), "req-2", "req-2")
    with pytest.raises(ModelNotFoundError):
        holds.chat_entry("nope")


def _http(enabled: bool, header: str | None):
    headers = {park_mod.HEADER: header} if header is not None else {}
    return SimpleNamespace(app=SimpleNamespace(ctx=SimpleNamespace(config=SimpleNamespace(test_park=enabled))),
                           headers=headers)


def test_park_is_read_only_when_enabled_and_only_for_known_points():
    assert Park.of(_http(False, "leased abc")) is None
    assert Park.of(_http(True, None)) is None
    assert Park.of(_http(True, "nowhere abc")) is None
    assert Park.of(_http(True, "leased abc")) == Park("leased", "abc")
    assert Park("leased", "x").on_pool_thread() is None and Park("acquire", "x").on_pool_thread() is not None


def test_park_waits_at_its_own_point_only(monkeypatch):
    monkeypatch.setattr(park_mod, "PARK_S", 0.05)

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        p = Park("prepared", "t")
        t0 = loop.time()
        await p.at("leased")
        t1 = loop.time()
        await p.at("prepared")
        return t1 - t0, loop.time() - t1

    other, own = asyncio.run(run())
    assert other < 0.01 and own >= 0.05


@pytest.mark.parametrize("body, max_bytes, want", [
    (b'{"model": "m", "messages": []}', 100, "m"),
    (b'{"model": "m", "pad": "' + b"x" * 100 + b'"}', 100, None),  # over the limit: the route says 413
    (b"", None, None), (None, None, None), (b"not json", None, None), (b"[1]", None, None),
    (b'{"model": 3}', None, None), (b'{"model": ""}', None, None), (b"[" * 100000, None, None),
])
def test_requested_model_never_raises(body, max_bytes, want):
    assert requested_model(body, max_bytes) == want

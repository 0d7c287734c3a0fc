"""Node agents in one process over loopback TCP (static peers, no mDNS): join, one plan per epoch
on every node, a crash and a goodbye each start a new epoch, a wrong secret is refused.
The namespace test (tests/integration/test_cluster_netns.py) covers mDNS and separate hosts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from safetensors.numpy import save_file

from omlx.cluster.agent import AgentSettings, NodeAgent
from omlx.cluster.discovery import NodeInfo
from tests.helpers import free_port
from tests.unit.cluster.test_cluster_layer_bytes import tensors, write_config

SECRET = b"unit-test-secret"
GB = 10**9


def _model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    save_file(tensors(tied=True), str(path / "model.safetensors"))
    write_config(path, tie_word_embeddings=True)
    return path


def _agent(tmp_path: Path, name: str, port: int, peers: list[int], *, model: Path | None = None,
           http_port: int = 0, secret: bytes = SECRET) -> NodeAgent:
    settings = AgentSettings(
        secret=secret, control_host="127.0.0.1", control_port=port,
        peers=tuple(f"127.0.0.1:{p}" for p in peers), mdns=False,
        heartbeat_interval_s=0.2, heartbeat_timeout_s=0.8,
        model_path=str(model) if model else None, context_tokens=16, max_concurrent=1, headroom_bytes=0,
    )
    info = NodeInfo(node_id=name * 32, addresses=("127.0.0.1",), control_port=port, http_port=http_port,
                    available_bytes=8 * GB)
    (tmp_path / name).mkdir(exist_ok=True)
    return NodeAgent(settings, info, tmp_path / name, stream_rate_bytes_s=10e9)


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 15.0) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def _agreed(agents: list[NodeAgent], num_members: int) -> bool:
    epochs = {a.membership.epoch for a in agents}
    return (
        all(len(a.membership.members) == num_members for a in agents)
        and len(epochs) == 1
        and all(a.plan is not None and a.plan_epoch == a.membership.epoch for a in agents)
        and len({repr(a.plan) for a in agents}) == 1
    )


def test_agents_join_agree_and_replan_on_crash_and_goodbye(tmp_path: Path) -> None:
    model = _model(tmp_path)
    pa, pb, pc = free_port(), free_port(), free_port()

    async def main() -> None:
        a = _agent(tmp_path, "a", pa, [pb, pc], model=model, http_port=8000)
        b = _agent(tmp_path, "b", pb, [pa, pc])
        c = _agent(tmp_path, "c", pc, [pa, pb])
        for x in (c, b, a):  # the coordinator last: the others form a view without it first
            await x.start()
        try:
            await _until("3 agents agree on members, epoch and plan", lambda: _agreed([a, b, c], 3))
            assert a.membership.coordinator_id == a.info.node_id
            assert a.plan is not None and a.plan.stages[0].node_id == a.info.node_id
            for x in (a, b, c):
                me = x.membership.me
                assert len(me.links) == 2 and all(bw > 0 and lat > 0 for bw, lat in me.links.values())
                assert x.status()["worker"] is None or x.status()["worker"]["dry_run"] is True
            epoch = a.membership.epoch

            await c.stop(announce=False)  # a crash: sockets close, no goodbye
            await _until("a and b drop c", lambda: _agreed([a, b], 2))
            assert a.membership.epoch > epoch and c.info.node_id not in a.membership.members
            assert any("left" in e and c.info.node_id in e for e in a.events)
            assert all(s.node_id != c.info.node_id for s in a.plan.stages)  # type: ignore[union-attr]
            epoch = a.membership.epoch

            await b.stop(announce=True)
            await _until("a drops b", lambda: len(a.membership.members) == 1)
            assert a.membership.epoch == epoch + 1
            assert any("announced it is leaving" in e for e in a.events)
            assert a.plan is not None and [s.node_id for s in a.plan.stages] == [a.info.node_id]
            assert a.plan_epoch == a.membership.epoch
        finally:
            for x in (a, b, c):
                await x.stop(announce=False)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_agent_with_the_wrong_secret_stays_out(tmp_path: Path) -> None:
    pa, pd = free_port(), free_port()

    async def main() -> None:
        a = _agent(tmp_path, "a", pa, [])
        d = _agent(tmp_path, "d", pd, [pa], secret=b"not the secret")
        await a.start()
        await d.start()
        try:
            await _until("d is refused", lambda: any("refused by" in e for e in d.events))
            await asyncio.sleep(0.5)
            assert list(a.membership.members) == [a.info.node_id] and a.membership.epoch == 0
            assert list(d.membership.members) == [d.info.node_id]
        finally:
            await d.stop(announce=False)
            await a.stop(announce=False)

    asyncio.run(asyncio.wait_for(main(), 30))

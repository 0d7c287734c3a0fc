"""Epochs, expiry, coordinator and stage order, NodeSpecs from measured figures; SPEC parsing;
the node id file; the worker launch line."""

from __future__ import annotations

import json
import re
import stat

import pytest

from omlx.cluster.agent import plan_from_dict, plan_to_dict
from omlx.cluster.discovery import NodeInfo, load_node_id
from omlx.cluster.launcher import WorkerLaunch, WorkerLauncher, write_hostfile
from omlx.cluster.membership import Member, Membership
from omlx.cluster.plan import (
    DEFAULT_LINK_BANDWIDTH_BYTES_S,
    DEFAULT_MEM_BANDWIDTH_BYTES_S,
    ModelLayout,
    PlanRequest,
    parse_nodes_spec,
    plan_pipeline,
)
from omlx.config import load_config
from omlx.config_values import parse_peer
from omlx.errors import ConfigError

GB = 10**9


def test_join_and_leave_bump_the_epoch_once() -> None:
    m = Membership(self_id="a")
    assert m.epoch == 0 and list(m.members) == ["a"]
    assert m.join(Member("b", last_seen_s=1.0)) is True and m.epoch == 1
    assert m.join(Member("b", available_bytes=5, last_seen_s=2.0)) is False and m.epoch == 1
    assert m.members["b"].available_bytes == 5
    assert m.join(Member("c"), new_epoch=False) is True and m.epoch == 1
    assert m.leave("b", "gone") is True and m.epoch == 2
    assert m.leave("b", "gone") is False and m.epoch == 2
    assert m.leave("a", "self") is False and "a" in m.members
    m.adopt_epoch(1)
    assert m.epoch == 2
    m.adopt_epoch(7)
    assert m.epoch == 7
    assert m.restart("pipeline failed") == 8 and sorted(m.members) == ["a", "c"]  # same members


def test_adopting_a_newer_epoch_drops_the_members_its_announcer_dropped_and_we_no_longer_hear() -> None:
    """b announces epoch 5 without c (b saw c leave first): c, silent here too, leaves within
    epoch 5 (no epoch 6 of its own); d, also unlisted but heard from a moment ago (it may have
    just joined us), stays; its own heartbeats decide."""
    m = Membership(self_id="a", epoch=4)
    for node_id, seen in (("b", 9.9), ("c", 7.0), ("d", 9.8)):
        m.join(Member(node_id, last_seen_s=seen), new_epoch=False)
    m.me.links = {"b": (1e9, 1e-4), "c": (1e9, 1e-4)}
    assert m.adopt_epoch(5, ["a", "b"], now_s=10.0, silent_s=1.0) == ["c"]
    assert m.epoch == 5 and sorted(m.members) == ["a", "b", "d"] and list(m.me.links) == ["b"]
    assert m.leave("c", "heartbeat timeout") is False and m.epoch == 5  # no extra epoch later
    # Heard from a moment ago but its connection here has closed (a killed node): dropped too.
    m.join(Member("e", last_seen_s=9.9), new_epoch=False)
    assert m.adopt_epoch(6, ["a", "b", "d"], now_s=10.0, silent_s=1.0, unreachable=["e", "b"]) == ["e"]
    assert m.epoch == 6 and sorted(m.members) == ["a", "b", "d"]
    # Not newer, or no member list: the number only (nothing is dropped).
    assert m.adopt_epoch(6, ["a"], now_s=100.0, silent_s=1.0) == [] and "b" in m.members
    assert m.adopt_epoch(7, None, now_s=100.0, silent_s=1.0) == [] and m.epoch == 7 and "b" in m.members
    # Self is never dropped, even when the announcer does not list it.
    assert m.adopt_epoch(8, ["b", "d"], now_s=100.0, silent_s=1.0) == [] and "a" in m.members


def test_leave_drops_links_to_the_gone_node() -> None:
    m = Membership(self_id="a")
    m.join(Member("b"))
    m.me.links["b"] = (1e9, 1e-4)
    m.leave("b", "gone")
    assert m.me.links == {}


def test_expired_members_are_those_silent_past_the_timeout() -> None:
    m = Membership(self_id="a")
    m.join(Member("b", last_seen_s=10.0))
    m.join(Member("c", last_seen_s=12.0))
    assert m.expired(now_s=12.5, timeout_s=3.0) == []
    assert m.expired(now_s=13.5, timeout_s=3.0) == ["b"]
    m.seen("b", 13.0)
    assert m.expired(now_s=15.5, timeout_s=3.0) == ["c"]
    assert m.expired(now_s=100.0, timeout_s=3.0) == ["b", "c"]  # never self


def test_stage_order_and_coordinator() -> None:
    m = Membership(self_id="c")
    m.join(Member("a"))
    m.join(Member("b", model_path="/m"))
    assert [x.node_id for x in m.ordered()] == ["b", "a", "c"] and m.coordinator_id == "b"
    m.join(Member("d", http_port=8000))
    assert m.coordinator_id == "d" and [x.node_id for x in m.ordered()] == ["d", "b", "a", "c"]


def test_node_specs_use_measured_figures_and_defaults() -> None:
    m = Membership(self_id="a")
    me = m.me
    me.available_bytes, me.stream_rate_bytes_s, me.http_port = 16 * GB, 50e9, 8000
    me.links = {"b": (2e9, 1e-4), "c": (1e9, 3e-4), "gone": (1.0, 9.0)}
    m.join(Member("b", available_bytes=8 * GB, memory_cap_bytes=6 * GB))
    a, b = m.node_specs(headroom_bytes=1 * GB)
    assert (a.node_id, a.mem_bandwidth_bytes_s, a.cap_bytes) == ("a", 50e9, 15 * GB)
    assert (a.link_bandwidth_bytes_s, a.link_latency_s) == (2e9, 1e-4)  # only links to members
    assert (b.cap_bytes, b.configured_cap_bytes) == (5 * GB, 6 * GB)
    assert (b.mem_bandwidth_bytes_s, b.link_bandwidth_bytes_s) == (
        DEFAULT_MEM_BANDWIDTH_BYTES_S,
        DEFAULT_LINK_BANDWIDTH_BYTES_S,
    )


def test_worst_link_is_taken() -> None:
    member = Member("a", links={"b": (2e9, 1e-4), "c": (1e9, 3e-4)})
    assert member.link_to(["b", "c"]) == (1e9, 3e-4)


def test_a_slower_node_gets_fewer_layers() -> None:
    layout = ModelLayout([10**8] * 20, 10**7, 0, 10**4, True, 1000)
    m = Membership(self_id="fast")
    m.me.available_bytes, m.me.stream_rate_bytes_s, m.me.http_port = 64 * GB, 400e9, 1
    m.join(Member("slow", available_bytes=64 * GB, stream_rate_bytes_s=100e9))
    plan = plan_pipeline(layout, m.node_specs(), PlanRequest(1024, 1, 2048))
    fast, slow = plan.stages
    assert fast.node_id == "fast" and fast.num_layers > slow.num_layers
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan


# ------------------------------------------------------------------ SPEC and peers


def test_nodes_spec_short_form() -> None:
    a, b = parse_nodes_spec("64GB@400GB/s,32GB@200GB/s", headroom_bytes=0)
    assert (a.node_id, a.available_bytes, a.mem_bandwidth_bytes_s) == ("node0", 64 * GB, 400e9)
    assert (b.node_id, b.available_bytes, b.mem_bandwidth_bytes_s) == ("node1", 32 * GB, 200e9)
    (c,) = parse_nodes_spec("16GiB", mem_bandwidth_bytes_s=7.0)
    assert (c.node_id, c.available_bytes, c.mem_bandwidth_bytes_s) == ("node0", 16 * 2**30, 7.0)
    mixed = parse_nodes_spec("big:64GB:400GB/s,32GB@200GB/s")
    assert [n.node_id for n in mixed] == ["big", "node1"]
    for bad in ("64GB@fast", "lots@400GB/s", "64GB@400GB", "64GB@400GB/s,", "@400GB/s"):
        with pytest.raises(ValueError):
            parse_nodes_spec(bad)


def test_parse_peer() -> None:
    assert parse_peer("10.0.0.2:9000", 8470) == ("10.0.0.2", 9000)
    assert parse_peer("host", 8470) == ("host", 8470)
    assert parse_peer("[fe80::1]:9000", 8470) == ("fe80::1", 9000)


@pytest.mark.parametrize("bad", ["host:", "host:x", ":80", "h:70000", "[]:80"])
def test_the_config_refuses_the_peers_the_agent_cannot_read(bad: str) -> None:
    """One reading of a peer: the config's check is the agent's parse (``[]:80`` passed the
    config's own copy of it, and the agent then dialled host '')."""
    with pytest.raises(ValueError, match="expected host or host:port"):
        parse_peer(bad, 8470)
    with pytest.raises(ConfigError, match=re.escape(f"peer {bad!r}: expected host or host:port")):
        load_config({}, {"OMLX_CLUSTER_PEERS": bad}, None)


# ------------------------------------------------------------------ node id, node info, launcher


def test_node_id_is_persisted_private_and_repaired(tmp_path) -> None:
    first = load_node_id(tmp_path)
    assert len(first) == 32 and load_node_id(tmp_path) == first
    folder, path = tmp_path / "cluster", tmp_path / "cluster" / "node_id"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("not an id")
    second = load_node_id(tmp_path)
    assert second != first and len(second) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_node_info_round_trips_through_txt_and_json() -> None:
    info = NodeInfo("ab" * 16, hostname="h", addresses=("10.0.0.1", "10.0.0.2"), control_port=9, total_bytes=5)
    assert NodeInfo.from_txt({k.encode(): v.encode() for k, v in info.to_txt().items()}) == info
    assert NodeInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert all(len(k) + len(v) < 255 for k, v in info.to_txt().items())
    with pytest.raises(ValueError):
        NodeInfo.from_dict({"hostname": "no id"})
    with pytest.raises(ValueError):
        NodeInfo.from_dict({"node_id": "x", "total_bytes": "lots"})


def test_worker_launch_line_and_hostfile(tmp_path) -> None:
    hostfile = tmp_path / "hostfile.json"
    write_hostfile(hostfile, ["10.0.0.1:8480", "10.0.0.2:8480"])
    assert json.loads(hostfile.read_text()) == [["10.0.0.1:8480"], ["10.0.0.2:8480"]]
    assert stat.S_IMODE(hostfile.stat().st_mode) == 0o600
    launch = WorkerLaunch(3, 1, 2, "/m", ((0, 15), (15, 30)), hostfile, ("10.0.0.1:8480", "10.0.0.2:8480"))
    assert launch.argv() == [
        "omlx", "cluster", "worker", "--model", "/m", "--ranges", "0:15,15:30",
        "--hostfile", str(hostfile), "--rank", "1",
    ]
    assert launch.env() == {"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    dry = WorkerLauncher(None)
    dry.restart(launch)
    st = dry.status()
    assert st is not None and st["dry_run"] is True and st["running"] is False and "--rank 1" in str(st["command"])
    dry.restart(None)
    assert dry.status() is None


def test_launcher_runs_and_replaces_the_worker(tmp_path) -> None:
    """A real child process stands in for `omlx cluster worker`: it gets the line, its ready file
    marks it ready, a new epoch's launch stops it (its process group), and an exit is `lost`."""
    import os
    import sys
    import time

    out = tmp_path / "out"
    script = (
        "import os, sys, time; a = sys.argv; "
        "open(a[a.index('--model') + 1] + '.' + a[a.index('--rank') + 1], 'w').write(' '.join(a[1:])); "
        "open(a[a.index('--ready-file') + 1], 'w').close() if '--ready-file' in a else None; "
        "time.sleep(60)"
    )
    launcher = WorkerLauncher([sys.executable, "-c", script], extra_args=["--timeout-s", "9"])
    hostfile = tmp_path / "h.json"

    def launch(epoch: int, rank: int) -> WorkerLaunch:
        return WorkerLaunch(epoch, rank, 2, str(out), ((0, 1), (1, 2)), hostfile, ("a:1", "b:1"), ("n0", "n1"))

    def until(what: str, check) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    launcher.restart(launch(1, 1))
    assert launcher.wait_settled(30)
    until("the first worker is ready", lambda: launcher.status()["state"] == "ready")  # type: ignore[index]
    first = launcher.status()["pid"]  # type: ignore[index]
    launcher.restart(launch(2, 1))
    assert launcher.wait_settled(30)
    with pytest.raises(ProcessLookupError):  # the old epoch's worker was stopped (and reaped)
        os.kill(first, 0)  # type: ignore[arg-type]
    until("the second worker is ready", lambda: launcher.status()["state"] == "ready")  # type: ignore[index]
    line = (tmp_path / "out.1").read_text()
    assert f"--ranges 0:1,1:2 --hostfile {hostfile} --rank 1 --timeout-s 9 --ready-file " in line
    assert line.endswith(f"--parent-pid {os.getpid()}")
    st = launcher.status()
    assert st is not None and st["running"] is True and st["dry_run"] is False and st["epoch"] == 2
    assert st["ranges"] == [[0, 1], [1, 2]] and st["node_ids"] == ["n0", "n1"]
    os.kill(st["pid"], 9)  # type: ignore[arg-type]
    until("a dead worker is lost", lambda: launcher.status()["state"] == "lost")  # type: ignore[index]
    assert "exited with code -9" in str(launcher.status()["error"])  # type: ignore[index]
    launcher.stop()
    assert launcher.status() is None


def test_ring_ports_step_per_epoch_and_wrap() -> None:
    from omlx.cluster.launcher import NUM_RING_PORTS, ring_port

    assert ring_port(8480, 0) == 8480 and ring_port(8480, 1) == 8481
    assert ring_port(8480, NUM_RING_PORTS) == 8480
    assert len({ring_port(8480, e) for e in range(NUM_RING_PORTS)}) == NUM_RING_PORTS

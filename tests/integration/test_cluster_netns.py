"""Cluster control plane across real network namespaces on one bridge (one machine, several hosts).

Node 0 runs `omlx serve --cluster` (rank 0, serves HTTP, plans SmolLM2); nodes 1 and 2 run
`omlx cluster join`; nobody is given a peer, so they can only find each other over mDNS across
the bridge. Then: a node with the wrong secret is refused (and logged), node 2 is killed (SIGKILL,
no goodbye) and the rest move to a new epoch with a plan without it, and a separate 2-node cluster
joins through static peers with mDNS off. Needs root (ip netns); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omlx.cluster.launcher import ring_port
from tests.helpers import default_model_dir
from tests.netns import BridgedNamespaces, bridge_netns_unavailable

SECRET = "omlx-test-cluster-secret"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0
PY = sys.executable


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = bridge_netns_unavailable()
    if reason:
        pytest.skip(f"cluster namespaces unavailable: {reason}")
    model = default_model_dir()
    net = BridgedNamespaces(4)
    try:
        yield Cluster(net, tmp_path_factory.mktemp("cluster"), model)
    finally:
        net.close()


class Cluster:
    """The nodes' homes, logs and processes, and `omlx cluster status` inside a namespace."""

    # the control plane only (test_cluster_serving_netns runs workers)
    extra_cluster_settings = "start_workers = false\n"

    def __init__(self, net: BridgedNamespaces, root: Path, model: Path) -> None:
        self.net, self.root, self.model = net, root, model
        self.procs: dict[int, Any] = {}

    def home(self, i: int) -> Path:
        home = self.root / f"node{i}"
        if not home.exists():
            home.mkdir()
            (home / "config.toml").write_text(
                "[cluster]\n"
                f"heartbeat_interval_s = {HEARTBEAT_INTERVAL_S}\n"
                f"heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\n"
                + self.extra_cluster_settings
            )
        return home

    def log(self, i: int) -> str:
        try:
            return (self.root / f"node{i}.log").read_text()
        except OSError:
            return ""

    def node_id(self, i: int) -> str:
        return (self.home(i) / "cluster" / "node_id").read_text().strip()

    def start(self, i: int, args: list[str], secret: str = SECRET) -> None:
        env = {"OMLX_LOG_LEVEL": "INFO", "COLUMNS": "200"}
        if args[:1] == ["serve"]:
            cmd = [PY, "-m", "omlx", "serve", "--base-path", str(self.home(i)), "--cluster-secret", secret,
                   "--no-ssd-cache", *args[1:]]
        else:
            cmd = [PY, "-m", "omlx", "cluster", "join", "--base-path", str(self.home(i)), "--secret", secret, *args]
        self.procs[i] = self.net.popen(i, cmd, self.root / f"node{i}.log", env=env)

    def kill(self, i: int) -> None:
        proc = self.procs.pop(i)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def cli(self, i: int, *args: str, check: bool = True) -> Any:
        r = self.net.run(i, [PY, "-m", "omlx", "cluster", *args, "--base-path", str(self.home(i)),
                             "--secret", SECRET], timeout_s=60, env={"COLUMNS": "200"})
        if check:
            assert r.returncode == 0, f"omlx cluster {' '.join(args)}: {r.stdout}\n{r.stderr}\n{self.log(i)[-3000:]}"
        return r

    def status(self, i: int) -> dict[str, Any]:
        return json.loads(self.cli(i, "status", "--json").stdout)

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float, nodes: list[int]) -> float:
        """Poll ``check`` until true; returns the seconds it took. Fails with the nodes' logs."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if check():
                return time.monotonic() - t0
            time.sleep(0.25)
        logs = "\n".join(f"--- node {i} ---\n{self.log(i)[-4000:]}" for i in nodes)
        pytest.fail(f"{what}: not within {timeout_s:g} s\n{logs}")


def _members(st: dict[str, Any]) -> list[str]:
    return sorted(m["node_id"] for m in st["members"])


def _silence_s(events: list[str], node_id: str) -> float:
    """How long the agent had not heard from ``node_id`` when it dropped it (from its event)."""
    found = [e for e in events if node_id in e and "left" in e and "silent for" in e]
    assert found, events
    return float(found[-1].rsplit("silent for ", 1)[1].split(" s")[0])


# The agent drops a member at most one interval + one timeout after its last reply; the slack
# covers a loaded 2-core CI machine. Polling deadlines are wider: each status call is a new process.
MAX_SILENCE_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S + 2.0
POLL_DEADLINE_S = 60.0


def test_three_nodes_find_each_other_over_mdns_and_join(lan: Cluster) -> None:
    lan.start(0, ["serve", "--cluster", "--model", str(lan.model)])
    lan.start(1, ["--memory-cap", "3GB"])
    lan.start(2, [])

    def all_joined() -> bool:
        if not all((lan.home(i) / "cluster" / "node_id").exists() for i in range(3)):
            return False
        ids = sorted(lan.node_id(i) for i in range(3))
        try:
            return all(_members(lan.status(i)) == ids for i in range(3))
        except (AssertionError, json.JSONDecodeError):
            return False  # an agent not listening yet

    lan.wait_for("3 members on every node", all_joined, 180, [0, 1, 2])
    for i in range(3):
        assert "over mDNS" in lan.log(i), lan.log(i)[-3000:]  # no --peer was given to anyone
    st = lan.status(0)
    me = next(m for m in st["members"] if m["self"])
    assert me["http_port"] > 0 and st["coordinator"] == lan.node_id(0)
    for m in st["members"]:  # measured at join, shared by heartbeats
        assert m["stream_rate_bytes_s"] > 0 and m["backend"] == "cpu" and m["available_bytes"] > 0
        assert len(m["links"]) == 2, m
        assert all(v["bandwidth_bytes_s"] > 0 and v["latency_s"] > 0 for v in m["links"].values())
        assert m["addresses"][0].startswith(BridgedNamespaces.SUBNET)


def test_the_plan_spans_the_nodes_and_every_node_shows_it(lan: Cluster) -> None:
    ids = [lan.node_id(i) for i in range(3)]

    def settled() -> bool:
        sts = [lan.status(i) for i in range(3)]
        return all(s["plan"] and s["plan_epoch"] == sts[0]["epoch"] and len(s["plan"]["stages"]) == 3 for s in sts)

    lan.wait_for("one plan over the 3 nodes in the current epoch", settled, POLL_DEADLINE_S, [0, 1, 2])
    st = lan.status(0)
    stages = st["plan"]["stages"]
    assert stages[0]["node_id"] == ids[0]  # rank 0 serves HTTP
    assert stages[0]["layer_start"] == 0 and stages[-1]["layer_end"] == 30
    assert all(a["layer_end"] == b["layer_start"] for a, b in zip(stages, stages[1:]))
    assert all(s["total_bytes"] <= s["cap_bytes"] for s in stages)
    capped = next(s for s in stages if s["node_id"] == ids[1])
    assert capped["cap_bytes"] == 3 * 10**9 - 2 * 10**9  # --memory-cap 3GB minus the default headroom
    for i in range(3):
        other = lan.status(i)
        assert other["plan"] == st["plan"] and other["plan_epoch"] == st["plan_epoch"]
        worker = other["worker"]
        rank = [s["node_id"] for s in stages].index(ids[i])
        assert worker["rank"] == rank and worker["num_ranks"] == 3 and worker["dry_run"] is True
        ranges = ",".join(f"{s['layer_start']}:{s['layer_end']}" for s in stages)
        assert f"omlx cluster worker --model {lan.model} --ranges {ranges}" in worker["command"]
        hostfile = json.loads(Path(worker["hostfile"]).read_text())
        port = ring_port(8480, other["plan_epoch"])
        assert hostfile == [[f"{BridgedNamespaces.SUBNET}.{10 + ids.index(s['node_id'])}:{port}"] for s in stages]
    text = lan.cli(0, "status").stdout
    assert f"plan (epoch {st['plan_epoch']})" in text and "predicted step" in text and ids[2] in text
    preview = lan.cli(0, "plan", str(lan.model)).stdout
    assert "predicted step" in preview and ids[1] in preview


def test_a_node_without_the_secret_is_refused_and_logged(lan: Cluster) -> None:
    before = lan.status(0)
    lan.start(3, [], secret="not-the-cluster-secret")
    lan.wait_for("the intruder is refused", lambda: "refused to let us join" in lan.log(3), 60, [0, 3])
    intruder = f"{BridgedNamespaces.SUBNET}.13"
    lan.wait_for("the refusal is logged", lambda: f"refused control connection from {intruder}" in lan.log(0), 30, [0, 3])
    after = lan.status(0)
    assert _members(after) == _members(before) and after["epoch"] == before["epoch"]
    lan.kill(3)


def test_killing_a_node_starts_a_new_epoch_and_replans_onto_the_rest(lan: Cluster) -> None:
    gone = lan.node_id(2)
    before = lan.status(0)
    lan.kill(2)
    lan.wait_for("node 0 drops the killed node", lambda: gone not in _members(lan.status(0)), POLL_DEADLINE_S, [0, 1])
    st = lan.status(0)
    assert st["epoch"] > before["epoch"]
    silence = _silence_s(st["events"], gone)
    print(f"killed node dropped after {silence:.2f} s of silence (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)")
    assert silence <= MAX_SILENCE_S

    agreed: set[int] = set()

    def replanned() -> bool:
        # Both nodes hold a plan for the epoch they are both in.
        sts = [lan.status(i) for i in (0, 1)]
        epochs = {s["epoch"] for s in sts} | {s["plan_epoch"] for s in sts}
        agreed.clear()
        agreed.update(epochs)
        return all(s["plan"] for s in sts) and len(epochs) == 1 and epochs.pop() >= st["epoch"]

    lan.wait_for("a plan for the new epoch on both nodes", replanned, POLL_DEADLINE_S, [0, 1])
    # ... and it is the epoch that dropped the node: a node that adopts a peer's newer epoch drops
    # the members that peer no longer lists (and it no longer reaches) in that same epoch, so the
    # loss costs one epoch and one plan, not two.
    assert agreed == {st["epoch"]}, (agreed, st["epoch"], lan.status(1)["events"])
    plan = lan.status(1)["plan"]
    assert [s["node_id"] for s in plan["stages"]] == [lan.node_id(0), lan.node_id(1)]
    assert plan["stages"][-1]["layer_end"] == 30


def test_a_paused_node_times_out_then_rejoins_in_a_new_epoch(lan: Cluster) -> None:
    """SIGSTOP keeps the node's sockets open: only the heartbeat timeout can notice it."""
    paused = lan.node_id(1)
    before = lan.status(0)
    assert paused in _members(before)
    os.killpg(lan.procs[1].pid, signal.SIGSTOP)
    dropped_epoch = None
    try:
        lan.wait_for("node 0 drops the paused node", lambda: paused not in _members(lan.status(0)),
                     POLL_DEADLINE_S, [0])
        st = lan.status(0)
        assert any(paused in e and "no heartbeat reply" in e for e in st["events"]), st["events"]
        silence = _silence_s(st["events"], paused)
        print(f"paused node dropped after {silence:.2f} s of silence (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)")
        assert silence <= MAX_SILENCE_S
        assert st["epoch"] > before["epoch"]
        assert [s["node_id"] for s in st["plan"]["stages"]] == [lan.node_id(0)] and st["plan_epoch"] == st["epoch"]
        dropped_epoch = st["epoch"]
    finally:
        os.killpg(lan.procs[1].pid, signal.SIGCONT)
    assert dropped_epoch is not None

    def rejoined() -> bool:
        st = lan.status(0)
        return (paused in _members(st) and st["epoch"] > dropped_epoch and st["plan_epoch"] == st["epoch"]
                and len(st["plan"]["stages"]) == 2)

    lan.wait_for("the resumed node rejoins and is planned again", rejoined, POLL_DEADLINE_S, [0, 1])


def test_two_nodes_join_through_static_peers_without_mdns(lan: Cluster) -> None:
    """A separate cluster in namespaces 2 and 3: mDNS off, a static --peer each."""
    other_secret = "second-cluster-secret"
    a, b = f"{BridgedNamespaces.SUBNET}.12:8470", f"{BridgedNamespaces.SUBNET}.13:8470"
    for i in (2, 3):
        home = lan.home(i)
        (home / "cluster" / "secret").unlink(missing_ok=True)
    lan.start(2, ["--no-mdns", "--peer", b, "--model", str(lan.model)], secret=other_secret)
    lan.start(3, ["--no-mdns", "--peer", a], secret=other_secret)

    def joined() -> bool:
        r = lan.net.run(2, [PY, "-m", "omlx", "cluster", "status", "--json", "--base-path", str(lan.home(2)),
                         "--secret", other_secret],
                        timeout_s=60)
        if r.returncode != 0:
            return False
        st = json.loads(r.stdout)
        return len(st["members"]) == 2 and bool(st["plan"]) and st["plan_epoch"] == st["epoch"]

    lan.wait_for("the static pair joins and plans", joined, 60, [2, 3])
    assert "over mDNS" not in lan.log(2) + lan.log(3)
    assert lan.node_id(2) not in _members(lan.status(0))  # the first cluster never saw them
    r = lan.net.run(3, [PY, "-m", "omlx", "cluster", "leave", "--base-path", str(lan.home(3)),
                        "--secret", other_secret], timeout_s=60)
    assert r.returncode == 0, r.stderr
    lan.wait_for("node 3 leaves cleanly", lambda: lan.procs[3].poll() is not None, 30, [3])
    assert lan.procs[3].returncode == 0

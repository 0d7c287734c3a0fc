"""The node agent: joins peers, heartbeats them, keeps the epoch, plans and restarts workers.

Owns the control-plane loop of one node, on one asyncio loop: it listens on the control port
(``omlx.cluster.control``), advertises and browses (``omlx.cluster.discovery``) and dials static
peers, measures every new link, heartbeats every member, and on a membership change moves to a
new epoch; the coordinator (``Membership.coordinator_id``) then plans the model over the members'
measured figures and announces the plan, and every node hands its rank to the worker launcher.
Must not import sanic or mlx (the streaming probe is measured by the caller, before the loop).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omlx.cluster.control import (
    Connection,
    ControlServer,
    connect,
    measure_link,
)
from omlx.cluster.discovery import DEFAULT_CONTROL_PORT, Discovery, NodeInfo, cluster_dir
from omlx.cluster.launcher import WorkerLaunch, WorkerLauncher, free_loopback_port, ring_port, write_hostfile
from omlx.cluster.membership import Member, Membership
from omlx.cluster.plan import (
    Plan,
    PlanRequest,
    Stage,
    format_plan_table,
    plan_pipeline,
)
from omlx.config_values import parse_peer
from omlx.errors import AuthError, ClusterError, ControlError
from omlx.units import format_rate

logger = logging.getLogger(__name__)

_DIAL_PERIOD_S = 1.0
_AUTH_RETRY_S = 10.0
_NUM_EVENTS = 50
_MAX_RESTART_BACKOFF_S = 60.0


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What one agent needs (built by the CLI from ``ClusterConfig`` and the serve flags).

    Attributes:
        secret: Shared cluster secret (bytes, >= 8).
        control_host: Address the control channel binds (``0.0.0.0`` = all).
        control_port: Its port (0 = any free port; the bound one is advertised).
        peers: Static peers ``host:port`` dialled without mDNS.
        mdns: Advertise and browse ``_omlx._tcp`` over zeroconf.
        heartbeat_interval_s: Period of heartbeats to every member.
        heartbeat_timeout_s: A member that does not answer a heartbeat within this has left.
        model_path: Model folder to plan for; None = no plan until one is set.
        context_tokens: KV reserve per sequence the plan leaves room for.
        max_concurrent: Sequences decoded together (the plan's batch).
        headroom_bytes: Bytes each node keeps free.
        worker_port: First ring port; epoch E's ring uses ``ring_port(worker_port, E)``.
    """

    secret: bytes
    control_host: str = "0.0.0.0"
    control_port: int = 8470
    peers: tuple[str, ...] = ()
    mdns: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    model_path: str | None = None
    context_tokens: int = 4096
    max_concurrent: int = 8
    headroom_bytes: int = 2 * 10**9
    worker_port: int = 8480


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "stages": [asdict(s) for s in plan.stages],
        "predicted_step_s": plan.predicted_step_s,
        "unused_node_ids": list(plan.unused_node_ids),
    }


def plan_from_dict(d: dict[str, Any]) -> Plan:
    """Inverse of ``plan_to_dict``.

    Raises:
        ValueError: Not a plan.
    """
    try:
        return Plan(
            stages=[Stage(**s) for s in d["stages"]],
            predicted_step_s=float(d["predicted_step_s"]),
            unused_node_ids=[str(i) for i in d.get("unused_node_ids", [])],
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed plan: {e}") from e


def plan_for(model_path: str, membership: Membership, settings: AgentSettings) -> Plan:
    """Plan ``model_path`` over the members' measured figures (stage order: ``Membership.ordered``).

    Raises:
        PlanError: It does not fit (the message says by how much).
        FileNotFoundError, ValueError: The model folder cannot be read.
    """
    from omlx.cluster.layer_bytes import activation_bytes_per_token, read_layout

    layout = read_layout(model_path)
    request = PlanRequest(
        context_tokens=settings.context_tokens,
        max_concurrent=settings.max_concurrent,
        activation_bytes_per_token=activation_bytes_per_token(model_path),
    )
    return plan_pipeline(layout, membership.node_specs(headroom_bytes=settings.headroom_bytes), request)


@dataclass
class _Peer:
    node_id: str
    address: tuple[str, int]
    conn: Connection
    link_measured: bool = False


class NodeAgent:
    """One node's control plane. Create, ``await start()``, then ``await wait_stopped()``.

    Args:
        settings: Agent settings.
        info: This node's NodeInfo (control_port is replaced by the bound port).
        base_dir: omlx's home; hostfiles go to ``<base>/cluster``.
        stream_rate_bytes_s: This node's measured weight-streaming rate (``measure_stream_rate``).
        launcher: Starts this node's worker per plan; default: a dry-run launcher.
    """

    def __init__(
        self,
        settings: AgentSettings,
        info: NodeInfo,
        base_dir: Path,
        stream_rate_bytes_s: float,
        launcher: WorkerLauncher | None = None,
    ) -> None:
        self.settings = settings
        self.info = info
        self.base_dir = base_dir
        self.launcher = launcher or WorkerLauncher(None)
        self.membership = Membership(self_id=info.node_id)
        me = self.membership.me
        me.http_port = info.http_port
        me.available_bytes = info.available_bytes
        me.memory_cap_bytes = info.memory_cap_bytes
        me.stream_rate_bytes_s = stream_rate_bytes_s
        me.info = info.to_dict()
        me.model_path = settings.model_path
        self.model_path = settings.model_path  # the model of the plan in force (adopted or own)
        self.plan: Plan | None = None
        self.plan_epoch = -1
        self.plan_error: str | None = None
        self.plan_from: str | None = None  # the coordinator that announced the plan in force
        self._departed: set[str] = set()  # members that left (heartbeat loss or goodbye)
        self.left_reasons: dict[str, str] = {}  # node id -> why it left (last time), for errors
        self._restart_backoff_s = 0.0  # grows while restarted pipelines keep failing
        # node id -> its worker as its heartbeats report it: (epoch, state, error, since_s), since_s
        # = monotonic time this agent first heard that state (a follower's crash is seen idle).
        self.peer_workers: dict[str, tuple[int, str, str | None, float]] = {}
        self.events: collections.deque[str] = collections.deque(maxlen=_NUM_EVENTS)
        self._peers: dict[str, _Peer] = {}
        self._known: dict[str, tuple[str, int]] = {}  # node id -> control address (mDNS/inbound)
        self._static = [parse_peer(p, DEFAULT_CONTROL_PORT) for p in settings.peers]
        self._self_addresses: set[tuple[str, int]] = set()
        self._dialing: set[tuple[str, int]] = set()
        self._refused_until: dict[tuple[str, int], float] = {}
        self._server: ControlServer | None = None
        self._discovery: Discovery | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self._started_s = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen, advertise, and start dialling and heartbeating.

        Raises:
            OSError: The control port cannot be bound.
        """
        self._server = ControlServer(
            secret=self.settings.secret,
            node_id=self.info.node_id,
            info=lambda: self.info.to_dict(),
            handler=self._handle,
            on_connect=self._on_inbound,
        )
        port = await self._server.start(self.settings.control_host, self.settings.control_port)
        self.info = NodeInfo.from_dict({**self.info.to_dict(), "control_port": port})
        self.membership.me.info = self.info.to_dict()
        self._self_addresses = {(a, port) for a in (*self.info.addresses, "127.0.0.1", "localhost")}
        self._event(f"node {self.info.node_id} started on port {port} (epoch {self.membership.epoch})")
        logger.info("cluster agent %s listening on %s:%d", self.info.node_id, self.settings.control_host, port)
        if self.settings.mdns:
            self._discovery = Discovery(self.info, on_peer=self._on_discovered, on_gone=self._on_gone)
            try:
                await self._discovery.start()
            except OSError as e:
                logger.warning("mDNS discovery is off (%s): only static peers (--peer) will be found", e)
                self._discovery = None
        self._spawn(self._dial_loop())
        self._spawn(self._heartbeat_loop())
        self._replan()

    async def stop(self, *, announce: bool = True) -> None:
        """Leave: tell the members (``leaving``), stop advertising, close every connection."""
        if self._stopped.is_set():
            return
        if announce:
            await asyncio.gather(
                *(self._send_quiet(p, {"type": "leaving", "node_id": self.info.node_id}) for p in list(self._peers.values()))
            )
        current = asyncio.current_task()
        for t in list(self._tasks):
            if t is not current:
                t.cancel()
        if self._discovery is not None:
            await self._discovery.stop()
        for p in list(self._peers.values()):
            await p.conn.close()
        self._peers.clear()
        if self._server is not None:
            await self._server.stop()
        self.launcher.stop()
        self._stopped.set()
        logger.info("cluster agent %s stopped", self.info.node_id)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _event(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    # ------------------------------------------------------------------ joining

    def _on_discovered(self, info: NodeInfo) -> None:
        if info.node_id == self.info.node_id or not info.addresses:
            return
        addr = (info.addresses[0], info.control_port)
        if self._known.get(info.node_id) != addr:
            logger.info("discovered node %s at %s:%d over mDNS", info.node_id, *addr)
        self._known[info.node_id] = addr

    def _on_gone(self, node_id: str) -> None:
        # Its mDNS goodbye: stop dialling it (heartbeats decide whether a member left).
        if node_id not in self._peers:
            self._known.pop(node_id, None)

    def _on_inbound(self, conn: Connection) -> None:
        if conn.peer_info is None:
            return  # a CLI client
        try:
            info = NodeInfo.from_dict(conn.peer_info)
        except ValueError:
            return
        if info.addresses and info.node_id not in self._known:
            self._known[info.node_id] = (info.addresses[0], info.control_port)

    async def _dial_loop(self) -> None:
        while True:
            now = time.monotonic()
            targets = set(self._static)
            targets |= {a for nid, a in self._known.items() if nid not in self._peers}
            connected = {p.address for p in self._peers.values()}
            for addr in targets - connected - self._dialing - self._self_addresses:
                if self._refused_until.get(addr, 0.0) > now:
                    continue
                self._dialing.add(addr)
                self._spawn(self._dial(addr))
            await asyncio.sleep(_DIAL_PERIOD_S)

    async def _dial(self, addr: tuple[str, int]) -> None:
        try:
            try:
                conn = await connect(
                    addr[0],
                    addr[1],
                    secret=self.settings.secret,
                    node_id=self.info.node_id,
                    info=self.info.to_dict(),
                    timeout_s=self.settings.heartbeat_timeout_s,
                )
            except AuthError as e:
                logger.error("cannot join %s:%d: %s", addr[0], addr[1], e)
                self._event(f"refused by {addr[0]}:{addr[1]}: {e}")
                self._refused_until[addr] = time.monotonic() + _AUTH_RETRY_S
                return
            except ControlError as e:
                logger.debug("dial %s:%d: %s", addr[0], addr[1], e)
                return
            if conn.peer_id == self.info.node_id:
                self._self_addresses.add(addr)
                await conn.close()
                return
            if conn.peer_id in self._peers:
                await conn.close()
                return
            peer = _Peer(conn.peer_id, addr, conn)
            self._peers[conn.peer_id] = peer
            self._known[conn.peer_id] = addr
            info = conn.peer_info or {}
            member = Member(
                node_id=conn.peer_id,
                http_port=int(info.get("http_port", 0) or 0),
                available_bytes=int(info.get("available_bytes", 0) or 0),
                memory_cap_bytes=int(info.get("memory_cap_bytes", 0) or 0),
                last_seen_s=time.monotonic(),
                info=dict(info),
            )
            try:
                figs = await measure_link(conn, timeout_s=self.settings.heartbeat_timeout_s * 3)
            except ControlError as e:
                await self._lost(peer, f"link probe failed: {e}")
                return
            self.membership.me.links[conn.peer_id] = (figs.bandwidth_bytes_s, figs.latency_s)
            peer.link_measured = True
            logger.info(
                "link to %s: %.2f ms one-way, %s",
                conn.peer_id,
                figs.latency_s * 1e3,
                format_rate(figs.bandwidth_bytes_s, "MB", 0),
            )
            # One heartbeat first, so the member arrives with its streaming rate and links.
            try:
                reply = await conn.request(
                    {"type": "heartbeat", "node_id": self.info.node_id, **self._figures()},
                    self.settings.heartbeat_timeout_s,
                )
            except ControlError as e:
                await self._lost(peer, f"no heartbeat reply after the link probe ({e})")
                return
            # The coordinator may have announced this node in the current epoch's plan already.
            announced = (
                self.plan is not None
                and self.plan_epoch == self.membership.epoch
                and conn.peer_id in {s.node_id for s in self.plan.stages} | set(self.plan.unused_node_ids)
            )
            joined = self.membership.join(member, new_epoch=not announced)
            self._apply_figures(conn.peer_id, reply)
            if joined:
                self._event(f"epoch {self.membership.epoch}: node {conn.peer_id} joined from {addr[0]}:{addr[1]}")
                self._replan()
        finally:
            self._dialing.discard(addr)

    # ------------------------------------------------------------------ heartbeats

    def _figures(self) -> dict[str, Any]:
        me = self.membership.me
        try:
            import psutil

            me.available_bytes = int(psutil.virtual_memory().available)
        except Exception:  # psutil is a dependency; a transient read error keeps the last figure
            pass
        return {
            "epoch": self.membership.epoch,
            "http_port": me.http_port,
            "available_bytes": me.available_bytes,
            "memory_cap_bytes": me.memory_cap_bytes,
            "stream_rate_bytes_s": me.stream_rate_bytes_s,
            "links": {k: list(v) for k, v in me.links.items()},
            "model_path": me.model_path,
            "members": sorted(self.membership.members),
            "worker": self._worker_report(),
        }

    def _worker_report(self) -> dict[str, Any] | None:
        """This node's worker for heartbeats: the coordinator restarts a pipeline whose follower
        worker failed while idle (no request would notice until the next one)."""
        st = self.launcher.status()
        if st is None or st["dry_run"]:
            return None
        return {"epoch": st["epoch"], "state": st["state"], "error": st["error"]}

    def _apply_figures(self, node_id: str, figs: dict[str, Any]) -> None:
        m = self.membership.members.get(node_id)
        if m is None:
            return
        try:
            self._apply_figures_to(m, figs)
        except (TypeError, ValueError, IndexError, KeyError) as e:
            logger.warning("ignoring malformed figures from %s: %s", node_id, e)

    def _apply_figures_to(self, m: Member, figs: dict[str, Any]) -> None:
        m.http_port = int(figs.get("http_port", m.http_port) or 0)
        m.available_bytes = int(figs.get("available_bytes", m.available_bytes) or 0)
        m.memory_cap_bytes = int(figs.get("memory_cap_bytes", m.memory_cap_bytes) or 0)
        m.stream_rate_bytes_s = float(figs.get("stream_rate_bytes_s", 0.0) or 0.0)
        links = figs.get("links") or {}
        if isinstance(links, dict):
            m.links = {str(k): (float(v[0]), float(v[1])) for k, v in links.items()}
        model = figs.get("model_path")
        m.model_path = str(model) if model else None
        worker = figs.get("worker")
        if isinstance(worker, dict):
            report = (int(worker["epoch"]), str(worker["state"]), worker.get("error"))
            known = self.peer_workers.get(m.node_id)
            since = known[3] if known is not None and known[:3] == report else time.monotonic()
            self.peer_workers[m.node_id] = (*report, since)
        else:
            self.peer_workers.pop(m.node_id, None)
        ids = figs.get("members")
        if self._adopt_epoch(int(figs.get("epoch", 0) or 0), [str(i) for i in ids] if isinstance(ids, list) else None,
                             m.node_id):
            # Another node saw a membership change: the coordinator announces a plan for it,
            # so every node converges on one plan per epoch.
            self._replan()

    def _adopt_epoch(self, epoch: int, member_ids: list[str] | None, sender: str) -> bool:
        """Move up to ``sender``'s newer epoch; a member it no longer lists that is silent here
        too, or whose connection here has closed, leaves in that epoch (``Membership.adopt_epoch``)
        instead of costing one more epoch when this node's own heartbeat notices. True when the
        epoch went up."""
        before = self.membership.epoch
        s = self.settings
        closed = [p.node_id for p in self._peers.values() if p.conn.closed]
        gone = self.membership.adopt_epoch(epoch, member_ids, now_s=time.monotonic(), unreachable=closed,
                                           silent_s=max(2 * s.heartbeat_interval_s, s.heartbeat_timeout_s / 2))
        for node_id in gone:
            why = "its connection here has closed" if node_id in closed else "it is silent here too"
            reason = f"node {sender} no longer lists it in epoch {epoch}, and {why}"
            self._departed.add(node_id)
            self._record_left(node_id, reason)
            self._event(f"epoch {epoch}: node {node_id} left: {reason}")
            peer = self._peers.pop(node_id, None)
            if peer is not None:  # the dial loop keeps trying its address, as after a lost heartbeat
                self._spawn(peer.conn.close())
        return self.membership.epoch > before

    async def _heartbeat(self, peer: _Peer) -> None:
        try:
            reply = await peer.conn.request(
                {"type": "heartbeat", "node_id": self.info.node_id, **self._figures()},
                self.settings.heartbeat_timeout_s,
            )
        except ControlError as e:
            await self._lost(peer, f"no heartbeat reply within {self.settings.heartbeat_timeout_s:g} s ({e})")
            return
        self.membership.seen(peer.node_id, time.monotonic())
        self._apply_figures(peer.node_id, reply)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            self._check_pipeline()
            peers = [p for p in self._peers.values() if p.node_id in self.membership.members]
            for p, result in zip(peers, await asyncio.gather(*(self._heartbeat(p) for p in peers), return_exceptions=True)):
                if isinstance(result, Exception):  # a bug must not stop the heartbeats to the rest
                    logger.error("heartbeat to %s failed: %r", p.node_id, result)
            # Members we only hear from inbound (no outbound link yet) expire on silence.
            for node_id in self.membership.expired(time.monotonic(), self.settings.heartbeat_timeout_s * 2):
                if node_id not in self._peers and self.membership.leave(node_id, "silent"):
                    self._record_left(node_id, "silent")
                    self._event(f"epoch {self.membership.epoch}: node {node_id} left (silent)")
                    self._replan()

    def _record_left(self, node_id: str, reason: str) -> None:
        self.left_reasons[node_id] = reason

    def lost_worker(self) -> tuple[str, str] | None:
        """(node id, error) of a member of the plan in force whose worker its agent reports lost
        in this epoch (its heartbeats carry it), else None. This node's own worker is not included."""
        if self.plan is None or self.plan_epoch != self.membership.epoch:
            return None
        for s in self.plan.stages:
            report = self.peer_workers.get(s.node_id)
            if (s.node_id != self.info.node_id and s.node_id in self.membership.members and report is not None
                    and report[0] == self.plan_epoch and report[1] == "lost"):
                return s.node_id, str(report[2] or "its worker is lost")
        return None

    def _check_pipeline(self) -> None:
        """Coordinator: restart a pipeline that failed while every member stayed (a worker crashed
        or a step timed out on a live node): a new epoch with the same members, so every node
        restarts its worker on fresh ring ports. A follower whose agent reports its worker lost
        (heartbeats) is restarted at once, even while idle; this node's own lost worker waits one
        heartbeat timeout first (a member that died is dropped by then, and that epoch change
        re-plans anyway). Restarts that keep failing back off."""
        st = self.launcher.status()
        peer = self.lost_worker()
        if peer is None and (st is None or st["state"] == "ready"):
            if st is not None:
                self._restart_backoff_s = 0.0
            return
        if self.membership.coordinator_id != self.info.node_id or self.plan_epoch != self.membership.epoch:
            return
        if peer is not None:
            node_id, error = peer
            lost_for_s = time.monotonic() - self.peer_workers[node_id][3]
            wait_s = self._restart_backoff_s
            what = f"node {node_id}'s worker failed ({error})"
        elif st is not None and st["state"] == "lost" and st["epoch"] == self.membership.epoch:
            lost_for_s = float(st["state_for_s"])  # type: ignore[arg-type]
            wait_s = max(self.settings.heartbeat_timeout_s + self.settings.heartbeat_interval_s, self._restart_backoff_s)
            what = str(st["error"])
        else:
            return
        if lost_for_s < wait_s:
            return
        self._restart_backoff_s = min(max(2 * self._restart_backoff_s, 5.0), _MAX_RESTART_BACKOFF_S)
        reason = f"the pipeline of epoch {self.membership.epoch} failed with every member still here: {what}"
        epoch = self.membership.restart(reason)
        self._event(f"epoch {epoch}: restarting the workers ({reason})")
        self._replan()

    async def _lost(self, peer: _Peer, reason: str) -> None:
        if self._peers.get(peer.node_id) is peer:
            del self._peers[peer.node_id]
        await peer.conn.close()
        # Its address stays known: the dial loop keeps trying, so a node that was only paused or
        # cut off rejoins (in a new epoch) as soon as it answers again.
        member = self.membership.members.get(peer.node_id)
        if member is not None and member.last_seen_s > 0:
            reason = f"{reason}; silent for {time.monotonic() - member.last_seen_s:.2f} s"
        if self.membership.leave(peer.node_id, reason):
            self._departed.add(peer.node_id)
            self._record_left(peer.node_id, reason)
            self._event(f"epoch {self.membership.epoch}: node {peer.node_id} left: {reason}")
            self._replan()

    async def _send_quiet(self, peer: _Peer, msg: dict[str, Any]) -> None:
        try:
            await peer.conn.request(msg, self.settings.heartbeat_timeout_s)
        except ControlError as e:
            logger.debug("%s to %s: %s", msg.get("type"), peer.node_id, e)

    # ------------------------------------------------------------------ planning

    def _replan(self) -> None:
        """On a new epoch: the coordinator plans and announces; others wait for its plan."""
        # Own model first; a node that inherits coordination because the coordinator left
        # re-plans the model in force onto the rest.
        model_path = self.membership.me.model_path
        if model_path is None and self.plan_from in self._departed:
            model_path = self.model_path
        if self.membership.coordinator_id != self.info.node_id or model_path is None:
            return
        epoch = self.membership.epoch
        try:
            plan = plan_for(model_path, self.membership, self.settings)
        except (ClusterError, FileNotFoundError, ValueError) as e:
            self.plan, self.plan_epoch, self.plan_error = None, epoch, str(e)
            self._event(f"epoch {epoch}: no plan for {model_path}: {e}")
            logger.error("epoch %d: cannot plan %s: %s", epoch, model_path, e)
            self.launcher.restart(None)
            return
        self._adopt_plan(epoch, plan, model_path, self.info.node_id)
        msg = {"type": "plan", "epoch": epoch, "model": model_path, "plan": plan_to_dict(plan)}
        for p in list(self._peers.values()):
            self._spawn(self._send_quiet(p, msg))

    def _adopt_plan(self, epoch: int, plan: Plan, model_path: str, sender: str) -> None:
        if epoch == self.plan_epoch and self.plan == plan and self.model_path == model_path:
            return  # the same plan announced again: the running workers stay
        if sender != self.info.node_id:
            self._adopt_epoch(epoch, [st.node_id for st in plan.stages] + list(plan.unused_node_ids), sender)
        self.plan, self.plan_epoch, self.plan_error, self.model_path = plan, epoch, None, model_path
        self.plan_from = sender
        ranks = ", ".join(f"{s.node_id}[{s.layer_start},{s.layer_end})" for s in plan.stages)
        self._event(f"epoch {epoch}: plan {ranks}")
        logger.info("epoch %d: plan for %s: %s", epoch, model_path, ranks)
        self.launcher.restart(self._launch_for(epoch, plan, model_path))

    def _launch_for(self, epoch: int, plan: Plan, model_path: str) -> WorkerLaunch | None:
        mine = [s for s in plan.stages if s.node_id == self.info.node_id]
        if not mine:
            return None
        port = ring_port(self.settings.worker_port, epoch)
        ring: list[str] = []
        for s in plan.stages:
            info = self.membership.members[s.node_id].info if s.node_id in self.membership.members else {}
            addrs = [a for a in info.get("addresses", []) if not str(a).startswith("127.")]  # type: ignore[union-attr]
            host = addrs[0] if addrs else (self._known.get(s.node_id, ("127.0.0.1", 0))[0])
            ring.append(f"{host}:{port}")
        folder = cluster_dir(self.base_dir)
        for old in (*folder.glob("hostfile-epoch*.json"), *folder.glob("ready-epoch*")):
            old.unlink(missing_ok=True)
        hostfile = folder / f"hostfile-epoch{epoch}.json"
        write_hostfile(hostfile, ring)
        return WorkerLaunch(
            epoch=epoch,
            rank=mine[0].rank,
            num_ranks=len(plan.stages),
            model_path=model_path,
            ranges=tuple((s.layer_start, s.layer_end) for s in plan.stages),
            hostfile=hostfile,
            ring_addresses=tuple(ring),
            node_ids=tuple(s.node_id for s in plan.stages),
            http_port=free_loopback_port() if mine[0].rank == 0 else 0,
        )

    # ------------------------------------------------------------------ requests

    async def _handle(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any] | None:
        kind = msg["type"]
        is_member = conn.peer_info is not None
        if kind == "heartbeat" and is_member:
            self.membership.seen(conn.peer_id, time.monotonic())
            self._apply_figures(conn.peer_id, msg)
            return {"type": "heartbeat_ack", **self._figures()}
        if kind == "leaving" and is_member:
            peer = self._peers.get(conn.peer_id)
            if peer is not None:
                self._spawn(self._lost(peer, "it announced it is leaving"))
            elif self.membership.leave(conn.peer_id, "it announced it is leaving"):
                self._departed.add(conn.peer_id)
                self._record_left(conn.peer_id, "it announced it is leaving")
                self._event(f"epoch {self.membership.epoch}: node {conn.peer_id} left (leave)")
                self._replan()
            return {"type": "ok"}
        if kind == "plan" and is_member:
            epoch = int(msg.get("epoch", -1))
            # Take plans from whom this node sees as coordinator, or from a node it has not
            # joined yet (its own dial follows); never an older epoch's.
            sender_ok = (
                conn.peer_id == self.membership.coordinator_id
                or conn.peer_id not in self.membership.members
            )
            if epoch >= self.plan_epoch and sender_ok:
                self._adopt_plan(epoch, plan_from_dict(msg["plan"]), str(msg.get("model", "")), conn.peer_id)
            return {"type": "ok"}
        if kind == "status":
            return {"type": "status", "status": self.status()}
        if kind == "plan_preview":
            plan = plan_for(str(msg["model"]), self.membership, self.settings)
            return {"type": "plan", "plan": plan_to_dict(plan), "table": format_plan_table(plan)}
        if kind == "leave" and not is_member:
            self._spawn(self.stop(announce=True))
            return {"type": "ok"}
        return {"type": "error", "message": f"unknown request {kind!r}"}

    def status(self) -> dict[str, Any]:
        """Everything ``omlx cluster status`` shows (JSON-ready; bytes, bytes/s, seconds)."""
        now = time.monotonic()
        members = []
        for m in self.membership.ordered():
            members.append(
                {
                    "node_id": m.node_id,
                    "self": m.node_id == self.info.node_id,
                    "hostname": m.info.get("hostname", ""),
                    "addresses": m.info.get("addresses", []),
                    "control_port": m.info.get("control_port", 0),
                    "http_port": m.http_port,
                    "backend": m.info.get("backend", ""),
                    "device": m.info.get("device", ""),
                    "omlx_version": m.info.get("omlx_version", ""),
                    "mlx_version": m.info.get("mlx_version", ""),
                    "total_bytes": m.info.get("total_bytes", 0),
                    "available_bytes": m.available_bytes,
                    "memory_cap_bytes": m.memory_cap_bytes,
                    "stream_rate_bytes_s": m.stream_rate_bytes_s,
                    "links": {
                        k: {"bandwidth_bytes_s": v[0], "latency_s": v[1]} for k, v in m.links.items()
                    },
                    "last_seen_ago_s": None if m.node_id == self.info.node_id else round(now - m.last_seen_s, 3),
                }
            )
        return {
            "node_id": self.info.node_id,
            "epoch": self.membership.epoch,
            "coordinator": self.membership.coordinator_id,
            "heartbeat_timeout_s": self.settings.heartbeat_timeout_s,
            "members": members,
            "model": self.model_path,
            "plan_epoch": self.plan_epoch,
            "plan": plan_to_dict(self.plan) if self.plan else None,
            "plan_table": format_plan_table(self.plan) if self.plan else None,
            "plan_error": self.plan_error,
            "worker": self.launcher.status(),
            "events": list(self.events),
        }


async def request_local(
    host: str, port: int, secret: bytes, msg: dict[str, Any], timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one CLI request (status, leave, plan_preview) to an agent and return its reply.

    Raises:
        AuthError: Wrong secret.
        ControlError: No agent there, or it answered with an error.
    """
    conn = await connect(host, port, secret=secret, node_id="cli", info=None, timeout_s=timeout_s)
    try:
        return await conn.request(msg, timeout_s)
    finally:
        await conn.close()

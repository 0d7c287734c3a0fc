"""Cluster membership per epoch, and turning members into the planner's NodeSpecs.

Owns the rules: a node joins or leaves -> the epoch goes up by one (membership is fixed within an
epoch); a member not heard from within the heartbeat timeout has left; adopting a peer's newer
epoch drops, within it, the members that peer no longer lists and this node no longer hears (see
``adopt_epoch``); stage order puts HTTP-serving members first (rank 0 serves HTTP), then members
that were given a model to plan, then the rest by id; the first in that order is the coordinator
(it plans and announces plans).
Pure Python: no sockets, no clocks (callers pass ``now_s``), no mlx.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from omlx.cluster.plan import (
    DEFAULT_HEADROOM_BYTES,
    DEFAULT_LINK_BANDWIDTH_BYTES_S,
    DEFAULT_LINK_LATENCY_S,
    DEFAULT_MEM_BANDWIDTH_BYTES_S,
    NodeSpec,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    """One node of the cluster as this agent sees it.

    Attributes:
        node_id: The node's persisted id.
        http_port: > 0 when the node serves the HTTP API (it must be rank 0).
        available_bytes: Memory available there (psutil), refreshed by heartbeats.
        memory_cap_bytes: Configured cap there; 0 = none.
        stream_rate_bytes_s: Weight-streaming rate the node measured at join (bytes/s); 0 = not
            measured yet (the planner then assumes ``DEFAULT_MEM_BANDWIDTH_BYTES_S``).
        links: Peer node id -> (bandwidth_bytes_s, latency_s) the node measured to that peer.
        last_seen_s: Monotonic time of the last sign of life.
        info: The NodeInfo dict it sent (addresses, versions, device), for status.
        model_path: The model this node was asked to serve over the cluster, or None.
    """

    node_id: str
    http_port: int = 0
    available_bytes: int = 0
    memory_cap_bytes: int = 0
    stream_rate_bytes_s: float = 0.0
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_seen_s: float = 0.0
    info: dict[str, object] = field(default_factory=dict)
    model_path: str | None = None

    def link_to(self, others: Iterable[str]) -> tuple[float, float]:
        """(bandwidth_bytes_s, latency_s) of this node's slowest measured link to ``others``.

        The planner takes one outbound link per node; before the stage order is known the
        conservative figure is the worst link. Defaults when none is measured.
        """
        figs = [self.links[o] for o in others if o in self.links]
        if not figs:
            return DEFAULT_LINK_BANDWIDTH_BYTES_S, DEFAULT_LINK_LATENCY_S
        return min(f[0] for f in figs), max(f[1] for f in figs)


@dataclass
class Membership:
    """The members of the current epoch.

    Attributes:
        self_id: This node's id (always a member).
        epoch: Bumped by one on every join or leave; never goes down.
        members: Node id -> Member, this node included.
    """

    self_id: str
    epoch: int = 0
    members: dict[str, Member] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.members.setdefault(self.self_id, Member(node_id=self.self_id))

    @property
    def me(self) -> Member:
        return self.members[self.self_id]

    def join(self, member: Member, *, new_epoch: bool = True) -> bool:
        """Add ``member``; True when it was not a member yet (and then the epoch goes up by one,
        unless ``new_epoch`` is False: the current epoch, announced by the coordinator, already
        counts this node). A known member's figures are refreshed without a new epoch.
        """
        known = self.members.get(member.node_id)
        if known is not None:
            known.http_port = member.http_port
            known.available_bytes = member.available_bytes
            known.memory_cap_bytes = member.memory_cap_bytes
            known.last_seen_s = max(known.last_seen_s, member.last_seen_s)
            if member.info:
                known.info = member.info
            if member.stream_rate_bytes_s:
                known.stream_rate_bytes_s = member.stream_rate_bytes_s
            known.links.update(member.links)
            known.model_path = member.model_path or known.model_path
            return False
        self.members[member.node_id] = member
        if new_epoch:
            self.epoch += 1
        logger.info("node %s joined: epoch %d, %d members", member.node_id, self.epoch, len(self.members))
        return True

    def leave(self, node_id: str, reason: str) -> bool:
        """Drop ``node_id``; True (and the epoch goes up) when it was a member. Never drops self."""
        if node_id == self.self_id or node_id not in self.members:
            return False
        self._drop(node_id)
        self.epoch += 1
        logger.warning(
            "node %s left the cluster (%s): epoch %d, %d members", node_id, reason, self.epoch, len(self.members)
        )
        return True

    def restart(self, reason: str) -> int:
        """Start a new epoch with the same members (their pipeline failed while every member
        stayed); returns the new epoch."""
        self.epoch += 1
        logger.warning("epoch %d: same %d members, new pipeline (%s)", self.epoch, len(self.members), reason)
        return self.epoch

    def seen(self, node_id: str, now_s: float) -> None:
        """Record a sign of life (a heartbeat reply or request) from ``node_id``."""
        m = self.members.get(node_id)
        if m is not None:
            m.last_seen_s = max(m.last_seen_s, now_s)

    def _drop(self, node_id: str) -> None:
        del self.members[node_id]
        for m in self.members.values():
            m.links.pop(node_id, None)

    def adopt_epoch(
        self,
        epoch: int,
        member_ids: Iterable[str] | None = None,
        *,
        now_s: float = 0.0,
        silent_s: float = 0.0,
        unreachable: Iterable[str] = (),
    ) -> list[str]:
        """Move up to an epoch another node announced (epochs never go down).

        When the announcer's members of that epoch are given, a member of ours it does not list,
        and that this node has not heard from for more than ``silent_s`` seconds or whose
        connection to this node has closed (``unreachable``), is dropped into that epoch (no
        epoch of its own): the announcer saw it leave first, and dropping it later would cost
        every node one more epoch and one more worker restart. A member we still hear from
        stays (it may have just joined us, or be cut off only from the announcer); its own
        heartbeats decide.

        Args:
            epoch: The announced epoch.
            member_ids: The announcer's member ids in ``epoch``; None: adopt the number only.
            now_s: Monotonic time now (seconds).
            silent_s: Silence (seconds since ``last_seen_s``) after which an unlisted member is
                dropped.
            unreachable: Ids of members whose connection to this node has closed.

        Returns:
            The ids dropped, sorted (empty when ``epoch`` is not newer than ours).
        """
        if epoch <= self.epoch:
            return []
        self.epoch = epoch
        if member_ids is None:
            return []
        listed, closed = set(member_ids), set(unreachable)
        gone = sorted(
            m.node_id
            for m in self.members.values()
            if m.node_id != self.self_id
            and m.node_id not in listed
            and (now_s - m.last_seen_s > silent_s or m.node_id in closed)
        )
        for node_id in gone:
            self._drop(node_id)
        if gone:
            logger.warning("epoch %d: %s left (the node announcing the epoch no longer lists them): %d members",
                           self.epoch, ", ".join(gone), len(self.members))
        return gone

    def expired(self, now_s: float, timeout_s: float) -> list[str]:
        """Members other than self not seen for more than ``timeout_s`` seconds, by id."""
        return sorted(
            m.node_id
            for m in self.members.values()
            if m.node_id != self.self_id and now_s - m.last_seen_s > timeout_s
        )

    def ordered(self) -> list[Member]:
        """Members in stage order: HTTP-serving first, then those with a model, then by node id."""
        return sorted(
            self.members.values(), key=lambda m: (m.http_port <= 0, m.model_path is None, m.node_id)
        )

    @property
    def coordinator_id(self) -> str:
        """The member that plans and announces plans (the first in stage order)."""
        return self.ordered()[0].node_id

    def node_specs(
        self,
        *,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
        default_mem_bandwidth_bytes_s: float = DEFAULT_MEM_BANDWIDTH_BYTES_S,
    ) -> list[NodeSpec]:
        """The planner's input: one NodeSpec per member, in stage order, from measured figures.

        ``mem_bandwidth_bytes_s`` = the member's measured streaming rate (the default when not
        measured); ``link_*`` = its worst measured link to another member (see ``Member.link_to``).
        """
        members = self.ordered()
        ids = [m.node_id for m in members]
        specs = []
        for m in members:
            bw, lat = m.link_to(i for i in ids if i != m.node_id)
            specs.append(
                NodeSpec(
                    node_id=m.node_id,
                    available_bytes=m.available_bytes,
                    configured_cap_bytes=m.memory_cap_bytes or None,
                    headroom_bytes=headroom_bytes,
                    mem_bandwidth_bytes_s=m.stream_rate_bytes_s or default_mem_bandwidth_bytes_s,
                    link_bandwidth_bytes_s=bw,
                    link_latency_s=lat,
                )
            )
        return specs

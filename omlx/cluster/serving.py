"""What the HTTP front of `omlx serve --cluster` needs to know: where rank 0's worker listens, or
why no pipeline can serve now (planning, workers starting, a lost peer), in words for the client.

Owns the wording of cluster-unavailable reasons and naming a lost peer. Read from the HTTP
server's thread while the agent's loop writes: it only reads references (atomic under the GIL)
and never calls into the loop. Must not import sanic or mlx (``omlx.api`` and ``omlx.cluster``
never import each other: the CLI hands this object to the front, which calls it duck-typed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omlx.cluster.launcher import WorkerState

if TYPE_CHECKING:
    from omlx.cluster.agent import NodeAgent

RETRY_AFTER_S = 5
"""Seconds a client is told to wait (``Retry-After``) while the cluster plans or starts workers."""


class ClusterServing:
    """The serve process's view of its node agent.

    Args:
        agent: This node's agent (it plans; this node is rank 0 of its plans).
    """

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.retry_after_s = RETRY_AFTER_S
        # How long the front waits for the agent to name a peer a lost pipeline lost: one
        # heartbeat timeout plus an interval and a margin (the agent drops a silent member then).
        s = agent.settings
        self.loss_wait_s = s.heartbeat_timeout_s + s.heartbeat_interval_s + 1.0

    def upstream(self) -> tuple[str | None, str]:
        """(base URL of rank 0's worker, "") when it is ready, else (None, why not)."""
        a = self.agent
        w = a.launcher.status()
        epoch = a.membership.epoch
        if a.plan is None or a.plan_epoch != epoch:
            if a.plan_error and a.plan_epoch == epoch:
                return None, f"cluster epoch {epoch}: no plan for {a.model_path}: {a.plan_error}"
            return None, (f"cluster epoch {epoch}: planning {a.model_path or 'the model'} over "
                          f"{len(a.membership.members)} node(s); no pipeline yet{self._after_loss()}")
        if w is None or w["rank"] != 0:
            return None, (f"cluster epoch {epoch}: this node has no first stage in the plan "
                          "(rank 0 serves HTTP); send requests to the node that holds rank 0")
        if w["dry_run"]:
            return None, "cluster mode without workers (dry run): nothing can serve"
        state = w["state"]
        stages = self._stages(w)
        if state == WorkerState.READY:
            peer = a.lost_worker()  # a follower's worker failed (seen idle, through heartbeats)
            if peer is None:
                return f"http://127.0.0.1:{w['http_port']}", ""
            return None, (f"cluster epoch {w['epoch']}: the pipeline ({stages}) is lost: node {peer[0]}'s "
                          f"worker failed ({peer[1]}); the cluster restarts the workers")
        if state == WorkerState.STARTING:
            return None, (f"cluster epoch {w['epoch']}: the pipeline's workers are starting ({stages}) "
                          f"for {w['state_for_s']:.0f} s{self._after_loss()}")
        lost = self.lost_peers(w)
        named = f"; {'; '.join(lost)}" if lost else ""
        return None, (f"cluster epoch {w['epoch']}: the pipeline ({stages}) is lost: {w['error']}{named}; "
                      "the cluster re-plans onto the remaining nodes")

    def snapshot(self) -> dict[str, Any] | None:
        """The worker's status now (pass it to ``lost_peers`` after a failed request)."""
        return self.agent.launcher.status()

    def lost_peers(self, snapshot: dict[str, Any] | None) -> list[str]:
        """Every node of ``snapshot``'s pipeline that has left the membership since, with why."""
        a = self.agent
        if snapshot is None:
            return []
        out = []
        for rank, node_id in enumerate(snapshot["node_ids"]):
            if node_id not in a.membership.members:
                why = a.left_reasons.get(node_id, "it left")
                lo, hi = snapshot["ranges"][rank]
                out.append(f"node {node_id} (rank {rank}, layers [{lo}, {hi})) is lost: {why}")
        return out

    def health(self) -> dict[str, Any]:
        """The ``cluster`` section of the front's ``/health``."""
        a = self.agent
        url, reason = self.upstream()
        return {
            "status": "ready" if url else "unavailable",
            "reason": reason or None,
            "node_id": a.info.node_id,
            "epoch": a.membership.epoch,
            "num_members": len(a.membership.members),
            "model": a.model_path,
            "plan_epoch": a.plan_epoch,
            "worker": a.launcher.status(),
        }

    def _stages(self, w: dict[str, Any]) -> str:
        return ", ".join(f"rank {r} node {n} [{lo}, {hi})"
                         for r, (n, (lo, hi)) in enumerate(zip(w["node_ids"], w["ranges"])))

    def _after_loss(self) -> str:
        a = self.agent
        prev = a.launcher.last_ready  # the nodes of the last pipeline that served, now gone
        if prev is None:
            return ""
        gone = [f"node {n} ({a.left_reasons.get(n, 'it left')})" for n in prev.node_ids
                if n not in a.membership.members]
        return f"; re-planned after losing {', '.join(gone)}" if gone else ""

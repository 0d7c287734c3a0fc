"""The pipeline's process group: ``mx.distributed`` over the ring backend, with timeouts.

Owns: writing the ring hostfile, initializing the group for one rank, broadcasting small control
messages from rank 0, and the watchdog that turns a collective stuck on a lost or frozen peer into
a clear error within ``timeout_s`` instead of a hang. Must not: know about models, HTTP or plans.

Failure model. MLX's ring backend (TCP) raises ``RuntimeError("[ring] connection to a peer was
lost")`` when a neighbour's socket closes (the peer process died), so a killed rank surfaces at
once. A peer that is alive but stuck (frozen, paused, partitioned) gives no such signal: the
collective waits forever and cannot be cancelled from Python. ``Watchdog`` times every blocking
step; past ``timeout_s`` it calls its ``on_timeout`` callback from its own thread, which fails the
requests in flight (rank 0) or ends the process (other ranks). The group is unusable after either
failure: the caller treats it as lost for good (membership is fixed per epoch; the node agent
re-plans and starts new workers).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx

from omlx.errors import ClusterUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
"""How long one pipeline step (or the group's start-up) may block before the peer counts as lost."""


def write_hostfile(path: str | Path, addresses: Sequence[tuple[str, int]]) -> Path:
    """Write the ring backend's hostfile: rank i listens on ``addresses[i]``.

    Format (as ``mlx.launch`` writes it): a JSON list with one list of ``"ip:port"`` strings per
    rank. The ring backend needs IP addresses, not host names.

    Returns:
        The path written.
    """
    path = Path(path)
    path.write_text(json.dumps([[f"{host}:{port}"] for host, port in addresses]))
    return path


def read_hostfile(path: str | Path) -> list[list[str]]:
    """The hostfile's ``"ip:port"`` lists, one per rank.

    Raises:
        ValueError: not a JSON list of lists of strings.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not all(
        isinstance(r, list) and r and all(isinstance(a, str) for a in r) for r in data
    ):
        raise ValueError(f"{path}: expected a JSON list of lists of 'ip:port' strings")
    return data


class Watchdog:
    """Times blocking steps on the thread that owns MLX; reports one stuck past ``timeout_s``.

    Args:
        timeout_s: most seconds one step may take.
        on_timeout: called once, from the watchdog thread, with a ClusterUnavailableError that
            names the step and the rank, when a step overruns.
        rank: this process's rank (for messages).
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[ClusterUnavailableError], None],
                 rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._on_timeout = on_timeout
        self._lock = threading.Lock()
        self._step: tuple[str, float] | None = None
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="cluster-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Time the block as one step named ``what`` (e.g. "decode step")."""
        with self._lock:
            self._step = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def _watch(self) -> None:
        period = min(0.25, self.timeout_s / 4)
        while not self.fired:
            time.sleep(period)
            with self._lock:
                step = self._step
            if step is not None and time.monotonic() - step[1] > self.timeout_s:
                self.fired = True
                what, _ = step
                self._on_timeout(ClusterUnavailableError(
                    f"cluster rank {self.rank}: {what} did not complete within {self.timeout_s:.0f} s; "
                    "a peer is lost or frozen. The pipeline is stopped; restart the workers "
                    "(the node agent re-plans onto the remaining nodes)."))


@dataclass
class ClusterGroup:
    """One rank's handle on the pipeline's process group.

    Attributes:
        group: the ``mx.distributed.Group``.
        rank: this process's rank, 0 = the one serving HTTP.
        size: number of ranks.
        timeout_s: step timeout used by the watchdogs built on this group.
        stream: the MLX stream control messages run on; None = the default stream. Set it to
            the stream the model's collectives run on (mlx-lm's ``generation_stream``): two
            streams would interleave their collectives on the same sockets.
    """

    group: Any
    rank: int
    size: int
    timeout_s: float
    stream: Any = None

    def _on_stream(self) -> Any:
        return mx.stream(self.stream) if self.stream is not None else nullcontext()

    def broadcast_message(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """Send a JSON-able message from rank 0 to every rank; every rank must call this.

        Rank 0 passes the message, the others pass None and get it back. Two ``all_sum``s: a
        length header (int32) and the UTF-8 payload (uint8, the other ranks add zeros). Blocks
        until every rank takes part.

        Raises:
            ClusterUnavailableError: a peer's connection was lost.
        """
        payload = json.dumps(message, separators=(",", ":")).encode() if self.rank == 0 else b""
        try:
            with self._on_stream():
                n = mx.distributed.all_sum(mx.array([len(payload)], dtype=mx.int32), group=self.group)
                num_bytes = int(n.item())
                if num_bytes <= 0:
                    raise ClusterUnavailableError(
                        f"cluster rank {self.rank}: control channel out of step (header {num_bytes})")
                data = (mx.array(list(payload), dtype=mx.uint8) if self.rank == 0
                        else mx.zeros((num_bytes,), dtype=mx.uint8))
                raw = bytes(mx.distributed.all_sum(data, group=self.group).tolist())
        except RuntimeError as e:
            raise lost_error(self.rank, e) from e
        return json.loads(raw)

    def gather_messages(self, message: dict[str, Any], region_bytes: int = 4096) -> list[dict[str, Any]]:
        """Every rank's JSON-able message, in rank order; every rank must call this.

        One ``all_sum`` of a (size * region_bytes,) uint8 buffer in which each rank fills its region.

        Raises:
            ValueError: this rank's message is longer than ``region_bytes``.
            ClusterUnavailableError: a peer's connection was lost.
        """
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) > region_bytes:
            raise ValueError(f"cluster message of {len(payload)} bytes exceeds the {region_bytes}-byte region")
        buf = bytearray(self.size * region_bytes)
        buf[self.rank * region_bytes:self.rank * region_bytes + len(payload)] = payload
        try:
            with self._on_stream():
                out = mx.distributed.all_sum(mx.array(list(buf), dtype=mx.uint8), group=self.group)
                raw = bytes(out.tolist())
        except RuntimeError as e:
            raise lost_error(self.rank, e) from e
        return [json.loads(raw[r * region_bytes:(r + 1) * region_bytes].rstrip(b"\0")) for r in range(self.size)]


def lost_error(rank: int, error: BaseException) -> ClusterUnavailableError:
    """The error a rank reports when a collective fails (``[ring] connection ... lost``)."""
    return ClusterUnavailableError(
        f"cluster rank {rank}: a pipeline peer was lost ({error}). The pipeline is stopped; "
        "restart the workers (the node agent re-plans onto the remaining nodes).")


def init_group(hostfile: str | Path, rank: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ClusterGroup:
    """Join the ring: every rank of the hostfile must call this within ``timeout_s``.

    Sets ``MLX_RANK`` and ``MLX_HOSTFILE`` for MLX (the ring backend reads only those) and calls
    ``mx.distributed.init(backend="ring", strict=True)``, which connects to both ring neighbours.
    A hostfile of one rank gives MLX's singleton group (no sockets).

    Raises:
        ClusterUnavailableError: the peers did not all connect within ``timeout_s``, or the ring
            could not be built.
        ValueError: ``rank`` is outside the hostfile.
    """
    hosts = read_hostfile(hostfile)
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside the hostfile's {len(hosts)} ranks")
    if len(hosts) == 1:
        # A one-stage plan (every other node gone): the ring backend cannot connect to itself;
        # MLX's singleton group makes every collective the identity.
        os.environ.pop("MLX_RANK", None)
        os.environ.pop("MLX_HOSTFILE", None)
        group = mx.distributed.init(strict=False)
        logger.info("rank 0 of 1: a one-stage pipeline (no ring)")
        return ClusterGroup(group=group, rank=0, size=1, timeout_s=timeout_s)
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    result: dict[str, Any] = {}

    def connect() -> None:
        try:
            result["group"] = mx.distributed.init(strict=True, backend="ring")
        except Exception as e:  # noqa: BLE001 - reported below with the rank
            result["error"] = e

    t = threading.Thread(target=connect, name="cluster-init", daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ClusterUnavailableError(
            f"cluster rank {rank}: the ring of {len(hosts)} ranks ({hostfile}) did not form within "
            f"{timeout_s:.0f} s; start every rank, and check the addresses and firewalls")
    if "error" in result:
        raise ClusterUnavailableError(f"cluster rank {rank}: cannot build the ring: {result['error']}")
    group = result["group"]
    if group.size() != len(hosts) or group.rank() != rank:
        raise ClusterUnavailableError(
            f"cluster rank {rank}: MLX formed a group of size {group.size()} as rank {group.rank()}; "
            f"the hostfile has {len(hosts)} ranks")
    logger.info("rank %d of %d joined the ring in %.1f s", rank, len(hosts), time.monotonic() - t0)
    return ClusterGroup(group=group, rank=rank, size=len(hosts), timeout_s=timeout_s)

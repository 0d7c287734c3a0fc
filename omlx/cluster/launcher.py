"""Starting this node's pipeline worker for a plan, stopping the previous epoch's, watching it.

Owns the hook between the control plane and execution. When the agent adopts a plan it calls
``WorkerLauncher.restart`` with a ``WorkerLaunch`` (this node's rank, every stage's layer range,
the hostfile path); the launcher's supervisor thread stops the previous epoch's worker (its
process group: SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) and starts ``omlx cluster worker``
for the new one, so the agent's asyncio loop never blocks on a process. With ``command=None`` it
only records the command line it would run (a dry run, shown by ``omlx cluster status``).
Does not import mlx.

Worker states (``WorkerState``): ``starting`` (process up, stage loading / ring forming),
``ready`` (rank 0: its loopback HTTP ``/health`` answers 200; rank > 0: it wrote its ready file
after the ring handshake), ``lost`` (it exited, or rank 0 reports its pipeline lost), ``stopped``.

Ports: rank 0's worker serves HTTP on a loopback port the launcher picks (``free_loopback_port``);
the serve process forwards to it. Ring endpoints use ``ring_port(base, epoch)`` = base + epoch mod
``NUM_RING_PORTS``, so a new epoch's ring never meets the previous epoch's sockets.

Hostfile: the JSON that mx.distributed's ring backend reads from ``MLX_HOSTFILE``: one list of
``"ip:port"`` strings per rank, rank 0 first; the worker gets its rank with ``--rank``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from omlx.config import NUM_RING_PORTS  # ring ports: base .. base + NUM_RING_PORTS - 1, one per epoch

logger = logging.getLogger(__name__)

WORKER_SUBCOMMAND = ("omlx", "cluster", "worker")
"""The execution side's command; prefix of every worker command line."""

STOP_TIMEOUT_S = 5.0
"""Seconds a stopping worker gets after SIGTERM before SIGKILL."""
_POLL_S = 0.25
_HEALTH_TIMEOUT_S = 2.0
_READY_CHECK_S = 1.0  # a ready rank 0 is checked this often (a lost pipeline turns /health 503)

# Exit codes of `omlx cluster worker` (omlx/cli/cluster_worker.py) -> what they mean.
_EXIT_MEANING = {0: "stopped", 1: "could not start (ring or stage)", 2: "bad arguments or refused bind",
                 3: "a pipeline peer was lost", 4: "the ranks disagreed or a step failed",
                 -9: "killed (SIGKILL)", -15: "terminated (SIGTERM)", 5: "its node agent is gone"}


class WorkerState:
    STARTING = "starting"
    READY = "ready"
    LOST = "lost"
    STOPPED = "stopped"


def ring_port(base_port: int, epoch: int) -> int:
    """The ring port every rank uses in ``epoch``: ``base_port + epoch % NUM_RING_PORTS``."""
    return base_port + epoch % NUM_RING_PORTS


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (for rank 0's worker HTTP)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What one node runs for one epoch's plan.

    Attributes:
        epoch: The plan's epoch.
        rank: This node's stage (0 = first layers, serves HTTP).
        num_ranks: Stages in the plan.
        model_path: Model folder (the same path on every node).
        ranges: ``[layer_start, layer_end)`` of every stage, in rank order.
        hostfile: Path of the ring hostfile written for this epoch.
        ring_addresses: ``ip:port`` of every rank's ring endpoint, in rank order.
        node_ids: Node id of every rank, in rank order (for status and error messages).
        http_port: Rank 0: the loopback port its worker serves HTTP on; 0 otherwise.
    """

    epoch: int
    rank: int
    num_ranks: int
    model_path: str
    ranges: tuple[tuple[int, int], ...]
    hostfile: Path
    ring_addresses: tuple[str, ...]
    node_ids: tuple[str, ...] = ()
    http_port: int = 0

    def argv(self, command: list[str] | tuple[str, ...] = WORKER_SUBCOMMAND) -> list[str]:
        """``command --model DIR --ranges 0:15,15:30 --hostfile PATH --rank R``."""
        ranges = ",".join(f"{a}:{b}" for a, b in self.ranges)
        return [
            *command,
            "--model", self.model_path,
            "--ranges", ranges,
            "--hostfile", str(self.hostfile),
            "--rank", str(self.rank),
        ]

    def env(self) -> dict[str, str]:
        """Environment for mx.distributed's ring backend."""
        return {"MLX_RANK": str(self.rank), "MLX_HOSTFILE": str(self.hostfile)}

    @property
    def ready_file(self) -> Path:
        """Where a rank > 0 worker marks itself ready (after the ring handshake)."""
        return self.hostfile.with_name(f"ready-epoch{self.epoch}-rank{self.rank}")


def write_hostfile(path: Path, ring_addresses: list[str] | tuple[str, ...]) -> None:
    """Write the ring hostfile (``[["ip:port"], ...]``, rank order) atomically, mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump([[a] for a in ring_addresses], f)
    os.replace(tmp, path)


class WorkerLauncher:
    """Runs at most one worker process; a new epoch's launch replaces the previous one.

    ``restart`` returns at once; a supervisor thread stops, starts and watches the process.

    Args:
        command: Worker command prefix (e.g. ``[python, "-m", "omlx", "cluster", "worker"]``);
            None = dry run: log and record the command line, start nothing.
        extra_args: Appended to every worker line (e.g. ``["--base-path", DIR]``).
        env: Extra environment of the worker (e.g. ``OMLX_API_KEY`` for rank 0's HTTP; never
            on the command line, where ``ps`` shows it).
    """

    def __init__(self, command: list[str] | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.command = command
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.current: WorkerLaunch | None = None
        self.last_ready: WorkerLaunch | None = None  # the last launch whose worker was ready
        self.state = WorkerState.STOPPED
        self.error: str | None = None
        self.since_s = time.monotonic()
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._want: tuple[WorkerLaunch | None] | None = None  # a pending restart (boxed: None = stop)
        self._last_check_s = 0.0
        self._settled = True  # the last restart has been carried out
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ agent side

    def restart(self, launch: WorkerLaunch | None) -> None:
        """Replace the running worker with ``launch`` (None: this node has no stage in the new
        plan). Returns at once; the supervisor thread does the stopping and starting."""
        with self._lock:
            self.current = launch
            self._set(WorkerState.STARTING if launch is not None and self.command is not None
                      else WorkerState.STOPPED, None)
            if self.command is None:
                if launch is not None:
                    logger.info("epoch %d: rank %d would run: %s", launch.epoch, launch.rank,
                                shlex.join(self._argv(launch)))
                return
            self._want = (launch,)
            self._settled = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name="omlx-cluster-launcher", daemon=True)
                self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        """Stop the worker and the supervisor (blocks up to ``STOP_TIMEOUT_S`` + a little)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self.current = None
            self._set(WorkerState.STOPPED, None)
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT_S + 5)
        self._stop_proc()

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until the last ``restart`` has been carried out (old worker stopped, new started)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._settled:
                    return True
            time.sleep(0.05)
        return False

    def status(self) -> dict[str, object] | None:
        """The current launch for ``omlx cluster status`` and ``/health`` (None: no stage here).

        Keys: epoch, rank, num_ranks, ranges, node_ids, state, error, state_for_s, pid,
        http_port, hostfile, command, running, dry_run.
        """
        launch = self.current
        if launch is None:
            return None
        proc = self._proc
        running = proc is not None and proc.poll() is None
        return {
            "epoch": launch.epoch,
            "rank": launch.rank,
            "num_ranks": launch.num_ranks,
            "ranges": [list(r) for r in launch.ranges],
            "node_ids": list(launch.node_ids),
            "state": self.state if self.command is not None else "dry_run",
            "error": self.error,
            "state_for_s": round(time.monotonic() - self.since_s, 2),
            "pid": proc.pid if running and proc is not None else None,
            "http_port": launch.http_port,
            "hostfile": str(launch.hostfile),
            "command": shlex.join(self._argv(launch)),
            "running": running,
            "dry_run": self.command is None,
        }

    # ------------------------------------------------------------------ supervisor thread

    def _set(self, state: str, error: str | None) -> None:
        if state != self.state or error != self.error:
            self.state, self.error, self.since_s = state, error, time.monotonic()
        if state == WorkerState.READY:
            self.last_ready = self.current

    def _argv(self, launch: WorkerLaunch) -> list[str]:
        extra = list(self.extra_args)
        if launch.rank == 0 and launch.http_port:
            extra += ["--host", "127.0.0.1", "--port", str(launch.http_port)]
        elif launch.rank > 0 and self.command is not None:
            extra += ["--ready-file", str(launch.ready_file)]
        if self.command is not None:
            extra += ["--parent-pid", str(os.getpid())]
        return [*launch.argv(self.command or WORKER_SUBCOMMAND), *extra]

    def _supervise(self) -> None:
        while True:
            self._wake.wait(_POLL_S)
            self._wake.clear()
            with self._lock:
                want, self._want = self._want, None
                closed = self._closed
            if closed:
                self._stop_proc()
                return
            if want is not None:
                self._stop_proc()
                launch = want[0]
                if launch is not None:
                    self._start(launch)
                with self._lock:
                    self._settled = self._want is None
                continue
            self._watch()

    def _start(self, launch: WorkerLaunch) -> None:
        argv = self._argv(launch)
        launch.ready_file.unlink(missing_ok=True)
        logger.info("epoch %d: starting rank %d of %d: %s", launch.epoch, launch.rank, launch.num_ranks,
                    shlex.join(argv))
        try:
            # Own session: stopping it kills its whole process group, never the agent's.
            proc = subprocess.Popen(argv, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as e:
            with self._lock:
                if self.current is launch:
                    self._set(WorkerState.LOST, f"cannot start the worker: {e}")
            logger.error("epoch %d: cannot start the worker: %s", launch.epoch, e)
            return
        self._proc = proc

    def _watch(self) -> None:
        launch, proc = self.current, self._proc
        if launch is None or proc is None or self.state in (WorkerState.LOST, WorkerState.STOPPED):
            return
        code = proc.poll()
        if code is not None:
            why = _EXIT_MEANING.get(code, "failed")
            with self._lock:
                if self.current is launch:
                    self._set(WorkerState.LOST, f"rank {launch.rank}'s worker of epoch {launch.epoch} "
                                                f"exited with code {code} ({why})")
            logger.error("epoch %d: rank %d's worker exited with code %d (%s)", launch.epoch, launch.rank, code, why)
            return
        if launch.rank > 0:
            if self.state == WorkerState.STARTING and launch.ready_file.exists():
                with self._lock:
                    if self.current is launch:
                        self._set(WorkerState.READY, None)
            return
        if not launch.http_port:
            return
        now = time.monotonic()
        if self.state == WorkerState.READY and now - self._last_check_s < _READY_CHECK_S:
            return
        self._last_check_s = now
        import httpx

        try:
            r = httpx.get(f"http://127.0.0.1:{launch.http_port}/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return  # not listening yet (loading, warming up) or busy: the exit code tells a death
        state, error = self.state, self.error
        if r.status_code == 200:
            state, error = WorkerState.READY, None
        else:
            try:
                cluster = r.json().get("cluster") or {}
            except ValueError:
                cluster = {}
            if cluster.get("status") == "lost":
                state, error = WorkerState.LOST, str(cluster.get("error") or "the pipeline is lost")
        with self._lock:
            if self.current is launch:
                self._set(state, error)

    def _stop_proc(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("worker %d did not stop within %.0f s of SIGTERM: killing it", proc.pid, STOP_TIMEOUT_S)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def describe_exit(code: int) -> str:
    """What a worker's exit code means (for messages)."""
    return _EXIT_MEANING.get(code, "failed")

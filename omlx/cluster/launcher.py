"""Starting this node's pipeline worker for a plan: its rank, the hostfile, the command line.

Owns the hook between the control plane and execution. When the agent adopts a plan it calls
``WorkerLauncher.restart`` with a ``WorkerLaunch`` (this node's rank, every stage's layer range,
the hostfile path); the launcher stops the previous epoch's worker and starts the new one with
``command`` (``omlx cluster worker`` once execution lands). With ``command=None`` it only
records the command line it would run (shown by ``omlx cluster status``). Does not import mlx.

Hostfile: the JSON that mx.distributed's ring backend reads from ``MLX_HOSTFILE``: one list of
``"ip:port"`` strings per rank, rank 0 first; the worker's rank is passed as ``MLX_RANK``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

WORKER_SUBCOMMAND = ("omlx", "cluster", "worker")
"""The execution side's command (issue #11); prefix of every worker command line."""

STOP_TIMEOUT_S = 10.0


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
    """

    epoch: int
    rank: int
    num_ranks: int
    model_path: str
    ranges: tuple[tuple[int, int], ...]
    hostfile: Path
    ring_addresses: tuple[str, ...]

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


def write_hostfile(path: Path, ring_addresses: list[str] | tuple[str, ...]) -> None:
    """Write the ring hostfile (``[["ip:port"], ...]``, rank order) atomically, mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump([[a] for a in ring_addresses], f)
    os.replace(tmp, path)


class WorkerLauncher:
    """Runs at most one worker process; a new epoch's launch replaces the previous one.

    Args:
        command: Worker command prefix (e.g. ``["omlx", "cluster", "worker"]``); None = dry run:
            log and record the command line, start nothing.
        extra_args: Appended to every worker line (e.g. ``["--base-path", DIR, "--port", "8000"]``).
    """

    def __init__(self, command: list[str] | None = None, extra_args: list[str] | None = None) -> None:
        self.command = command
        self.extra_args = list(extra_args or [])
        self.current: WorkerLaunch | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def restart(self, launch: WorkerLaunch | None) -> None:
        """Stop the running worker (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) and start
        ``launch`` (None: this node has no stage in the new plan)."""
        self.stop()
        self.current = launch
        if launch is None:
            return
        argv = self._argv(launch)
        if self.command is None:
            logger.info("epoch %d: rank %d would run: %s", launch.epoch, launch.rank, shlex.join(argv))
            return
        logger.info("epoch %d: starting rank %d: %s", launch.epoch, launch.rank, shlex.join(argv))
        self._proc = subprocess.Popen(argv, env={**os.environ, **launch.env()})

    def _argv(self, launch: WorkerLaunch) -> list[str]:
        return [*launch.argv(self.command or WORKER_SUBCOMMAND), *self.extra_args]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def status(self) -> dict[str, object] | None:
        """The current launch for ``omlx cluster status`` (None when this node has no stage)."""
        if self.current is None:
            return None
        return {
            "epoch": self.current.epoch,
            "rank": self.current.rank,
            "num_ranks": self.current.num_ranks,
            "hostfile": str(self.current.hostfile),
            "command": shlex.join(self._argv(self.current)),
            "running": self._proc is not None and self._proc.poll() is None,
            "dry_run": self.command is None,
        }

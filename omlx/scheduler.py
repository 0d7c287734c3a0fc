"""Admission control: how many requests run at once, how many may wait, and cancellation.

Pure Python (no mlx). The engine thread asks `admit()` for requests to start; the API threads
call `add()` and `abort()`. Running out of room is a value or a RateLimitError, never a hang.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from omlx.errors import RateLimitError
from omlx.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counts at one moment. ``num_aborting``: running requests already aborted (their client
    left), still counted in ``num_running`` until the engine takes them out of the batch at the
    end of its current step."""

    num_running: int
    num_waiting: int
    max_running: int
    max_waiting: int
    num_aborting: int = 0


class Scheduler:
    """FIFO admission with a bound on running and on waiting requests.

    Args:
        max_running: requests decoding at once (``--max-concurrent-requests``).
        max_waiting: requests allowed to wait; one more gets a RateLimitError (HTTP 429).
    """

    def __init__(self, max_running: int = 8, max_waiting: int = 64):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, Request] = {}
        self._aborting: set[str] = set()  # running, aborted, not yet out of the batch

    def add(self, request: Request) -> None:
        """Queue a request.

        Raises:
            RateLimitError: when ``max_waiting`` requests already wait (carries retry-after).
        """
        with self._lock:
            # an aborted request still in the batch (its client is gone) holds no place in line
            num_held = len(self._waiting) + len(self._running) - len(self._aborting)
            if num_held >= self.max_running + self.max_waiting:
                raise RateLimitError(
                    f"server busy: {len(self._running)} requests running and "
                    f"{len(self._waiting)} waiting (max {self.max_waiting}); retry later",
                    retry_after_s=1,
                )
            request.status = RequestStatus.WAITING
            self._waiting[request.request_id] = request

    def admit(self) -> list[Request]:
        """Move as many waiting requests to running as there is room for (FIFO, up to max_concurrent)."""
        out: list[Request] = []
        with self._lock:
            while self._waiting and len(self._running) < self.max_running:
                _, req = self._waiting.popitem(last=False)
                req.status = RequestStatus.RUNNING
                self._running[req.request_id] = req
                out.append(req)
        return out

    def mark_aborting(self, request_id: str) -> bool:
        """A running request was aborted; until `finish` frees its place it no longer counts
        against the queue bound of `add`. Returns False when it is not running."""
        with self._lock:
            if request_id not in self._running:
                return False
            self._aborting.add(request_id)
            return True

    def finish(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED) -> Request | None:
        """Free a running request's place. Returns the request, or None if it was not running."""
        with self._lock:
            self._aborting.discard(request_id)
            req = self._running.pop(request_id, None)
            if req is not None:
                req.status = status
            return req

    def remove_waiting(self, request_id: str) -> Request | None:
        """Drop a request that has not started. Returns it, or None if it was not waiting."""
        with self._lock:
            req = self._waiting.pop(request_id, None)
            if req is not None:
                req.status = RequestStatus.ABORTED
            return req

    def waiting(self) -> list[Request]:
        """The waiting requests, oldest first (a snapshot)."""
        with self._lock:
            return list(self._waiting.values())

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(len(self._running), len(self._waiting), self.max_running, self.max_waiting,
                                  len(self._aborting))

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

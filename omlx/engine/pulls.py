"""Pulls from the Hugging Face hub that run in the background of a server (the admin API's
``/v1/admin/pulls``): a FIFO queue of jobs and one worker thread that downloads them one at a time.

Owns: each job's state (queued -> running -> done | failed | cancelled), its bytes done and to do,
its transfer rate, its error, and cancelling it. The checks before a pull (`PullManager.start`
runs `omlx.engine.hub.plan_pull` on the caller's thread, so a missing repo, a gated one, one that
is not an mlx-lm model or a disk too small fail the request itself) and the download
(`omlx.engine.hub.fetch`, on the worker) are the code of ``omlx models pull``.
Must not: speak HTTP, print, or load what it pulled (the pool finds it in the hub cache).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.engine.hub import HubRef, PullPlan, PullResult
from omlx.errors import ConflictError, InvalidRequestError, OmlxError

logger = logging.getLogger(__name__)

#: ``(ref, cache) -> PullPlan``: `omlx.engine.hub.plan_pull`, or a test's stand-in.
Planner = Callable[[HubRef, Path], PullPlan]
#: ``(plan, on_total=, on_bytes=) -> PullResult``: `omlx.engine.hub.fetch`, or a test's stand-in.
Fetcher = Callable[..., PullResult]
#: Finished jobs kept for ``GET /v1/admin/pulls`` (oldest dropped first).
MAX_FINISHED_JOBS = 50
#: The transfer rate is measured over this trailing window.
RATE_WINDOW_S = 5.0


class PullState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = (PullState.DONE, PullState.FAILED, PullState.CANCELLED)


class PullCancelled(OmlxError):
    """Raised from the download's byte callback to stop a cancelled pull (finished files are kept)."""


@dataclass(slots=True)
class PullJob:
    """One pull. Times are wall-clock seconds since the epoch (None: not yet).

    Attributes:
        pull_id: ``pull-<n>``, unique for the server's life.
        ref: what is pulled.
        done_bytes: bytes written so far by this pull.
        total_bytes: bytes this pull has to fetch (0: all of it is cached already).
        error: why it failed (None unless ``state`` is failed).
        result: what it left in the cache (None unless ``state`` is done).
    """

    pull_id: str
    ref: HubRef
    state: PullState = PullState.QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    done_bytes: int = 0
    total_bytes: int = 0
    error: OmlxError | None = None
    result: PullResult | None = None
    plan: PullPlan | None = None
    cancel_requested: bool = False
    _samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def rate_bytes_per_s(self, now: float | None = None) -> float | None:
        """Bytes per second over the last `RATE_WINDOW_S` while running; the average over the whole
        download once finished; None before any byte has arrived."""
        if self.state is PullState.RUNNING:
            samples = tuple(self._samples)  # one copy: the download threads append while this reads
            if not samples:
                return None
            now = time.monotonic() if now is None else now
            # the newest sample at least a window old (else the oldest): a stalled download decays to 0
            base = samples[0]
            for s in samples:
                if now - s[0] < RATE_WINDOW_S:
                    break
                base = s
            span = now - base[0]
            return max(0.0, (self.done_bytes - base[1]) / span) if span > 0.05 else None
        if self.started_at is None or self.finished_at is None or not self.done_bytes:
            return None
        span = self.finished_at - self.started_at
        return self.done_bytes / span if span > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form ``/v1/admin/pulls`` serves."""
        rate = self.rate_bytes_per_s()
        out: dict[str, Any] = {
            "id": self.pull_id, "repo": self.ref.repo_id, "revision": self.ref.revision, "model_id": self.ref.model_id,
            "state": self.state.value, "done_bytes": self.done_bytes, "total_bytes": self.total_bytes,
            "rate_bytes_per_s": round(rate, 1) if rate is not None else None,
            "cancel_requested": self.cancel_requested,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "error": None, "model": None,
        }
        if self.error is not None:
            out["error"] = {"message": self.error.message, "type": self.error.openai_type, "code": self.error.code,
                            "status": self.error.status}
        if self.result is not None:
            m = self.result.model
            out["model"] = {"id": m.model_id, "commit": m.commit_hash, "path": str(m.path),
                            "size_bytes": self.result.num_bytes, "downloaded_bytes": self.result.num_downloaded_bytes}
        return out


class PullManager:
    """The server's pulls: `start` queues one, a worker thread runs them in order.

    Args:
        cache: the hub cache folder pulls write into.
        planner, fetcher: `omlx.engine.hub.plan_pull` and `omlx.engine.hub.fetch` (the defaults), or
            stand-ins with their signatures.
    """

    def __init__(self, cache: Path, *, planner: Planner | None = None, fetcher: Fetcher | None = None):
        self.cache = cache
        self._planner = planner
        self._fetcher = fetcher
        self._checking: set[str] = set()  # repos whose checks run now (a second start is a conflict)
        self._jobs: dict[str, PullJob] = {}
        self._queue: deque[PullJob] = deque()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, ref: HubRef) -> PullJob:
        """Check a pull of ``ref`` (`omlx.engine.hub.plan_pull`: network calls, on this thread; nothing
        is written) and queue its download; it starts when the ones before it have finished.

        Raises:
            ConflictError: a pull of the same repo (any revision) is being checked, queued or running.
            InvalidRequestError: the manager is stopping.
            OmlxError: what `omlx.engine.hub.plan_pull` raises (no such repo, gated, not an mlx-lm
                model, not enough disk, hub unreachable); no job is made.
        """
        from omlx.engine import hub

        with self._cond:
            if self._stopping:
                raise InvalidRequestError("the server is stopping; no new pulls")
            if ref.repo_id in self._checking:
                raise ConflictError(f"{ref.repo_id} is already being pulled (its checks are running)")
            for j in self._jobs.values():
                if j.ref.repo_id == ref.repo_id and j.state not in FINISHED:
                    raise ConflictError(f"{ref.repo_id} is already being pulled ({j.pull_id}, {j.state.value}); "
                                        f"follow it at /v1/admin/pulls/{j.pull_id} or cancel it first")
            self._checking.add(ref.repo_id)
        try:
            plan = (self._planner or hub.plan_pull)(ref, self.cache)
        except BaseException:
            with self._cond:
                self._checking.discard(ref.repo_id)
            raise
        with self._cond:
            self._checking.discard(ref.repo_id)
            if self._stopping:
                raise InvalidRequestError("the server is stopping; no new pulls")
            job = PullJob(f"pull-{next(self._ids)}", ref, plan=plan, total_bytes=plan.need_bytes)
            self._jobs[job.pull_id] = job
            self._queue.append(job)
            self._forget_old()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omlx-pulls", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        logger.info("pull %s of %s queued", job.pull_id, ref.model_id)
        return job

    def get(self, pull_id: str) -> PullJob | None:
        """The job ``pull_id`` (None: no such job, or finished long enough ago to be forgotten)."""
        with self._cond:
            return self._jobs.get(pull_id)

    def jobs(self) -> list[PullJob]:
        """Every job kept, oldest first."""
        with self._cond:
            return list(self._jobs.values())

    def cancel(self, pull_id: str) -> PullJob | None:
        """Cancel a pull: a queued one at once; a running one stops at its next chunk (its state
        turns to cancelled when its download threads have stopped; finished files are kept, so a
        new pull resumes). Cancelling a cancelled pull again changes nothing. None: no such job.

        Raises:
            ConflictError: the pull has already finished (done or failed).
        """
        with self._cond:
            job = self._jobs.get(pull_id)
            if job is None:
                return None
            if job.state in (PullState.DONE, PullState.FAILED):
                ended = "finished" if job.state is PullState.DONE else "failed"
                raise ConflictError(f"pull {pull_id} has already {ended}; there is nothing to cancel")
            job.cancel_requested = True
            if job.state is PullState.QUEUED:
                self._queue.remove(job)
                self._finish(job, PullState.CANCELLED)
        logger.info("pull %s of %s: cancel asked", pull_id, job.ref.model_id)
        return job

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel every pull and wait up to ``timeout_s`` for the worker to end."""
        with self._cond:
            self._stopping = True
            for job in list(self._jobs.values()):
                if job.state not in FINISHED:
                    job.cancel_requested = True
                    if job.state is PullState.QUEUED:
                        self._finish(job, PullState.CANCELLED)
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # ---- the worker -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.state = PullState.RUNNING
                job.started_at = time.time()
            self._pull(job)

    def _pull(self, job: PullJob) -> None:
        from omlx.engine import hub

        fetcher = self._fetcher or hub.fetch
        assert job.plan is not None  # set by start

        def on_total(n: int) -> None:
            with self._cond:
                job.total_bytes = n
                job._samples.append((time.monotonic(), job.done_bytes))
            if job.cancel_requested:
                raise PullCancelled(f"pull {job.pull_id} cancelled")

        def on_bytes(n: int) -> None:  # from download threads, once per chunk
            if job.cancel_requested:
                raise PullCancelled(f"pull {job.pull_id} cancelled")
            now = time.monotonic()
            with self._cond:
                job.done_bytes += n
                if not job._samples or now - job._samples[-1][0] >= 0.2:
                    job._samples.append((now, job.done_bytes))

        try:
            result = fetcher(job.plan, on_total=on_total, on_bytes=on_bytes)
        except PullCancelled:
            logger.info("pull %s of %s cancelled after %d bytes", job.pull_id, job.ref.model_id, job.done_bytes)
            with self._cond:
                self._finish(job, PullState.CANCELLED)
            return
        except OmlxError as e:
            logger.warning("pull %s of %s failed: %s", job.pull_id, job.ref.model_id, e.message)
            with self._cond:
                job.error = e
                self._finish(job, PullState.FAILED)
            return
        except Exception as e:  # a bug, or an error hub.pull does not name: the job fails, the server goes on
            logger.exception("pull %s of %s failed unexpectedly", job.pull_id, job.ref.model_id)
            with self._cond:
                job.error = OmlxError(f"pulling {job.ref.model_id} failed: {type(e).__name__}: {e}")
                self._finish(job, PullState.FAILED)
            return
        logger.info("pull %s of %s done (%d bytes fetched)", job.pull_id, job.ref.model_id, result.num_downloaded_bytes)
        with self._cond:
            job.result = result
            self._finish(job, PullState.DONE)

    def _finish(self, job: PullJob, state: PullState) -> None:
        """Caller holds the lock."""
        job.state = state
        job.finished_at = time.time()

    def _forget_old(self) -> None:
        """Drop the oldest finished jobs beyond `MAX_FINISHED_JOBS`. Caller holds the lock."""
        finished = [j for j in self._jobs.values() if j.state in FINISHED]
        for j in finished[:max(0, len(finished) - MAX_FINISHED_JOBS)]:
            del self._jobs[j.pull_id]

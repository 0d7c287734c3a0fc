"""PullManager (omlx/engine/pulls.py) with stand-ins for hub.plan_pull and hub.fetch: the job's
states in order, bytes and rate, one pull at a time, a conflict for the same repo, cancelling a
queued and a running pull, errors kept on the job, and the worker surviving a bug."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from omlx.engine.hub import HubModel, HubRef, PullPlan, PullResult
from omlx.engine.pulls import PullCancelled, PullJob, PullManager, PullState
from omlx.errors import ConflictError, HubNotFoundError, HubUnreachableError, InsufficientDiskError

CACHE = Path("/nonexistent/hub")


def _result(plan: PullPlan) -> PullResult:
    model = HubModel(plan.ref.model_id, plan.ref.repo_id, "c" * 40, CACHE / "snap", plan.need_bytes)
    return PullResult(model, plan.need_bytes, plan.need_bytes)


class Hub:
    """Stand-ins for plan_pull and fetch: each fetch sends ``chunks`` chunks of ``chunk`` bytes and
    waits on ``gate`` (a test opens it) after the first."""

    def __init__(self, *, chunks: int = 4, chunk: int = 1000):
        self.chunks, self.chunk = chunks, chunk
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fetched: list[str] = []
        self.plan_errors: dict[str, Exception] = {}
        self.fetch_errors: dict[str, BaseException] = {}
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def plan(self, ref: HubRef, cache: Path) -> PullPlan:
        assert cache == CACHE
        if ref.repo_id in self.plan_errors:
            raise self.plan_errors[ref.repo_id]
        return PullPlan(ref, cache, self.chunks * self.chunk)

    def fetch(self, plan: PullPlan, *, on_total, on_bytes) -> PullResult:
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            on_total(plan.need_bytes)
            self.started.set()
            for i in range(self.chunks):
                on_bytes(self.chunk)
                if i == 0:
                    assert self.gate.wait(10), "the test never opened the gate"
                err = self.fetch_errors.get(plan.ref.repo_id)
                if err is not None:
                    raise err
            self.fetched.append(plan.ref.model_id)
            return _result(plan)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture()
def hub():
    return Hub()


@pytest.fixture()
def manager(hub):
    m = PullManager(CACHE, planner=hub.plan, fetcher=hub.fetch)
    yield m
    hub.gate.set()
    m.stop()


def wait_state(job: PullJob, *states: PullState, timeout_s: float = 10.0) -> PullJob:
    deadline = time.monotonic() + timeout_s
    while job.state not in states:
        assert time.monotonic() < deadline, f"{job.pull_id} stayed {job.state}"
        time.sleep(0.01)
    return job


def test_a_pull_runs_to_done_with_its_bytes_and_result(manager, hub):
    job = manager.start(HubRef("org/a"))
    assert job.pull_id == "pull-1" and job.total_bytes == 4000
    assert hub.started.wait(5)
    assert wait_state(job, PullState.RUNNING).done_bytes == 1000  # the first chunk, then the gate
    hub.gate.set()
    wait_state(job, PullState.DONE)
    d = job.as_dict()
    assert (d["state"], d["done_bytes"], d["total_bytes"], d["error"]) == ("done", 4000, 4000, None)
    assert d["model"]["id"] == "org/a" and d["model"]["size_bytes"] == 4000
    assert d["started_at"] <= d["finished_at"] and manager.get("pull-1") is job
    assert [j.pull_id for j in manager.jobs()] == ["pull-1"]


def test_pulls_run_one_at_a_time_in_order(manager, hub):
    a, b = manager.start(HubRef("org/a")), manager.start(HubRef("org/b", "v1"))
    assert hub.started.wait(5)
    time.sleep(0.1)
    assert (a.state, b.state) == (PullState.RUNNING, PullState.QUEUED)
    hub.gate.set()
    wait_state(b, PullState.DONE)
    assert hub.fetched == ["org/a", "org/b@v1"] and hub.max_running == 1
    assert b.as_dict()["revision"] == "v1" and b.as_dict()["model_id"] == "org/b@v1"


def test_the_same_repo_twice_is_a_conflict_until_the_first_finishes(manager, hub):
    job = manager.start(HubRef("org/a"))
    with pytest.raises(ConflictError, match="org/a is already being pulled \\(pull-1"):
        manager.start(HubRef("org/a", "other-branch"))  # any revision: they share the repo's folder
    assert ConflictError.status == 409
    hub.gate.set()
    wait_state(job, PullState.DONE)
    again = manager.start(HubRef("org/a"))  # finished: a new pull may start
    wait_state(again, PullState.DONE)
    assert again.pull_id == "pull-2"


def test_a_failed_check_raises_and_makes_no_job(manager, hub):
    hub.plan_errors["org/missing"] = HubNotFoundError("no model org/missing")
    with pytest.raises(HubNotFoundError):
        manager.start(HubRef("org/missing"))
    assert manager.jobs() == []
    hub.plan_errors.clear()
    job = manager.start(HubRef("org/missing"))  # the repo is not left reserved
    hub.gate.set()
    wait_state(job, PullState.DONE)


def test_the_checks_of_a_repo_reserve_it(hub):
    """A second start of a repo whose checks are still running is a conflict too."""
    checking, release = threading.Event(), threading.Event()

    def slow_plan(ref, cache):
        checking.set()
        release.wait(5)
        return hub.plan(ref, cache)

    m = PullManager(CACHE, planner=slow_plan, fetcher=hub.fetch)
    t = threading.Thread(target=m.start, args=(HubRef("org/a"),))
    t.start()
    try:
        assert checking.wait(5)
        with pytest.raises(ConflictError, match="checks are running"):
            m.start(HubRef("org/a"))
    finally:
        release.set()
        t.join(5)
        hub.gate.set()
        m.stop()


def test_an_error_while_fetching_is_kept_on_the_job(manager, hub):
    hub.fetch_errors["org/a"] = HubUnreachableError("lost the connection")
    job = manager.start(HubRef("org/a"))
    hub.gate.set()
    wait_state(job, PullState.FAILED)
    assert job.as_dict()["error"] == {"message": "lost the connection", "type": "server_error",
                                      "code": "hub_unreachable", "status": 502}
    hub.fetch_errors["org/b"] = InsufficientDiskError("the disk filled up")
    b = manager.start(HubRef("org/b"))
    wait_state(b, PullState.FAILED)
    assert b.as_dict()["error"]["status"] == 507 and b.as_dict()["model"] is None


def test_a_bug_in_a_fetch_fails_that_job_and_the_worker_goes_on(manager, hub):
    hub.fetch_errors["org/a"] = KeyError("oops")
    a = manager.start(HubRef("org/a"))
    b = manager.start(HubRef("org/b"))
    hub.gate.set()
    wait_state(a, PullState.FAILED)
    assert a.error.status == 500 and "KeyError" in a.error.message
    wait_state(b, PullState.DONE)


def test_cancel_a_queued_pull_at_once_and_a_running_one_at_its_next_chunk(manager, hub):
    a, b = manager.start(HubRef("org/a")), manager.start(HubRef("org/b"))
    assert hub.started.wait(5)
    assert manager.cancel(b.pull_id) is b and b.state is PullState.CANCELLED  # queued: at once
    assert manager.cancel(a.pull_id) is a and a.cancel_requested
    assert a.state is PullState.RUNNING  # running: until its download sees the flag
    hub.gate.set()
    wait_state(a, PullState.CANCELLED)
    assert a.done_bytes == 1000 and hub.fetched == []  # no chunk after the cancel was counted
    assert manager.cancel(a.pull_id) is a  # cancelling again changes nothing
    assert manager.cancel("pull-99") is None
    c = manager.start(HubRef("org/a"))  # a cancelled pull frees its repo
    wait_state(c, PullState.DONE)
    with pytest.raises(ConflictError, match="already finished"):
        manager.cancel(c.pull_id)


def test_the_callbacks_raise_pull_cancelled_once_cancel_is_asked():
    seen: list[type] = []

    def fetch(plan, *, on_total, on_bytes):
        on_total(plan.need_bytes)
        gate.wait(5)
        try:
            on_bytes(1)
        except PullCancelled as e:
            seen.append(type(e))
            raise
        return _result(plan)

    gate = threading.Event()
    m = PullManager(CACHE, planner=lambda ref, cache: PullPlan(ref, cache, 10), fetcher=fetch)
    job = m.start(HubRef("org/a"))
    wait_state(job, PullState.RUNNING)
    m.cancel(job.pull_id)
    gate.set()
    wait_state(job, PullState.CANCELLED)
    assert seen == [PullCancelled] and job.error is None
    m.stop()


def test_rate_over_the_trailing_window_then_the_average_once_finished():
    job = PullJob("pull-1", HubRef("org/a"), state=PullState.RUNNING)
    assert job.rate_bytes_per_s() is None  # nothing yet
    job._samples.extend([(100.0, 0), (101.0, 1000), (102.0, 2000)])
    job.done_bytes = 3000
    assert job.rate_bytes_per_s(now=103.0) == pytest.approx(1000.0)  # 3000 bytes in 3 s
    # stalled: the newest sample a window old is the base, so the rate falls toward 0
    assert job.rate_bytes_per_s(now=108.0) == pytest.approx(1000 / 6)
    assert job.rate_bytes_per_s(now=200.0) == pytest.approx(1000 / 98)
    job.state, job.started_at, job.finished_at = PullState.DONE, 10.0, 14.0
    assert job.rate_bytes_per_s() == pytest.approx(750.0)


def test_stop_cancels_everything_and_refuses_new_pulls(hub):
    m = PullManager(CACHE, planner=hub.plan, fetcher=hub.fetch)
    a, b = m.start(HubRef("org/a")), m.start(HubRef("org/b"))
    assert hub.started.wait(5)
    threading.Timer(0.2, hub.gate.set).start()
    m.stop()
    assert (a.state, b.state) == (PullState.CANCELLED, PullState.CANCELLED)
    with pytest.raises(Exception, match="stopping"):
        m.start(HubRef("org/c"))


def test_finished_jobs_are_forgotten_beyond_the_limit(hub, monkeypatch):
    import omlx.engine.pulls as pulls

    monkeypatch.setattr(pulls, "MAX_FINISHED_JOBS", 2)
    hub.gate.set()
    m = PullManager(CACHE, planner=hub.plan, fetcher=hub.fetch)
    for i in range(4):
        wait_state(m.start(HubRef(f"org/m{i}")), PullState.DONE)
    m.start(HubRef("org/last"))
    assert [j.ref.repo_id for j in m.jobs()][:2] == ["org/m2", "org/m3"]
    assert m.get("pull-1") is None
    m.stop()

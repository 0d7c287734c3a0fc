import pytest

from omlx.errors import RateLimitError
from omlx.request import Request, RequestStatus, SamplingParams
from omlx.scheduler import Scheduler


def _req(i: int) -> Request:
    return Request("m", [1, 2, 3], SamplingParams(), request_id=f"r{i}")


def test_admission_is_fifo_and_bounded():
    s = Scheduler(max_running=2, max_waiting=1)
    for i in range(3):
        s.add(_req(i))
    with pytest.raises(RateLimitError) as ei:
        s.add(_req(3))
    assert ei.value.headers()["retry-after"] == "1"
    assert [r.request_id for r in s.admit()] == ["r0", "r1"]
    assert s.admit() == []
    s.finish("r0")
    assert [r.request_id for r in s.admit()] == ["r2"]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 0


def test_remove_waiting_and_finish_statuses():
    s = Scheduler(max_running=1, max_waiting=4)
    a, b = _req(0), _req(1)
    s.add(a)
    s.add(b)
    s.admit()
    assert s.remove_waiting("r1") is b and b.status == RequestStatus.ABORTED
    assert s.remove_waiting("r1") is None
    assert s.finish("r0", RequestStatus.FINISHED) is a and a.status == RequestStatus.FINISHED
    assert s.finish("r0") is None
    assert not s.has_work


def test_an_aborting_running_request_frees_its_place_in_line_at_once():
    s = Scheduler(max_running=1, max_waiting=1)
    s.add(_req(0))
    s.admit()
    s.add(_req(1))
    with pytest.raises(RateLimitError):
        s.add(_req(2))
    assert s.mark_aborting("r0") and not s.mark_aborting("r1")  # r1 waits; only running ones mark
    s.add(_req(2))  # r0's client is gone: its place is free although it is still in the batch
    assert s.admit() == []  # ...but its batch row is not, until the engine finishes it
    s.finish("r0", RequestStatus.ABORTED)
    assert [r.request_id for r in s.admit()] == ["r1"]
    with pytest.raises(RateLimitError):
        s.add(_req(3))

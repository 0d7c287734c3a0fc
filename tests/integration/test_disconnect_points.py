"""A client that leaves at any moment of its request leaves nothing held (issue 26), over many
random moments.

Hypothesis draws a route (chat completions, completions, messages, count_tokens, responses),
streaming or not, a small body or one larger than Sanic's 64 KiB read buffer, a FIN or a TCP
reset, and the moment: one of the route's own await points, where the server (started with the
test-only ``OMLX_TEST_PARK``, omlx/api/park.py) parks the request until its client leaves —
before the lease, on the pool's thread holding a lease not yet handed over, holding it, with the
prompt rendered, with the request submitted, with a stream's headers out — or later, while the
engine works: a non-streaming request a random time after it started running, a streaming one a
random time after its first event. After each departure, within seconds: no model lease, no
request running, waiting or holding a batch row, the hot tier's held blocks back where they
were; and at the end no lease expired and no error was logged.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from omlx.api.park import HEADER, POINTS
from tests.helpers import ServerProcess
from tests.leaving import (
    PATHS,
    READ_BUFFER_BYTES,
    RawClient,
    body,
    expired_leases,
    held,
    is_released,
    running_or_waiting,
    wait_released,
)

NUM_EXAMPLES = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 64-token blocks keep engine steps (and so aborts) short on a CPU; see test_load.py.
    with ServerProcess(["--block-size", "64", "--max-concurrent-requests", "4"],
                       base_path=tmp_path_factory.mktemp("park-home"),
                       env={"OMLX_SSD_CACHE_ENABLED": "0", "OMLX_TEST_PARK": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def baseline(server):
    return held(server.url)


@dataclass(frozen=True)
class Departure:
    """When and how one client leaves: ``moment`` is a park point, ``running`` (a random
    ``delay_s`` after its request started running) or ``streaming`` (after its first event)."""

    api: str
    stream: bool
    moment: str
    delay_s: float
    pad_bytes: int
    how: str


@st.composite
def departures(draw) -> Departure:
    api = draw(st.sampled_from(list(PATHS)))
    stream = api != "count_tokens" and draw(st.booleans())
    moments = ["before_lease", "acquire", "leased", "prepared"]
    if api != "count_tokens":
        moments += ["submitted", "streaming" if stream else "running"]
    if stream:
        moments.append("responded")
    return Departure(api, stream, draw(st.sampled_from(moments)), draw(st.floats(0.0, 1.0)),
                     draw(st.sampled_from([0, READ_BUFFER_BYTES + 4096])), draw(st.sampled_from(["fin", "rst"])))


def _wait_for_log(server, text: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in " ".join(server.log_path.read_text().split()):  # the log wraps long lines
            return True
        time.sleep(0.02)
    return False


def _wait_running(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while running_or_waiting(server.url) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


# No shrinking: the examples share one server, so after a leak every later example would fail
# too; the first failing example, as drawn, is the one that leaked.
@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(d=departures())
def test_leaving_at_any_moment_releases_everything(server, baseline, d):
    tag = uuid.uuid4().hex[:8]
    headers = {HEADER: f"{d.moment} {tag}"} if d.moment in POINTS else {}
    prompt = f"({uuid.uuid4().hex}) Tell me a long story about a lighthouse."
    c = RawClient(server.port, d.api, body(d.api, prompt, stream=d.stream, max_tokens=48), pad_bytes=d.pad_bytes,
                  headers=headers).send()
    if d.moment in POINTS:
        assert _wait_for_log(server, f"test park {tag} at {d.moment}"), d
    elif d.moment == "running":
        _wait_running(server)
        time.sleep(d.delay_s)
    else:  # streaming: after the first event
        assert c.read_until(b"data:", 30), (d, c.received[:300])
        time.sleep(d.delay_s)
    c.leave(d.how)
    h = wait_released(server.url, baseline, timeout_s=10)
    assert is_released(h, baseline), (d, h)


def test_no_lease_expired_and_no_error_was_logged(server):
    log = server.log_path.read_text()
    assert not expired_leases(log)
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"

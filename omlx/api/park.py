"""TEST ONLY: park a request at one of its route's await points until its client leaves.

The disconnect tests (``tests/integration/test_disconnect_points.py``) make a client leave at a
chosen moment of its request, and most of those moments last microseconds. With
``ServerConfig.test_park`` on (env ``OMLX_TEST_PARK=1``, read in config.py only; off in
production, where no header is read), a request whose header ``x-omlx-test-park: <point> <tag>``
names one of `POINTS` stops there, logs ``test park <tag> at <point>`` and waits up to `PARK_S`
seconds; its client sees the line and leaves, so Sanic's cancel (``connection_lost``) lands at
exactly that await. A client that does not leave gets its answer `PARK_S` seconds late.

The points, in a request's order (``omlx.api.holds`` and the routes mark them):

- ``before_lease``: the route has started (its body is read); nothing is held.
- ``acquire``: on the pool's thread, the lease just taken and not yet handed to the route; a
  thread cannot be cancelled, so it waits `ACQUIRE_PARK_S` there and then hands the lease over.
- ``leased``: the route holds its model's lease.
- ``prepared``: the prompt is rendered and counted (count_tokens: about to answer); nothing is
  submitted to the engine yet.
- ``submitted``: the engine has the request (queued or running); no event was read yet.
- ``responded``: a streaming response's headers are out and no event is written yet.

Must not: do anything unless ``test_park`` is on, or be wired anywhere but ``omlx.api.holds``
and the generation routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from sanic import Request as HttpRequest

logger = logging.getLogger(__name__)

POINTS = ("before_lease", "acquire", "leased", "prepared", "submitted", "responded")
HEADER = "x-omlx-test-park"
PARK_S = 10.0
ACQUIRE_PARK_S = 0.5


@dataclass(frozen=True, slots=True)
class Park:
    """Where one request parks (a name in `POINTS`), and the tag its log line carries."""

    point: str
    tag: str

    @classmethod
    def of(cls, http: HttpRequest) -> Park | None:
        """The park a request asks for; None unless ``test_park`` is on and the header names a point."""
        if not http.app.ctx.config.test_park:
            return None
        point, _, tag = (http.headers.get(HEADER) or "").strip().partition(" ")
        return cls(point, tag or "-") if point in POINTS else None

    async def at(self, point: str) -> None:
        """Await point ``point`` of the route: wait there (up to `PARK_S`) if it is this park's."""
        if point == self.point:
            logger.info("test park %s at %s", self.tag, point)
            await asyncio.sleep(PARK_S)

    def on_pool_thread(self) -> Callable[[], None] | None:
        """For ``EnginePool.acquire_async(then=...)``: the ``acquire`` park, else None."""
        if self.point != "acquire":
            return None

        def wait() -> None:
            logger.info("test park %s at acquire", self.tag)
            time.sleep(ACQUIRE_PARK_S)

        return wait

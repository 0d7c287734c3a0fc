"""EventStream, the engine-thread -> event-loop bridge: every event exactly once and in order,
at most one ``call_soon_threadsafe`` per burst, keep-alive markers while idle, abort on close.

A real asyncio loop and real producer threads; the engine is a small fake (submit/abort), since
this tests the bridge, not the engine.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from omlx.api.sse import KEEPALIVE, EventStream
from omlx.api.turn import ContentDelta, ModelTurn, ToolCallStart
from omlx.request import Admitted, Failed, Finished, PrefillProgress, Request, SamplingParams, TextDelta, Usage
from tests.helpers import BatchedFake

USAGE = Usage(3, 0)


class FakeEngine:
    """submit() keeps the sink; abort() records the id and ends the request the way the engine
    does (a Finished("abort") from another thread)."""

    model_id = "fake"

    def __init__(self) -> None:
        self.sink = None
        self.aborted: list[str] = []

    def submit(self, request: Request, sink) -> None:
        self.sink = sink

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        t = threading.Thread(target=self.sink, args=(Finished("abort", USAGE),))
        t.start()
        t.join()


def new_stream(keepalive_s: float = 5.0, observer=None) -> tuple[FakeEngine, EventStream]:
    engine = FakeEngine()
    es = EventStream(engine, Request("fake", [1, 2, 3], SamplingParams()), keepalive_s, observer=observer)
    es.start()
    return engine, es


def deltas(n: int) -> list[TextDelta]:
    return [TextDelta(f"t{i} ", [i]) for i in range(n)]


def produce(sink, events, *, per_step: int = 1, pause_s: float = 0.0) -> threading.Thread:
    """Emit ``events`` from a thread, ``per_step`` at a time with ``pause_s`` between steps."""

    def run():
        for i in range(0, len(events), per_step):
            for ev in events[i:i + per_step]:
                sink(ev)
            if pause_s:
                time.sleep(pause_s)

    t = threading.Thread(target=run)
    t.start()
    return t


def run(coro, timeout_s: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)  # a lost wake-up fails here, not hangs

    return asyncio.run(bounded())


@pytest.mark.parametrize("per_step,pause_s", [(1, 0.0), (1, 0.0002), (8, 0.0005), (64, 0.0)])
def test_every_event_arrives_once_in_order_and_finished_last(per_step, pause_s):
    sent = deltas(3000) + [Finished("stop", USAGE)]

    async def go():
        engine, es = new_stream(keepalive_s=30)
        t = produce(engine.sink, sent, per_step=per_step, pause_s=pause_s)
        batches = [b async for b in es.batches()]
        t.join()
        return es, batches

    es, batches = run(go())
    got = [ev for b in batches for ev in b]
    assert got == sent  # same objects, same order, none twice
    assert [type(e) for e in got].count(Finished) == 1 and got[-1] is sent[-1]
    assert es.done and all(batches)
    # No hand-off is wasted: each releases the parked consumer, which takes a batch. (Alone, a
    # stream's later events of a step may need one of their own: see _Bridge._pass.)
    assert es.num_wakeups <= len(batches)


def test_batches_are_never_empty_and_end_at_finished():
    sent = deltas(2000) + [Finished("length", USAGE)]

    async def go():
        engine, es = new_stream(keepalive_s=30)
        t = produce(engine.sink, sent, per_step=16, pause_s=0.0001)
        batches = [b async for b in es.batches()]
        t.join()
        return es, batches

    es, batches = run(go())
    assert all(isinstance(b, list) and b for b in batches)
    assert [ev for b in batches for ev in b] == sent
    assert isinstance(batches[-1][-1], Finished)
    assert es.num_wakeups <= len(batches)


def test_a_burst_while_the_consumer_waits_costs_one_hand_off_and_comes_as_one_batch():
    sent = [Admitted(0)] + deltas(100)

    async def go():
        engine, es = new_stream(keepalive_s=30)
        it = es.batches()
        nxt = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.01)  # the consumer is parked
        assert not nxt.done()
        # One engine step of 101 events while the loop is blocked (join): it cannot run the
        # wake-up in between, so only the first event schedules one.
        produce(engine.sink, sent, per_step=len(sent)).join()
        assert es.num_wakeups == 1
        first = await nxt
        # Several more steps while the loop is busy (blocked): the consumer is not parked, so
        # the engine thread schedules nothing; the next batch holds all of them.
        more = deltas(30) + [Finished("stop", USAGE)]
        produce(engine.sink, more, per_step=5).join()
        second = await it.__anext__()
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        return es, first, second, more

    es, first, second, more = run(go())
    assert first == sent and second == more
    assert es.num_wakeups == 1


def test_one_hand_off_per_engine_step_for_all_streams_of_a_loop():
    num_streams, num_steps = 8, 200

    async def go():
        pairs = [new_stream(keepalive_s=30) for _ in range(num_streams)]
        streams = [es for _, es in pairs]
        sent = [deltas(num_steps) + [Finished("stop", USAGE)] for _ in streams]

        async def consume(es):
            return [b async for b in es.batches()]

        tasks = [asyncio.ensure_future(consume(es)) for es in streams]
        await asyncio.sleep(0.01)  # all parked
        # One engine step: one event per request, emitted while the loop is blocked.
        def step(k):
            for (engine, _), evs in zip(pairs, sent):
                engine.sink(evs[k])

        t = threading.Thread(target=step, args=(0,))
        t.start()
        t.join()
        assert streams[0].num_wakeups == 1  # eight events, one hand-off
        await asyncio.sleep(0.01)

        def rest():  # the other steps, racing the consumers
            for k in range(1, num_steps + 1):
                step(k)
                time.sleep(0.0002)

        t = threading.Thread(target=rest)
        t.start()
        results = await asyncio.gather(*tasks)
        t.join()
        return streams, sent, results

    streams, sent, results = run(go())
    for evs, batches in zip(sent, results):
        assert [ev for b in batches for ev in b] == evs
    assert streams[0]._bridge.num_parked == 0 and streams[0]._bridge.num_streams == 0
    # Racing: a step's first hand-off lets the loop thread take the GIL before the step's other
    # events are queued; they come during its passes and need no hand-off of their own.
    assert streams[0].num_wakeups <= num_steps + 1


def test_keepalive_marker_while_nothing_arrives():
    async def go():
        engine, es = new_stream(keepalive_s=0.05)
        out = []
        async for ev in es.events():
            out.append(ev)
            if sum(x is KEEPALIVE for x in out) == 3:
                engine.sink(TextDelta("late", [7]))
                engine.sink(Finished("stop", USAGE))
        return out

    out = run(go())
    assert out[:3] == [KEEPALIVE] * 3
    assert isinstance(out[-2], TextDelta) and isinstance(out[-1], Finished)


def test_prefill_progress_does_not_put_the_keepalive_off():
    """Progress events reach no client: a prefill that reports every 20 ms still gets markers."""

    async def go():
        engine, es = new_stream(keepalive_s=0.1)

        def prefill():
            for k in range(20):  # 0.4 s of chunks
                engine.sink(PrefillProgress(k * 64, 20 * 64))
                time.sleep(0.02)
            engine.sink(TextDelta("a", [1]))
            engine.sink(Finished("stop", USAGE))

        t = threading.Thread(target=prefill)
        t.start()
        out = [ev async for ev in es.events()]
        t.join()
        return out

    out = run(go())
    assert sum(ev is KEEPALIVE for ev in out) >= 2
    assert [type(ev) for ev in out if ev is not KEEPALIVE] == [PrefillProgress] * 20 + [TextDelta, Finished]


def test_no_keepalive_marker_when_not_asked():
    async def go():
        engine, es = new_stream(keepalive_s=0.01)
        threading.Timer(0.2, lambda: engine.sink(Finished("stop", USAGE))).start()
        return [ev async for ev in es.events(keepalive=False)]

    out = run(go())
    assert len(out) == 1 and isinstance(out[0], Finished)


def test_close_aborts_an_unfinished_request_once_and_ends_the_stream():
    async def go():
        engine, es = new_stream(keepalive_s=30)
        t = produce(engine.sink, deltas(5))
        t.join()
        got = []
        async for batch in es.batches():
            got += batch
            es.close()  # the client went away
            es.close()
        return engine, es, got

    engine, es, got = run(go())
    assert engine.aborted == [es.request.request_id]
    assert es.done and got == got[:5] and all(isinstance(e, TextDelta) for e in got)
    assert es._bridge.num_streams == 0


def test_close_after_finished_does_not_abort():
    async def go():
        engine, es = new_stream()
        engine.sink(TextDelta("a", [1]))
        engine.sink(Failed(RuntimeError("boom")))
        got = [ev async for ev in es.events()]
        es.close()
        return engine, got

    engine, got = run(go())
    assert engine.aborted == [] and isinstance(got[-1], Failed)


def test_observer_sees_the_last_event_on_the_engine_thread_and_its_fault_costs_nothing():
    seen = []

    def observer(model_id, request, event):
        seen.append((model_id, type(event).__name__, threading.current_thread() is not threading.main_thread()))
        raise RuntimeError("metrics broke")

    async def go():
        engine, es = new_stream(observer=observer)
        sent = deltas(3) + [Finished("stop", USAGE)]
        produce(engine.sink, sent).join()
        return sent, [ev async for ev in es.events()]

    sent, got = run(go())
    assert got == sent and seen == [("fake", "Finished", True)]


def test_events_after_the_loop_closed_are_dropped_quietly():
    holder = {}

    async def go():
        engine, es = new_stream()
        holder["engine"] = engine
        it = es.batches()
        nxt = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # parked: the next event would schedule a wake-up
        nxt.cancel()
        await asyncio.gather(nxt, return_exceptions=True)
        assert es._bridge.num_parked == 0 and es._waiter is None

    run(go())
    produce(holder["engine"].sink, deltas(3) + [Finished("stop", USAGE)]).join()  # no RuntimeError


def test_racing_producer_and_slow_consumer_lose_nothing():
    rng = random.Random(0)
    sent = deltas(1500) + [Finished("stop", USAGE)]

    async def go():
        engine, es = new_stream(keepalive_s=30)

        def run_producer():
            for ev in sent:
                engine.sink(ev)
                if rng.random() < 0.05:
                    time.sleep(rng.random() * 0.001)

        t = threading.Thread(target=run_producer)
        t.start()
        got = []
        async for batch in es.batches(keepalive=False):
            got += batch
            if rng.random() < 0.3:
                time.sleep(0.0005)  # the loop is busy elsewhere
            await asyncio.sleep(0)
        t.join()
        return got

    assert run(go()) == sent




TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.mark.parametrize("kw", [{}, {"think": ("<think>", "</think>")},
                                {"tool_dialect": "hermes", "tools": TOOLS, "think": ("<think>", "</think>")}])
def test_model_turn_events_do_not_depend_on_how_engine_events_are_batched(kw):
    text = ('<think>Plan it.</think>Writing the file.\n<tool_call>\n{"name": "write", '
            '"arguments": {"path": "a.txt"}}\n</tool_call>')
    engine = [Admitted(4)] + [TextDelta(text[i:i + 3], [i]) for i in range(0, len(text), 3)] + [Finished("stop", USAGE)]

    def turn_events(batches):
        async def go():
            turn = ModelTurn(BatchedFake(batches), **kw)
            return [b async for b in turn.batches(admitted=True)]

        out = asyncio.run(go())
        assert all(out) and isinstance(out[-1][-1], Finished)
        # tool-call ids are random per parser: compare everything else
        return [ToolCallStart(ev.index, "id", ev.name) if isinstance(ev, ToolCallStart) else ev for b in out for ev in b]

    one_by_one = turn_events([[ev] for ev in engine])
    assert turn_events([engine]) == one_by_one
    assert turn_events([engine[i:i + 7] for i in range(0, len(engine), 7)]) == one_by_one
    assert isinstance(one_by_one[0], Admitted)
    if not kw:
        assert "".join(e.text for e in one_by_one if isinstance(e, ContentDelta)) == text

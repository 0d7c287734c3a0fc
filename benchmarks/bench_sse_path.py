"""Micro-benchmark of the serving path: engine thread -> EventStream -> ModelTurn -> OpenAI chunks.

No server and no model. A producer thread stands in for the engine and calls each request's sink
the way the engine does (one `TextDelta` per request per step, then `Finished`); the consumer side
is omlx's own code: `omlx.api.sse.EventStream`, `omlx.api.turn.ModelTurn` and the streaming loop of
the OpenAI chat route (`omlx.api.openai._stream`), writing to a stand-in for Sanic's response whose
``send`` is one chunked-encoded ``transport.write`` to a pipe that another process drains (Sanic's
own per-send work is not in these figures, so they understate what fewer sends save). The loop is
uvloop by default, as under Sanic.

Two measurements, each for 1 and 8 concurrent streams:

- flood: the producer emits ``--steps`` steps back to back (no pause): events/s from the first
  event to the last chunk written, and the producer thread's CPU time per event.
- paced: each step holds the GIL for ``--cpu-us`` (the engine's Python work) and then releases it
  for ``--gpu-us`` (waiting on the GPU), as a real step does. Steps/s with the serving path attached
  against the same producer with sinks that drop every event ("engine alone"): the slowdown is
  what the serving path costs the engine.

Both count ``call_soon_threadsafe`` hand-offs (the loop's method is wrapped) and ``send`` calls,
and hash the bytes of stream 0 (fixed ids and timestamps), so two trees can be compared byte for
byte. Run it against another tree with PYTHONPATH::

    python benchmarks/bench_sse_path.py                         # the tree it is in
    git worktree add /tmp/sse-old <commit>
    PYTHONPATH=/tmp/sse-old python benchmarks/bench_sse_path.py # the old code, same script
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import omlx
from omlx.api import openai as openai_routes
from omlx.api.sse import EventStream
from omlx.api.turn import ModelTurn
from omlx.request import Finished, Request, SamplingParams, TextDelta, Usage

TEXT = " token"  # one short word per step, like a real decode step
RID, CREATED, MODEL = "chatcmpl-bench0000000000000000", 1_700_000_000, "bench-model"


class FakeEngine:
    """submit() keeps the sink; the producer thread calls it."""

    model_id = "bench"

    def __init__(self) -> None:
        self.sink: Any = None

    def submit(self, request: Request, sink: Any) -> None:
        self.sink = sink

    def abort(self, request_id: str) -> None:
        pass


class PipeResponse:
    """Sanic's HTTPResponse as far as the stream loop sees it: send() and eof()."""

    def __init__(self, transport: asyncio.WriteTransport, keep: bool):
        self.transport = transport
        self.num_sends = 0
        self.num_bytes = 0
        self.hash = hashlib.sha256() if keep else None

    async def send(self, data: str) -> None:
        b = data.encode()
        self.transport.write(b"%x\r\n%b\r\n" % (len(b), b))  # HTTP/1.1 chunked, as Sanic writes it
        self.num_sends += 1
        self.num_bytes += len(b)
        if self.hash is not None:
            self.hash.update(b)

    async def eof(self) -> None:
        self.transport.write(b"0\r\n\r\n")


class _Pipe(asyncio.Protocol):
    def __init__(self) -> None:
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)


class FakeHttp:
    def __init__(self, response: PipeResponse):
        self.response = response

    async def respond(self, **_: Any) -> PipeResponse:
        return self.response


def busy(seconds: float) -> None:
    """Hold the GIL for ``seconds`` (the engine's Python work of one step)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def produce(sinks: list[Any], num_steps: int, cpu_s: float, gpu_s: float, out: dict[str, float]) -> None:
    t0, c0 = time.perf_counter(), time.thread_time()
    for k in range(num_steps):
        if cpu_s:
            busy(cpu_s)
        if gpu_s:
            time.sleep(gpu_s)
        ids = [k]
        for sink in sinks:
            sink(TextDelta(TEXT, ids))
    usage = Usage(16, num_steps)
    for sink in sinks:
        sink(Finished("length", usage))
    out["producer_s"] = time.perf_counter() - t0
    out["producer_cpu_s"] = time.thread_time() - c0


def engine_alone(num_streams: int, num_steps: int, cpu_s: float, gpu_s: float) -> float:
    """Steps/s of the producer with sinks that drop every event."""
    out: dict[str, float] = {}
    produce([lambda ev: None] * num_streams, num_steps, cpu_s, gpu_s, out)
    return num_steps / out["producer_s"]


def counting_loop(kind: str) -> Any:
    """A loop factory whose loops count ``call_soon_threadsafe`` (only the sinks call it here)."""
    if kind == "uvloop":
        import uvloop

        base: Any = uvloop.Loop
    else:
        base = asyncio.SelectorEventLoop

    class CountingLoop(base):  # type: ignore[misc, valid-type]
        num_handoffs = 0

        def call_soon_threadsafe(self, callback: Any, *args: Any, **kw: Any) -> Any:
            self.num_handoffs += 1
            return super().call_soon_threadsafe(callback, *args, **kw)

    return CountingLoop


async def serve(num_streams: int, num_steps: int, cpu_s: float, gpu_s: float) -> dict[str, Any]:
    loop: Any = asyncio.get_running_loop()
    # A pipe drained by `cat` in another process (uvloop cannot write to /dev/null itself).
    rfd, wfd = os.pipe()
    drain = subprocess.Popen(["cat"], stdin=rfd, stdout=subprocess.DEVNULL)
    os.close(rfd)
    transport, pipe = await loop.connect_write_pipe(_Pipe, os.fdopen(wfd, "wb", buffering=0))
    p = SimpleNamespace(model_name=MODEL, include_usage=True, request=SimpleNamespace(sampling=SamplingParams()))
    engines, responses, tasks = [], [], []
    for i in range(num_streams):
        engine = FakeEngine()
        es = EventStream(engine, Request("bench", [1, 2, 3], SamplingParams()), keepalive_s=30.0)
        turn = ModelTurn(es)
        turn.start()
        resp = PipeResponse(transport, keep=i == 0)
        engines.append(engine)
        responses.append(resp)
        tasks.append(asyncio.ensure_future(openai_routes._stream(FakeHttp(resp), turn, p, RID, CREATED, True)))
    await asyncio.sleep(0.05)  # every stream has sent its role chunk and waits
    sends0 = sum(r.num_sends for r in responses)
    prod: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.thread_time()  # this coroutine runs on the loop's thread
    thread = threading.Thread(target=produce, args=([e.sink for e in engines], num_steps, cpu_s, gpu_s, prod))
    thread.start()
    await asyncio.gather(*tasks)
    wall_s, loop_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    thread.join()
    transport.close()
    await pipe.closed
    drain.wait()
    num_handoffs = loop.num_handoffs
    num_events = num_streams * (num_steps + 1)
    return {
        "num_streams": num_streams, "num_steps": num_steps, "num_events": num_events,
        "wall_s": wall_s, "events_per_s": num_events / wall_s, "steps_per_s": num_steps / wall_s,
        "num_handoffs": num_handoffs, "handoffs_per_step": num_handoffs / (num_steps + 1),
        "num_sends": sum(r.num_sends for r in responses) - sends0,
        "producer_cpu_us_per_event": 1e6 * prod["producer_cpu_s"] / num_events,
        "loop_cpu_us_per_event": 1e6 * loop_cpu_s / num_events,
        "bytes_stream0": responses[0].num_bytes, "sha256_stream0": responses[0].hash.hexdigest(),
    }


def tree_commit() -> str:
    root = Path(omlx.__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() + ("" if not _dirty(root) else "+dirty")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _dirty(root: Path) -> bool:
    r = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "omlx"], capture_output=True, text=True)
    return bool(r.stdout.strip())


def run_serve(loop_kind: str, *args: Any) -> dict[str, Any]:
    with asyncio.Runner(loop_factory=counting_loop(loop_kind)) as runner:
        return runner.run(serve(*args))


def median_run(fn: Any, reps: int) -> dict[str, Any]:
    runs = [fn() for _ in range(reps)]
    runs.sort(key=lambda r: r["wall_s"])
    out = dict(runs[len(runs) // 2])
    out["wall_s_all"] = [r["wall_s"] for r in runs]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000, help="flood: steps per run (default 20000)")
    ap.add_argument("--paced-steps", type=int, default=400, help="paced: steps per run (default 400)")
    ap.add_argument("--cpu-us", type=float, default=1500.0, help="paced: GIL-holding work per step (µs)")
    ap.add_argument("--gpu-us", type=float, default=4000.0, help="paced: GIL-free wait per step (µs)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the median run is reported")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                    help="event loop (default uvloop: what Sanic, hence omlx serve, runs on when installed)")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the figures here (default benchmarks/results/sse_path-<time>.json)")
    args = ap.parse_args()
    cpu_s, gpu_s = args.cpu_us * 1e-6, args.gpu_us * 1e-6
    result: dict[str, Any] = {"omlx": str(Path(omlx.__file__).parent), "commit": tree_commit(), "loop": args.loop,
                              "loadavg_start": os.getloadavg(), "python": sys.version.split()[0], "runs": []}
    print(f"omlx from {result['omlx']} ({result['commit']}), {args.loop}; load {result['loadavg_start'][0]:.2f}")
    for n in args.streams:
        flood = median_run(lambda: run_serve(args.loop, n, args.steps, 0.0, 0.0), args.reps)
        alone = sorted(engine_alone(n, args.paced_steps, cpu_s, gpu_s) for _ in range(args.reps))[args.reps // 2]
        paced = median_run(lambda: run_serve(args.loop, n, args.paced_steps, cpu_s, gpu_s), args.reps)
        paced["engine_alone_steps_per_s"] = alone
        paced["slowdown"] = 1 - paced["steps_per_s"] / alone
        result["runs"].append({"flood": flood, "paced": paced})
        print(f"{n} stream(s), flood {args.steps} steps: {flood['events_per_s']:,.0f} events/s, "
              f"{flood['num_handoffs']} hand-offs ({flood['handoffs_per_step']:.2f}/step), {flood['num_sends']} sends, "
              f"CPU/event: loop {flood['loop_cpu_us_per_event']:.1f} µs, producer {flood['producer_cpu_us_per_event']:.1f} µs; sha256[stream 0] {flood['sha256_stream0'][:16]}")
        print(f"{n} stream(s), paced {args.cpu_us:.0f}+{args.gpu_us:.0f} µs/step: {paced['steps_per_s']:.1f} steps/s "
              f"against {alone:.1f} alone ({100 * paced['slowdown']:.1f}% slower), "
              f"{paced['handoffs_per_step']:.2f} hand-offs/step, {paced['num_sends']} sends, "
              f"CPU/event: loop {paced['loop_cpu_us_per_event']:.1f} µs, producer {paced['producer_cpu_us_per_event']:.1f} µs")
    result["loadavg_end"] = os.getloadavg()
    out = args.json or Path(__file__).resolve().parent / "results" / f"sse_path-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running `omlx bench` workloads against one or two servers, interleaved.

For every repeat, scenario and step, each target runs the step in turn (the order of targets
alternates between repeats, so neither server always goes first on a warm machine), which is
what makes a side-by-side comparison fair on a machine whose speed drifts. The ``restart``
scenario needs a server this process started (`ManagedServer`); on any other target it is
skipped with the reason in the JSON.
Must not: import omlx's server; an omlx it manages is a child process spoken to over HTTP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from omlx.bench.client import MemoryProbe, StreamResult, Target, new_client, stream_chat
from omlx.bench.prompts import PromptFactory
from omlx.bench.workloads import Step, WorkloadConfig, build


class ManagedServer:
    """An ``omlx serve`` child process this benchmark starts, stops and starts again.

    Args:
        port: the port it listens on (127.0.0.1).
        args: extra ``omlx serve`` arguments (model, base path, cache flags...).
        log_path: where its output goes (appended).
    """

    def __init__(self, port: int, args: list[str], log_path: Path):
        self.port, self.args, self.log_path = port, args, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> float:
        """Start and wait for ``/health``; returns the seconds until it answered.

        Raises:
            RuntimeError: the process exited or did not answer within ``timeout_s``.
        """
        t0 = time.monotonic()
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "omlx", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omlx serve exited with {self.proc.returncode}; its log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code in (200, 503):
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"omlx serve did not answer within {timeout_s:.0f} s; its log: {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the server flushes its SSD tier), SIGKILL after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@dataclass(slots=True)
class StepRun:
    """One step on one target in one repeat: the wave's results and its figures."""

    target: str
    scenario: str
    step: str
    repeat: int
    results: list[StreamResult]
    wall_s: float
    peak_memory_bytes: int | None
    restart_s: float | None = None
    skipped: str | None = None

    def figures(self) -> dict[str, float | None]:
        """TTFT, TPOT, decode tok/s: medians over the wave's streams; aggregate tok/s: all its
        generated tokens / its wall time; cached and prompt tokens: medians."""
        ok = [r for r in self.results if r.ok]

        def med(values: list[float | None]) -> float | None:
            v = [x for x in values if x is not None]
            return statistics.median(v) if v else None

        num_tokens = sum(r.num_tokens for r in ok)
        return {
            "ttft_s": med([r.ttft_s for r in ok]),
            "tpot_s": med([r.tpot_s for r in ok]),
            "decode_tps": med([r.decode_tps for r in ok]),
            "aggregate_tps": num_tokens / self.wall_s if ok and self.wall_s > 0 else None,
            "prompt_tokens": med([r.prompt_tokens for r in ok]),
            "cached_tokens": med([r.cached_tokens for r in ok]),
            "completion_tokens": med([r.num_tokens for r in ok]),
            "peak_memory_bytes": self.peak_memory_bytes,
            "restart_s": self.restart_s,
        }


@dataclass(slots=True)
class BenchRun:
    """Everything measured: every StepRun in the order it ran."""

    runs: list[StepRun] = field(default_factory=list)


async def run_step(target: Target, step: Step, client: httpx.AsyncClient) -> tuple[list[StreamResult], float, int | None]:
    """Send the step's bodies at once; returns results, wall seconds and the peak memory."""
    probe = MemoryProbe(client, target)
    probe.start()
    t0 = time.perf_counter()
    results = await asyncio.gather(*[stream_chat(client, target, b) for b in step.bodies])
    wall_s = time.perf_counter() - t0
    peak = await probe.stop()
    return list(results), wall_s, peak


def plan(scenarios: list[str], pf: PromptFactory, cfg: WorkloadConfig, repeats: int) -> list[tuple[int, str, list[Step]]]:
    """(repeat, scenario, steps) in run order; builds every prompt up front."""
    return [(rep, sc, build(sc, pf, cfg, rep)) for rep in range(repeats) for sc in scenarios]


async def run_all(targets: list[Target], work: list[tuple[int, str, list[Step]]],
                  managed: dict[str, ManagedServer], on_step: Callable[[str], None] | None = None,
                  timeout_s: float = 900.0) -> BenchRun:
    """Run every step on every target, interleaved (target order alternates by repeat).

    Args:
        managed: targets (by label) whose server this process started; only they run ``restart``.
        on_step: called with a description after each step (progress bars).
    """
    out = BenchRun()
    max_wave = max((len(s.bodies) for _, _, steps in work for s in steps), default=1)
    async with new_client(max_wave, timeout_s) as client:
        for rep, scenario, steps in work:
            order = targets if rep % 2 == 0 else list(reversed(targets))
            for step in steps:
                for t in order:
                    server = managed.get(t.label)
                    if scenario == "restart" and server is None:
                        out.runs.append(StepRun(t.label, scenario, step.name, rep, [], 0.0, None,
                                                skipped="restart needs a server that omlx bench starts (--serve)"))
                    else:
                        restart_s = None
                        if step.restart_before and server is not None:
                            server.stop()
                            restart_s = server.start()
                        results, wall_s, peak = await run_step(t, step, client)
                        out.runs.append(StepRun(t.label, scenario, step.name, rep, results, wall_s, peak, restart_s))
                    if on_step:
                        on_step(f"{scenario}/{step.name} on {t.label} (repeat {rep + 1})")
    return out


def count_steps(targets: list[Target], work: list[tuple[int, str, list[Step]]]) -> int:
    return len(targets) * sum(len(steps) for _, _, steps in work)


def describe_errors(run: StepRun) -> list[str]:
    return [r.error for r in run.results if not r.ok and r.error]


def as_json_rows(bench: BenchRun) -> list[dict[str, Any]]:
    """One row per step run (figures rounded), for the JSON's ``runs``."""
    rows = []
    for r in bench.runs:
        row: dict[str, Any] = {"target": r.target, "scenario": r.scenario, "step": r.step, "repeat": r.repeat,
                               "num_requests": len(r.results), "num_errors": sum(1 for x in r.results if not x.ok),
                               "wall_s": round(r.wall_s, 4), **{k: _round(v) for k, v in r.figures().items()}}
        if r.skipped:
            row["skipped"] = r.skipped
        if errs := describe_errors(r):
            row["errors"] = errs[:3]
        rows.append(row)
    return rows


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)

"""One `omlx bench` invocation: targets, token counter, workloads, progress, result JSON.

`run_session` is what ``omlx bench`` calls after parsing its flags (cli/bench.py); it returns
the result (a JSON-ready dict) and the exit code. Must not: import omlx's server.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import platform
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from omlx.bench import report
from omlx.bench.client import ServerCounter, Target, list_models
from omlx.bench.prompts import EstimateCounter, PromptFactory, TokenCounter, TokenizerCounter
from omlx.bench.runner import ManagedServer, as_json_rows, count_steps, plan, run_all
from omlx.bench.workloads import SCENARIOS, WorkloadConfig
from omlx.errors import OmlxError

SCHEMA_VERSION = 1


class BenchError(OmlxError):
    """A benchmark that cannot start (server unreachable, no model, bad flag); exit code 2."""


@dataclass(slots=True)
class BenchOptions:
    """Flags of ``omlx bench`` (see cli/bench.py for their help)."""

    scenarios: list[str]
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    compare_url: str | None = None
    compare_model: str | None = None
    compare_api_key: str | None = None
    repeat: int = 3
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    tokenizer: str | None = None
    serve: bool = False
    serve_args: list[str] = field(default_factory=list)
    min_ratio: float | None = None
    timeout_s: float = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pick_model(t: Target) -> None:
    try:
        ids = list_models(t)
    except httpx.HTTPError as e:
        raise BenchError(f"{t.label} server {t.base_url} cannot be reached or refused /v1/models: {e}") from e
    if t.model is None:
        if not ids:
            raise BenchError(f"{t.label} server {t.base_url} lists no model; pass --model")
        t.model = ids[0]


def _counter(opts: BenchOptions, base: Target) -> TokenCounter:
    if opts.tokenizer:
        return TokenizerCounter(Path(opts.tokenizer))
    sc = ServerCounter(base)
    if sc.probe():
        return sc
    sc.close()
    return EstimateCounter()


def run_session(opts: BenchOptions, console: Any = None, progress: bool = True) -> tuple[dict[str, Any], int]:
    """Run the benchmark; returns (result, exit code: 0 ok, 1 below ``min_ratio`` or a request
    failed, 2 could not run).

    Raises:
        BenchError: nothing could be measured (unreachable server, unknown scenario...).
    """
    unknown = [s for s in opts.scenarios if s not in SCENARIOS]
    if unknown:
        raise BenchError(f"unknown scenario(s) {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    if opts.min_ratio is not None and not opts.compare_url:
        raise BenchError("--min-ratio needs --compare URL (a ratio is between two servers)")
    managed: dict[str, ManagedServer] = {}
    server: ManagedServer | None = None
    if opts.serve:
        log_dir = Path(tempfile.mkdtemp(prefix="omlx-bench-"))
        server = ManagedServer(_free_port(), opts.serve_args, log_dir / "server.log")
        server.start()
        managed["base"] = server
    try:
        base = Target("base", (server.url if server else (opts.base_url or "http://127.0.0.1:8000")).rstrip("/"),
                      opts.model, opts.api_key)
        targets = [base]
        if opts.compare_url:
            targets.append(Target("compare", opts.compare_url.rstrip("/"), opts.compare_model or opts.model,
                                  opts.compare_api_key if opts.compare_api_key is not None else opts.api_key))
        for t in targets:
            _pick_model(t)
        counter = _counter(opts, base)
        pf = PromptFactory(counter)
        work = plan(opts.scenarios, pf, opts.workload, opts.repeat)
        started = _dt.datetime.now(_dt.timezone.utc)
        bench = _run_with_progress(targets, work, managed, opts, console if progress else None)
    finally:
        if server is not None:
            server.stop()
    labels = [t.label for t in targets]
    scenarios = report.aggregate(bench, labels)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "started_at": started.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "config": {"scenarios": opts.scenarios, "repeat": opts.repeat, **asdict(opts.workload),
                   "token_counter": counter.source, "managed_server": bool(server),
                   "serve_args": opts.serve_args if server else None},
        "targets": {t.label: {"url": t.base_url, "model": t.model} for t in targets},
        "figures": list(report.FIGURES),
        "scenarios": scenarios,
        "runs": as_json_rows(bench),
    }
    code = 0
    num_errors = sum(1 for r in bench.runs for x in r.results if not x.ok)
    result["num_errors"] = num_errors
    if num_errors:
        code = 1
    if len(targets) == 2:
        overall = report.overall_ratios(scenarios)
        result["overall_ratio"] = overall
        if opts.min_ratio is not None:
            failed = report.check_min_ratio(overall, opts.min_ratio)
            result["min_ratio"] = {"min": opts.min_ratio, "passed": not failed, "below": failed}
            if failed:
                code = 1
    return result, code


def _run_with_progress(targets: list[Target], work: list[Any], managed: dict[str, ManagedServer],
                       opts: BenchOptions, console: Any) -> Any:
    if console is None:
        return asyncio.run(run_all(targets, work, managed, timeout_s=opts.timeout_s))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task("omlx bench", total=count_steps(targets, work))

        def on_step(desc: str) -> None:
            prog.update(task, advance=1, description=desc)

        return asyncio.run(run_all(targets, work, managed, on_step=on_step, timeout_s=opts.timeout_s))

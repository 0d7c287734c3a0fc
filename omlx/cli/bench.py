"""`omlx bench`: measure a server (and compare it with another) on seeded workloads.

JSON goes to stdout (or ``--json FILE``); the progress bar and the table go to stderr, so
``omlx bench ... | jq`` works. Exit codes: 0 ok, 1 a request failed or a ratio is below
``--min-ratio``, 2 the benchmark could not run.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated, Optional

import typer

SCENARIO_HELP = "Scenarios to run: decode, concurrency, cache, agent, restart (default: decode concurrency cache agent)."


def bench(
    scenarios: Annotated[Optional[list[str]], typer.Argument(help=SCENARIO_HELP, show_default=False)] = None,
    base_url: Annotated[str, typer.Option(help="Server under test (OpenAI-compatible, without /v1).")] = "http://127.0.0.1:8000",
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model id (default: the first of /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="API key of the server under test.")] = None,
    compare: Annotated[Optional[str], typer.Option("--compare", help="A second server: the same workload runs on both, interleaved, and ratios are printed.")] = None,
    compare_model: Annotated[Optional[str], typer.Option(help="Model id on the --compare server (default: --model, else its first).")] = None,
    compare_api_key: Annotated[Optional[str], typer.Option(help="API key of the --compare server (default: --api-key).")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Runs of every step; figures are median, min and max over them.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of every prompt (same seed, same prompts).")] = 0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens of decode, concurrency and edit streams.")] = 128,
    reply_tokens: Annotated[int, typer.Option(min=1, help="Output tokens of cache, agent and restart requests.")] = 16,
    prompt_tokens: Annotated[int, typer.Option(min=16, help="Tokens of the long prompt (cache, restart) and the agent's system prompt.")] = 2048,
    concurrency: Annotated[str, typer.Option(help="Stream counts of the concurrency scenario, comma-separated.")] = "1,2,4,8,16",
    agent_turns: Annotated[int, typer.Option(min=2, help="Requests in the agent trace.")] = 6,
    tool_result_tokens: Annotated[int, typer.Option(min=8, help="Tokens of each tool result in the agent trace.")] = 256,
    tokenizer: Annotated[Optional[str], typer.Option(help="Model folder whose tokenizer.json sizes the prompts (default: the server's /v1/messages/count_tokens, else an estimate).")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Start an omlx server for this run (needed by the restart scenario) instead of using --base-url.")] = False,
    serve_args: Annotated[str, typer.Option(help="Extra `omlx serve` arguments for --serve, one string (e.g. \"--model X --base-path DIR\").")] = "",
    min_ratio: Annotated[Optional[float], typer.Option(help="With --compare: exit 1 when any overall ratio (TTFT, TPOT, decode and aggregate tok/s; above 1 = base better) is below this.")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the JSON here instead of stdout.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no table.")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds one request may take.")] = 900.0,
) -> None:
    """Benchmark an OpenAI-compatible server: TTFT, TPOT, decode and aggregate tok/s, cached
    tokens and peak memory, each as median/min/max over --repeat runs."""
    from rich.console import Console

    from omlx.bench.session import BenchError, BenchOptions, run_session
    from omlx.bench.workloads import WorkloadConfig

    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    try:
        levels = tuple(int(x) for x in concurrency.split(",") if x.strip())
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        err.print(f"omlx bench: --concurrency must be positive integers separated by commas (got {concurrency!r})")
        raise typer.Exit(2) from None
    opts = BenchOptions(
        scenarios=list(scenarios or ["decode", "concurrency", "cache", "agent"]),
        base_url=base_url, model=model, api_key=api_key, compare_url=compare, compare_model=compare_model,
        compare_api_key=compare_api_key, repeat=repeat,
        workload=WorkloadConfig(seed=seed, max_tokens=max_tokens, reply_tokens=reply_tokens, prompt_tokens=prompt_tokens,
                                concurrency=levels, agent_turns=agent_turns, tool_result_tokens=tool_result_tokens),
        tokenizer=tokenizer, serve=serve, serve_args=shlex.split(serve_args), min_ratio=min_ratio, timeout_s=timeout_s)
    try:
        result, code = run_session(opts, console=err, progress=not quiet)
    except (BenchError, RuntimeError, FileNotFoundError) as e:
        err.print(f"omlx bench: {e}")
        raise typer.Exit(2) from e
    text = json.dumps(result, indent=2)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    else:
        typer.echo(text)
    if not quiet:
        from omlx.bench.report import render_table

        render_table(result, err)
        if "min_ratio" in result and not result["min_ratio"]["passed"]:
            err.print(f"below --min-ratio {min_ratio}: {', '.join(result['min_ratio']['below'])}")
        if result["num_errors"]:
            err.print(f"{result['num_errors']} request(s) failed; see 'errors' in the JSON")
    raise typer.Exit(code)

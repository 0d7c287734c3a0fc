"""`omlx` root command: registers one sub-app per noun. Heavy imports live in command bodies."""

from __future__ import annotations

import typer

from omlx.cli import bench as bench_cli
from omlx.cli import cache as cache_cli
from omlx.cli import cluster as cluster_cli
from omlx.cli import doctor as doctor_cli
from omlx.cli import launch as launch_cli
from omlx.cli import models as models_cli
from omlx.cli import serve as serve_cli
from omlx.cli import service as service_cli
from omlx.cli.common import OneLineErrors

app = typer.Typer(name="omlx", cls=OneLineErrors, help="A local LLM inference server on MLX.", no_args_is_help=True, add_completion=False)
app.command("serve", help="Run the server (OpenAI and Anthropic APIs).")(serve_cli.serve)
app.add_typer(models_cli.app, name="models")
app.add_typer(cache_cli.app, name="cache")
app.add_typer(cluster_cli.app, name="cluster")
app.command("bench", help="Benchmark a server (or compare two): TTFT, TPOT, tok/s, cache, memory; JSON out.")(bench_cli.bench)
app.command("doctor", help="Check this machine and the setup; exit 1 on an error.")(doctor_cli.doctor)
app.command("launch", help="Run Claude Code, Codex or opencode against omlx (starting the server if none runs): "
            "omlx launch claude -- ARGS.")(launch_cli.launch)
app.command("start", help="Run omlx serve in the background (launchd, systemd user unit or pid file) with serve's "
            "options; waits for /health.")(service_cli.start)
app.command("stop", help="Stop the background server (SIGTERM; it writes its KV cache to disk first).")(service_cli.stop)
app.command("restart", help="Restart the background server with the settings it was started with.")(service_cli.restart)
app.command("status", help="URL, models, pid, uptime, memory and cache hit rate of the background server(s).")(service_cli.status)
app.command("logs", help="Show (-n N) or follow (-f) the background server's log.")(service_cli.logs)


@app.callback()
def _root() -> None:
    """omlx: serve local models over the OpenAI and Anthropic APIs."""

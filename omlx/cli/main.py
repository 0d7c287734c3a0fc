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

app = typer.Typer(name="omlx", help="A local LLM inference server on MLX.", no_args_is_help=True, add_completion=False)
app.command("serve", help="Run the server (OpenAI and Anthropic APIs).")(serve_cli.serve)
app.add_typer(models_cli.app, name="models")
app.add_typer(cache_cli.app, name="cache")
app.add_typer(cluster_cli.app, name="cluster")
app.command("bench", help="Benchmark a server (or compare two): TTFT, TPOT, tok/s, cache, memory; JSON out.")(bench_cli.bench)
app.command("doctor", help="Check this machine and the setup; exit 1 on an error.")(doctor_cli.doctor)
app.command("launch", help="Run Claude Code, Codex or opencode against omlx (starting the server if none runs): "
            "omlx launch claude -- ARGS.")(launch_cli.launch)


@app.callback()
def _root() -> None:
    """omlx: serve local models over the OpenAI and Anthropic APIs."""

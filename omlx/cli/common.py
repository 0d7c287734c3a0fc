"""Helpers shared by CLI commands: logging set-up and config from flags."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

import typer

from omlx.config import ServerConfig, load_config
from omlx.errors import OmlxError


def setup_logging(level: str = "INFO") -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
        force=True,
    )
    # httpx logs every request at INFO (the cluster launcher polls its worker's /health).
    logging.getLogger("httpx").setLevel(logging.WARNING)


def config_from(flags: dict[str, Any], config_file: str | None) -> ServerConfig:
    """Build the config or exit with the reason (exit code 2)."""
    try:
        return load_config(flags, config_file=config_file)
    except OmlxError as e:
        typer.echo(f"omlx: {e.message}", err=True)
        raise typer.Exit(2) from e


def reexec_with_blas(enabled: bool, argv: Sequence[str]) -> None:
    """On Linux, re-run ``argv`` (after the interpreter) with OpenBLAS preloaded: MLX's wheel
    links a reference BLAS. Returns when disabled, already re-run, or no OpenBLAS is found."""
    if not enabled or os.environ.get("OMLX_BLAS_REEXEC") == "1":
        return
    from omlx.kernels.blas import preload_env

    env = preload_env(dict(os.environ))
    if env is None:
        return
    env["OMLX_BLAS_REEXEC"] = "1"
    os.execve(sys.executable, [sys.executable, *argv], env)

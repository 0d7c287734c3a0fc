"""Helpers shared by CLI commands: logging set-up and config from flags."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Sequence

import typer
from typer.core import TyperGroup

from omlx.config import ServerConfig, bad_value, expected, load_config, unknown_env
from omlx.errors import OmlxError

logger = logging.getLogger(__name__)


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


def config_from(flags: dict[str, Any], config_file: str | None, flag_names: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the config or exit with the reason (exit code 2).

    Args:
        flag_names: config key -> the flag the command takes it by, where that is not ``--`` + the
            key's last part, dashed (``memory.ceiling_bytes`` -> ``--memory-ceiling``); errors name it.
    """
    from omlx.tool_parsers import resolve_dialect_name

    try:
        return load_config(flags, config_file=config_file, flag_names=flag_names, resolve_dialect=resolve_dialect_name)
    except OmlxError as e:
        typer.echo(f"omlx: {e.message}", err=True)
        raise typer.Exit(2) from e


class OneLineErrors(TyperGroup):
    """The root command group: an option value its type refuses (``--port abc``) is one line and
    exit code 2, worded as the config's own errors (``omlx: bad value for --port: 'abc' (expected
    an integer), from the command line``), not Typer's usage box. Typer checks a typed option with
    pydantic before the config sees it; other usage mistakes (an unknown option) keep Typer's box."""

    def invoke(self, ctx: typer.Context) -> Any:
        from pydantic import ValidationError

        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:
            if not isinstance(e.__cause__, ValidationError) or e.param is None:
                raise
            err = e.__cause__.errors()[0]
            name = (e.param.opts or [e.param.name or "?"])[0]
            typer.echo(f"omlx: {bad_value(name, err.get('input'), expected(err), 'the command line')}", err=True)
            raise typer.Exit(2) from e


def warn_unknown_env() -> None:
    """Log a warning for each ``OMLX_*`` variable omlx does not read (`omlx.config.unknown_env`);
    call once, after `setup_logging`."""
    for line in unknown_env():
        logger.warning("%s", line)


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

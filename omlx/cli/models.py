"""`omlx models list|import`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from omlx.cli.common import config_from

app = typer.Typer(help="Manage local models.", no_args_is_help=True)


@app.command("list")
def list_models(
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")] = None,
) -> None:
    """List the models in <base-path>/models."""
    cfg = config_from({"base_path": base_path}, None)
    d = cfg.models_dir
    rows = sorted(p for p in d.iterdir() if (p / "config.json").exists()) if d.exists() else []
    if not rows:
        typer.echo(f"no models in {d} (the default model is imported on first `omlx serve`)")
        return
    for p in rows:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        typer.echo(f"{p.name}\t{size / 1e6:.0f} MB\t{p}")


@app.command("import")
def import_model_cmd(
    path: Annotated[str, typer.Argument(help="A .gguf file or an mlx-lm model folder.")],
    name: Annotated[Optional[str], typer.Option(help="Served id (default: the file or folder name).")] = None,
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")] = None,
) -> None:
    """Import a model into <base-path>/models."""
    from pathlib import Path

    from omlx.engine.embedded import import_model
    from omlx.errors import OmlxError

    cfg = config_from({"base_path": base_path}, None)
    try:
        dest = import_model(Path(path).expanduser(), cfg.models_dir, name)
    except (OmlxError, OSError, ValueError) as e:
        typer.echo(f"omlx: cannot import {path}: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(f"imported {dest.name} -> {dest}")

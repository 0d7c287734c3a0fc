"""`omlx models list|pull|import|rm`: the models on this machine (omlx's models folder and the
Hugging Face hub cache), fetching one from the hub, importing or quantizing one, removing one."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from omlx.cli.common import config_from
from omlx.units import format_bytes

app = typer.Typer(help="Manage local models (omlx's models folder and the Hugging Face hub cache).",
                  no_args_is_help=True)

_BASE = typer.Option(help="omlx's home (default ~/.omlx).")
_HUB = typer.Option(help="The Hugging Face hub cache (default: HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub).")


def _config(base_path: str | None, hub_cache_dir: str | None):
    return config_from({"base_path": base_path, "hub_cache_dir": hub_cache_dir}, None)


def _hub_cache(cfg):
    from omlx.engine import hub

    return cfg.hub_cache or hub.cache_dir(None)


def _fail(message: str) -> None:
    typer.echo(f"omlx: {message}", err=True)
    raise typer.Exit(1)


@app.command("list")
def list_models(
    base_path: Annotated[Optional[str], _BASE] = None,
    hub_cache_dir: Annotated[Optional[str], _HUB] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """List the models omlx can serve: source, size on disk, quantization, architecture, context
    length and whether the prefix cache is on for it."""
    import json

    from omlx.engine.catalogue import listing

    cfg = _config(base_path, hub_cache_dir)
    cache = _hub_cache(cfg)
    rows = listing(cfg.models_dir, cache, kv_bits=cfg.kv_bits, kv_group_size=cfg.kv_group_size,
                   cache_enabled=cfg.cache.enabled)
    if not rows:
        typer.echo(f"no models in {cfg.models_dir} or the hub cache {cache} (the default model is imported on "
                   "first `omlx serve`; `omlx models pull ORG/NAME` fetches one)")
        return
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("ID", "SOURCE", "SIZE", "QUANTIZATION", "ARCH", "CONTEXT", "PREFIX CACHE"):
        table.add_column(col, justify="right" if col in ("SIZE", "CONTEXT") else "left", no_wrap=col == "ID")
    for r in rows:
        table.add_row(r["id"], r["source"], format_bytes(r["size_bytes"], "MB", 0), r["quantization"],
                      r["architecture"] or "?", str(r["context_length"] or "?"), r["prefix_cache"])
    console = Console(highlight=False)
    if not console.is_terminal:  # piped: no terminal width to fit, keep rows whole
        console = Console(highlight=False, width=240)
    console.print(table)


@app.command("pull")
def pull_model(
    model: Annotated[str, typer.Argument(help="ORG/NAME or ORG/NAME@REVISION (a branch, tag or commit).")],
    hub_cache_dir: Annotated[Optional[str], _HUB] = None,
    base_path: Annotated[Optional[str], _BASE] = None,
) -> None:
    """Download an mlx-lm model from the Hugging Face Hub into the hub cache (HF_TOKEN, HF_ENDPOINT and
    HF_HUB_OFFLINE apply); then `omlx serve --model ORG/NAME` serves it. Resumes an interrupted pull."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    from omlx.engine import hub
    from omlx.engine.catalogue import HUB_CACHE, describe
    from omlx.errors import OmlxError

    ref = hub.parse_hub_id(model)
    if ref is None:
        _fail(f"{model!r} is not a hub model id; give ORG/NAME or ORG/NAME@REVISION (e.g. "
              "mlx-community/SmolLM2-135M-Instruct-4bit)")
        return
    cfg = _config(base_path, hub_cache_dir)
    cache = _hub_cache(cfg)
    console = Console(stderr=True, highlight=False)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=console, transient=False)
    task: list = []

    def on_total(n: int) -> None:
        task.append(progress.add_task(ref.model_id, total=n))
        progress.start()

    def on_bytes(n: int) -> None:
        if task:
            progress.advance(task[0], n)

    try:
        result = hub.pull(ref, cache, on_total=on_total, on_bytes=on_bytes)
    except OmlxError as e:
        progress.stop()
        _fail(f"cannot pull {model}: {e.message}")
        return
    except KeyboardInterrupt:
        progress.stop()
        _fail(f"pull of {model} interrupted; run it again to resume (finished files are kept)")
        return
    progress.stop()
    e = describe(result.model.model_id, HUB_CACHE, result.model.path, result.num_bytes)
    fetched = "already in the cache" if result.num_downloaded_bytes == 0 else f"fetched {format_bytes(result.num_downloaded_bytes, 'MB', 1)}"
    typer.echo(f"pulled {e.model_id} (commit {result.model.commit_hash[:12]}, {fetched}) into {e.path}")
    typer.echo(f"  {format_bytes(e.size_bytes, 'MB', 1)} on disk, {e.quantization}, {e.architecture or '?'}, "
               f"context {e.context_length or '?'}")
    typer.echo(f"  serve it: omlx serve --model {e.model_id}")


@app.command("import")
def import_model_cmd(
    path: Annotated[str, typer.Argument(help="A .gguf file or an mlx-lm model folder.")],
    name: Annotated[Optional[str], typer.Option(help="Served id (default: the file or folder name).")] = None,
    quantize: Annotated[Optional[int], typer.Option(help="Quantize the weights to 4 or 8 bits with mlx-lm's convert.")] = None,
    group_size: Annotated[int, typer.Option(help="Weights per quantization scale (with --quantize).")] = 64,
    keep_quantized: Annotated[bool, typer.Option(help="Keep a GGUF's Q4_0/Q4_1/Q8_0 weights quantized (converted "
                                                      "exactly, group size 32) instead of float32.")] = False,
    base_path: Annotated[Optional[str], _BASE] = None,
) -> None:
    """Import a model into <base-path>/models (a GGUF is converted, a folder copied or quantized)."""
    from pathlib import Path

    from omlx.engine.embedded import import_model
    from omlx.errors import OmlxError

    cfg = config_from({"base_path": base_path}, None)
    try:
        dest = import_model(Path(path).expanduser(), cfg.models_dir, name, quantize=quantize, group_size=group_size,
                            keep_quantized=keep_quantized)
    except (OmlxError, OSError, ValueError) as e:
        _fail(f"cannot import {path}: {getattr(e, 'message', e)}")
        return
    how = f", quantized to {quantize} bits (group size {group_size})" if quantize else (
        ", the GGUF's quantized weights kept (group size 32)" if keep_quantized else "")
    typer.echo(f"imported {dest.name} -> {dest}{how}")


@app.command("rm")
def remove_model(
    model: Annotated[str, typer.Argument(help="A model id from `omlx models list`.")],
    hub_cache: Annotated[bool, typer.Option("--hub-cache", help="Also delete from the shared Hugging Face hub cache "
                                                                "(mlx-lm, LM Studio and others read it too).")] = False,
    base_path: Annotated[Optional[str], _BASE] = None,
    hub_cache_dir: Annotated[Optional[str], _HUB] = None,
) -> None:
    """Remove a model omlx owns (a folder in <base-path>/models); one in the hub cache only with --hub-cache."""
    import shutil

    from omlx.engine import hub
    from omlx.engine.loader import is_safe_model_id

    cfg = _config(base_path, hub_cache_dir)
    folder = cfg.models_dir / model
    if is_safe_model_id(model) and (folder / "config.json").is_file():
        size = hub.snapshot_bytes(folder)
        shutil.rmtree(folder)
        typer.echo(f"removed {model} ({format_bytes(size)}) from {cfg.models_dir}")
        return
    ref = hub.parse_hub_id(model)
    cache = _hub_cache(cfg)
    if ref is None or not (cache / ("models--" + ref.repo_id.replace("/", "--"))).is_dir():
        _fail(f"no model {model!r} in {cfg.models_dir} or the hub cache {cache} (see `omlx models list`)")
        return
    if not hub_cache:
        _fail(f"{model} is in the shared Hugging Face hub cache ({cache}), which other programs (mlx-lm, LM Studio) "
              "use too; omlx does not delete from it unless asked: `omlx models rm --hub-cache " + model + "`")
        return
    freed = hub.remove(ref, cache)
    if not freed:
        _fail(f"nothing of {model} is in the hub cache {cache}")
        return
    typer.echo(f"removed {model} from the hub cache {cache} ({format_bytes(freed)} freed)")

"""`omlx cache stats|clear|verify`: the SSD KV tier on disk (no server needed)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from omlx.cli.common import config_from
from omlx.units import format_bytes

app = typer.Typer(help="Inspect and maintain the SSD KV cache.", no_args_is_help=True)

BasePath = Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")]
CacheDir = Annotated[Optional[str], typer.Option(help="SSD cache folder (default <base-path>/cache).")]


def _cache_dir(base_path: str | None, ssd_cache_dir: str | None):
    cfg = config_from({"base_path": base_path, "cache.ssd_cache_dir": ssd_cache_dir}, None)
    return cfg.ssd_cache_dir


@app.command("stats")
def stats(
    base_path: BasePath = None,
    ssd_cache_dir: CacheDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Files and bytes per namespace (model, block size, KV format, format version)."""
    from omlx.cache.blockfile import SSD_FORMAT_VERSION
    from omlx.cache.ssd import summarize_cache_dir

    root = _cache_dir(base_path, ssd_cache_dir)
    rows = summarize_cache_dir(root)
    if as_json:
        typer.echo(json.dumps({
            "dir": str(root),
            "format_version": SSD_FORMAT_VERSION,  # the block-file format this omlx reads and writes
            "num_files": sum(r.num_files for r in rows),
            "num_bytes": sum(r.num_bytes for r in rows),
            "namespaces": [{
                "digest": r.digest, "model_id": r.model_id, "num_files": r.num_files,
                "num_bytes": r.num_bytes, "num_temp_files": r.num_temp_files,
                "kv_format": r.namespace.kv_format if r.namespace else None,
                # tokens per block: a server started with another --block-size shares none of these
                "block_size": r.namespace.block_size if r.namespace else None,
                # cluster mode: each rank keeps the KV of its own layers in its own namespace
                "layers": [r.namespace.layer_start, r.namespace.layer_end] if r.namespace else None,
                # the block-file format its files were written in (None: not recorded); another is never read
                "format_version": r.format_version,
                # the layout its keys are computed with (a folder of another is never read)
                "key_format_version": r.namespace.format_version if r.namespace else None,
            } for r in rows],
        }, indent=1))
        return
    if not rows:
        typer.echo(f"SSD KV cache {root}: empty")
        return
    total_files = sum(r.num_files for r in rows)
    total_bytes = sum(r.num_bytes for r in rows)
    typer.echo(f"SSD KV cache {root}: {total_files} block files, {format_bytes(total_bytes)} "
               f"(block-file format {SSD_FORMAT_VERSION})")
    for r in rows:
        fmt = r.namespace.kv_format if r.namespace else "unknown namespace"
        if r.format_version is not None and r.format_version != SSD_FORMAT_VERSION:
            fmt += f"\tblock-file format {r.format_version} (this omlx reads none of them)"
        layers = f"layers [{r.namespace.layer_start}, {r.namespace.layer_end})\t" if r.namespace else ""
        size = f"{r.namespace.block_size}-token blocks\t" if r.namespace else ""
        typer.echo(f"  {r.digest}  {r.model_id or '?'}\t{layers}{r.num_files} files\t{format_bytes(r.num_bytes)}\t{size}{fmt}"
                   + (f"\t{r.num_temp_files} temp files" if r.num_temp_files else ""))


@app.command("clear")
def clear(
    model: Annotated[Optional[str], typer.Option("--model", help="Only the blocks written for this served model id.")] = None,
    base_path: BasePath = None,
    ssd_cache_dir: CacheDir = None,
) -> None:
    """Delete cached KV blocks (all, or one model's). Safe while a server runs: it recomputes."""
    from omlx.cache.ssd import clear_cache_dir

    root = _cache_dir(base_path, ssd_cache_dir)
    num_files, num_bytes = clear_cache_dir(root, model)
    what = f"model {model}" if model else "all models"
    typer.echo(f"removed {num_files} block files ({format_bytes(num_bytes)}) of {what} from {root}")


@app.command("verify")
def verify(
    base_path: BasePath = None,
    ssd_cache_dir: CacheDir = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report bad files without removing them.")] = False,
) -> None:
    """Check every block file (format, namespace, hash chain, checksum); remove bad ones.

    Exits with code 1 when bad files were found.
    """
    import sys

    from omlx.cache.ssd import verify_cache_dir

    root = _cache_dir(base_path, ssd_cache_dir)
    report = verify_cache_dir(root, remove=not dry_run, progress=sys.stderr.isatty())
    for path, reason in report.bad:
        typer.echo(f"bad: {path}: {reason}")
    removed = "" if dry_run else f", {report.num_removed} removed"
    typer.echo(f"checked {report.num_files} block files in {root}: {report.num_ok} ok, "
               f"{len(report.bad)} bad{removed}"
               + (f"; {report.num_temp_removed} stale temp files removed" if report.num_temp_removed else ""))
    if report.bad:
        raise typer.Exit(1)

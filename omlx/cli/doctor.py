"""`omlx doctor [--json]`: check this machine and omlx's setup; exit 1 on any error.

The checks live in `omlx.kernels.doctor`; this command gathers the facts that need higher
layers (memory ceiling, whether `omlx serve` could bind), runs them and prints the report.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from omlx.cli.common import config_from

_COLOR = {"ok": "green", "info": "blue", "warning": "yellow", "error": "red"}


def _catalogue(cfg) -> list:
    """The models folder's and the hub cache's `CatalogueEntry`s (walked once per report)."""
    from omlx.engine import hub
    from omlx.engine.catalogue import local_models

    return local_models(cfg.models_dir, cfg.hub_cache or hub.cache_dir(None))


def _model_caches(cfg, kv_bits: int | None = None, kv_group_size: int = 64,
                  entries: list | None = None) -> dict[str, tuple[str, bool | None]]:
    """Each model's cache layout (as ``--kv-bits`` serves it), by served id, for the models folder and
    the hub cache (``entries``: `_catalogue`'s, walked here when not given), read from its config
    without loading weights (None: not a language model mlx-lm builds, e.g. an embedding model omlx
    serves with its own encoder)."""
    from omlx.engine.catalogue import prefix_cache_of

    return {e.model_id: prefix_cache_of(e.path, kv_bits, kv_group_size)
            for e in (entries if entries is not None else _catalogue(cfg))}


def _model_dialects(cfg, entries: list | None = None) -> dict[str, str | None]:
    """Each model's tool-call dialect, by served id: the config's ``tool_dialect`` for it, else
    the one its chat template names (read from its tokenizer files, as ``omlx serve`` detects it)."""
    from omlx.engine.catalogue import tool_dialect_of

    out: dict[str, str | None] = {}
    for e in entries if entries is not None else _catalogue(cfg):
        settings = cfg.model_settings.get(e.model_id)
        out[e.model_id] = settings.tool_dialect if settings and settings.tool_dialect else tool_dialect_of(e.path)
    return out


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (schema_version 1).")] = False,
    host: Annotated[Optional[str], typer.Option(help="Address `omlx serve` would bind (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port `omlx serve` would use (default 8000).")] = None,
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="TOML config file (default <base-path>/config.toml).")] = None,
) -> None:
    """Check the platform, MLX, GPU backend, BLAS, native kernels, memory, disk, port and models."""
    from omlx.api.server import check_bind
    from omlx.kernels.doctor import Facts, run_checks
    from omlx.memory import MemoryLimits

    cfg = config_from({"host": host, "port": port, "base_path": base_path}, config)
    entries = _catalogue(cfg)
    facts = Facts(memory_ceiling_bytes=MemoryLimits.from_config(cfg.memory).ceiling_bytes,
                  bind_problem=check_bind(cfg),
                  model_caches=_model_caches(cfg, cfg.kv_bits, cfg.kv_group_size, entries=entries),
                  model_dialects=_model_dialects(cfg, entries=entries))
    report = run_checks(cfg, facts)
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=1))
        raise typer.Exit(report.exit_code)
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    for f in report.findings:
        console.print(f"[{_COLOR[f.level]}]{f.level:>7}[/]  [bold]{f.check}[/]: {escape(f.summary)}")
        if f.fix:
            console.print(f"{'':>9}fix: {escape(f.fix)}")
    verdict = ("[red]not ready[/]" if report.num_errors else "[yellow]ready, with warnings[/]"
               if report.num_warnings else "[green]ready[/]")
    console.print(f"\n{verdict}: {report.num_errors} error(s), {report.num_warnings} warning(s)")
    raise typer.Exit(report.exit_code)

"""`omlx serve`: load models, warm them up, then listen."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import typing
from typing import Annotated, Any, Mapping, Optional

import typer

from omlx.cli.common import config_from, reexec_with_blas, setup_logging, warn_unknown_env
from omlx.config import ServerConfig
from omlx.config_values import parse_pairs

logger = logging.getLogger("omlx.serve")


def serve(
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Served id, mlx-lm folder or .gguf file; repeat for several. Default: the embedded SmolLM2-135M-Instruct.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind (default 127.0.0.1). Any other address needs an API key.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    max_concurrent_requests: Annotated[Optional[int], typer.Option(help="Requests decoding at once per model (default 8).")] = None,
    max_queued_requests: Annotated[Optional[int], typer.Option(help="Requests allowed to wait beyond the running ones before a 429 (default 64).")] = None,
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home: models, cache, config (default ~/.omlx).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="TOML config file (default <base-path>/config.toml).")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="Require this key (Authorization: Bearer or x-api-key).")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="KV block size in tokens (default 256).")] = None,
    hot_cache_max_size: Annotated[Optional[str], typer.Option(help="RAM budget of the hot KV tier, e.g. 2GB (default: derived from memory).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Turn the prefix cache off.")] = False,
    ssd_cache_dir: Annotated[Optional[str], typer.Option(help="Folder of the SSD KV tier (default <base-path>/cache).")] = None,
    ssd_cache_max_size: Annotated[Optional[str], typer.Option(help="Disk budget of the SSD KV tier, e.g. 20GB (default: 10% of free disk, at most 50 GB).")] = None,
    kv_bits: Annotated[Optional[int], typer.Option(help="Quantize the KV cache of full-attention layers to this many bits (2, 3, 4, 5, 6 or 8; from the first token). Default: off (the model's dtype).")] = None,
    kv_group_size: Annotated[Optional[int], typer.Option(help="Quantization group size of --kv-bits along the head dim: 32, 64 or 128 (default 64).")] = None,
    prefill_step_size: Annotated[Optional[int], typer.Option(help="Most prompt tokens of one prefill chunk, a multiple of --block-size (default: measured per model on this device at load).")] = None,
    max_tpot_slowdown: Annotated[Optional[float], typer.Option(help="While prompts prefill beside decoding streams, hold the streams' mean time per output token to at most this many times a decode-only step (default 2.0; <= 1 = off: a prefill chunk in every step).")] = None,
    lookup_draft_tokens: Annotated[Optional[int], typer.Option(help="Prompt-lookup speculative decoding: most tokens drafted per verify step for a request without penalties or structured output, alone or in a batch (0 = off, the default; experimental).")] = None,
    no_ssd_cache: Annotated[bool, typer.Option("--no-ssd-cache", help="Keep the KV cache in RAM only.")] = False,
    memory_ceiling: Annotated[Optional[str], typer.Option(help="Most memory the process may use, e.g. 12GB; models are unloaded (LRU) to stay under it (default: total RAM - 8 GB, at least half of RAM).")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="DEBUG, INFO, WARNING.")] = None,
    alias: Annotated[Optional[list[str]], typer.Option("--alias", help="NAME=TARGET: serve model TARGET also as NAME (e.g. a client's model id); repeat for several.")] = None,
    context_scale_to: Annotated[Optional[int], typer.Option(help="Anthropic API: scale reported token counts so a client assuming a window of this many tokens compacts at the model's real limit. Off by default.")] = None,
    strict_content: Annotated[bool, typer.Option("--strict-content", help="Answer 400 to content a text model cannot read (images, PDFs, audio, files). Default: serve the text with a placeholder naming each dropped block's kind.")] = False,
    cluster: Annotated[bool, typer.Option("--cluster", help="Serve one --model over a cluster: run the node agent (advertise over mDNS, join peers holding the secret, plan the model over them; this node is rank 0) and forward requests to this node's rank-0 worker.")] = False,
    cluster_secret: Annotated[Optional[str], typer.Option(help="Shared cluster secret (or OMLX_CLUSTER_SECRET, [cluster] secret).")] = None,
    peer: Annotated[Optional[list[str]], typer.Option("--peer", help="Static cluster peer host:port; repeat for several.")] = None,
) -> None:
    flags = serve_flags(locals())
    cfg = config_from(flags, config, serve_flag_names())
    reexec_with_blas(cfg.preload_blas, ["-m", "omlx", *sys.argv[1:]])
    setup_logging(cfg.log_level)
    warn_unknown_env()
    if cluster:
        code = _serve_cluster(cfg, cluster_secret)
    else:
        from pathlib import Path

        from omlx.api.server import run_server
        from omlx.cli.service_backends import ServicePaths, remove_live, write_live

        live = ServicePaths(Path(os.path.abspath(cfg.base_dir)), cfg.port).live

        def record_live() -> None:  # `omlx status --base-path` finds this server by it
            try:
                write_live(live)
            except OSError as e:
                logger.warning("cannot write %s (omlx status will not find this server by its base path): %s", live, e)

        try:
            code = run_server(cfg, on_ready=record_live)
        finally:
            remove_live(live)
    # MLX's C++ runtime aborts ("terminate called without an active exception") when its
    # stream threads are torn down by interpreter finalization; everything is already stopped
    # and flushed here, so leave without finalization.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_flags(o: Mapping[str, Any]) -> dict[str, Any]:
    """`omlx serve`'s options, by parameter name (``locals()`` of `serve`; `omlx start` passes the
    same) -> the ``flags`` of `omlx.config.load_config`. Options left out count as not given."""
    return {
        "models": tuple(o.get("model")) if o.get("model") else None,
        "host": o.get("host"),
        "port": o.get("port"),
        "max_concurrent_requests": o.get("max_concurrent_requests"),
        "max_queued_requests": o.get("max_queued_requests"),
        "base_path": o.get("base_path"),
        "api_key": o.get("api_key"),
        "cache.block_size": o.get("block_size"),
        "cache.hot_cache_max_bytes": o.get("hot_cache_max_size"),
        "cache.enabled": False if o.get("no_cache") else None,
        "cache.ssd_cache_dir": o.get("ssd_cache_dir"),
        "cache.ssd_cache_max_bytes": o.get("ssd_cache_max_size"),
        "cache.ssd_enabled": False if o.get("no_ssd_cache") else None,
        "kv_bits": o.get("kv_bits"),
        "kv_group_size": o.get("kv_group_size"),
        "prefill_step_size": o.get("prefill_step_size"),
        "max_tpot_slowdown": o.get("max_tpot_slowdown"),
        "lookup_draft_tokens": o.get("lookup_draft_tokens"),
        "memory.ceiling_bytes": o.get("memory_ceiling"),
        "log_level": o.get("log_level"),
        "aliases": parse_aliases(o.get("alias")) if o.get("alias") else None,
        "context_scale_to": o.get("context_scale_to"),
        "strict_content": True if o.get("strict_content") else None,
        "cluster.peers": tuple(o.get("peer")) if o.get("peer") else None,
    }


def _serve_cluster(cfg: ServerConfig, cluster_secret: str | None) -> int:
    """`omlx serve --cluster`: the node agent plus the HTTP front that forwards to rank 0's worker
    (omlx.api.cluster_front); this process loads no model itself."""
    from omlx import __version__
    from omlx.api.cluster_front import run_front
    from omlx.api.server import check_bind
    from omlx.cli.cluster import _model_path, make_agent, resolve_secret, start_agent_thread
    from omlx.cluster.serving import ClusterServing

    if len(cfg.models) > 1:
        logger.error("--cluster serves one model over the cluster; got %d --model values", len(cfg.models))
        return 2
    if cfg.kv_bits is not None:
        logger.error("--kv-bits is not supported with --cluster yet (a stage's KV stays in the model's dtype)")
        return 2
    reason = check_bind(cfg)
    if reason:
        logger.error("%s", reason)
        return 2
    secret = resolve_secret(cfg, cluster_secret, persist=True)
    model_path = _model_path(cfg, cfg.models[0] if cfg.models else None)
    agent = make_agent(cfg, secret, model_path, http_port=cfg.port)
    start_agent_thread(agent)
    try:
        return run_front(cfg, ClusterServing(agent), {"version": __version__, "model": model_path})
    finally:
        agent.launcher.stop()  # never leave this node's worker running without its agent


def parse_aliases(values: list[str]) -> dict[str, str]:
    """``["NAME=TARGET", ...]`` -> {NAME: TARGET}; exits with code 2 on a malformed entry."""
    try:
        return parse_pairs(values)
    except ValueError as e:
        typer.echo(f"omlx: --alias: {e}", err=True)
        raise typer.Exit(2) from e


# ---- serve's own options, read from its signature (omlx start and the config tables use them) ----


def serve_options() -> list[inspect.Parameter]:
    """`serve`'s parameters with their annotations resolved (Typer reads them from a signature)."""
    hints = typing.get_type_hints(serve, include_extras=True)
    return [p.replace(annotation=hints[p.name]) for p in inspect.signature(serve).parameters.values()]


def option_decl(param: inspect.Parameter) -> str:
    """The long flag of a serve parameter (``--model`` for ``model``, ``--no-cache`` ...)."""
    for meta in getattr(param.annotation, "__metadata__", ()):
        decls = [d for d in (getattr(meta, "param_decls", None) or ()) if d.startswith("--")]
        if decls:
            return decls[0]
    return "--" + param.name.replace("_", "-")


def serve_flag_specs() -> dict[str, tuple[str, bool]]:
    """Config key (dotted, as in `load_config`'s flags) -> (the ``omlx serve`` option that sets
    it, whether it repeats)."""
    out = {}
    for param in serve_options():
        if param.default is False:
            sample: Any = True
        elif "list" in str(typing.get_args(param.annotation)[:1]):
            sample = ["a=b"]
        else:
            sample = "1"
        for key, value in serve_flags({param.name: sample}).items():
            if value is not None:
                out[key] = (option_decl(param), isinstance(sample, list))
    return out


def serve_flag_names() -> dict[str, str]:
    """Config key -> the ``omlx serve`` option that sets it (``--memory-ceiling``); `omlx serve`
    and `omlx start` name flags in config errors by it."""
    return {key: flag for key, (flag, _) in serve_flag_specs().items()}

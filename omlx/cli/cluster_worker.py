"""`omlx cluster worker`: run one rank of a pipeline; rank 0 serves the HTTP API.

The node agent starts one worker per node with the same ``--model``, ``--ranges`` and
``--hostfile`` and that node's ``--rank``. Rank 0 loads its stage, then serves the normal omlx
API (OpenAI, Anthropic, Responses; ``/health`` shows the pipeline under ``cluster``); the other
ranks follow rank 0 until it stops or the pipeline breaks. Registered under ``omlx cluster`` by
``omlx/cli/cluster.py`` as ``worker_command``; also runnable as ``python -m omlx.cli.cluster_worker``.

Exit codes: 0 stopped cleanly, 1 could not start, 2 bad arguments or refused bind,
3 a peer was lost (``EXIT_PEER_LOST``), 4 the ranks disagreed or a step failed, 5 the node agent
that started it (``--parent-pid``) is gone.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from omlx.cli.common import config_from, reexec_with_blas, setup_logging
from omlx.units import format_bytes

logger = logging.getLogger("omlx.cluster.worker")

SERVING_NOTE = ("cluster mode serves requests through one pipeline; requests beyond "
                "--max-concurrent-requests wait in the queue (default 1: one request at a time)")


def worker_command(
    model: Annotated[str, typer.Option("--model", "-m", help="mlx-lm model folder (the same on every node).")],
    ranges: Annotated[str, typer.Option(help="Layer ranges per rank, rank 0 first, e.g. 0:15,15:30 (from `omlx cluster plan`).")],
    rank: Annotated[int, typer.Option(help="This worker's rank (0 serves HTTP).")],
    hostfile: Annotated[str, typer.Option(help="Ring hostfile: JSON list, one [\"ip:port\"] per rank.")],
    host: Annotated[Optional[str], typer.Option(help="Rank 0: address to bind (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Rank 0: HTTP port (default 8000).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds one pipeline step (a decode step, or one prefill chunk of up to 2048 tokens), or the ring's start, may block before a peer counts as lost; raise it for slow nodes and long prompts.")] = 30.0,
    max_concurrent_requests: Annotated[int, typer.Option(help="Rank 0: sequences decoded together through the pipeline.")] = 1,
    seed: Annotated[int, typer.Option(help="PRNG seed shared by every rank (sampling must agree).")] = 0,
    base_path: Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="Rank 0: require this key.")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="DEBUG, INFO, WARNING.")] = None,
    parent_pid: Annotated[Optional[int], typer.Option(help="Exit when this process (the node agent that started the worker) is gone.")] = None,
    ready_file: Annotated[Optional[str], typer.Option(help="Ranks > 0: create this file once the ring handshake is done (the node agent reads it).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Turn this rank's prefix cache (hot + SSD tiers of its layers) off; the pipeline then takes nothing from the cache.")] = False,
) -> None:
    from omlx.cluster.pipeline import parse_ranges

    try:
        layer_ranges = parse_ranges(ranges)
    except ValueError as e:
        typer.echo(f"omlx: --ranges: {e}", err=True)
        raise typer.Exit(2) from e
    if not 0 <= rank < len(layer_ranges):
        typer.echo(f"omlx: --rank {rank} is outside the {len(layer_ranges)} ranges", err=True)
        raise typer.Exit(2)
    cfg = config_from({
        "host": host, "port": port, "base_path": base_path, "api_key": api_key, "log_level": log_level,
        "max_concurrent_requests": max_concurrent_requests, "cache.enabled": False if no_cache else None,
    }, None, {"cache.enabled": "--no-cache"})
    reexec_with_blas(cfg.preload_blas, sys.orig_argv[1:])
    setup_logging(cfg.log_level)
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    code = _run(cfg, Path(model).expanduser(), layer_ranges, rank, hostfile, timeout_s, seed, ready_file)
    # As `omlx serve`: leave without interpreter finalization (MLX's threads abort in it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent_pid: int, period_s: float = 0.25) -> None:
    """Watch the node agent that started this worker: when it is gone (killed, crashed), the
    node has left the cluster, so its worker must not hold its place in the ring. Portable (no prctl)."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        logger.error("the node agent (pid %d) is gone: stopping this worker", parent_pid)
        logging.shutdown()
        os._exit(EXIT_AGENT_GONE)

    threading.Thread(target=watch, name="omlx-parent-watch", daemon=True).start()


EXIT_AGENT_GONE = 5
"""Exit code of a worker whose node agent (``--parent-pid``) is gone."""


def _run(cfg: Any, path: Path, layer_ranges: list[Any], rank: int, hostfile: str, timeout_s: float, seed: int,
         ready_file: str | None = None) -> int:
    from mlx_lm.utils import load_tokenizer

    from omlx.cluster.group import init_group
    from omlx.cluster.pipeline import load_stage, stage_weight_bytes
    from omlx.cluster.prefix_cache import FollowerPrefixCache, build_stage_prefix_cache
    from omlx.cluster.worker import handshake, run_follower
    from omlx.errors import OmlxError

    if rank == 0:
        from omlx.api.server import check_bind

        reason = check_bind(cfg)
        if reason:
            logger.error("%s", reason)
            return 2
    try:
        group = init_group(hostfile, rank, timeout_s=timeout_s)
        if group.size != len(layer_ranges):
            logger.error("--ranges has %d ranges but the hostfile %d ranks", len(layer_ranges), group.size)
            return 2
        t0 = time.monotonic()
        stage, config = load_stage(path, layer_ranges[rank], group.group)
        logger.info("rank %d: layers [%d, %d) of %s loaded in %.1f s (%s of weights)", rank,
                    stage.layer_range.start, stage.layer_range.end, path.name, time.monotonic() - t0,
                    format_bytes(stage_weight_bytes(stage)))
        facts = handshake(group, stage)
        tokenizer = load_tokenizer(path)
        # Each rank keeps the KV tiers of its own layers (a folder per layer range).
        try:
            if cfg.cache.enabled:
                from omlx.api.server import make_private_dir

                make_private_dir(cfg.ssd_cache_dir)  # KV of this user's prompts: this user only
            tiers, note = build_stage_prefix_cache(cfg, path, config, stage, tokenizer, enabled=cfg.cache.enabled)
        except Exception as e:  # the cache is an optimization: the rank serves without it
            logger.exception("rank %d: cannot build the prefix cache; running without it", rank)
            tiers, note = None, f"rank {rank} layers [{stage.layer_range.start}, {stage.layer_range.end}): off: {e}"
        notes = [m["prefix_cache"] for m in group.gather_messages({"prefix_cache": note[:1000]})]
    except OmlxError as e:
        logger.error("rank %d cannot start: %s", rank, e.message)
        return 1
    if rank > 0:
        if ready_file:
            Path(ready_file).touch()
        return run_follower(group, stage, FollowerPrefixCache(tiers, group))
    return _serve(cfg, path, config, stage, group, layer_ranges, timeout_s, seed, facts, tokenizer, tiers, notes)


def _serve(cfg: Any, path: Path, config: dict[str, Any], stage: Any, group: Any, layer_ranges: list[Any],
           timeout_s: float, seed: int, facts: list[dict[str, Any]], tokenizer: Any, tiers: Any,
           cache_notes: list[str]) -> int:
    from omlx.api.server import run_app
    from omlx.api.server import make_private_dir, startup_status
    from omlx.cluster.prefix_cache import WHOLE_HITS_NOTE
    from omlx.cluster.worker import ClusterPipeline
    from omlx.config import ModelSettings
    from omlx.engine.engine import Engine
    from omlx.engine.factory import PoolEntry, model_formats
    from omlx.engine.loader import LoadedModel
    from omlx.errors import OmlxError
    from omlx.pool import EnginePool
    from omlx.scheduler import Scheduler

    for d in (cfg.base_dir, cfg.models_dir):
        make_private_dir(d)
    model_id = path.name
    ctx = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or 8192)
    loaded = LoadedModel(model_id, path, stage, tokenizer, config, ctx,
                         tuple(type(c).__name__ for c in stage.make_cache()))
    state: dict[str, Any] = {
        "status": "ok",
        "num_ranks": group.size,
        "ranges": [[r.start, r.end] for r in layer_ranges],
        "weight_bytes_per_rank": [int(f["weight_bytes"]) for f in facts],
        "timeout_s": timeout_s,
        "max_concurrent_requests": cfg.max_concurrent_requests,
        "serving": SERVING_NOTE,
        # Each rank's own tiers; a request takes from the cache the fewest tokens any rank holds.
        "prefix_cache": {"per_rank": cache_notes, "whole_prompt_hits": WHOLE_HITS_NOTE},
        "error": None,
    }
    if tiers is None:
        cache_note = "off (disabled by configuration)" if not cfg.cache.enabled else cache_notes[0]
    elif any(": off" in n for n in cache_notes[1:]):
        cache_note = "off on a rank (the pipeline takes nothing from the cache): " + "; ".join(cache_notes)
    else:
        cache_note = ("on per rank, each rank's own layers (agreed count per request); "
                      + "; ".join(f"rank {r} layers [{a.start}, {a.end})" for r, a in enumerate(layer_ranges))
                      + "; " + WHOLE_HITS_NOTE)
    # Pinned: the pool must never unload the pipeline (its followers cannot reload it).
    settings = (cfg.model_settings.get(model_id) or ModelSettings()).model_copy(update={"pin": True, "ttl_s": None})
    cfg = cfg.model_copy(update={"model_settings": {**cfg.model_settings, model_id: settings}})
    made: list[PoolEntry] = []

    def loader(mid: str, p: Path, task: str, s: ModelSettings, warm: bool) -> PoolEntry:
        if made or mid != model_id:
            raise OmlxError(f"cluster mode serves only {model_id}, loaded once at start")
        pipeline = ClusterPipeline(group, timeout_s=timeout_s, state=state, seed=seed, prefix_cache=tiers,
                                   layer_ranges=[(r.start, r.end) for r in layer_ranges])
        engine = Engine(model_id, stage, tokenizer,
                        scheduler=Scheduler(cfg.max_concurrent_requests, cfg.max_queued_requests),
                        block_size=cfg.cache.block_size, prefix_cache=pipeline.prefix_cache, pipeline=pipeline)
        engine.start()
        entry = PoolEntry(loaded, engine, cache_note, *model_formats(loaded, cfg), settings=s)
        made.append(entry)
        if warm:
            _warm_up(entry)
        return entry

    status = startup_status(cfg)
    status["cluster"] = state
    if cfg.cache.enabled and cache_note.startswith("off"):  # on here, but off on a rank: no ranks' cache works
        logger.warning("prefix cache: %s", cache_note)
        status["slow_paths"].append(f"model {model_id} runs without the prefix cache: {cache_note}")
    logger.warning("CLUSTER MODE: %s", SERVING_NOTE)
    pool = EnginePool(cfg, loader=loader, resolver=lambda mid, src: (path, "chat"))
    try:
        pool.register(str(path))
        pool.preload(warmup=True)
    except OmlxError as e:
        logger.error("cannot start: %s", e.message)
        pool.stop()
        return 1
    ranges = ", ".join(f"[{r.start}, {r.end})" for r in layer_ranges)
    return run_app(cfg, pool, status, f"omlx cluster rank 0 ready on http://{cfg.host}:{cfg.port} "
                                      f"(model {model_id} over {group.size} ranks: {ranges})")


def _warm_up(entry: Any) -> None:
    from omlx.engine.chat import render_prompt
    from omlx.request import Failed, Request, SamplingParams

    t0 = time.monotonic()
    ids = render_prompt(entry.loaded.tokenizer, [{"role": "user", "content": "Warm-up: say hello."}]).token_ids
    evs = entry.engine.run_sync(Request(entry.loaded.model_id, ids, SamplingParams(max_tokens=4, temperature=0.0)), 300)
    if isinstance(evs[-1], Failed):
        raise evs[-1].error
    if entry.engine.prefix_cache is not None:
        entry.engine.prefix_cache.clear()  # as on one node; rank 0 holding nothing is enough
    logger.info("warmed up the pipeline in %.2f s", time.monotonic() - t0)


worker_app = typer.Typer(add_completion=False)
worker_app.command()(worker_command)

if __name__ == "__main__":
    worker_app()

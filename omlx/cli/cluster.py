"""`omlx cluster ...`: join a cluster, show it, plan a model over it (or over hypothetical nodes), leave.

`omlx serve --cluster` runs the same agent beside its HTTP front (see ``start_agent_thread`` and
``omlx.api.cluster_front``); ``make_launcher`` gives every agent its real worker launcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from typing import Annotated, Any, Optional

import typer

from omlx.cli import cluster_worker
from omlx.cli.common import config_from, setup_logging, warn_unknown_env
from omlx.config import ServerConfig
from omlx.units import format_bytes, format_rate

logger = logging.getLogger("omlx.cluster")

app = typer.Typer(help="Cluster mode: several machines serve one model as pipeline stages.", no_args_is_help=True)

_SECRET_FILE = "secret"


def resolve_secret(cfg: ServerConfig, flag: str | None, *, persist: bool = False) -> bytes:
    """The shared secret: --secret > OMLX_CLUSTER_SECRET / config > ``<base>/cluster/secret``.

    With ``persist`` a secret given on the command line is stored in ``<base>/cluster/secret``
    (0600, folder 0700) so ``status``/``leave`` on this machine find it. Exits 2 without one.
    """
    from omlx.cluster.control import check_secret
    from omlx.errors import AuthError
    from omlx.cluster.discovery import cluster_dir, write_private_file

    secret = flag or cfg.cluster.secret
    path = cfg.base_dir / "cluster" / _SECRET_FILE
    if secret is None and path.is_file():
        secret = path.read_text().strip()
    try:
        raw = check_secret(secret)
    except AuthError as e:
        typer.echo(f"omlx: {e}", err=True)
        raise typer.Exit(2) from e
    if persist and flag:
        write_private_file(cluster_dir(cfg.base_dir) / _SECRET_FILE, flag + "\n")
    return raw


def _settings(cfg: ServerConfig, secret: bytes, model_path: str | None) -> Any:
    from omlx.cluster.agent import AgentSettings

    c = cfg.cluster
    return AgentSettings(
        secret=secret,
        control_host=c.control_host,
        control_port=c.control_port,
        peers=c.peers,
        mdns=c.mdns,
        heartbeat_interval_s=c.heartbeat_interval_s,
        heartbeat_timeout_s=c.heartbeat_timeout_s,
        model_path=model_path,
        context_tokens=c.context_tokens,
        max_concurrent=cfg.max_concurrent_requests,
        headroom_bytes=c.headroom_bytes,
        worker_port=c.worker_port,
    )


def _model_path(cfg: ServerConfig, spec: str | None) -> str:
    """A served id, folder or .gguf -> the mlx-lm folder (as `omlx serve --model` resolves it)."""
    from omlx.engine.loader import resolve_model
    from omlx.errors import OmlxError

    try:
        return str(resolve_model(spec, cfg.models_dir, progress=False, hub_cache=cfg.hub_cache)[1])
    except OmlxError as e:
        typer.echo(f"omlx: {e.message}", err=True)
        raise typer.Exit(2) from e


def make_launcher(cfg: ServerConfig) -> Any:
    """This node's worker launcher: ``python -m omlx cluster worker ...`` per plan, or a dry run
    when ``[cluster] start_workers = false``."""
    from omlx.cluster.launcher import WorkerLauncher

    if not cfg.cluster.start_workers:
        return WorkerLauncher(None)
    # The planner's KV reserve assumes cfg.max_concurrent_requests sequences: rank 0 batches as many.
    extra = ["--base-path", str(cfg.base_dir), "--timeout-s", f"{cfg.cluster.step_timeout_s:g}",
             "--max-concurrent-requests", str(cfg.max_concurrent_requests)]
    # Rank 0's worker checks the same API key as the front (from the environment, not argv).
    env = {"OMLX_API_KEY": cfg.api_key} if cfg.api_key else {}
    return WorkerLauncher([sys.executable, "-m", "omlx", "cluster", "worker"], extra_args=extra, env=env)


def make_agent(cfg: ServerConfig, secret: bytes, model_path: str | None, *, http_port: int = 0) -> Any:
    """Measure this node (weight-streaming probe) and build its agent with its worker launcher.
    Call on the MLX thread."""
    from omlx.cluster.agent import NodeAgent
    from omlx.cluster.discovery import describe_local_node, load_node_id
    from omlx.cluster.measure import measure_stream_rate

    node_id = load_node_id(cfg.base_dir)
    info = describe_local_node(
        node_id,
        control_port=cfg.cluster.control_port,
        http_port=http_port,
        memory_cap_bytes=cfg.cluster.memory_cap_bytes or 0,
    )
    rate = measure_stream_rate()
    return NodeAgent(_settings(cfg, secret, model_path), info, cfg.base_dir, rate, launcher=make_launcher(cfg))


def start_agent_thread(agent: Any) -> threading.Thread:
    """Run ``agent`` on its own asyncio loop in a daemon thread (beside `omlx serve`)."""

    def run() -> None:
        async def main() -> None:
            try:
                await agent.start()
            except OSError as e:
                logger.error("cluster agent cannot start: %s", e)
                return
            await agent.wait_stopped()

        asyncio.run(main())

    t = threading.Thread(target=run, name="omlx-cluster-agent", daemon=True)
    t.start()
    return t


#: `join`'s flags whose names are not their key's (errors name the flag the user typed).
_JOIN_FLAGS = {"cluster.peers": "--peer", "cluster.memory_cap_bytes": "--memory-cap", "cluster.mdns": "--no-mdns",
               "cluster.heartbeat_timeout_s": "--heartbeat-timeout", "cluster.heartbeat_interval_s": "--heartbeat-interval"}


def _flags(base_path: str | None, peer: list[str] | None, control_port: int | None,
           memory_cap: str | None, no_mdns: bool, heartbeat_timeout: float | None,
           heartbeat_interval: float | None) -> dict[str, Any]:
    return {
        "base_path": base_path,
        "cluster.peers": tuple(peer) if peer else None,
        "cluster.control_port": control_port,
        "cluster.memory_cap_bytes": memory_cap,
        "cluster.mdns": False if no_mdns else None,
        "cluster.heartbeat_timeout_s": heartbeat_timeout,
        "cluster.heartbeat_interval_s": heartbeat_interval,
    }


BasePath = Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")]
ConfigFile = Annotated[Optional[str], typer.Option("--config", help="TOML config file.")]
Secret = Annotated[Optional[str], typer.Option(help="Shared cluster secret (or OMLX_CLUSTER_SECRET, [cluster] secret).")]
Peer = Annotated[Optional[list[str]], typer.Option("--peer", help="Static peer host:port (mDNS does not cross subnets); repeat for several.")]
ControlPort = Annotated[Optional[int], typer.Option(help="Control channel port (default 8470).")]


@app.command("join")
def join(
    secret: Secret = None,
    peer: Peer = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model to plan when this node coordinates (served id or folder).")] = None,
    control_port: ControlPort = None,
    memory_cap: Annotated[Optional[str], typer.Option(help="Most memory this node gives the cluster, e.g. 48GB.")] = None,
    no_mdns: Annotated[bool, typer.Option("--no-mdns", help="Do not advertise or browse over mDNS (static peers only).")] = False,
    heartbeat_interval: Annotated[Optional[float], typer.Option(help="Seconds between heartbeats (default 1).")] = None,
    heartbeat_timeout: Annotated[Optional[float], typer.Option(help="A member silent this long has left (default 3 s).")] = None,
    base_path: BasePath = None,
    config: ConfigFile = None,
    log_level: Annotated[Optional[str], typer.Option(help="DEBUG, INFO, WARNING, ERROR, CRITICAL (default INFO, or log_level of the config).")] = None,
) -> None:
    """Run this machine's node agent (no HTTP server) until interrupted or `omlx cluster leave`;
    it starts this machine's pipeline worker for every plan that gives it a stage."""
    flags = {**_flags(base_path, peer, control_port, memory_cap, no_mdns, heartbeat_timeout, heartbeat_interval),
             "log_level": log_level}
    cfg = config_from(flags, config, _JOIN_FLAGS)
    setup_logging(cfg.log_level)
    warn_unknown_env()
    raw = resolve_secret(cfg, secret, persist=True)
    model_path = _model_path(cfg, model) if model else None
    agent = make_agent(cfg, raw, model_path)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(agent.stop(announce=True)))
        try:
            await agent.start()
        except OSError as e:
            logger.error("cannot start the cluster agent: %s", e)
            return 1
        await agent.wait_stopped()
        return 0

    raise typer.Exit(asyncio.run(main()))


def _ask(cfg: ServerConfig, secret: str | None, host: str, port: int | None, msg: dict[str, Any]) -> dict[str, Any]:
    from omlx.cluster.agent import request_local
    from omlx.errors import ControlError

    raw = resolve_secret(cfg, secret)
    try:
        return asyncio.run(request_local(host, port or cfg.cluster.control_port, raw, msg))
    except ControlError as e:
        typer.echo(f"omlx: {e}", err=True)
        raise typer.Exit(1) from e


@app.command("status")
def status(
    secret: Secret = None,
    host: Annotated[str, typer.Option(help="Agent to ask.")] = "127.0.0.1",
    control_port: ControlPort = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw status as JSON.")] = False,
    base_path: BasePath = None,
    config: ConfigFile = None,
) -> None:
    """Members, epoch, measured figures, the current plan and recent membership events."""
    cfg = config_from({"base_path": base_path}, config)
    st = _ask(cfg, secret, host, control_port, {"type": "status"})["status"]
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    _print_status(st)


def _print_status(st: dict[str, Any]) -> None:
    out = [f"node {st['node_id']}  epoch {st['epoch']}  coordinator {st['coordinator']}  "
           f"heartbeat timeout {st['heartbeat_timeout_s']:g} s",
           f"members ({len(st['members'])}):"]
    for m in st["members"]:
        cap = format_bytes(m["memory_cap_bytes"], "GB", 1) if m["memory_cap_bytes"] else "none"
        seen = "" if m["last_seen_ago_s"] is None else f", seen {m['last_seen_ago_s']:.1f} s ago"
        out.append(f"  {m['node_id']}{' (this node)' if m['self'] else ''}: {m['hostname']} "
                   f"{','.join(m['addresses'][:2])}:{m['control_port']}"
                   f"{' http ' + str(m['http_port']) if m['http_port'] else ''}"
                   f", {m['backend']} {m['device']}, mlx {m['mlx_version']}{seen}")
        out.append(f"    memory: {format_bytes(m['available_bytes'], 'GB', 1)} available of "
                   f"{format_bytes(m['total_bytes'], 'GB', 1)}, cap {cap}; "
                   f"weight streaming {format_rate(m['stream_rate_bytes_s'], 'GB')}")
        for peer, link in m["links"].items():
            out.append(f"    link to {peer}: {format_rate(link['bandwidth_bytes_s'], 'MB', 0)}, "
                       f"{link['latency_s'] * 1e3:.3f} ms one-way")
    if st["plan_table"]:
        out.append(f"plan (epoch {st['plan_epoch']}) for {st['model']}:")
        out.append(st["plan_table"])
    elif st["plan_error"]:
        out.append(f"no plan for {st['model']}: {st['plan_error']}")
    else:
        out.append("no plan (no member was given a model)")
    w = st["worker"]
    if w:
        ranges = ",".join(f"{a}:{b}" for a, b in w["ranges"])
        error = f" ({w['error']})" if w.get("error") else ""
        out.append(f"worker: epoch {w['epoch']} rank {w['rank']} of {w['num_ranks']}, layers {ranges}: "
                   f"{w['state']} for {w['state_for_s']:.0f} s{error}")
        out.append(f"  {w['command']}")
    out.append("events:")
    out.extend(f"  {e}" for e in st["events"][-10:])
    typer.echo("\n".join(out))


@app.command("plan")
def plan(
    model: Annotated[str, typer.Argument(help="Served id, mlx-lm folder or .gguf.")],
    nodes: Annotated[Optional[str], typer.Option(help="Hypothetical nodes, no cluster needed: '64GB@400GB/s,32GB@200GB/s' or 'a:64GB:400GB/s:cap=48GB,b:32GB' (keys cap, headroom, link, latency).")] = None,
    context_tokens: Annotated[Optional[int], typer.Option(help="KV reserve per sequence (default 4096).")] = None,
    max_concurrent: Annotated[Optional[int], typer.Option(help="Sequences decoded together (default 8).")] = None,
    search_order: Annotated[bool, typer.Option("--search-order", help="Also try every node order (--nodes only).")] = False,
    secret: Secret = None,
    control_port: ControlPort = None,
    base_path: BasePath = None,
    config: ConfigFile = None,
) -> None:
    """Plan MODEL over --nodes, or over the running cluster's members and measured figures."""
    from omlx.cluster.plan import PlanRequest, even_split, format_plan_table, parse_nodes_spec, plan_pipeline
    from omlx.errors import PlanError

    flags = {"base_path": base_path, "max_concurrent_requests": max_concurrent,
             "cluster.context_tokens": context_tokens}
    cfg = config_from(flags, config, {"max_concurrent_requests": "--max-concurrent"})
    path = _model_path(cfg, model)
    if nodes is None:
        reply = _ask(cfg, secret, "127.0.0.1", control_port, {"type": "plan_preview", "model": path})
        typer.echo(reply["table"])
        return
    from omlx.cluster.layer_bytes import activation_bytes_per_token, read_layout

    try:
        specs = parse_nodes_spec(nodes, headroom_bytes=cfg.cluster.headroom_bytes)
    except ValueError as e:
        typer.echo(f"omlx: --nodes: {e}", err=True)
        raise typer.Exit(2) from e
    layout = read_layout(path)
    request = PlanRequest(context_tokens=cfg.cluster.context_tokens, max_concurrent=cfg.max_concurrent_requests,
                          activation_bytes_per_token=activation_bytes_per_token(path))
    try:
        p = plan_pipeline(layout, specs, request, search_order=search_order)
    except PlanError as e:
        typer.echo(f"omlx: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(format_plan_table(p))
    even = even_split(layout, specs, request)
    typer.echo(f"even split: predicted step {1000 * even.predicted_step_s:.2f} ms"
               f"{'' if even.fits else ' (does not fit)'}")


@app.command("leave")
def leave(
    secret: Secret = None,
    control_port: ControlPort = None,
    base_path: BasePath = None,
    config: ConfigFile = None,
) -> None:
    """Make this machine's agent leave the cluster (its members start a new epoch) and stop."""
    cfg = config_from({"base_path": base_path}, config)
    _ask(cfg, secret, "127.0.0.1", control_port, {"type": "leave"})
    typer.echo("left the cluster")


# The pipeline worker of one rank (execution side): the node agent's launcher starts it, and the
# README's manual pipeline runs it by hand, so `omlx cluster --help` lists it.
app.command("worker", help="Run one pipeline rank (rank 0 serves HTTP); the node agents of `omlx serve --cluster` and `omlx cluster join` start these themselves.")(
    cluster_worker.worker_command)

"""Starting the server process: checks, model loading and warm-up, then Sanic.

Order matters: refuse an unsafe bind and a busy port first (seconds), then load and warm up
every model (minutes at worst), and only then listen, so a client never meets a half-ready
server.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from omlx.config import ServerConfig
from omlx.errors import OmlxError

if TYPE_CHECKING:
    from omlx.pool import EnginePool

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(cfg: ServerConfig) -> str | None:
    """Why the server must not start on this address, or None."""
    if not is_loopback(cfg.host) and not cfg.api_key:
        return (f"refusing to bind {cfg.host} without an API key: anyone on the network could use it. "
                "Set --api-key (or OMLX_API_KEY), or bind 127.0.0.1.")
    fam = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.host, cfg.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {cfg.port} on {cfg.host} is already in use; pick another with --port"
            return f"cannot bind {cfg.host}:{cfg.port}: {e.strerror}"
    return None


def make_private_dir(path: Path) -> None:
    """Create a folder readable only by this user (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path, 0o700)
    except OSError:
        logger.warning("could not set permissions 0700 on %s", path)


def startup_status(cfg: ServerConfig) -> dict[str, Any]:
    """BLAS, versions and every known slow path (logged as warnings, shown in /health)."""
    import mlx.core as mx
    import mlx_lm

    from omlx import __version__
    from omlx.kernels.blas import detect_blas
    from omlx.kernels.status import native_kernel_status, slow_path_messages

    blas = detect_blas()
    slow: list[str] = []
    if not blas.fast:
        slow.append(blas.advice)
    kernels = native_kernel_status(cfg.disable_kernels)
    slow.extend(slow_path_messages(kernels))
    if unknown := sorted(set(cfg.disable_kernels) - set(kernels) - {"all"}):
        logger.warning("disable_kernels names unknown kernels %s (known: %s)", unknown, ", ".join(kernels))
    for msg in slow:
        logger.warning("SLOW PATH: %s", msg)
    logger.info("BLAS in use: %s (%s)", blas.name, blas.path or "-")
    return {
        "version": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": blas.as_dict(),
        "kernels": {name: k.as_dict() for name, k in kernels.items()},
        "slow_paths": slow,
    }


def run_server(cfg: ServerConfig, on_ready: Callable[[], None] | None = None) -> int:
    """Run until interrupted. Returns the process exit code (2 for a refused start).

    Args:
        on_ready: called once the socket is bound (`omlx serve` records the running server).
    """
    reason = check_bind(cfg)
    if reason:
        logger.error("%s", reason)
        return 2
    for d in (cfg.base_dir, cfg.models_dir, cfg.ssd_cache_dir):  # config, models, KV cache: this user only
        make_private_dir(d)
    status = startup_status(cfg)

    from omlx.memory import gb
    from omlx.pool import EnginePool

    pool = EnginePool(cfg)
    lim = pool.enforcer.limits
    logger.info("memory ceiling %s (soft %s, hard %s); process uses %s", gb(lim.ceiling_bytes), gb(lim.soft_bytes),
                gb(lim.hard_bytes), gb(pool.enforcer.snapshot().used_bytes))
    specs = list(cfg.models) or [None]
    try:
        for spec in specs:
            pool.register(spec)
        pool.preload(warmup=True)
    except OmlxError as e:
        logger.error("cannot start: %s", e.message)
        pool.stop()
        return 1
    for model_id, note in [(e.loaded.model_id, e.cache_note) for e in pool.entries()]:
        if note:  # (no entry stays referenced from this frame: it would pin the model's memory)
            logger.warning("prefix cache for %s: %s", model_id, note)
            if not note.startswith("off (disabled"):  # a model family without its fast path
                status["slow_paths"].append(f"model {model_id} runs without the prefix cache: {note}")
    return run_app(cfg, pool, status, f"omlx ready on http://{cfg.host}:{cfg.port} (models: {', '.join(pool.listed_ids())})",
                   on_ready)


def run_app(cfg: ServerConfig, pool: EnginePool, status: dict[str, Any], ready: str,
            on_ready: Callable[[], None] | None = None) -> int:
    """Serve HTTP for a started pool until the server stops (then stop the pool); returns 0, or
    2 when the port cannot be bound (taken since `check_bind`).

    Args:
        ready: the line logged once the socket is bound (what is served, where).
        on_ready: called then, after the line.
    """
    from omlx.api.app import create_app

    pool.start_watchdog()
    app = create_app(cfg, pool, status)

    async def say_ready(*_: Any) -> None:  # the socket is bound: only now does it answer
        logger.info("%s", ready)
        if on_ready is not None:
            on_ready()

    app.register_listener(say_ready, "after_server_start")
    try:
        app.run(host=cfg.host, port=cfg.port, single_process=True, motd=False, access_log=False,
                debug=False, auto_reload=False)
    except OSError as e:
        # The port was free when the start was checked (`check_bind`) but taken while the
        # models loaded: the same one line as a refused start, not a traceback.
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        logger.error("cannot listen on %s port %d: %s (taken while the models loaded); pick another with "
                     "--port", cfg.host, cfg.port, e.strerror or e)
        return 2
    finally:
        pool.stop()
    return 0

"""`omlx start|stop|restart|status|logs`: ``omlx serve`` as a background service.

``omlx start`` takes every option of ``omlx serve``, checks them (a bad flag or config exits 2
before anything starts), records them in ``<base>/run/serve-PORT.json`` and runs the server
through a backend (`omlx.cli.service_backends`): a launchd LaunchAgent on macOS, a systemd user
unit where ``systemctl --user`` works, else a detached child tracked by
``<base>/run/serve-PORT.pid`` (``--backend`` picks one). Its output goes to
``<base>/logs/serve-PORT.log``. ``start`` returns once ``/health`` answers 200, or exits 1 with
the log's last lines. ``stop`` sends SIGTERM and waits for the exit (the server writes its hot
KV tier to the SSD tier on the way out); ``restart`` reruns the recorded settings; ``status``
reads ``/health``, ``/v1/cache/stats`` and ``/metrics``; ``logs`` tails the log.

`start_service` is also how `omlx launch` starts a server when none answers. Errors are one
line on stderr (exit 1; 2 for bad options), never a traceback.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import sys
import time
import typing
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer

from omlx.cli.common import config_from
from omlx.cli.serve import option_decl, serve_flag_names, serve_flags, serve_options
from omlx.cli.service_backends import (
    Backend,
    LaunchdBackend,
    PidfileBackend,
    ServiceError,
    ServicePaths,
    ServiceSpec,
    SystemdBackend,
    backend_for,
    forwarded_env,
    listening_pid,
    load_record,
    read_pid_file,
    recorded_ports,
    sweep_stale_live,
    write_private,
)
from omlx.config import ServerConfig
from omlx.units import format_bytes

#: `omlx status` exit code when a service is not running (as LSB init scripts and systemctl).
NOT_RUNNING = 3
#: serve options whose values are paths: made absolute, since the service runs in ``<base>``.
PATH_OPTIONS = ("config", "ssd_cache_dir")
#: serve options `omlx start` always sets itself (resolved from flags, env and config).
RESOLVED_OPTIONS = ("host", "port", "base_path", "api_key")


class _Say:
    """Messages of one command, prefixed with its name, on stderr."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, text: str) -> None:
        typer.echo(f"{self.prefix}: {text}", err=True)


@contextlib.contextmanager
def _clean_errors(say: _Say) -> Iterator[None]:
    """Turn a `ServiceError` or an OS error into one line and exit 1; Ctrl-C into exit 130."""
    try:
        yield
    except ServiceError as e:
        say(str(e))
        raise typer.Exit(1) from e
    except OSError as e:
        say(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
        raise typer.Exit(1) from e
    except KeyboardInterrupt as e:
        say("interrupted (a server already started keeps running: `omlx status`, `omlx stop`)")
        raise typer.Exit(130) from e


# ---- the settings a service runs with ---------------------------------------------------------


def serve_argv(options: dict[str, Any]) -> list[str]:
    """serve options by parameter name -> the ``omlx serve`` arguments that give them (lists
    repeat the flag, True booleans are bare flags, None and False are left out)."""
    argv: list[str] = []
    for param in serve_options():
        value = options.get(param.name)
        if value is None or value is False:
            continue
        flag = option_decl(param)
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def stable_python(executable: str) -> str:
    """``executable``, with a Homebrew Cellar path (versioned, gone after ``brew upgrade``) turned
    into its ``opt`` link: ``/opt/homebrew/Cellar/omlx/0.1.0/libexec/bin/python`` ->
    ``/opt/homebrew/opt/omlx/libexec/bin/python``."""
    return re.sub(r"/Cellar/([^/]+)/[^/]+/", r"/opt/\1/", executable)


def build_spec(cfg: ServerConfig, options: dict[str, Any], backend: str,
               environ: typing.Mapping[str, str] | None = None) -> ServiceSpec:
    """The service running ``omlx serve`` with ``options`` (serve's parameters by name) as
    resolved into ``cfg``: host, port and base path always explicit, paths absolute, the API
    key moved into the environment (``OMLX_API_KEY``) so ``ps`` does not show it."""
    environ = os.environ if environ is None else environ
    opts = {k: v for k, v in options.items() if k not in RESOLVED_OPTIONS}
    for name in PATH_OPTIONS:
        if opts.get(name):
            opts[name] = os.path.abspath(os.path.expanduser(opts[name]))
    if opts.get("model"):  # a folder or .gguf given relative to here; ids stay as they are
        opts["model"] = [os.path.abspath(m) if os.path.exists(m) else m for m in opts["model"]]
    base = os.path.abspath(cfg.base_dir)
    env = forwarded_env(environ)
    if env.get("OMLX_CONFIG"):
        env["OMLX_CONFIG"] = os.path.abspath(os.path.expanduser(env["OMLX_CONFIG"]))
    if options.get("api_key"):
        env["OMLX_API_KEY"] = options["api_key"]
    argv = [stable_python(sys.executable), "-m", "omlx", "serve", "--host", cfg.host, "--port", str(cfg.port),
            "--base-path", base, *serve_argv(opts)]
    return ServiceSpec(port=cfg.port, host=cfg.host, base=base, backend=backend, argv=tuple(argv), env=env)


# ---- finding and talking to a server -----------------------------------------------------------


def _get(url: str, key: str | None, timeout_s: float = 5.0) -> Any:
    import httpx

    r = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=timeout_s)
    r.raise_for_status()
    return r if url.endswith("/metrics") else r.json()


def health_ok(url: str) -> bool:
    """True when ``url``/health answers 200 (``/health`` needs no key)."""
    try:
        _get(url + "/health", None, timeout_s=2.0)
        return True
    except Exception:
        return False


def backend_of(spec: ServiceSpec | None) -> Backend:
    """The backend that started ``spec`` (no availability check: stopping must still work);
    pidfile when there is no record (a server `omlx launch` started before records existed)."""
    name = spec.backend if spec is not None else "pidfile"
    return {"systemd": SystemdBackend, "launchd": LaunchdBackend}.get(name, PidfileBackend)()


def running_pid(spec: ServiceSpec | None, paths: ServicePaths) -> tuple[int | None, str | None]:
    """(pid of the service's server or None, a note about a stale pid file that was removed)."""
    backend = backend_of(spec)
    stale = read_pid_file(paths.pid) if isinstance(backend, PidfileBackend) else None
    try:
        pid = backend.pid(spec, paths)
    except (OSError, ValueError) as e:
        raise ServiceError(f"cannot ask {backend.name} about port {paths.port}: {e}") from e
    if pid is None and stale is not None:
        return None, f"removed a stale pid file ({paths.pid}: pid {stale} is gone or is another process now)"
    return pid, None


def _log_tail(path: Path, offset: int = 0, num_lines: int = 40, end: int | None = None) -> str:
    """The last ``num_lines`` lines of ``path`` between bytes ``offset`` and ``end`` (default: its
    size), read from the end in 64 KiB steps (a log may be large)."""
    try:
        with open(path, "rb") as f:
            end = os.fstat(f.fileno()).st_size if end is None else end
            start, data = end, b""
            while start > offset and data.count(b"\n") <= num_lines:
                step = min(65536, start - offset)
                start -= step
                f.seek(start)
                data = f.read(step) + data
    except FileNotFoundError:
        return "(no log)"
    lines = data.decode(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:]) if num_lines > 0 else ""


def start_service(spec: ServiceSpec, backend: Backend, cfg: ServerConfig, wait_s: float,
                  say: Callable[[str], None]) -> ServiceSpec:
    """Start ``spec`` through ``backend`` and wait until ``/health`` answers 200.

    Refuses when its port already has a running service or any listener, or when the bind is
    unsafe (`omlx.api.server.check_bind`). Writes the record before waiting, so ``omlx stop``
    works on a server still loading its model.

    Args:
        cfg: the resolved config (for the bind check).
        wait_s: most seconds to wait for ``/health``.
        say: prints one progress line (the process started: URL, pid, log).

    Returns:
        The recorded spec (with the pid for the pidfile backend).

    Raises:
        ServiceError: refused, or the server exited or did not answer in time (with the log's
            last lines since this start).
    """
    from omlx.api.server import check_bind

    paths = spec.paths
    pid, _ = running_pid(load_record(paths), paths)
    if pid is not None:
        rec = load_record(paths)
        how = f"{rec.backend} backend" if rec else "pid file"
        raise ServiceError(f"omlx is already running on port {spec.port} (pid {pid}, {how}); "
                           f"`omlx restart --port {spec.port}` restarts it, `omlx stop --port {spec.port}` stops it")
    if health_ok(spec.url):
        raise ServiceError(f"an omlx server already answers at {spec.url} (not started by `omlx start`); "
                           "stop it where it was started, or pick another --port")
    reason = check_bind(cfg)
    if reason:
        raise ServiceError(reason)
    paths.log.parent.mkdir(parents=True, exist_ok=True)
    paths.pid.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.pid.parent, 0o700)  # the record and env file may hold the API key
    offset = paths.log.stat().st_size if paths.log.exists() else 0
    with open(paths.log, "a") as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} omlx start ({spec.backend}): {' '.join(spec.argv)}\n")
    spec = replace(backend.start(spec), started_at=time.time())
    write_private(paths.record, spec.to_json())
    pid = spec.pid or running_pid(spec, paths)[0]
    say(f"started omlx serve on {spec.url} (pid {pid or '?'}, {spec.backend}, log {paths.log}); "
        "waiting for it to load its model")
    deadline = time.monotonic() + wait_s
    while True:
        code = backend.exited(spec)
        if code is not None:
            if isinstance(backend, PidfileBackend):
                paths.pid.unlink(missing_ok=True)
            raise ServiceError(f"omlx serve exited with code {code} before answering; last lines of {paths.log}:\n"
                               f"{_log_tail(paths.log, offset)}")
        if health_ok(spec.url):
            return spec
        if time.monotonic() > deadline:
            raise ServiceError(f"omlx serve did not answer {spec.url}/health within {wait_s:.0f} s; it is still "
                               f"running (`omlx logs -f --port {spec.port}` follows it, `omlx stop --port {spec.port}` "
                               f"stops it); last lines of {paths.log}:\n{_log_tail(paths.log, offset)}")
        time.sleep(0.5)


def stop_service(spec: ServiceSpec | None, paths: ServicePaths, timeout_s: float, force: bool,
                 say: Callable[[str], None]) -> bool:
    """Stop the service on ``paths.port``: SIGTERM (through its backend), then wait for the exit.

    Returns:
        True when it was running and has stopped, False when it was not running.

    Raises:
        ServiceError: it did not exit within ``timeout_s`` (and ``force`` is off), or the port
            answers but belongs to a server `omlx start` did not start.
    """
    pid, stale = running_pid(spec, paths)
    if stale:
        say(stale)
    if pid is None:
        url = spec.url if spec else f"http://127.0.0.1:{paths.port}"
        if health_ok(url):
            other = listening_pid(paths.port)
            raise ServiceError(f"a server answers at {url} but `omlx start` did not start it"
                               f"{f' (pid {other})' if other else ''}; stop it where it was started")
        return False
    say(f"stopping omlx on port {paths.port} (pid {pid}); it writes its KV cache to disk before it exits")
    t0 = time.monotonic()
    backend = backend_of(spec)
    if not backend.stop(spec, paths, timeout_s):
        if not force:
            raise ServiceError(f"pid {pid} did not exit within {timeout_s:.0f} s of SIGTERM and still runs; "
                               f"`omlx stop --force --port {paths.port}` kills it (its unwritten KV blocks are lost)")
        backend.kill(spec, paths)
        say(f"killed pid {pid} (SIGKILL) after {timeout_s:.0f} s")
        return True
    say(f"stopped (pid {pid}, {time.monotonic() - t0:.1f} s)")
    return True


# ---- status --------------------------------------------------------------------------------------


def _metric_sum(text: str, name: str) -> float:
    """Sum of every sample of counter ``name`` in a Prometheus text exposition."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def service_status(spec: ServiceSpec | None, paths: ServicePaths, key: str | None) -> dict[str, Any]:
    """What ``omlx status`` shows for one port, as a dict (``--json`` prints it).

    Keys: port, state ("running", "starting": the process runs but /health does not answer,
    "external": a server answers that `omlx start` did not start, "stopped"), backend, url,
    pid, uptime_s, rss_bytes, models (loaded ids), cache (prompt-token hit rate over the
    requests since the server started, hot and SSD tier sizes), prefilling (the prompts being
    prefilled now: ``/v1/admin/recent``'s rows, `omlx.engine.progress.PrefillStatus.as_dict`),
    log (the log file; None when there is none: a server run in the foreground logs to its
    terminal), note.
    """
    import psutil

    url = spec.url if spec else f"http://127.0.0.1:{paths.port}"
    pid, stale = running_pid(spec, paths)
    up = health_ok(url)
    state = "running" if pid and up else "starting" if pid else "external" if up else "stopped"
    if state == "external":
        pid = listening_pid(paths.port)
    out: dict[str, Any] = {"port": paths.port, "state": state, "backend": spec.backend if spec else None, "url": url,
                           "pid": pid, "log": str(paths.log) if paths.log.exists() else None, "note": stale}
    if pid:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            out["uptime_s"] = round(time.time() - p.create_time(), 1)
            out["rss_bytes"] = p.memory_info().rss
    if not up:
        return out
    with contextlib.suppress(Exception):
        out["models"] = [m["id"] for m in _get(url + "/health", key)["models"]]
    with contextlib.suppress(Exception):
        text = _get(url + "/metrics", key).text
        prompt = _metric_sum(text, "omlx_prompt_tokens_total")
        cached = _metric_sum(text, "omlx_cached_prompt_tokens_total")
        out["cache"] = {"num_prompt_tokens": int(prompt), "num_cached_tokens": int(cached),
                        "hit_rate": round(cached / prompt, 4) if prompt else None}
    with contextlib.suppress(Exception):
        tiers = _get(url + "/v1/cache/stats", key)["models"].values()
        cache = out.setdefault("cache", {})
        cache["hot_bytes"] = sum(t.get("hot", {}).get("num_bytes", 0) for t in tiers)
        cache["ssd_files"] = sum(t["cold"].get("num_files", 0) for t in tiers)
        cache["ssd_bytes"] = sum(t["cold"].get("num_bytes", 0) for t in tiers)
    with contextlib.suppress(Exception):
        out["prefilling"] = _get(url + "/v1/admin/recent?limit=1", key)["prefilling"]
    return out


def _duration(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d {h}h {m:02d}m" if d else f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def format_status(st: dict[str, Any]) -> str:
    """The text of one port's status."""
    how = {"running": f"running ({st['backend']})", "starting": f"starting, /health does not answer yet ({st['backend']})",
           "external": "running, not started by `omlx start`", "stopped": "not running"}[st["state"]]
    rows = [f"omlx on port {st['port']}: {how}"]
    if st.get("note"):
        rows.append(f"  note      {st['note']}")
    if st["state"] == "stopped":
        return "\n".join(rows)
    rows.append(f"  url       {st['url']}")
    if st.get("models") is not None:
        rows.append(f"  models    {', '.join(st['models']) or '(none loaded)'}")
    if st.get("pid"):
        rows.append(f"  pid       {st['pid']}")
    if st.get("uptime_s") is not None:
        rows.append(f"  uptime    {_duration(st['uptime_s'])}")
    if st.get("rss_bytes") is not None:
        rows.append(f"  memory    {format_bytes(st['rss_bytes'], digits=1)} RSS")
    c = st.get("cache")
    if c:
        rate = c.get("hit_rate")
        hit = (f"hit rate {rate:.1%} of prompt tokens ({c['num_cached_tokens']} of {c['num_prompt_tokens']})"
               if rate is not None else "hit rate - (no request yet)")
        tiers = (f"; hot {format_bytes(c.get('hot_bytes', 0), digits=1)}, SSD {c.get('ssd_files', 0)} blocks "
                 f"({format_bytes(c.get('ssd_bytes', 0), digits=1)})")
        rows.append(f"  cache     {hit}{tiers if 'hot_bytes' in c else ''}")
    for p in st.get("prefilling") or []:
        rows.append(f"  prefill   {format_prefill(p)}")
    if st["state"] != "external":  # an external server's output goes where its starter sent it
        rows.append(f"  log       {st['log'] or 'none (no log file: see where this server was started)'}")
    return "\n".join(rows)


def format_prefill(p: dict[str, Any]) -> str:
    """One prompt being prefilled (a ``prefilling`` row of ``/v1/admin/recent``), e.g.
    ``req-1-ab Qwen: 3,840 / 18,769 tokens (20%; 5 cached), 31.5 tok/s, ETA 7m 54s, 2m 01s so far``."""
    rate = p.get("tokens_per_s")
    eta = p.get("eta_s")
    cached = f"; {p['num_cached_tokens']:,} cached" if p.get("num_cached_tokens") else ""
    return (f"{p['request_id']} {p['model']}: {p['num_done_tokens']:,} / {p['num_prompt_tokens']:,} tokens "
            f"({p['progress']:.0%}{cached}), {'-' if rate is None else f'{rate:.1f}'} tok/s, "
            f"ETA {'-' if eta is None else _duration(eta)}, {_duration(p['elapsed_s'])} so far")


# ---- commands ------------------------------------------------------------------------------------

PortOpt = Annotated[Optional[int], typer.Option(help="The service's port (default: the only recorded service, "
                                                     "else the configured port, 8000).")]
BaseOpt = Annotated[Optional[str], typer.Option(help="omlx's home (default ~/.omlx).")]
ConfigOpt = Annotated[Optional[str], typer.Option("--config", help="TOML config file.")]
WaitOpt = Annotated[float, typer.Option(help="Most seconds to wait for /health after starting.")]
TimeoutOpt = Annotated[float, typer.Option(help="Most seconds to wait for the server to exit after SIGTERM.")]


def _target(port: int | None, base_path: str | None, config: str | None) -> tuple[ServerConfig, ServicePaths]:
    cfg = config_from({"port": port, "base_path": base_path}, config)
    base = Path(os.path.abspath(cfg.base_dir))
    p = cfg.port
    if port is None:
        ports = recorded_ports(base)
        if p not in ports and len(ports) == 1:
            p = ports[0]
    return cfg, ServicePaths(base, p)


def _key(spec: ServiceSpec | None, cfg: ServerConfig) -> str | None:
    return (spec.env.get("OMLX_API_KEY") if spec else None) or cfg.api_key


def _start(backend: str, wait_s: float, **options: Any) -> None:
    say = _Say("omlx start")

    cfg = config_from(serve_flags(options), options.get("config"), serve_flag_names())
    with _clean_errors(say):
        b = backend_for(backend)
        spec = build_spec(cfg, options, b.name)
        spec = start_service(spec, b, cfg, wait_s, say)
        say(f"omlx is up on {spec.url}; `omlx status` shows it, `omlx stop` stops it")


def _with_serve_options(func: Callable[..., None]) -> Callable[..., None]:
    """``func`` with every `omlx serve` option added to its signature, for Typer."""
    hints = typing.get_type_hints(func, include_extras=True)
    own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(func).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [*own, *serve_options()]

    def command(**kwargs: Any) -> None:
        func(**kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = func.__doc__
    command.__name__ = "start"
    return command


def _start_command(
    backend: Annotated[str, typer.Option(help="auto (launchd on macOS, a systemd user unit where `systemctl --user` "
                                              "works, else pidfile), launchd, systemd or pidfile.")] = "auto",
    wait_s: WaitOpt = 600.0,
    **options: Any,
) -> None:
    _start(backend, wait_s, **options)


start = _with_serve_options(_start_command)


def stop(port: PortOpt = None, base_path: BaseOpt = None, config: ConfigOpt = None, timeout_s: TimeoutOpt = 180.0,
         force: Annotated[bool, typer.Option("--force", help="SIGKILL it when it has not exited after --timeout-s.")] = False,
         ) -> None:
    say = _Say("omlx stop")
    cfg, paths = _target(port, base_path, config)
    with _clean_errors(say):
        if not stop_service(load_record(paths), paths, timeout_s, force, say):
            say(f"omlx is not running on port {paths.port}")


def restart(port: PortOpt = None, base_path: BaseOpt = None, config: ConfigOpt = None, wait_s: WaitOpt = 600.0,
            timeout_s: TimeoutOpt = 180.0) -> None:
    say = _Say("omlx restart")
    cfg, paths = _target(port, base_path, config)
    with _clean_errors(say):
        spec = load_record(paths)
        if spec is None:
            raise ServiceError(f"no service recorded for port {paths.port} under {paths.base}; "
                               "start one with `omlx start` (its settings are then reused by restart)")
        if not stop_service(spec, paths, timeout_s, False, say):
            say(f"omlx was not running on port {paths.port}; starting it")
        run_cfg = config_from({"host": spec.host, "port": spec.port, "base_path": spec.base,
                               "api_key": spec.env.get("OMLX_API_KEY")}, None)
        spec = start_service(replace(spec, pid=None, create_time=None), backend_for(spec.backend), run_cfg, wait_s, say)
        say(f"omlx is up on {spec.url}")


def status(port: Annotated[Optional[int], typer.Option(help="Only this port (default: every recorded service and "
                                                             "every server running with the base path, else the "
                                                             "configured port).")] = None,
           base_path: BaseOpt = None, config: ConfigOpt = None,
           json_out: Annotated[bool, typer.Option("--json", help="Print JSON (a list, one object per port).")] = False,
           ) -> None:
    say = _Say("omlx status")
    cfg = config_from({"port": port, "base_path": base_path}, config)
    base = Path(os.path.abspath(cfg.base_dir))
    gone = sweep_stale_live(base)  # before recorded_ports, which drops such a file without a word
    ports = [port] if port is not None else (sorted({*recorded_ports(base), *gone}) or [cfg.port])
    with _clean_errors(say):
        out = []
        for p in ports:
            paths = ServicePaths(base, p)
            spec = load_record(paths)
            st = service_status(spec, paths, _key(spec, cfg))
            if p in gone:
                died = (f"the server that listened on port {p} (pid {gone[p]}) is gone without stopping "
                        f"(killed or crashed); removed its stale {paths.live}")
                st["note"] = "; ".join(n for n in (died, st["note"]) if n)
            out.append(st)
    typer.echo(json.dumps(out, indent=2) if json_out else "\n".join(format_status(s) for s in out))
    raise typer.Exit(0 if all(s["state"] in ("running", "external") for s in out) else NOT_RUNNING)


def logs(port: PortOpt = None, base_path: BaseOpt = None, config: ConfigOpt = None,
         lines: Annotated[int, typer.Option("--lines", "-n", help="Show the last N lines.")] = 50,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C ends).")] = False,
         ) -> None:
    say = _Say("omlx logs")
    cfg, paths = _target(port, base_path, config)
    if not paths.log.exists():
        say(f"no log at {paths.log} (has `omlx start` run on port {paths.port}?)")
        raise typer.Exit(1)
    with _clean_errors(say):
        end = paths.log.stat().st_size  # follow from here: a line written while the tail prints is not lost
        tail = _log_tail(paths.log, 0, lines, end)
        if tail:
            typer.echo(tail)
        if follow:
            try:
                _follow(paths.log, end)
            except KeyboardInterrupt:
                raise typer.Exit(0) from None


def _follow(path: Path, offset: int, poll_s: float = 0.25) -> None:
    """Print what is appended to ``path`` after byte ``offset`` until interrupted; starts over
    when the file is truncated or replaced."""
    f = open(path, "rb")
    f.seek(offset)
    try:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
                continue
            time.sleep(poll_s)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell():
                f.close()
                f = open(path, "rb")
    finally:
        f.close()

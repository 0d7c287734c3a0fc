"""Where a background ``omlx serve`` lives and how it is started, found and stopped.

Owns the service's files under ``<base>`` (``logs/serve-PORT.log``, ``run/serve-PORT.pid``,
``run/serve-PORT.json`` = the record of the settings it was started with, ``run/serve-PORT.env`` =
its environment, 0600) and three backends: a pid file (a detached child in its own session),
a systemd user unit (``~/.config/systemd/user/omlx-PORT.service``) and a launchd LaunchAgent
(``~/Library/LaunchAgents/omlx.serve.PORT.plist``). Rendering the unit and the plist is pure.
No Typer and no printing here: the commands are `omlx.cli.service`; failures raise
`ServiceError` with a message meant for the user.
"""

from __future__ import annotations

import json
import os
import plistlib
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from omlx.errors import OmlxError

RECORD_VERSION = 1
BACKENDS = ("pidfile", "systemd", "launchd")
#: Environment forwarded into the service (the rest of the shell's is not: a unit runs without it).
FORWARDED_PREFIXES = ("OMLX_", "HF_")
FORWARDED_NAMES = ("PYTHONPATH", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
#: Process-internal markers never forwarded (OMLX_BLAS_REEXEC=1 would skip serve's BLAS re-exec).
NOT_FORWARDED = ("OMLX_BLAS_REEXEC",)
#: Seconds a service manager waits after SIGTERM before SIGKILL: the SSD tier's flush on stop
#: waits up to 60 s per model (`PrefixCacheTiers.close`).
STOP_TIMEOUT_S = 120


class ServiceError(OmlxError):
    """A service command that cannot do what was asked; ``str(e)`` says why and what to do.
    CLI-only: it never crosses the HTTP API."""


@dataclass(frozen=True, slots=True)
class ServicePaths:
    """The files of the service on ``port`` under omlx's home ``base``."""

    base: Path
    port: int

    @property
    def log(self) -> Path:
        return self.base / "logs" / f"serve-{self.port}.log"

    @property
    def pid(self) -> Path:
        return self.base / "run" / f"serve-{self.port}.pid"

    @property
    def record(self) -> Path:
        return self.base / "run" / f"serve-{self.port}.json"

    @property
    def env_file(self) -> Path:
        return self.base / "run" / f"serve-{self.port}.env"

    @property
    def live(self) -> Path:
        """Written by every ``omlx serve`` once it listens, however it was started (`write_live`);
        how ``omlx status --base-path`` finds a server run in the foreground."""
        return self.base / "run" / f"serve-{self.port}.live"


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """What a service runs, persisted at start so ``restart`` and the unit reuse it.

    Attributes:
        port, host: where it listens (``--port``/``--host`` are always in ``argv``).
        base: omlx's home, absolute.
        backend: "pidfile", "systemd" or "launchd".
        argv: the whole command, interpreter first (``python -m omlx serve ...``).
        env: variables set for it (``OMLX_*``, ``HF_*``, ``PYTHONPATH``; the API key as
            ``OMLX_API_KEY``, never in ``argv`` where ``ps`` shows it).
        pid, create_time: the pidfile backend's process and its start time (s since the epoch),
            so a pid reused by another process is not taken for the server; None otherwise.
        started_at: when ``omlx start`` ran (s since the epoch).
    """

    port: int
    host: str
    base: str
    backend: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    pid: int | None = None
    create_time: float | None = None
    started_at: float | None = None

    @property
    def paths(self) -> ServicePaths:
        return ServicePaths(Path(self.base), self.port)

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def to_json(self) -> str:
        d = asdict(self)
        d["argv"] = list(self.argv)
        d["env"] = dict(self.env)
        return json.dumps({"version": RECORD_VERSION, **d}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ServiceSpec:
        """Raises ServiceError on a record this version cannot read."""
        try:
            d = json.loads(text)
            if d.pop("version", None) != RECORD_VERSION:
                raise ValueError("unknown record version")
            d["argv"] = tuple(d["argv"])
            return cls(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise ServiceError(f"unreadable service record ({e})") from e


def connect_host(host: str) -> str:
    """The address a client on this machine dials for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a service gets (`FORWARDED_PREFIXES`, `FORWARDED_NAMES`)."""
    return {k: v for k, v in environ.items()
            if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and k not in NOT_FORWARDED}


def child_env(spec: ServiceSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The pidfile child's environment: ``environ`` without what `forwarded_env` would take from
    it, plus the recorded ``spec.env`` (so a restart from another shell runs the same settings)."""
    base = {k: v for k, v in environ.items() if k not in forwarded_env(environ) and k not in NOT_FORWARDED}
    return {**base, **spec.env}


# ---- records and pid files ----------------------------------------------------------------------


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_record(paths: ServicePaths) -> ServiceSpec | None:
    """The service record of ``paths.port``, or None when there is none."""
    try:
        return ServiceSpec.from_json(paths.record.read_text())
    except FileNotFoundError:
        return None


def recorded_ports(base: Path) -> list[int]:
    """Ports with a service record (or a pid file, as `omlx launch` writes), or a server that
    runs now (`ServicePaths.live`), under ``base``."""
    ports = set()
    for p in (base / "run").glob("serve-*.*"):
        m = re.fullmatch(r"serve-(\d+)\.(json|pid|live)", p.name)
        if m and (m.group(2) != "live" or live_pid(p) is not None):
            ports.add(int(m.group(1)))
    return sorted(ports)


def sweep_stale_live(base: Path) -> dict[int, int]:
    """Port -> pid of each `ServicePaths.live` file under ``base`` whose server is gone (killed or
    crashed: a server that stops removes its own file). Those files are removed (`live_pid`);
    an unreadable one is left alone."""
    out = {}
    for p in (base / "run").glob("serve-*.live"):
        m = re.fullmatch(r"serve-(\d+)\.live", p.name)
        try:
            pid = int(json.loads(p.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if m and live_pid(p) is None and not p.exists():
            out[int(m.group(1))] = pid
    return out


def write_live(path: Path) -> None:
    """Record this process as the server listening on the port of ``path`` (`ServicePaths.live`):
    its pid and start time (a reused pid is not taken for it)."""
    import psutil

    write_private(path, json.dumps({"pid": os.getpid(), "create_time": psutil.Process().create_time()}))


def remove_live(path: Path) -> None:
    """Remove ``path`` if this process wrote it (a server refused on a taken port leaves the
    running one's file alone)."""
    if live_pid(path) == os.getpid():
        path.unlink(missing_ok=True)


def live_pid(path: Path) -> int | None:
    """The pid in a `ServicePaths.live` file while that process runs; a file whose process is
    gone (killed, crashed) is removed and None returned, as is None for no or an unreadable file."""
    import psutil

    try:
        rec = json.loads(path.read_text())
        pid, created = int(rec["pid"]), float(rec["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - created) <= 1.0:
            return pid
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        return pid
    path.unlink(missing_ok=True)
    return None


def read_pid_file(path: Path) -> int | None:
    """The pid in ``path``, or None when it is missing or holds no number."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def is_serve_cmdline(cmdline: Sequence[str], port: int) -> bool:
    """True when ``cmdline`` is ``omlx serve`` listening on ``port`` (``--port P`` or ``--port=P``)."""
    args = list(cmdline)
    if "serve" not in args or not any(a == "omlx" or a.endswith("/omlx") or a.endswith("omlx/__main__.py") for a in args):
        return False
    for i, a in enumerate(args):
        if (a == "--port" and i + 1 < len(args) and args[i + 1] == str(port)) or a == f"--port={port}":
            return True
    return False


def process_state(pid: int, port: int, create_time: float | None = None) -> str:
    """What runs as ``pid``: "running" (omlx serve on ``port``), "gone" (no such process, or a
    zombie) or "other" (the pid was reused by another process, or it cannot be inspected).

    Args:
        create_time: the recorded start time of the server process (s since the epoch); when
            given, a process started at another time is "other" even with the same command.
    """
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return "gone"
        if create_time is not None and abs(p.create_time() - create_time) > 1.0:
            return "other"
        return "running" if is_serve_cmdline(p.cmdline(), port) else "other"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.AccessDenied:
        return "other"


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited (or is a zombie); True if it did within ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def listening_pid(port: int) -> int | None:
    """The pid of this user's process listening on TCP ``port``, when the OS tells (Linux does
    for one's own processes; macOS needs root); None otherwise."""
    import psutil

    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, OSError):
        pass
    return None


# ---- rendering (pure) ----------------------------------------------------------------------------


def systemd_quote(arg: str) -> str:
    """One ExecStart word, quoted for systemd.service(5): ``%`` -> ``%%``, ``$`` -> ``$$``,
    double quotes around words with spaces or quotes (backslash and ``"`` escaped inside)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not re.search(r'[\s"\'\\;]', arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_path(path: str) -> str:
    """A path for a unit setting that takes one path (WorkingDirectory=, EnvironmentFile=,
    StandardOutput=append:): taken literally, spaces included; only specifiers (``%``) escaped."""
    return path.replace("%", "%%")


def systemd_unit_name(port: int) -> str:
    return f"omlx-{port}.service"


def render_systemd_unit(spec: ServiceSpec) -> str:
    """The systemd user unit running ``spec`` (systemd.service(5), systemd.exec(5)).

    Restarts only on an abnormal end (a signal such as an OOM kill, a crash): a refused start
    (exit 1 or 2, e.g. a bad model name or a busy port) would only fail again. ``TimeoutStopSec``
    leaves time for the SSD tier's flush on SIGTERM. The environment comes from the 0600
    ``serve-PORT.env`` (it may hold the API key).
    """
    p = spec.paths
    lines = [
        "[Unit]",
        f"Description=omlx LLM inference server on {spec.host}:{spec.port}",
        "Documentation=https://github.com/omlx/omlx",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={' '.join(systemd_quote(a) for a in spec.argv)}",
        f"WorkingDirectory={systemd_path(spec.base)}",
        f"EnvironmentFile=-{systemd_path(str(p.env_file))}",
        f"StandardOutput=append:{systemd_path(str(p.log))}",
        f"StandardError=append:{systemd_path(str(p.log))}",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Restart=on-abnormal",
        "RestartSec=5",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def render_env_file(env: Mapping[str, str]) -> str:
    """``KEY="value"`` lines for systemd's EnvironmentFile= (quotes and backslashes escaped)."""
    out = []
    for k, v in sorted(env.items()):
        v = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        out.append(f'{k}="{v}"')
    return "\n".join(out) + ("\n" if out else "")


def launchd_label(port: int) -> str:
    return f"omlx.serve.{port}"


def render_launchd_plist(spec: ServiceSpec) -> bytes:
    """The LaunchAgent property list running ``spec`` (launchd.plist(5)).

    ``KeepAlive.Crashed`` restarts it after a crash only (a refused start would only fail
    again); ``ProcessType Interactive`` keeps macOS from throttling it as a background job;
    ``ExitTimeOut`` leaves time for the SSD flush on SIGTERM; ``RunAtLoad`` starts it now and
    at each login until ``omlx stop`` removes the plist.
    """
    p = spec.paths
    doc: dict[str, Any] = {
        "Label": launchd_label(spec.port),
        "ProgramArguments": list(spec.argv),
        "EnvironmentVariables": dict(spec.env),
        "WorkingDirectory": spec.base,
        "StandardOutPath": str(p.log),
        "StandardErrorPath": str(p.log),
        "RunAtLoad": True,
        "KeepAlive": {"Crashed": True},
        "ProcessType": "Interactive",
        "ExitTimeOut": STOP_TIMEOUT_S,
        "ThrottleInterval": 10,
    }
    return plistlib.dumps(doc, fmt=plistlib.FMT_XML, sort_keys=False)


# ---- backends ------------------------------------------------------------------------------------


def _run(cmd: list[str], what: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        raise ServiceError(f"{what}: {cmd[0]} not found") from e
    except subprocess.TimeoutExpired as e:
        raise ServiceError(f"{what}: `{' '.join(cmd)}` did not finish within {timeout_s:.0f} s") from e
    if r.returncode != 0:
        raise ServiceError(f"{what}: `{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r


class PidfileBackend:
    """``omlx serve`` as a detached child (its own session, so it outlives the shell), found
    through ``run/serve-PORT.pid``. Lasts until stopped or the machine restarts."""

    name = "pidfile"

    def start(self, spec: ServiceSpec) -> ServiceSpec:
        """Start the child; returns ``spec`` with its pid and start time (pid file written)."""
        import psutil

        p = spec.paths
        with open(p.log, "ab") as out:
            proc = subprocess.Popen(list(spec.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env(spec, os.environ), cwd=spec.base, start_new_session=True)
        self._proc = proc  # reaped by `exited` while the caller waits for /health
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = None
        p.pid.write_text(f"{proc.pid}\n")
        return replace(spec, pid=proc.pid, create_time=create_time)

    def exited(self, spec: ServiceSpec) -> int | None:
        """The exit code when the child started by `start` has ended, else None."""
        proc = getattr(self, "_proc", None)
        return proc.poll() if proc is not None else None

    def pid(self, spec: ServiceSpec | None, paths: ServicePaths) -> int | None:
        """The server's pid when it runs; a stale pid file (process gone, or the pid reused by
        another process) is removed and None returned."""
        pid = read_pid_file(paths.pid)
        if pid is None:
            return None
        create_time = spec.create_time if spec is not None and spec.pid == pid else None
        if process_state(pid, paths.port, create_time) == "running":
            return pid
        paths.pid.unlink(missing_ok=True)
        return None

    def stop(self, spec: ServiceSpec | None, paths: ServicePaths, timeout_s: float) -> bool:
        """SIGTERM the server and wait for it to exit; True when it did (or was not running)."""
        pid = self.pid(spec, paths)
        if pid is None:
            return True
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not wait_gone(pid, timeout_s):
            return False
        paths.pid.unlink(missing_ok=True)
        return True

    def kill(self, spec: ServiceSpec | None, paths: ServicePaths) -> None:
        pid = self.pid(spec, paths)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid, 10)
            paths.pid.unlink(missing_ok=True)


class SystemdBackend:
    """A systemd user unit ``omlx-PORT.service``: enabled (runs at login) and started by
    ``start``; stopped and disabled by ``stop``."""

    name = "systemd"

    @staticmethod
    def available() -> bool:
        """True when ``systemctl --user`` reaches a user manager (not in most containers)."""
        if shutil.which("systemctl") is None:
            return False
        try:
            return subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True,
                                  timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    @staticmethod
    def unit_path(port: int) -> Path:
        config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
        return Path(config) / "systemd" / "user" / systemd_unit_name(port)

    def start(self, spec: ServiceSpec) -> ServiceSpec:
        write_private(spec.paths.env_file, render_env_file(spec.env))
        unit = self.unit_path(spec.port)
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(render_systemd_unit(spec))
        _run(["systemctl", "--user", "daemon-reload"], "systemd")
        _run(["systemctl", "--user", "enable", "--now", systemd_unit_name(spec.port)], "systemd")
        return spec

    def exited(self, spec: ServiceSpec) -> int | None:
        r = subprocess.run(["systemctl", "--user", "show", "-p", "ActiveState", "-p", "ExecMainStatus", "--value",
                            systemd_unit_name(spec.port)], capture_output=True, text=True, timeout=30)
        state, _, status = r.stdout.partition("\n")
        if state.strip() in ("failed", "inactive"):
            return int(status.strip() or 1)
        return None

    def pid(self, spec: ServiceSpec | None, paths: ServicePaths) -> int | None:
        r = subprocess.run(["systemctl", "--user", "show", "-p", "MainPID", "--value", systemd_unit_name(paths.port)],
                           capture_output=True, text=True, timeout=30)
        pid = r.stdout.strip()
        return int(pid) if pid.isdigit() and int(pid) > 0 else None

    def stop(self, spec: ServiceSpec | None, paths: ServicePaths, timeout_s: float) -> bool:
        # `systemctl stop` waits for the job: SIGTERM, then up to TimeoutStopSec for the exit.
        _run(["systemctl", "--user", "disable", "--now", systemd_unit_name(paths.port)], "systemd",
             timeout_s=timeout_s + 30)
        return True

    def kill(self, spec: ServiceSpec | None, paths: ServicePaths) -> None:
        _run(["systemctl", "--user", "kill", "-s", "SIGKILL", systemd_unit_name(paths.port)], "systemd")


class LaunchdBackend:
    """A launchd LaunchAgent ``omlx.serve.PORT`` in the user's GUI domain: bootstrapped (and
    run at each login while its plist is there) by ``start``; booted out, plist removed, by
    ``stop``."""

    name = "launchd"

    @staticmethod
    def available() -> bool:
        return sys.platform == "darwin" and shutil.which("launchctl") is not None

    @staticmethod
    def plist_path(port: int) -> Path:
        return Path(os.path.expanduser("~/Library/LaunchAgents")) / f"{launchd_label(port)}.plist"

    @staticmethod
    def target(port: int) -> str:
        return f"gui/{os.getuid()}/{launchd_label(port)}"

    def start(self, spec: ServiceSpec) -> ServiceSpec:
        plist = self.plist_path(spec.port)
        plist.parent.mkdir(parents=True, exist_ok=True)
        # 0600: the plist may hold the API key; launchd refuses group/world-writable plists anyway.
        write_private(plist, render_launchd_plist(spec).decode())
        subprocess.run(["launchctl", "bootout", self.target(spec.port)], capture_output=True, timeout=60)
        _run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)], "launchd")
        return spec

    def _print(self, port: int) -> str | None:
        r = subprocess.run(["launchctl", "print", self.target(port)], capture_output=True, text=True, timeout=30)
        return r.stdout if r.returncode == 0 else None

    def exited(self, spec: ServiceSpec) -> int | None:
        out = self._print(spec.port)
        if out is None:
            return 1
        m = re.search(r"^\s*last exit code = (\d+)", out, re.M)
        if self.pid(spec, spec.paths) is None and m:
            return int(m.group(1))
        return None

    def pid(self, spec: ServiceSpec | None, paths: ServicePaths) -> int | None:
        out = self._print(paths.port)
        m = re.search(r"^\s*pid = (\d+)", out or "", re.M)
        return int(m.group(1)) if m else None

    def stop(self, spec: ServiceSpec | None, paths: ServicePaths, timeout_s: float) -> bool:
        pid = self.pid(spec, paths)
        subprocess.run(["launchctl", "bootout", self.target(paths.port)], capture_output=True, timeout=timeout_s + 30)
        self.plist_path(paths.port).unlink(missing_ok=True)
        return pid is None or wait_gone(pid, timeout_s)

    def kill(self, spec: ServiceSpec | None, paths: ServicePaths) -> None:
        subprocess.run(["launchctl", "kill", "SIGKILL", self.target(paths.port)], capture_output=True, timeout=30)


Backend = PidfileBackend | SystemdBackend | LaunchdBackend


def detect_backend() -> str:
    """The default backend here: launchd on macOS, systemd where a user manager answers, else
    the pid file."""
    if LaunchdBackend.available():
        return "launchd"
    if sys.platform.startswith("linux") and SystemdBackend.available():
        return "systemd"
    return "pidfile"


def backend_for(name: str) -> Backend:
    """The backend called ``name`` ("auto" = `detect_backend`).

    Raises:
        ServiceError: an unknown name, or a backend this machine lacks.
    """
    if name == "auto":
        name = detect_backend()
    if name == "pidfile":
        return PidfileBackend()
    if name == "systemd":
        if not SystemdBackend.available():
            raise ServiceError("the systemd backend needs a systemd user manager (`systemctl --user` failed); "
                               "use --backend pidfile")
        return SystemdBackend()
    if name == "launchd":
        if not LaunchdBackend.available():
            raise ServiceError("the launchd backend needs macOS (launchctl); use --backend pidfile")
        return LaunchdBackend()
    raise ServiceError(f"unknown backend {name!r}; expected auto, {', '.join(BACKENDS)}")

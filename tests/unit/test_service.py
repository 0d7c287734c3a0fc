"""`omlx start|stop|restart|status|logs` without a server: the systemd unit and the launchd plist
(rendered, then checked by `systemd-analyze verify` and `plutil -lint` where installed), the
record, the serve arguments a service runs with, stale pid files (process gone, pid reused), and
each command's errors (one line, no traceback)."""

from __future__ import annotations

import json
import os
import plistlib
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.main import get_command

from omlx.cli import service
from omlx.cli.main import app
from omlx.cli.service_backends import (
    PidfileBackend,
    ServicePaths,
    ServiceSpec,
    child_env,
    forwarded_env,
    is_serve_cmdline,
    process_state,
    recorded_ports,
    remove_live,
    render_env_file,
    render_launchd_plist,
    render_systemd_unit,
    systemd_quote,
    write_live,
)
from omlx.config import load_config

PY = sys.executable


def omlx(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "omlx", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def spec_for(tmp_path: Path, **options) -> ServiceSpec:
    cfg = load_config({"port": 8123, "base_path": str(tmp_path / "my home")}, env={})
    return service.build_spec(cfg, options, "systemd", environ={"OMLX_SSD_CACHE_MAX_SIZE": "1GB", "HOME": "/h",
                                                                  "OMLX_BLAS_REEXEC": "1", "HF_HOME": "/hf"})


def test_build_spec_records_serve_arguments_serve_accepts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf.toml").write_text("")
    s = spec_for(tmp_path, model=["SmolLM2-135M-Instruct", "other"], config="conf.toml", no_cache=True,
                 alias=["a=b", "c=d"], block_size=16, api_key="sekret", kv_bits=None)
    assert s.argv[:4] == (PY, "-m", "omlx", "serve") and s.port == 8123 and s.base == str(tmp_path / "my home")
    assert "sekret" not in " ".join(s.argv) and s.env["OMLX_API_KEY"] == "sekret"  # never where `ps` shows it
    # Only what the service needs from the environment: OMLX_* and HF_*, never the re-exec marker.
    assert s.env == {"OMLX_SSD_CACHE_MAX_SIZE": "1GB", "HF_HOME": "/hf", "OMLX_API_KEY": "sekret"}
    # The arguments parse as `omlx serve`'s own, to the values given (paths made absolute).
    cmd = get_command(app).commands["serve"]
    ctx = cmd.make_context("serve", list(s.argv[4:]))
    p = ctx.params
    assert p["model"] == ["SmolLM2-135M-Instruct", "other"] and p["alias"] == ["a=b", "c=d"]
    assert p["port"] == 8123 and p["host"] == "127.0.0.1" and p["base_path"] == str(tmp_path / "my home")
    assert p["config"] == str(tmp_path / "conf.toml") and p["no_cache"] is True and p["block_size"] == 16
    assert p["api_key"] is None and p["kv_bits"] is None and p["no_ssd_cache"] is False


def test_start_has_every_serve_option():
    cmds = get_command(app).commands
    serve_opts = {o for p in cmds["serve"].params for o in p.opts}
    start_opts = {o for p in cmds["start"].params for o in p.opts}
    assert serve_opts <= start_opts and {"--backend", "--wait-s"} <= start_opts


def test_record_round_trips(tmp_path):
    s = spec_for(tmp_path, model=["m"])
    assert ServiceSpec.from_json(s.to_json()) == s


def test_child_env_uses_the_recorded_settings_not_the_shell():
    s = ServiceSpec(port=1, host="127.0.0.1", base="/b", backend="pidfile", argv=("x",), env={"OMLX_PORT": "1"})
    env = child_env(s, {"PATH": "/bin", "OMLX_KV_BITS": "4", "OMLX_BLAS_REEXEC": "1"})
    assert env == {"PATH": "/bin", "OMLX_PORT": "1"}
    assert forwarded_env({"OMLX_A": "1", "PYTHONPATH": "/p", "HOME": "/h"}) == {"OMLX_A": "1", "PYTHONPATH": "/p"}


def test_stable_python_survives_brew_upgrade():
    assert (service.stable_python("/opt/homebrew/Cellar/omlx/0.1.0_1/libexec/bin/python")
            == "/opt/homebrew/opt/omlx/libexec/bin/python")
    assert service.stable_python("/usr/bin/python3") == "/usr/bin/python3"


# ---- systemd ----------------------------------------------------------------------------------


def test_systemd_quote():
    assert systemd_quote("--port") == "--port"
    assert systemd_quote("/a b/c") == '"/a b/c"'
    assert systemd_quote("50%") == "50%%" and systemd_quote("$HOME") == "$$HOME"
    assert systemd_quote('say "hi"\\') == '"say \\"hi\\"\\\\"'


def test_systemd_unit_content(tmp_path):
    s = spec_for(tmp_path, alias=["x=y 50%"])
    unit = render_systemd_unit(s)
    lines = unit.splitlines()
    exec_start = next(ln for ln in lines if ln.startswith("ExecStart="))
    assert exec_start.startswith(f"ExecStart={PY} -m omlx serve --host 127.0.0.1 --port 8123 ")
    assert f'--base-path "{tmp_path}/my home"' in exec_start and '--alias "x=y 50%%"' in exec_start
    log = tmp_path / "my home" / "logs" / "serve-8123.log"
    assert f"StandardOutput=append:{log}" in lines and f"StandardError=append:{log}" in lines
    assert f"EnvironmentFile=-{tmp_path}/my home/run/serve-8123.env" in lines
    assert "Restart=on-abnormal" in lines and "KillSignal=SIGTERM" in lines and "TimeoutStopSec=120" in lines
    assert "WantedBy=default.target" in lines
    env = render_env_file({"OMLX_API_KEY": 'a"b\\c', "HF_HOME": "/hf"})
    assert env == 'HF_HOME="/hf"\nOMLX_API_KEY="a\\"b\\\\c"\n'


def test_systemd_analyze_verifies_the_unit(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt install systemd)")
    s = spec_for(tmp_path, alias=["x=y 50%"], model=["SmolLM2-135M-Instruct"])
    (tmp_path / "my home" / "logs").mkdir(parents=True)
    unit = tmp_path / "omlx-8123.service"
    unit.write_text(render_systemd_unit(s))
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "Failed to initialize manager" in r.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {r.stderr.strip()}")
    # verify exits 0 even for unknown keys; any line about the unit is a finding
    assert r.returncode == 0 and str(unit) not in r.stderr and "omlx-8123" not in r.stderr, r.stderr
    # and it does find a mistake (the check can fail)
    unit.write_text(render_systemd_unit(s).replace("Restart=", "Restrt="))
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in r.stderr, r.stderr


# ---- launchd ----------------------------------------------------------------------------------


def test_launchd_plist(tmp_path):
    s = spec_for(tmp_path, model=["m"], api_key="k")
    raw = render_launchd_plist(s)
    doc = plistlib.loads(raw)
    assert doc["Label"] == "omlx.serve.8123" and doc["ProgramArguments"] == list(s.argv)
    assert doc["EnvironmentVariables"]["OMLX_API_KEY"] == "k"
    log = str(tmp_path / "my home" / "logs" / "serve-8123.log")
    assert doc["StandardOutPath"] == log and doc["StandardErrorPath"] == log
    assert doc["RunAtLoad"] is True and doc["KeepAlive"] == {"Crashed": True}
    assert doc["ProcessType"] == "Interactive" and doc["ExitTimeOut"] >= 60
    plutil = shutil.which("plutil")
    if plutil:
        path = tmp_path / "omlx.plist"
        path.write_bytes(raw)
        r = subprocess.run([plutil, "-lint", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


# ---- pid files --------------------------------------------------------------------------------


def test_is_serve_cmdline():
    assert is_serve_cmdline([PY, "-m", "omlx", "serve", "--port", "8000"], 8000)
    assert is_serve_cmdline(["/usr/local/bin/omlx", "serve", "--port=8000"], 8000)
    assert not is_serve_cmdline([PY, "-m", "omlx", "serve", "--port", "8001"], 8000)
    assert not is_serve_cmdline(["sleep", "100"], 8000)
    assert not is_serve_cmdline([PY, "-m", "omlx", "bench", "--port", "8000"], 8000)


def _sleeper(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", "import time; time.sleep(120)", *extra])


def test_process_state_tells_running_gone_and_reused():
    import psutil

    fake = _sleeper("omlx", "serve", "--port", "8999")  # looks like a server on 8999
    other = subprocess.Popen(["sleep", "120"])
    try:
        assert process_state(fake.pid, 8999) == "running"
        assert process_state(fake.pid, 8999, psutil.Process(fake.pid).create_time()) == "running"
        assert process_state(fake.pid, 8999, create_time=1.0) == "other"  # same pid, another start: reused
        assert process_state(fake.pid, 8000) == "other"
        assert process_state(other.pid, 8999) == "other"
        fake.kill()
        fake.wait()
        assert process_state(fake.pid, 8999) == "gone"
    finally:
        for p in (fake, other):
            p.kill()
            p.wait()


def test_stop_removes_a_stale_pid_file_of_a_gone_process(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    paths = ServicePaths(tmp_path, 8998)
    paths.pid.parent.mkdir(parents=True)
    paths.pid.write_text(f"{gone.pid}\n")
    r = omlx("stop", "--base-path", str(tmp_path), "--port", "8998")
    assert r.returncode == 0, r.stderr
    assert "removed a stale pid file" in r.stderr and "not running on port 8998" in r.stderr
    assert not paths.pid.exists() and "Traceback" not in r.stderr


def test_stop_never_signals_a_process_that_reused_the_pid(tmp_path):
    other = subprocess.Popen(["sleep", "120"])
    try:
        paths = ServicePaths(tmp_path, 8997)
        paths.pid.parent.mkdir(parents=True)
        paths.pid.write_text(f"{other.pid}\n")
        r = omlx("stop", "--base-path", str(tmp_path), "--port", "8997")
        assert r.returncode == 0 and "removed a stale pid file" in r.stderr, r.stderr
        time.sleep(0.2)
        assert other.poll() is None  # still running: not ours
        assert PidfileBackend().pid(None, paths) is None
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_recorded_ports(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("serve-8000.pid", "serve-8001.json", "serve-8001.env", "serve-x.pid", "other.json"):
        (tmp_path / "run" / name).write_text("1")
    assert recorded_ports(tmp_path) == [8000, 8001]


def test_a_running_servers_live_file_counts_and_a_gone_ones_is_removed(tmp_path):
    """`omlx serve` writes ``serve-PORT.live`` once it listens (`omlx status --base-path` finds it);
    a file left by a killed server names a gone process: not a port, and removed."""
    run = tmp_path / "run"
    write_live(ServicePaths(tmp_path, 8100).live)  # this process stands for the server
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / "serve-8101.live").write_text(json.dumps({"pid": gone.pid, "create_time": time.time()}))
    (run / "serve-8102.live").write_text("not json")
    assert recorded_ports(tmp_path) == [8100]
    assert not (run / "serve-8101.live").exists()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other_live = run / "serve-8103.live"
        other_live.write_text(json.dumps({"pid": other.pid, "create_time": psutil.Process(other.pid).create_time()}))
        remove_live(other_live)  # another server's file (this one was refused on its port): left alone
        assert other_live.exists() and recorded_ports(tmp_path) == [8100, 8103]
    finally:
        other.kill()
        other.wait()
    remove_live(ServicePaths(tmp_path, 8100).live)
    assert recorded_ports(tmp_path) == []


def test_status_names_a_dead_servers_port_from_its_stale_live_file(tmp_path):
    """A server killed on port P leaves ``serve-P.live``: `omlx status` dropped the file without
    a word and reported the configured port instead ("omlx on port 8000: not running")."""
    from tests.helpers import free_port

    port = free_port()
    gone = subprocess.Popen([PY, "-c", "pass"])
    gone.wait()
    live = ServicePaths(tmp_path, port).live
    live.parent.mkdir()
    live.write_text(json.dumps({"pid": gone.pid, "create_time": time.time()}))
    r = omlx("status", "--base-path", str(tmp_path), "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    (st,) = json.loads(r.stdout)
    assert (st["port"], st["state"]) == (port, "stopped"), st
    assert f"(pid {gone.pid}) is gone" in st["note"] and str(live) in st["note"], st
    assert not live.exists()

    live.write_text(json.dumps({"pid": gone.pid, "create_time": time.time()}))
    r = omlx("status", "--base-path", str(tmp_path), "--port", str(port))
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"omlx on port {port}: not running" and f"(pid {gone.pid}) is gone" in lines[1], r.stdout
    assert not live.exists()


# ---- command errors ---------------------------------------------------------------------------


def test_commands_without_a_service_say_so(tmp_path):
    base = ["--base-path", str(tmp_path)]
    r = omlx("status", *base, "--port", "8996")
    assert r.returncode == 3 and "omlx on port 8996: not running" in r.stdout, r.stdout + r.stderr
    r = omlx("restart", *base, "--port", "8996")
    assert r.returncode == 1 and "no service recorded for port 8996" in r.stderr and "omlx start" in r.stderr
    r = omlx("logs", *base, "--port", "8996")
    assert r.returncode == 1 and "no log at" in r.stderr
    r = omlx("stop", *base, "--port", "8996")
    assert r.returncode == 0 and "not running on port 8996" in r.stderr


def test_start_refuses_bad_options_and_backends_before_starting(tmp_path):
    base = ["--base-path", str(tmp_path), "--port", "8995"]
    r = omlx("start", *base, "--kv-bits", "7")
    assert r.returncode == 2 and "kv_bits must be one of" in r.stderr, r.stderr
    r = omlx("start", *base, "--backend", "nope")
    assert r.returncode == 1 and "unknown backend 'nope'" in r.stderr, r.stderr
    if sys.platform != "darwin":
        r = omlx("start", *base, "--backend", "launchd")
        assert r.returncode == 1 and "needs macOS" in r.stderr, r.stderr
    r = omlx("start", *base, "--backend", "pidfile", "--host", "0.0.0.0")
    assert r.returncode == 1 and "refusing to bind 0.0.0.0 without an API key" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "serve-8995.pid").exists()


def test_logs_tail_and_follow(tmp_path):
    log = tmp_path / "logs" / "serve-8994.log"
    log.parent.mkdir()
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    r = omlx("logs", "--base-path", str(tmp_path), "--port", "8994", "-n", "3")
    assert r.returncode == 0 and r.stdout == "line 7\nline 8\nline 9\n", r.stdout
    r = omlx("logs", "--base-path", str(tmp_path), "--port", "8994", "-n", "0")
    assert r.returncode == 0 and r.stdout == "", r.stdout
    # A terminal's Ctrl-C: SIGINT at its default in the child even where this test runs with it
    # ignored (a background job of a non-interactive shell ignores it, and exec keeps that).
    p = subprocess.Popen([PY, "-m", "omlx", "logs", "--base-path", str(tmp_path), "--port", "8994", "-n", "1", "-f"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def readline(timeout_s: float = 60) -> str:
        ready, _, _ = select.select([p.stdout], [], [], timeout_s)
        assert ready, "omlx logs -f printed nothing"
        return p.stdout.readline()

    try:
        assert readline() == "line 9\n"
        with open(log, "a") as f:
            f.write("appended\n")
        assert readline() == "appended\n"
        p.send_signal(signal.SIGINT)  # Ctrl-C ends it cleanly
        assert p.wait(30) == 0
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---- systemd and launchd backends, against recording stand-ins for systemctl and launchctl --------


def _fake_tool(bin_dir: Path, name: str, stdout: str = "") -> Path:
    """An executable ``name`` that appends its arguments to ``<bin_dir>/calls`` and prints ``stdout``."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {bin_dir}/calls\nprintf '%s' '{stdout}'\n")
    tool.chmod(0o755)
    return bin_dir / "calls"


def test_systemd_backend_writes_the_unit_and_drives_systemctl(tmp_path, monkeypatch):
    from omlx.cli.service_backends import SystemdBackend

    calls = _fake_tool(tmp_path / "bin", "systemctl", "4242\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    s = spec_for(tmp_path, api_key="k")
    assert SystemdBackend.available()
    b = SystemdBackend()
    b.start(s)
    unit = tmp_path / "xdg" / "systemd" / "user" / "omlx-8123.service"
    assert unit.read_text() == render_systemd_unit(s)
    env_file = s.paths.env_file
    assert 'OMLX_API_KEY="k"' in env_file.read_text() and (env_file.stat().st_mode & 0o077) == 0
    assert b.pid(s, s.paths) == 4242
    assert b.stop(s, s.paths, 5)
    assert calls.read_text().splitlines() == [
        "systemctl --user show-environment", "systemctl --user daemon-reload",
        "systemctl --user enable --now omlx-8123.service", "systemctl --user show -p MainPID --value omlx-8123.service",
        "systemctl --user disable --now omlx-8123.service"]


def test_launchd_backend_writes_the_plist_and_drives_launchctl(tmp_path, monkeypatch):
    from omlx.cli.service_backends import LaunchdBackend

    calls = _fake_tool(tmp_path / "bin", "launchctl", "gui/501/omlx.serve.8123 = {\n\tstate = running\n\tpid = 4343\n}\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = spec_for(tmp_path, api_key="k")
    b = LaunchdBackend()
    b.start(s)
    plist = tmp_path / "home" / "Library" / "LaunchAgents" / "omlx.serve.8123.plist"
    assert plistlib.loads(plist.read_bytes())["ProgramArguments"] == list(s.argv)
    assert (plist.stat().st_mode & 0o077) == 0  # it holds the API key
    assert b.pid(s, s.paths) == 4343
    b.stop(s, s.paths, 0.1)
    assert not plist.exists()  # not started again at the next login
    uid = os.getuid()
    assert calls.read_text().splitlines() == [
        f"launchctl bootout gui/{uid}/omlx.serve.8123", f"launchctl bootstrap gui/{uid} {plist}",
        f"launchctl print gui/{uid}/omlx.serve.8123", f"launchctl print gui/{uid}/omlx.serve.8123",
        f"launchctl bootout gui/{uid}/omlx.serve.8123"]


def test_log_tail_reads_from_the_end(tmp_path):
    log = tmp_path / "big.log"
    log.write_text("".join(f"{i:06d} {'x' * 90}\n" for i in range(5000)))  # ~485 KB
    assert service._log_tail(log, 0, 3).splitlines() == [f"{i:06d} {'x' * 90}" for i in (4997, 4998, 4999)]
    assert len(service._log_tail(log, 0, 2000).splitlines()) == 2000
    offset = 4990 * 98  # only what a start appended after this byte
    assert service._log_tail(log, offset, 40).splitlines()[0].startswith("004990")
    assert service._log_tail(log, 0, 1, end=98).startswith("000000")


def test_status_text_shows_each_prefilling_prompt_with_progress_rate_and_eta():
    row = {"request_id": "req-1-ab", "model": "Qwen2.5-Coder-0.5B-Instruct", "outcome": "prefilling",
           "num_prompt_tokens": 18769, "num_cached_tokens": 5, "num_prefilled_tokens": 3835, "num_to_prefill": 18764,
           "num_done_tokens": 3840, "progress": 0.2046, "elapsed_s": 121.68, "tokens_per_s": 31.5, "eta_s": 473.7}
    st = {"port": 8000, "state": "running", "backend": "pidfile", "url": "http://127.0.0.1:8000", "pid": 1,
          "log": "/x.log", "note": None, "prefilling": [row, {**row, "request_id": "req-2-cd", "num_cached_tokens": 0,
                                                               "tokens_per_s": None, "eta_s": None}]}
    rows = service.format_status(st).splitlines()
    assert ("  prefill   req-1-ab Qwen2.5-Coder-0.5B-Instruct: 3,840 / 18,769 tokens (20%; 5 cached), 31.5 tok/s, "
            "ETA 7m 53s, 2m 01s so far") in rows
    assert "  prefill   req-2-cd Qwen2.5-Coder-0.5B-Instruct: 3,840 / 18,769 tokens (20%), - tok/s, ETA -, 2m 01s so far" in rows
    assert "prefill" not in service.format_status({**st, "prefilling": []})

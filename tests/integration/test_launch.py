"""`omlx launch claude|codex` with the real Claude Code and Codex CLIs (installed by
scripts/setup.sh), in a loopback-only network namespace with no server running.

The first launch starts `omlx serve` in the background and runs the client against it; the
second finds it running and reuses it. The user's own ``~/.claude`` and ``~/.codex`` are left as
they were. The server is stopped at the end through the pid file launch wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MODEL_ID, REPO, TEST_HOME
from tests.netns import netns_unavailable

CLAUDE = REPO / "clients" / "node_modules" / ".bin" / "claude"
CODEX = REPO / "clients" / "node_modules" / ".bin" / "codex"
PORT = 8125

DRIVER = r'''
import json, os, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
out = []
try:
    for cmd in spec["runs"]:
        r = subprocess.run(cmd, cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=480)
        out.append({"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr})
finally:
    pid_file = spec["pid_file"]
    if os.path.exists(pid_file):
        pid = int(open(pid_file).read())
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(120):
                os.kill(pid, 0)
                time.sleep(0.25)
        except ProcessLookupError:
            pass
    print(json.dumps(out))
'''


def run_in_netns(runs: list[list[str]], *, cwd: Path, env: dict[str, str], base: Path) -> list[dict]:
    spec = {"runs": runs, "cwd": str(cwd), "env": env, "pid_file": str(base / "run" / f"serve-{PORT}.pid")}
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", DRIVER, json.dumps(spec)], capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def setup(tmp_path: Path, exe: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    if not exe.exists():
        pytest.skip(f"{exe.name} not installed at {exe}: run ./scripts/setup.sh (needs npm)")
    home, work, base = tmp_path / "home", tmp_path / "work", tmp_path / "omlx-home"
    for d in (home, work, base):
        d.mkdir()
    (base / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    config = tmp_path / "omlx.toml"
    # Greedy and capped (the test is about the wiring: a 135M model at temperature 1 rambles).
    config.write_text(f'[models."{MODEL_ID}"]\ndefault_temperature = 0.0\nmax_output_tokens = 200\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "OMLX_SSD_CACHE_MAX_SIZE": "256MB",
           "PYTHONPATH": str(REPO), "OMLX_LOG_LEVEL": "INFO"}
    return home, work, base, {**env, "OMLX_CONFIG": str(config)}


def launch_cmd(client: str, exe: Path, base: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "omlx", "launch", client, "--client-path", str(exe), "--base-path", str(base),
            "--port", str(PORT), "--", *args]


def test_launch_claude_starts_the_server_then_reuses_it(tmp_path):
    home, work, base, env = setup(tmp_path, CLAUDE)
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text('{"theme": "dark"}\n')
    ask = ["-p", "say hi", "--output-format", "json", "--no-session-persistence",
           "--system-prompt", "You are a helpful assistant. Answer briefly.", "--tools", "Bash,Read,Edit"]
    status = [sys.executable, "-m", "omlx", "status", "--json", "--base-path", str(base), "--port", str(PORT)]
    first, second, st = run_in_netns([launch_cmd("claude", CLAUDE, base, *ask)] * 2 + [status], cwd=work, env=env,
                                     base=base)
    for r in (first, second):
        assert r["rc"] == 0, f"stdout:\n{r['stdout'][-3000:]}\nstderr:\n{r['stderr'][-4000:]}"
        out = json.loads(r["stdout"].strip().splitlines()[-1])
        assert out["subtype"] == "success" and not out["is_error"] and out["result"].strip(), out
        assert MODEL_ID in out["modelUsage"], out  # Claude Code asked for the served id
    assert "started omlx serve on http://127.0.0.1:8125" in first["stderr"]
    assert "using the server at http://127.0.0.1:8125" in second["stderr"]
    assert (home / ".claude" / "settings.json").read_text() == '{"theme": "dark"}\n'
    assert "loaded SmolLM2-135M-Instruct" in (base / "logs" / f"serve-{PORT}.log").read_text()
    # The server launch started is a pidfile service: `omlx status` (and `omlx stop`) see it.
    assert st["rc"] == 0, st["stdout"] + st["stderr"]
    (svc,) = json.loads(st["stdout"])
    assert svc["state"] == "running" and svc["backend"] == "pidfile" and svc["models"] == [MODEL_ID], svc


def test_launch_codex_uses_a_private_codex_home(tmp_path):
    home, work, base, env = setup(tmp_path, CODEX)
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text('model = "gpt-5"\n')
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer briefly.\n")
    ask = ["exec", "--skip-git-repo-check", "-c", f'model_instructions_file="{instructions}"',
           "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false", "-c", "feedback.enabled=false",
           "--disable", "plugins", "--disable", "remote_plugin", "--disable", "apps", "say hi"]
    (r,) = run_in_netns([launch_cmd("codex", CODEX, base, *ask)], cwd=work, env=env, base=base)
    assert r["rc"] == 0, f"stdout:\n{r['stdout'][-3000:]}\nstderr:\n{r['stderr'][-4000:]}"
    assert r["stdout"].strip() and f"model: {MODEL_ID}" in r["stderr"] and "provider: omlx" in r["stderr"], r["stderr"][-3000:]
    assert "started omlx serve" in r["stderr"]
    assert (home / ".codex" / "config.toml").read_text() == 'model = "gpt-5"\n'
    assert 'wire_api = "responses"' in (base / "launch" / "codex" / "config.toml").read_text()

"""`omlx launch --print-env` and its errors (no server, no client run)."""

from __future__ import annotations

import subprocess
import sys


def omlx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omlx", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_print_env_names_every_setting_and_starts_nothing(tmp_path):
    r = omlx("launch", "claude", "--print-env", "--base-path", str(tmp_path), "--port", "8765", "-m", "my-model")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8765" and env["ANTHROPIC_MODEL"] == "my-model"
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "my-model" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) > 300000
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs").exists()  # nothing started
    r = omlx("launch", "codex", "--print-env", "--base-path", str(tmp_path), "--port", "8765")
    assert r.returncode == 0 and f"CODEX_HOME={tmp_path}/launch/codex" in r.stdout
    assert 'base_url = "http://127.0.0.1:8765/v1"' in r.stdout and 'wire_api = "responses"' in r.stdout
    assert 'stream_idle_timeout_ms = 1800000' in r.stdout  # a long first prefill outlasts Codex's 300 s
    assert not (tmp_path / "launch").exists()  # printed, not written


def test_an_unknown_or_missing_client_is_a_clear_error(tmp_path):
    r = omlx("launch", "vim", "--base-path", str(tmp_path))
    assert r.returncode == 2 and "unknown client 'vim'" in r.stderr
    r = omlx("launch", "opencode", "--base-path", str(tmp_path), env={"PATH": "/nonexistent", "HOME": str(tmp_path)})
    assert r.returncode == 2 and "npm install -g opencode-ai" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # no server started for a client that cannot run

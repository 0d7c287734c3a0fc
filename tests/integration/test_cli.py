"""The `omlx` CLI: models list/import (CliRunner) and `serve` start-up refusals (real processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from omlx.cli.main import app
from tests.helpers import MODEL_ID, default_model_dir, free_port

runner = CliRunner()


def test_models_import_folder_and_list(tmp_path: Path):
    src = default_model_dir()
    r = runner.invoke(app, ["models", "import", str(src), "--name", "smol-copy", "--base-path", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "models" / "smol-copy" / "config.json").exists()
    r = runner.invoke(app, ["models", "list", "--base-path", str(tmp_path)])
    assert r.exit_code == 0 and "smol-copy" in r.output


def test_models_import_rejects_bad_input(tmp_path: Path):
    r = runner.invoke(app, ["models", "import", str(tmp_path / "missing.gguf"), "--base-path", str(tmp_path)])
    assert r.exit_code != 0 and "cannot import" in r.output
    r = runner.invoke(app, ["models", "import", str(default_model_dir()), "--name", "../escape", "--base-path", str(tmp_path)])
    assert r.exit_code != 0
    assert not (tmp_path / "escape").exists()


def test_models_list_empty(tmp_path: Path):
    r = runner.invoke(app, ["models", "list", "--base-path", str(tmp_path), "--hub-cache-dir", str(tmp_path / "hub")])
    assert r.exit_code == 0 and "no models" in r.output


def _serve(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    models = tmp_path / "models"
    if not models.exists():
        models.symlink_to(default_model_dir().parent, target_is_directory=True)
    return subprocess.run([sys.executable, "-m", "omlx", "serve", "--base-path", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_refuses_public_bind_without_api_key(tmp_path: Path):
    r = _serve(["--host", "0.0.0.0", "--port", str(free_port())], tmp_path)
    assert r.returncode == 2
    assert "without an API key" in (r.stdout + r.stderr)


def test_serve_reports_port_in_use(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _serve(["--port", str(port)], tmp_path)
    assert r.returncode == 2
    assert f"port {port}" in (r.stdout + r.stderr) and "already in use" in (r.stdout + r.stderr)


def test_serve_unknown_model_is_a_clear_error(tmp_path: Path):
    r = _serve(["--port", str(free_port()), "--model", "no-such-model"], tmp_path)
    assert r.returncode == 1
    assert "no-such-model" in (r.stdout + r.stderr)


def test_default_model_id():
    assert default_model_dir().name == MODEL_ID


def test_serve_refuses_a_bad_config_value_naming_file_key_and_type(tmp_path: Path):
    cfg = tmp_path / "config.toml"  # <base-path>/config.toml, read by default
    cfg.write_text("[cache]\nblock_size = 'big'\n")
    r = _serve(["--port", str(free_port())], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"omlx: bad value for cache.block_size: 'big' (expected an integer), from config file {cfg}" in out
    assert "Traceback" not in out


def test_serve_warns_once_about_an_unknown_omlx_variable_with_a_suggestion(tmp_path: Path):
    """A misspelt variable is not an error (other tools may set OMLX_* variables), but it is said,
    once (the BLAS re-exec runs the start-up twice), before anything slow."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]  # held: the server stops at its bind check, after the warning
        env = {**os.environ, "OMLX_MAX_CONCURENT_REQUESTS": "4"}
        r = subprocess.run([sys.executable, "-m", "omlx", "serve", "--base-path", str(tmp_path), "--port", str(port)],
                           capture_output=True, text=True, timeout=120, env=env)
    out = " ".join((r.stdout + r.stderr).split())  # rich wraps long log lines
    assert r.returncode == 2, out
    assert out.count("OMLX_MAX_CONCURENT_REQUESTS is not an omlx setting and is ignored") == 1, out
    assert "(did you mean OMLX_MAX_CONCURRENT_REQUESTS?)" in out, out

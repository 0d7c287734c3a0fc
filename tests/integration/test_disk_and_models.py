"""A full disk and unreadable model folders give clear messages, and a full disk under the
SSD tier costs only the cold cache: requests keep completing.

The full disk is a 200 KB tmpfs mounted over the server's KV cache folder in a private mount
namespace (``unshare -m``; needs root, skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.helpers import MODEL_ID, ServerProcess, free_port


def _mount_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for 'unshare -m' and a tmpfs mount"
    if shutil.which("unshare") is None:
        return "'unshare' (util-linux) is not installed"
    r = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/mnt"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a private namespace: {r.stderr.strip()}"


@pytest.mark.skipif(_mount_unavailable() is not None, reason=str(_mount_unavailable()))
def test_full_disk_under_the_ssd_tier_keeps_serving(tmp_path):
    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)
    mount = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=200k tmpfs "$0" && exec "$@"', str(home / "cache")]
    with ServerProcess(base_path=home, prefix=mount, env={"OMLX_SSD_CACHE_MAX_SIZE": "512MB"}) as s:
        for i in range(3):  # prompts of 3+ full blocks: their KV is written to the (full) disk
            r = httpx.post(s.url + "/v1/chat/completions", timeout=180, json={
                "model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": f"{i} " + "word " * 700}]})
            assert r.status_code == 200, r.text
        cold = httpx.get(s.url + "/v1/cache/stats", timeout=10).json()["models"][MODEL_ID]["cold"]
        assert cold["num_disk_full"] >= 1, cold
        log = " ".join(s.log().split())
        assert "cold KV cache: disk full at" in log, log
        assert "Traceback" not in log
        assert httpx.get(s.url + "/health", timeout=10).json()["status"] == "ok"


def _serve_model(tmp_path, model: str) -> str:
    r = subprocess.run([sys.executable, "-m", "omlx", "serve", "--port", str(free_port()), "--base-path", str(tmp_path / "home"),
                        "--model", model], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 1, r.stdout + r.stderr
    return " ".join((r.stdout + r.stderr).split())


def test_model_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    assert f"cannot start: {tmp_path / 'm'} is not an mlx-lm model folder (no config.json)" in _serve_model(tmp_path, str(tmp_path / "m"))


def test_model_folder_with_broken_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    out = _serve_model(tmp_path, str(tmp_path / "m"))
    assert f"{tmp_path / 'm' / 'config.json'} is not a readable JSON file" in out, out


def test_model_folder_without_weights(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    out = _serve_model(tmp_path, str(tmp_path / "m"))
    assert f"cannot load model m from {tmp_path / 'm'}" in out and "safetensors" in out, out


def test_missing_model_path(tmp_path):
    assert f"The model '{tmp_path / 'nope'}' does not exist" in _serve_model(tmp_path, str(tmp_path / "nope"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder, so a mode-000 folder is readable here")
def test_unreadable_model_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    os.chmod(tmp_path / "m", 0)
    try:
        out = _serve_model(tmp_path, str(tmp_path / "m"))
    finally:
        os.chmod(tmp_path / "m", 0o700)
    assert "not readable by this user" in out or "no config.json" in out, out

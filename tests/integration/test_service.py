"""`omlx start|status|logs|restart|stop` with the pid-file backend, a real server process and the
real model: one service per module, driven through the CLI as a user would.

The SSD tier is set to write blocks only on a clean stop (no write of new blocks, no write-through
on hits), so blocks on disk after `omlx stop` show that stop let the server flush them: their
files are absent while it runs and present after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from omlx.cache.blockfile import block_path
from omlx.cache.hashing import Namespace, block_hashes
from omlx.cli.service_backends import process_state
from tests.helpers import MODEL_ID, TEST_HOME, default_model_dir, free_port

BS = 16


def _tokenize(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")).encode(text).ids


class Svc:
    def __init__(self, base: Path, port: int):
        self.base, self.port = base, port
        self.url = f"http://127.0.0.1:{port}"
        # Blocks reach the disk only when the server stops cleanly (see the module docstring).
        self.env = {**os.environ, "OMLX_LOG_LEVEL": "INFO", "OMLX_SSD_CACHE_MAX_SIZE": "256MB",
                    "OMLX_SSD_WRITE_NEW_BLOCKS": "0", "OMLX_SSD_WRITE_THROUGH_HITS": "0"}

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "omlx", *args, "--base-path", str(self.base), "--port", str(self.port)],
                           capture_output=True, text=True, timeout=timeout, env=self.env)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    def pid(self) -> int:
        return int((self.base / "run" / f"serve-{self.port}.pid").read_text())

    def complete(self, prompt: list[int]) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=120,
                       json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def cold(self) -> dict:
        return httpx.get(self.url + "/v1/cache/stats", timeout=30).json()["models"][MODEL_ID]["cold"]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    default_model_dir()  # imported once, outside the start's wait
    base = tmp_path_factory.mktemp("svc-home")
    (base / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    s = Svc(base, free_port())
    r = s.run("start", "--backend", "pidfile", "--block-size", str(BS), "--wait-s", "300")
    assert r.returncode == 0, r.stderr
    s.start_stderr = r.stderr
    yield s
    if (base / "run" / f"serve-{s.port}.pid").exists():
        s.run("stop", "--force", "--timeout-s", "60")


def test_start_returns_once_the_server_answers_and_records_its_settings(svc):
    assert f"started omlx serve on {svc.url}" in svc.start_stderr and f"omlx is up on {svc.url}" in svc.start_stderr
    assert httpx.get(svc.url + "/health", timeout=5).status_code == 200
    rec = json.loads((svc.base / "run" / f"serve-{svc.port}.json").read_text())
    assert rec["backend"] == "pidfile" and rec["pid"] == svc.pid()
    assert rec["argv"][1:4] == ["-m", "omlx", "serve"] and rec["argv"][-2:] == ["--block-size", str(BS)]
    assert rec["env"]["OMLX_SSD_WRITE_NEW_BLOCKS"] == "0"
    proc = psutil.Process(svc.pid())
    assert proc.cmdline()[-2:] == ["--block-size", str(BS)] and os.getsid(svc.pid()) == svc.pid()  # own session
    hot = httpx.get(svc.url + "/v1/cache/stats", timeout=30).json()["models"][MODEL_ID]["hot"]
    assert hot["block_size"] == BS


def test_a_second_start_on_the_port_is_refused(svc):
    pid = svc.pid()
    r = svc.run("start", "--backend", "pidfile")
    assert r.returncode == 1 and f"omlx is already running on port {svc.port} (pid {pid}" in r.stderr, r.stderr
    assert "omlx restart" in r.stderr and svc.pid() == pid


def test_status_shows_url_models_pid_uptime_memory_and_hit_rate(svc):
    prompt = _tokenize("Status check: " + " ".join(f"word{i}" for i in range(60)))
    svc.complete(prompt)
    cached = svc.complete(prompt)["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    r = svc.run("status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    (st,) = json.loads(r.stdout)
    assert st["state"] == "running" and st["url"] == svc.url and st["pid"] == svc.pid()
    assert st["models"] == [MODEL_ID] and st["uptime_s"] > 0 and st["rss_bytes"] > 50e6
    c = st["cache"]
    assert c["num_prompt_tokens"] == 2 * len(prompt) and c["num_cached_tokens"] == cached
    assert c["hit_rate"] == pytest.approx(c["num_cached_tokens"] / c["num_prompt_tokens"], abs=1e-4)
    text = svc.run("status").stdout
    assert f"omlx on port {svc.port}: running (pidfile)" in text and f"pid       {svc.pid()}" in text
    assert "hit rate" in text and "RSS" in text and MODEL_ID in text


def test_status_shows_a_prompt_being_prefilled_with_progress(svc):
    """Issue 27: `omlx status` lists each prompt being prefilled: tokens done / total, rate, ETA."""
    import threading
    import uuid

    prompt = _tokenize(f"Run {uuid.uuid4().hex}. " + " ".join(f"item{i} is number {i}." for i in range(480)))
    assert 4000 < len(prompt) < 8000  # long, and inside SmolLM2's 8,192-token context
    done, seen = threading.Event(), threading.Event()

    def complete() -> None:  # streamed, so the test can leave once it has seen the prefill (an abort)
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "stream": True}
        try:
            with httpx.stream("POST", svc.url + "/v1/completions", json=body, timeout=900) as r:
                for _ in r.iter_lines():  # a keep-alive comment every 5 s while it prefills
                    if seen.is_set():
                        break
        finally:
            done.set()

    t = threading.Thread(target=complete, daemon=True)
    t.start()
    rows, text = [], ""
    while not done.is_set() and not rows:
        (st,) = json.loads(svc.run("status", "--json").stdout)
        rows = [r for r in st.get("prefilling", []) if r["num_prefilled_tokens"] > 0 and r["tokens_per_s"]]
    if rows:
        text = svc.run("status").stdout  # the same prefill, as text
    seen.set()
    t.join(900)
    assert rows, "the prefill ended before `omlx status` saw it"
    (row,) = rows
    assert row["model"] == MODEL_ID and row["num_prompt_tokens"] == len(prompt)
    assert 0 < row["num_done_tokens"] < len(prompt) and row["tokens_per_s"] > 0 and row["eta_s"] > 0
    lines = [ln for ln in text.splitlines() if ln.startswith("  prefill ")]
    assert len(lines) == 1 and f"{row['request_id']} {MODEL_ID}: " in lines[0], text
    assert f" / {len(prompt):,} tokens (" in lines[0] and " tok/s, ETA " in lines[0], text


def test_logs_tail(svc):
    r = svc.run("logs", "-n", "200")
    assert r.returncode == 0 and "omlx start (pidfile)" in r.stdout and f"omlx ready on http://127.0.0.1:{svc.port}" in r.stdout
    assert len(svc.run("logs", "-n", "2").stdout.splitlines()) == 2


def test_restart_reuses_the_recorded_settings(svc):
    old = svc.pid()
    r = svc.run("restart", "--wait-s", "300")
    assert r.returncode == 0, r.stderr
    assert f"stopping omlx on port {svc.port} (pid {old})" in r.stderr and f"omlx is up on {svc.url}" in r.stderr
    assert svc.pid() != old and process_state(old, svc.port) == "gone"  # (a zombie until init reaps it)
    hot = httpx.get(svc.url + "/v1/cache/stats", timeout=30).json()["models"][MODEL_ID]["hot"]
    assert hot["block_size"] == BS  # the recorded --block-size, not the default


def test_stop_flushes_the_hot_tier_to_disk(svc):
    prompt = _tokenize("Flush check: " + " ".join(f"item{i}" for i in range(80)))
    svc.complete(prompt)
    cache_dir = svc.base / "cache"
    (ns_dir,) = [p for p in cache_dir.iterdir() if (p / "namespace.json").exists()]
    ns = Namespace.from_json(json.dumps(json.loads((ns_dir / "namespace.json").read_text())["namespace"]))
    keys = block_hashes(ns, prompt, BS)
    assert len(keys) >= 4
    assert not any(block_path(cache_dir, ns, k).exists() for k in keys)  # only in RAM while it runs
    pid = svc.pid()
    r = svc.run("stop")
    assert r.returncode == 0 and f"stopped (pid {pid}" in r.stderr, r.stderr
    assert process_state(pid, svc.port) == "gone" and not (svc.base / "run" / f"serve-{svc.port}.pid").exists()
    assert all(block_path(cache_dir, ns, k).exists() for k in keys)  # written on SIGTERM, before the exit
    assert "cold KV cache flushed" in svc.run("logs", "-n", "30").stdout
    r = svc.run("status")
    assert r.returncode == 3 and "not running" in r.stdout
    r = svc.run("stop")
    assert r.returncode == 0 and f"omlx is not running on port {svc.port}" in r.stderr


def test_a_start_that_fails_shows_the_log_tail(tmp_path):
    base = tmp_path / "home"
    base.mkdir()
    (base / "models").symlink_to(TEST_HOME / "models", target_is_directory=True)
    s = Svc(base, free_port())
    r = s.run("start", "--backend", "pidfile", "--model", "no-such-model", "--wait-s", "120")
    assert r.returncode == 1 and "omlx serve exited with code 1 before answering" in r.stderr, r.stderr
    assert "no-such-model" in r.stderr.split("last lines of", 1)[1]  # serve's own reason, from the log
    assert not (base / "run" / f"serve-{s.port}.pid").exists()
    assert s.run("status").returncode == 3


def test_status_by_base_path_finds_a_server_run_in_the_foreground(tmp_path):
    """``omlx status --base-path X`` looked only at records of `omlx start` and then at the default
    port: a plain ``omlx serve --base-path X --port P`` was "not running on port 8000". Its JSON
    named a log file that did not exist."""
    from tests.helpers import ServerProcess

    home = tmp_path / "home"
    with ServerProcess(base_path=home) as s:
        live = home / "run" / f"serve-{s.port}.live"
        for _ in range(100):  # written once the socket is bound: /health may answer a moment before
            if live.exists():
                break
            time.sleep(0.1)
        assert json.loads(live.read_text())["pid"] == s.proc.pid
        r = subprocess.run([sys.executable, "-m", "omlx", "status", "--base-path", str(home), "--json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        (st,) = json.loads(r.stdout)
        assert (st["port"], st["state"], st["pid"], st["models"]) == (s.port, "external", s.proc.pid, [MODEL_ID])
        assert st["log"] is None  # it logs to where it was started; no file under <base>/logs
    assert not live.exists()  # removed at its exit


def test_status_after_a_killed_server_names_its_port_and_removes_its_file(tmp_path):
    """A killed ``omlx serve`` leaves ``serve-PORT.live``: `omlx status --base-path` removed it
    without a word and said "omlx on port 8000: not running", the configured port."""
    from tests.helpers import ServerProcess

    home = tmp_path / "home"
    s = ServerProcess(base_path=home).start()
    live = home / "run" / f"serve-{s.port}.live"
    try:
        for _ in range(100):  # written once the socket is bound: /health may answer a moment before
            if live.exists():
                break
            time.sleep(0.1)
        pid = s.proc.pid
    finally:
        s.stop(signal.SIGKILL)
    assert live.exists()  # no chance to remove it
    r = subprocess.run([sys.executable, "-m", "omlx", "status", "--base-path", str(home), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    (st,) = json.loads(r.stdout)
    assert (st["port"], st["state"]) == (s.port, "stopped") and f"(pid {pid}) is gone" in st["note"], st
    assert not live.exists()

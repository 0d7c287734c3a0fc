"""The real Claude Code's full default session against `omlx serve` on Qwen2.5-Coder-0.5B (issue 27).

Three sessions of ``claude -p`` with Claude Code's DEFAULT system prompt and all its tools (the
first request is ~18.7k tokens): A (nothing cached), B (a new process, another question: the
shared system prompt and tools come from the hot tier), then the server is stopped (SIGTERM: the
hot tier is written to the SSD tier) and started again, and C (a third question: from the SSD
tier). Each session's requests are read from ``/v1/admin/recent`` (the records that appeared
while it ran).

Run as root; `run_sessions` re-runs this file inside a new loopback-only network namespace
(``unshare -n``), so nothing can leave the machine. Used by the slow test
`tests/integration/test_claude_code_long_prompt.py` and by `benchmarks/bench_claude_long_prompt.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLAUDE = REPO / "clients" / "node_modules" / ".bin" / "claude"
PORT = 8126
KEY = "sk-omlx-claude-long-prompt"
CLIENT_MODEL = "local-model"
QUESTIONS = ("What is 17 + 25? Answer with the number only.",
             "What is the capital of France? Answer with one word.",
             "What is 6 times 7? Answer with the number only.")


def run_sessions(out_json: Path, *, session_timeout_s: float = 3600, timeout_s: float = 12000) -> dict:
    """Run the three sessions in a new loopback-only namespace; returns (and writes) the result.

    Returns:
        ``{"sessions": [{"name", "question", "rc", "wall_s", "result", "stdout_tail",
        "stderr_tail", "records": [/v1/admin/recent rows]}...], "server_log_tail"}``.

    Raises:
        subprocess.TimeoutExpired: the whole run took longer than ``timeout_s``.
    """
    sys.path.insert(0, str(REPO))
    from tests.helpers import default_model_dir, qwen_model_dir

    default_model_dir()  # both are imported (from PyPI wheels) outside the namespace, once
    qwen_model_dir()
    cmd = ["unshare", "-n", sys.executable, str(Path(__file__).resolve()), "--out", str(out_json),
           "--session-timeout-s", str(session_timeout_s)]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"the session driver exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return json.loads(out_json.read_text())


def _recent(url: str) -> list[dict]:
    import httpx

    r = httpx.get(url + "/v1/admin/recent", params={"limit": 200}, headers={"x-api-key": KEY}, timeout=30)
    r.raise_for_status()
    return r.json()["requests"]


def _wait_idle(url: str, timeout_s: float = 600) -> None:
    """Wait until the server runs no request (an aborted prefill first finishes its chunk)."""
    import re

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", headers={"x-api-key": KEY}, timeout=30).text
        if not any(float(v) for v in re.findall(r"^omlx_requests_running\{[^}]*\} ([0-9.eE+-]+)$", text, re.M)):
            return
        time.sleep(2)


def _session(name: str, question: str, url: str, work: Path, env: dict[str, str], timeout_s: float) -> dict:
    before = {r["request_id"] for r in _recent(url)}
    cmd = [str(CLAUDE), "-p", question, "--output-format", "json", "--no-session-persistence"]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout_s)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    wall_s = time.monotonic() - t0
    _wait_idle(url)  # an attempt the CLI left (or a killed CLI's) is recorded once the engine stops it
    records = [r for r in reversed(_recent(url)) if r["request_id"] not in before]  # oldest first
    result = None
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pass
    return {"name": name, "question": question, "rc": rc, "wall_s": round(wall_s, 1), "result": result,
            "stdout_tail": out[-2000:], "stderr_tail": err[-3000:], "records": records}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--session-timeout-s", type=float, default=3600)
    args = ap.parse_args(argv)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    sys.path.insert(0, str(REPO))
    from tests.helpers import QWEN_ID, ServerProcess, qwen_model_dir

    qwen_model_dir()
    with tempfile.TemporaryDirectory(prefix="omlx-claude-long-") as tmp:
        tmp_path = Path(tmp)
        home, work, base = tmp_path / "home", tmp_path / "work", tmp_path / "omlx-home"
        for d in (home, work):
            d.mkdir()
        config = tmp_path / "omlx.toml"
        # Greedy with an output cap: the test is about the long first prompt, not the answer.
        config.write_text(f'api_key = "{KEY}"\n[aliases]\n"{CLIENT_MODEL}" = "{QWEN_ID}"\n'
                          f'[models."{QWEN_ID}"]\ndefault_temperature = 0.0\nmax_output_tokens = 200\n')
        env = {**os.environ, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PORT}", "ANTHROPIC_API_KEY": KEY,
               "ANTHROPIC_AUTH_TOKEN": "", "ANTHROPIC_MODEL": CLIENT_MODEL,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": CLIENT_MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        server_env = {"OMLX_CONFIG": str(config), "OMLX_SSD_CACHE_MAX_SIZE": "8GB"}
        sessions = []
        server = ServerProcess(["--model", QWEN_ID], base_path=base, env=server_env, port=PORT)
        with server:
            for name, q in zip("AB", QUESTIONS):
                sessions.append(_session(name, q, server.url, work, env, args.session_timeout_s))
            log_tail = server.log()
            server.stop(timeout_s=600)  # SIGTERM: the hot tier goes to the SSD tier first
        server = ServerProcess(["--model", QWEN_ID], base_path=base, env=server_env, port=PORT)
        server.log_path = base / f"server-{PORT}-restart.log"
        with server:
            sessions.append(_session("C", QUESTIONS[2], server.url, work, env, args.session_timeout_s))
            log_tail += "\n--- after the restart ---\n" + server.log()
            server.stop(timeout_s=600)
        Path(args.out).write_text(json.dumps({"sessions": sessions, "server_log_tail": log_tail[-12000:]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

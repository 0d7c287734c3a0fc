"""Load with disconnects: p50/p99 TTFT and aggregate tokens/s of many streaming clients.

Starts an ``omlx serve`` (embedded SmolLM2-135M-Instruct, a temp home whose models folder links
to .omlx-test/models) unless ``--url`` names a running one, then runs tests/loadgen.py: N
clients loop for ``--duration`` seconds, each streaming greedy chat completions of 8-48
tokens, a fraction dropping the connection at a random point. Afterwards it checks that
nothing is left running and that a next request completes, prints the figures and writes
``benchmarks/results/load-<UTC time>.json`` (figures, machine, date, load average).

    python benchmarks/bench_load.py                      # 64 clients, 60 s, 30% disconnects
    python benchmarks/bench_load.py --duration 180 --clients 64 --disconnect 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import MODEL_ID, ServerProcess  # noqa: E402
from tests.loadgen import run_load  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--model", default=MODEL_ID)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--disconnect", type=float, default=0.3, help="fraction of requests dropped at a random point")
    p.add_argument("--max-concurrent", type=int, default=8, help="server --max-concurrent-requests (own server)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def settle(url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = httpx.get(url + "/health", timeout=10).json()["models"][0]
        if (m.get("active", 0), m["running"], m["waiting"]) == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def main() -> int:
    a = parse_args()
    server = None
    tmp = None
    url = a.url
    if url is None:
        tmp = tempfile.TemporaryDirectory()
        server = ServerProcess(["--max-concurrent-requests", str(a.max_concurrent),
                                "--max-queued-requests", str(max(a.clients, 64))],
                               base_path=Path(tmp.name) / "home", env={"OMLX_SSD_CACHE_ENABLED": "0"}).start()
        url = server.url
    try:
        load_start = os.getloadavg()
        rep = asyncio.run(run_load(url, a.model, num_clients=a.clients, duration_s=a.duration,
                                   disconnect_frac=a.disconnect, seed=a.seed))
        after = settle(url)
        nxt = httpx.post(url + "/v1/chat/completions", timeout=60,
                         json={"model": a.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        out = {
            "benchmark": "load", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "report": rep.as_dict(),
            "after": {"active": after.get("active"), "running": after["running"], "waiting": after["waiting"],
                      "request_failures": after.get("request_failures"), "batch_failures": after.get("batch_failures"),
                      "next_request_status": nxt.status_code},
        }
    finally:
        if server is not None:
            server.stop()
            tmp.cleanup()
    r = out["report"]
    print(f"{r['num_clients']} clients, {r['duration_s']:.0f} s, {r['disconnect_frac']:.0%} disconnects: "
          f"{r['num_requests']} requests ({r['num_completed']} completed, {r['num_disconnected']} dropped, "
          f"{r['num_rejected']} rejected, {r['num_errors']} errors)")
    p50 = f"{r['ttft_p50_s']:.3f}" if r["ttft_p50_s"] is not None else "-"
    p99 = f"{r['ttft_p99_s']:.3f}" if r["ttft_p99_s"] is not None else "-"
    print(f"TTFT p50 {p50} s, p99 {p99} s; {r['num_tokens']} tokens, {r['tokens_per_s']:.1f} tok/s aggregate")
    print(f"after: {out['after']}")
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    path = res / f"load-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    clean = out["after"]["active"] == 0 and out["after"]["running"] == 0 and out["after"]["next_request_status"] == 200
    return 0 if clean and r["num_errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Two commits' long prefix hits, request by request: their TTFTs under the same load (issue 27).

On a shared machine whose load swings by a factor of two within a minute, two runs of
``bench_long_prefix_restore.py`` one after the other compare the load, not the code. This script
starts two ``omlx serve`` of Qwen2.5-Coder-0.5B side by side, each from its own source tree
(``--before`` and ``--after``: worktrees of the two commits) and each on its own copy of one
filled base path (``--base``: a work folder of ``bench_long_prefix_restore.py`` after its cold
request), then sends the same prompt (the bench's fixed ~18.7k-token prompt, a new question each
round) to one and then the other, swapping the order every round. Round 0's hits come from the
SSD tier (fresh servers); the later ones from RAM. Per request: client TTFT, the server's
``ttft_ms``, cached and cold-cached tokens, the 1-minute load, the text (greedy: equal across the
two when both are exact).

Measured (2026-12-07 23:13-23:20 UTC, the 2-core AMD EPYC VM, OpenBLAS, MLX 0.32.4 CPU, other
agents' tests beside it, load 2.5-4.7; ``benchmarks/results/interleaved_hits-20261207-*.json``, the
first two by this script's first draft): ``553221b`` against ``d6518fb`` (the hit's KV copied once,
not twice), 3 runs, 23 rounds: RAM hits 1.43-6.22 s (median 4.42) before, 1.15-9.30 s (median
3.76) after, after faster in 17 of 20 rounds (by 0.49 s at the median); the same text in all 23.

Usage::

    python benchmarks/diag_interleaved_hits.py --before /tmp/wt-old --after . \\
        --base /tmp/long-prefix/base [--rounds 8]

JSON to ``benchmarks/results/interleaved_hits-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_long_prefix_restore as B  # noqa: E402
import common as C  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree of the first commit")
    ap.add_argument("--after", type=Path, required=True, help="source tree of the second commit")
    ap.add_argument("--base", type=Path, required=True, help="a filled base path (copied for each server)")
    ap.add_argument("--model-dir", type=Path, default=B.DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    from openai import OpenAI

    prompts = C.Prompts(a.model_dir)
    system, tools = B.build_prompt(prompts, 18700)
    work = Path(tempfile.mkdtemp(prefix="omlx-interleaved-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    for label, src in (("before", a.before), ("after", a.after)):
        base = work / label
        shutil.copytree(a.base, base, symlinks=True)
        port = C.free_port()
        log = open(work / f"{label}.log", "w")
        servers[label] = (subprocess.Popen(
            [sys.executable, "-m", "omlx", "serve", "--port", str(port), "--base-path", str(base),
             "--model", str(a.model_dir)], cwd=str(src.resolve()), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True), port)
    rows = []
    try:
        for label, (_, port) in servers.items():
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
        time.sleep(5)  # warm-up requests done
        for i in range(a.rounds):
            for label in (("before", "after") if i % 2 == 0 else ("after", "before")):
                port = servers[label][1]
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900, max_retries=0)
                r = B.ask(client, a.model_dir.name, system, tools,
                          f"{B.QUESTIONS[i % len(B.QUESTIONS)]} (ask il-{i})", 8)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/admin/recent?limit=1") as resp:
                    rec = json.load(resp)["requests"][0]
                r.update(label=label, round=i, ttft_ms=rec["ttft_ms"], cached=rec["num_cached_tokens"],
                         cold=rec["num_cached_tokens_cold"], load=os.getloadavg()[0])
                rows.append(r)
                print(f"{i} {label:>6}: client {r['ttft_s']:.2f} s, server {r['ttft_ms'] / 1000:.2f} s, cached "
                      f"{r['cached']} (cold {r['cold']}), load {r['load']:.1f}, {r['text']!r}", flush=True)
    finally:
        for p, _ in servers.values():
            p.terminate()
        for p, _ in servers.values():
            p.wait(120)
        shutil.rmtree(work, ignore_errors=True)
    path = C.RESULTS_DIR / f"interleaved_hits-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"benchmark": "interleaved_hits", "before": str(a.before), "after": str(a.after),
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
                                "rows": rows}, indent=1))
    print(path)


if __name__ == "__main__":
    main()

"""Where an identical long prompt's time goes over HTTP (issue 18's "identical 4k prompt <= 10 ms").

Starts `omlx serve` on the default model (or ``--model``) with its own home, prefills a ~4,000-token
chat prompt once (``max_tokens`` 1), then times ``--reps`` identical non-streaming requests, each a
whole-prompt hit of the prefix cache (no forward pass). With ``--py-spy`` (py-spy installed) it also
records the server's stacks during a second series and prints the functions that took the most
samples.

``--route completions`` sends the text as ``/v1/completions``' prompt, as ``bench_gpu.py`` does.
Measured 2026-12-07 23:40 (2-core VM, load ~2, persistent client, a ~4,400-token text): the
completions route took 11.3 ms median (8.4-14.4) while it tokenized the text on every request,
1.7-1.8 ms once it went through `omlx.engine.token_cache` as chat prompts did.

Usage:
    python benchmarks/diag_identical_prompt.py [--model ID] [--lines 200] [--reps 50] [--route chat|completions]
        [--py-spy] [--out results/...json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Server, ensure_model_dir  # noqa: E402


def top_functions(raw: Path, n: int = 15) -> list[tuple[int, str]]:
    """Inclusive sample counts per omlx / tokenizer / template frame of a py-spy ``raw`` file."""
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        frames = stack.split(";")
        if any(k in frames[-1] for k in ("select (", "wait (threading", "epoll", "sleep")):
            continue  # idle
        for f in set(frames[1:]):
            if "omlx/" in f or "tokeniz" in f or "jinja" in f:
                counts[f] += int(num)
    return [(c, f) for f, c in counts.most_common(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="mlx-lm model folder (default: the embedded SmolLM2)")
    ap.add_argument("--lines", type=int, default=200, help="prompt lines (200: ~4,000 tokens with SmolLM2)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--py-spy", action="store_true")
    ap.add_argument("--route", choices=["chat", "completions"], default="chat",
                    help="completions: the text prompt as /v1/completions' prompt (bench_gpu's request)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(args.lines))
    model_dir = ensure_model_dir(Path(args.model) if args.model else None)
    home = Path(tempfile.mkdtemp(prefix="omlx-identical-"))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "model": str(model_dir)}
    s = Server("omlx", model_dir, base_path=home).start()
    try:
        with httpx.Client(timeout=600) as c:
            body = {"model": s.model_name, "max_tokens": 1, "temperature": 0}
            if args.route == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            result["route"] = args.route

            def once() -> tuple[float, dict]:
                t = time.perf_counter()
                r = c.post(s.url + f"/v1/{'chat/' if args.route == 'chat' else ''}completions", json=body)
                r.raise_for_status()
                return time.perf_counter() - t, r.json()["usage"]

            cold_s, usage = once()
            result.update(prompt_tokens=usage["prompt_tokens"], cold_s=cold_s)
            for _ in range(3):
                once()
            times, usages = zip(*(once() for _ in range(args.reps)))
            assert all(u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] for u in usages), usages[0]
            result.update(identical_ms_median=statistics.median(times) * 1e3, identical_ms_min=min(times) * 1e3)
            if args.py_spy:
                raw = home / "py-spy.txt"
                spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                spy = subprocess.Popen([spy_bin, "record", "--pid", str(s.proc.pid),
                                        "--rate", "500", "--format", "raw", "-o", str(raw), "--nonblocking",
                                        "--duration", "6"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.5)
                while spy.poll() is None:
                    once()
                result["py_spy_top"] = top_functions(raw)
    finally:
        s.stop()
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

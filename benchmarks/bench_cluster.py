"""Cluster mode benchmark (issue 11): pipeline decode speed, predicted vs measured stage times, plans.

Sections:

1. Decode tokens/s over the OpenAI API (streaming chat, greedy, fixed prompt) of one node
   (`omlx serve --no-cache --max-concurrent-requests 1`) against 2- and 3-rank pipelines
   (`python -m omlx.cli.cluster_worker`, ring over TCP on 127.0.0.1) split by the planner.
   On one machine every rank shares the same cores, so a pipeline can only be slower than one
   node: the figure measures the pipeline's overhead (hops, control messages, all-sum of the
   logits, one more process per rank competing for the cores), not the speed-up of real nodes.
2. Planner's predicted stage time vs each stage's measured forward time: the planner's cost model
   (bytes streamed / memory bandwidth) with this machine's bandwidth measured by a probe
   (reading a 256 MB float32 array), against the time of one decode step through that stage's
   layers (+ norm and head on the last stage) with a KV cache of ``--context`` tokens, in
   process, no communication.
3. Plans for a few unequal-memory node sets against an even split, for SmolLM2 and for a
   synthetic 70B-class 4-bit layout (80 layers of 0.44 GB): layer counts, bytes vs cap, predicted
   step time; an even split that overflows a node is marked.

Usage:
    python benchmarks/bench_cluster.py            # ~5 min on a quiet 2-core machine
    python benchmarks/bench_cluster.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "SmolLM2-135M-Instruct"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 96, quick 24)")
    p.add_argument("--reps", type=int, default=None, help="requests per configuration (default 3, quick 1)")
    p.add_argument("--context", type=int, default=512, help="KV tokens behind each timed decode step (section 2)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per stage (default 40, quick 10)")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# section 1: tokens/s over HTTP


def stream_tps(url: str, max_tokens: int) -> dict[str, Any]:
    import httpx
    from httpx_sse import connect_sse

    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    usage = None
    with httpx.Client(timeout=600) as client, connect_sse(client, "POST", url + "/v1/chat/completions",
                                                          json=body) as source:
        source.response.raise_for_status()
        for event in source.iter_sse():
            if not event.data or event.data == "[DONE]":
                continue
            ev = event.json()
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices", []):
                if c["delta"].get("content"):
                    times.append(time.perf_counter() - t0)
                    text.append(c["delta"]["content"])
    n = usage["completion_tokens"] if usage else len(times)
    span = times[-1] - times[0] if len(times) > 1 else None
    return {"ttft_s": times[0] if times else None, "completion_tokens": n,
            "decode_tps": (n - 1) / span if span else None, "text": "".join(text)}


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 300) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a process exited with {p.returncode} before the server was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def run_config(label: str, model_dir: Path, ranges: str | None, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from omlx.cluster.group import write_hostfile

    home = Path(tempfile.mkdtemp(prefix="omlx-bench-cluster-"))
    port = C.free_port()
    env = {**os.environ, "OMLX_LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen] = []
    if ranges is None:
        cmds = [[sys.executable, "-m", "omlx", "serve", "--model", str(model_dir), "--port", str(port),
                 "--base-path", str(home), "--no-cache", "--max-concurrent-requests", "1"]]
    else:
        n = len(ranges.split(","))
        hostfile = write_hostfile(home / "hostfile.json", [("127.0.0.1", C.free_port()) for _ in range(n)])
        cmds = [[sys.executable, "-m", "omlx.cli.cluster_worker", "--model", str(model_dir), "--ranges", ranges,
                 "--rank", str(r), "--hostfile", str(hostfile), "--port", str(port), "--base-path", str(home),
                 "--no-cache"]  # like the single node: the fixed prompt must not become a cache hit
                for r in range(n)]
    for i, cmd in enumerate(cmds):
        log = open(log_dir / f"{label.replace(' ', '_')}-{i}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    url = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_ready(url, procs)
        stream_tps(url, 8)  # one untimed request
        runs = [stream_tps(url, args.max_tokens) for _ in range(args.reps)]
    finally:
        stop_all(procs)
    tps = [r["decode_tps"] for r in runs if r["decode_tps"]]
    return {"label": label, "ranges": ranges, "ready_s": round(ready_s, 1),
            "decode_tps_median": round(statistics.median(tps), 2) if tps else None,
            "ttft_s_median": round(statistics.median(r["ttft_s"] for r in runs), 3),
            "completion_tokens": [r["completion_tokens"] for r in runs], "text": runs[0]["text"]}


# ---------------------------------------------------------------------------------------------
# section 2: predicted vs measured stage times


def probe_bandwidth_bytes_s(num_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Read a float32 array of ``num_bytes`` with a sum; the best of ``reps`` (bytes/s)."""
    import mlx.core as mx

    x = mx.random.uniform(shape=(num_bytes // 4,))
    mx.eval(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(mx.sum(x))
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def stage_times(model_dir: Path, stages: list[tuple[int, int]], context: int, steps: int) -> list[float]:
    """Median seconds of one decode step (B=1, L=1) through each stage's layers, in process."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    inner = model.model
    cache = make_prompt_cache(model)
    # Fill the KV cache with `context` tokens (one prefill through the whole model).
    mx.eval(model(mx.array([[1 + (i * 7919) % 40000 for i in range(context)]]), cache=cache))
    out = []
    for start, end in stages:
        last = end == len(inner.layers)
        h0 = mx.random.normal((1, 1, inner.embed_tokens.weight.shape[1]))
        mx.eval(h0)
        ts = []
        for s in range(steps):
            # Time a step, then trim the cache back so every step sees `context` tokens.
            t0 = time.perf_counter()
            h = h0
            mask = create_attention_mask(h, cache[start])
            for layer, c in zip(inner.layers[start:end], cache[start:end]):
                h = layer(h, mask, cache=c)
            if last:
                h = inner.embed_tokens.as_linear(inner.norm(h)) if model.args.tie_word_embeddings else model.lm_head(inner.norm(h))
            mx.eval(h)
            ts.append(time.perf_counter() - t0)
            for c in cache[start:end]:
                c.trim(1)
        out.append(statistics.median(ts[2:] or ts))
    return out


# ---------------------------------------------------------------------------------------------
# section 3: plan tables


def synthetic_70b_layout() -> Any:
    from omlx.cluster.plan import GB, ModelLayout

    # Llama-3-70B at 4 bits (group size 64): ~0.44 GB per layer, 1.05 GB embeddings, 1.05 GB head,
    # KV: 8 kv heads x 128 dims x 2 (K, V) x 2 bytes = 4 KiB per token per layer.
    return ModelLayout(layer_bytes=[int(0.44 * GB)] * 80, embed_bytes=int(1.05 * GB), head_bytes=int(1.05 * GB),
                       norm_bytes=16384, tied_embeddings=False, kv_bytes_per_token_per_layer=4096)


def plan_tables(model_dir: Path) -> list[dict[str, Any]]:
    from omlx.cluster.layer_bytes import activation_bytes_per_token, read_layout
    from omlx.cluster.plan import PlanRequest, even_split, format_plan_table, parse_nodes_spec, plan_pipeline
    from omlx.errors import PlanError

    cases = [
        ("SmolLM2 f32", read_layout(model_dir), PlanRequest(2048, 1, activation_bytes_per_token(model_dir)),
         ["small:0.25GB:50GB/s,big:0.60GB:100GB/s", "a:0.20GB,b:0.20GB,c:0.40GB", "x:0.15GB:30GB/s,y:1GB:200GB/s,z:0.3GB:100GB/s"], 0),
        ("70B 4-bit (synthetic)", synthetic_70b_layout(), PlanRequest(8192, 4, 8192 * 2),
         ["studio:64GB:400GB/s,mini:32GB:120GB/s,air:16GB:100GB/s",
          "m3max:128GB:400GB/s,m4:24GB:120GB/s",
          "a:48GB:273GB/s,b:48GB:273GB/s,c:24GB:120GB/s"], 2 * 10**9),
    ]
    out = []
    for name, layout, req, specs, headroom in cases:
        for spec in specs:
            nodes = parse_nodes_spec(spec, headroom_bytes=headroom)
            row: dict[str, Any] = {"model": name, "nodes": spec}
            try:
                plan = plan_pipeline(layout, nodes, req)
                row["plan"] = format_plan_table(plan)
                row["plan_counts"] = [s.num_layers for s in plan.stages]
                row["plan_step_ms"] = round(plan.predicted_step_s * 1e3, 3)
            except PlanError as e:
                row["plan"] = f"PlanError: {e}"
            even = even_split(layout, nodes, req)
            row["even"] = format_plan_table(even)
            row["even_counts"] = [s.num_layers for s in even.stages]
            row["even_step_ms"] = round(even.predicted_step_s * 1e3, 3)
            row["even_fits"] = even.fits
            out.append(row)
    return out


def main() -> int:
    args = parse_args()
    args.max_tokens = args.max_tokens or (24 if args.quick else 96)
    args.reps = args.reps or (1 if args.quick else 3)
    args.steps = args.steps or (10 if args.quick else 40)
    model_dir = C.ensure_model_dir(None)
    info = C.machine_info()
    warn = C.busy_warning()
    if warn:
        print("NOTE:", warn)
    log_dir = Path(tempfile.mkdtemp(prefix="omlx-bench-cluster-logs-"))

    from omlx.cluster.layer_bytes import activation_bytes_per_token, read_layout
    from omlx.cluster.plan import PlanRequest, parse_nodes_spec, plan_pipeline

    layout = read_layout(model_dir)
    act = activation_bytes_per_token(model_dir)
    bw = probe_bandwidth_bytes_s()
    print(f"memory bandwidth probe: {bw / 1e9:.1f} GB/s")
    # Equal nodes with this machine's bandwidth: the planner's split for 2 and 3 ranks.
    planned: dict[int, Any] = {}
    for n in (2, 3):
        spec = ",".join(f"n{i}:8GB:{bw / 1e9:.3f}GB/s:link=1GB/s:latency=100us" for i in range(n))
        planned[n] = plan_pipeline(layout, parse_nodes_spec(spec, headroom_bytes=0), PlanRequest(args.context, 1, act))

    # Section 1
    configs = [("1 node", None)] + [(f"{n} ranks", ",".join(f"{s.layer_start}:{s.layer_end}" for s in planned[n].stages))
                                    for n in (2, 3)]
    speed = []
    for label, ranges in configs:
        r = run_config(label, model_dir, ranges, args, log_dir)
        speed.append(r)
        print(f"{label:8s} ranges={ranges or '-':14s} decode {r['decode_tps_median']} tok/s  TTFT {r['ttft_s_median']} s  ready {r['ready_s']} s")
    same = all(r["text"] == speed[0]["text"] for r in speed)
    print(f"greedy text identical across configurations: {same}")

    # Section 2
    timing = []
    for n in (2, 3):
        stages = [(s.layer_start, s.layer_end) for s in planned[n].stages]
        measured = stage_times(model_dir, stages, args.context, args.steps)
        for s, m in zip(planned[n].stages, measured):
            hop = 0.0 if s.layer_end == layout.num_layers else 100e-6 + act / 1e9
            row = {"ranks": n, "rank": s.rank, "layers": [s.layer_start, s.layer_end],
                   "predicted_compute_ms": round((s.predicted_s - hop) * 1e3, 3), "measured_ms": round(m * 1e3, 3)}
            row["measured_over_predicted"] = round(row["measured_ms"] / row["predicted_compute_ms"], 2)
            timing.append(row)
            print(f"{n} ranks, rank {s.rank} [{s.layer_start:2d}, {s.layer_end:2d}): predicted {row['predicted_compute_ms']:.2f} ms"
                  f"  measured {row['measured_ms']:.2f} ms  (x{row['measured_over_predicted']})")

    # Section 3
    tables = plan_tables(model_dir)
    for t in tables:
        print(f"\n== {t['model']}: {t['nodes']}\n-- planner\n{t['plan']}\n-- even split\n{t['even']}")

    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out = {"machine": info, "note": warn, "mem_bandwidth_bytes_s": bw, "args": vars(args), "speed": speed,
           "stage_times": timing, "plans": tables, "identical_greedy_text": same}
    res = REPO / "benchmarks" / "results" / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

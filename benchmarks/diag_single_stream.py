"""Where does one decoding stream lose its time over HTTP? (issue #18, diagnosis)

Starts ``omlx serve`` once per variant and times one streamed ``/v1/completions`` request at a
time (a ~64-token random-word prompt, ``--tokens`` tokens, greedy), ``--reps`` times after one
warm-up request; per request: tok/s = (tokens - 1) / (last content chunk - first), and the
median and p90 chunk interval. A variant is ``NAME=ARGS``: ARGS are extra ``omlx serve``
arguments, and a first word ``swi:SECONDS`` starts the server under
``sys.setswitchinterval(SECONDS)`` (the GIL hand-over interval; Python's default is 5 ms).
With ``--py-spy`` (py-spy on PATH or importable), the first variant's server is sampled by
``py-spy record --threads --idle`` during its timed requests and the raw profile is saved
beside the JSON, so the engine thread's and the event loop's time can be read apart.

Usage (H200, model from ../shared/gpu/make_model.py)::

    python3 benchmarks/diag_single_stream.py --model /tmp/model-3b --variant default= \\
        --variant nocache=--no-cache --variant swi=swi:0.0002 --py-spy

JSON to ``benchmarks/results/single_stream-<stamp>.json`` (and ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import PromptMaker, Srv, decode_tps, itls, machine_info, stream  # noqa: E402

SWITCH_LAUNCH = ("import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1))); sys.argv[0] = 'omlx'; "
                 "runpy.run_module('omlx', run_name='__main__')")


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


async def one_variant(name: str, args: list[str], model: Path, pm: PromptMaker, reps: int, tokens: int,
                      log_dir: Path, spy_out: Path | None, streams: int = 1) -> dict[str, Any]:
    import httpx

    switch = None
    if args and args[0].startswith("swi:"):
        switch, args = args[0][4:], args[1:]
    srv = Srv(name, "omlx", model, args, log_dir)
    if switch is not None:
        srv_launch = srv.launch

        def launch() -> None:  # the same command, under another GIL switch interval
            real = subprocess.Popen

            def popen(cmd, *a, **kw):
                assert cmd[1:3] == ["-m", "omlx"], cmd
                return real([cmd[0], "-c", SWITCH_LAUNCH, switch, *cmd[3:]], *a, **kw)

            subprocess.Popen = popen
            try:
                srv_launch()
            finally:
                subprocess.Popen = real
        srv.launch = launch
    srv.launch()
    out: dict[str, Any] = {"variant": name, "args": args, "switch_interval_s": switch, "reqs": []}
    async with httpx.AsyncClient() as client:
        await srv.wait_ready(client, time.perf_counter() + 300)
        out["ready_s"] = srv.ready_s
        if not srv.up:
            out["error"] = srv.error
            srv.terminate()
            srv.reap(20)
            return out
        await stream(client, srv, pm.text(64), tokens, 120)  # warm-up
        spy = None
        if spy_out is not None:
            exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen([exe, "record", "-p", str(srv.proc.pid), "--threads", "--idle", "-r", "500",
                                    "-f", "raw", "-o", str(spy_out), "-d", "30", "--nonblocking"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            await asyncio.sleep(1.0)
        for _ in range(reps if streams > 1 else 0):
            t0 = time.perf_counter()
            rs = await asyncio.gather(*[stream(client, srv, pm.text(64), tokens, 120) for _ in range(streams)])
            wall = time.perf_counter() - t0
            n = sum(r.get("completion_tokens") or len(r["chunks"]) for r in rs)
            out.setdefault("waves", []).append({"streams": streams, "tokens": n, "wall_s": wall,
                                                "aggregate_tok_s": n / wall, "errors": [r["error"] for r in rs if not r["ok"]][:3]})
            print(f"{name}: {streams} streams, {n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s", flush=True)
            await asyncio.sleep(0.3)
        for _ in range(reps if streams == 1 else 0):
            r = await stream(client, srv, pm.text(64), tokens, 120)
            g = [1e3 * x for x in itls(r)]
            out["reqs"].append({"ok": r["ok"], "error": r["error"], "tokens": r.get("completion_tokens"),
                                "tok_s": decode_tps(r), "ttft_ms": None if r.get("ttft_s") is None else 1e3 * r["ttft_s"],
                                "itl_median_ms": statistics.median(g) if g else None,
                                "itl_p90_ms": pct(g, 0.9) if g else None, "itl_max_ms": max(g) if g else None})
            await asyncio.sleep(0.3)
        if spy is not None:
            spy.send_signal(2)
            try:
                out["py_spy"] = spy.communicate(timeout=30)[0].decode(errors="replace")[-2000:]
            except subprocess.TimeoutExpired:
                spy.kill()
        try:
            out["recent"] = (await client.get(srv.url + "/v1/admin/recent", timeout=10)).json()
        except Exception as e:  # recorded only
            out["recent"] = f"{type(e).__name__}: {e}"
    srv.terminate()
    srv.reap(30)
    out["log_tail"] = srv.log_tail(2500)
    if streams > 1:
        return out
    tps = [r["tok_s"] for r in out["reqs"] if r["tok_s"]]
    out["tok_s_median"] = statistics.median(tps) if tps else None
    rows = out["recent"].get("requests", []) if isinstance(out["recent"], dict) else []
    out["engine_tok_s"] = [r.get("decode_tps") for r in reversed(rows)][-len(out["reqs"]):]
    if streams > 1:
        return out
    print(f"{name:10s} {args} swi={switch}: tok/s {[round(x, 1) for x in tps]} median "
          f"{out['tok_s_median'] and round(out['tok_s_median'], 1)}; engine-side {out['engine_tok_s']}; itl median "
          f"{[r['itl_median_ms'] and round(r['itl_median_ms'], 2) for r in out['reqs']]} ms", flush=True)
    return out


def inprocess(model: Path, pm: PromptMaker, reps: int, tokens: int) -> dict[str, Any]:
    """mlx-lm's ``stream_generate`` on the same kind of prompt, in a child process."""
    code = f"""
import json, sys, time, statistics
from mlx_lm import load, stream_generate
model, tok = load({str(model)!r})
prompts = json.loads(sys.stdin.read())
res = []
for i, p in enumerate(prompts):
    ts = []
    for r in stream_generate(model, tok, p, max_tokens={tokens}):
        ts.append(time.perf_counter())
    if i:
        res.append((len(ts) - 1) / (ts[-1] - ts[0]))
print(json.dumps(res))
"""
    prompts = [pm.text(64) for _ in range(reps + 1)]
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True,
                       timeout=300)
    try:
        tps = json.loads(p.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": p.stderr[-2000:]}
    print(f"in-process stream_generate: tok/s {[round(x, 1) for x in tps]}", flush=True)
    return {"tok_s": tps, "tok_s_median": statistics.median(tps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--variant", action="append", default=[], help="NAME=ARGS (repeat); default: default=")
    ap.add_argument("--py-spy", action="store_true", help="sample the first variant's server with py-spy")
    ap.add_argument("--streams", type=int, default=1, help="concurrent streams per repetition (aggregate tok/s)")
    ap.add_argument("--no-inprocess", action="store_true")
    a = ap.parse_args()
    model = Path(a.model).resolve()
    pm = PromptMaker(model, 0)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    res_dir = Path(__file__).resolve().parent / "results"
    res_dir.mkdir(exist_ok=True)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"diag-single-{stamp}"
    log_dir.mkdir(parents=True)
    out: dict[str, Any] = {"machine": machine_info(), "stamp": stamp, "reps": a.reps, "tokens": a.tokens,
                           "variants": []}
    if not a.no_inprocess:
        out["inprocess"] = inprocess(model, pm, a.reps, a.tokens)
    for i, v in enumerate(a.variant or ["default="]):
        name, _, rest = v.partition("=")
        spy = res_dir / f"single_stream-{stamp}-{name}.spy.txt" if a.py_spy and i == 0 else None
        out["variants"].append(asyncio.run(one_variant(name, rest.split(), model, pm, a.reps, a.tokens,
                                                       log_dir, spy, a.streams)))
    path = res_dir / f"single_stream-{stamp}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    if os.environ.get("OUT"):
        for f in res_dir.glob(f"single_stream-{stamp}*"):
            shutil.copy(f, os.environ["OUT"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

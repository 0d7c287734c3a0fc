"""Serving benchmark (issue 2): omlx against mlx_lm.server and mlx-lm in-process, one run.

What it measures (README.md in this folder explains every figure):

1. First request after start: a fresh server gets 10 sequential chat requests (distinct
   prompts of the same length, so no cache helps) as soon as /health says 200; TTFT of the 1st
   against the 10th. omlx is started fresh ``--starts`` times; mlx_lm.server the same (info).
2. Single-stream decode: one greedy streamed essay per repetition (same prompt for both
   servers, a different one each repetition); decode tok/s and TTFT. mlx-lm in-process decodes
   the same prompt tokens with ``generate_step``.
3. Aggregate output tok/s at 1, 2, 4, 8 concurrent streams (distinct prompts): all completion
   tokens / wall time from the first send to the last stream's end.
4. Cold prefill of a ~4,000-token /v1/completions prompt, max_tokens=1: prompt tokens / TTFT.
   Every repetition uses a prompt from a different seed (no cache can help; cached_tokens is
   reported to prove it); mlx-lm in-process prefills the same token ids from an empty cache.

Usage:
    python benchmarks/bench_serving.py            # full run (~5-10 min on 2 cores)
    python benchmarks/bench_serving.py --quick    # smoke run (~2 min)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run (fewer repetitions, shorter outputs)")
    p.add_argument("--model-dir", type=Path, default=None, help="mlx-lm model folder (default: omlx's embedded SmolLM2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each measurement (default 3, quick 1)")
    p.add_argument("--starts", type=int, default=None, help="fresh starts for first-vs-tenth (default 3, quick 1)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per single-stream decode (default 256, quick 32)")
    p.add_argument("--concurrency", type=str, default="1,2,4,8", help="stream counts for aggregate throughput")
    p.add_argument("--agg-tokens", type=int, default=None, help="tokens per stream in the aggregate runs (default 128, quick 24)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="cold prefill prompt length (default 4000, quick 1000)")
    p.add_argument("--first-prompt-tokens", type=int, default=None, help="prompt length for first-vs-tenth (default 1000, quick 200)")
    p.add_argument("--omlx-arg", action="append", default=[], help="extra argument for omlx serve (repeatable)")
    p.add_argument("--peer-arg", action="append", default=[], help="extra argument for mlx_lm server (repeatable)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS for every server and the in-process run (default: OpenBLAS's own)")
    p.add_argument("--out-dir", type=Path, default=C.RESULTS_DIR)
    a = p.parse_args()
    q = a.quick
    a.reps = a.reps or (1 if q else 3)
    a.starts = a.starts or (1 if q else 3)
    a.decode_tokens = a.decode_tokens or (32 if q else 256)
    a.agg_tokens = a.agg_tokens or (24 if q else 128)
    a.prefill_tokens = a.prefill_tokens or (1000 if q else 4000)
    a.first_prompt_tokens = a.first_prompt_tokens or (200 if q else 1000)
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x]
    return a


def first_vs_tenth(server: C.Server, contents: list[str], rep: C.Report) -> dict[str, Any]:
    """10 sequential requests (prepared beforehand) on a just-started server; TTFT of each."""
    out = []
    for i, content in enumerate(contents):
        r = C.stream_chat(server, [{"role": "user", "content": content}], max_tokens=8)
        if not r.ok:
            rep.note(f"{server.label} first-vs-tenth request {i + 1} failed: {r.error}")
        out.append(r.summary())
    return {"ready_s": server.ready_s, "requests": out}


def main() -> int:
    a = parse_args()
    C.set_blas_threads(a.blas_threads)
    model_dir = C.ensure_model_dir(a.model_dir)
    rep = C.Report("serving", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()})
    rep.data["model_dir"] = str(model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="omlx-bench-serving-"))
    rep.log(f"model {model_dir}; logs in {log_dir}")
    prompts = C.Prompts(model_dir)
    servers: dict[str, C.Server] = {}
    labels = ("omlx", "mlx_lm.server")
    kinds = {"omlx": "omlx", "mlx_lm.server": "mlx_lm"}
    extra = {"omlx": a.omlx_arg, "mlx_lm.server": a.peer_arg}
    raw: dict[str, Any] = {"first_vs_tenth": {}, "decode": {}, "aggregate": {}, "prefill": {}}
    try:
        # 1. first request after start (fresh processes; the last start of each stays up)
        for label in labels:
            raw["first_vs_tenth"][label] = []
            for s in range(a.starts):
                contents = [prompts.text(f"first-{label}-{s}-{i}", a.first_prompt_tokens) for i in range(10)]
                srv = C.Server(kinds[label], model_dir, extra[label], log_dir, label)
                rep.log(f"starting {label} (fresh, start {s + 1}/{a.starts})")
                srv.start()
                raw["first_vs_tenth"][label].append(first_vs_tenth(srv, contents, rep))
                if s < a.starts - 1:
                    srv.stop()
                else:
                    servers[label] = srv
            rep.log(f"{label}: ready in {servers[label].ready_s:.1f} s, BLAS {servers[label].blas()}")
        rep.data["servers"] = {k: v.info() for k, v in servers.items()}
        for label, srv in servers.items():
            if srv.blas() != "openblas":
                rep.note(f"{label} does not run on OpenBLAS ({srv.blas()}): the comparison is not fair")

        # 2. single-stream decode (same prompt for both servers within a repetition)
        decode_prompts = [prompts.essay_messages(100 + r) for r in range(a.reps)]
        for label in labels:
            raw["decode"][label] = []
        for r in range(a.reps):
            order = labels if r % 2 == 0 else labels[::-1]
            for label in order:
                res = C.stream_chat(servers[label], decode_prompts[r], a.decode_tokens)
                if not res.ok:
                    rep.note(f"{label} decode rep {r} failed: {res.error}")
                if res.num_tokens < 0.9 * a.decode_tokens:
                    rep.note(f"{label} decode rep {r}: only {res.num_tokens}/{a.decode_tokens} tokens (early EOS)")
                n_local = len(prompts.chat_ids(decode_prompts[r]))
                if res.prompt_tokens is not None and res.prompt_tokens != n_local:
                    rep.note(f"{label} counts {res.prompt_tokens} prompt tokens for the decode prompt, "
                             f"the local chat template {n_local}")
                raw["decode"][label].append(res.summary(keep_times=True))
            rep.log(f"decode rep {r + 1}/{a.reps}: " + ", ".join(
                f"{lb} {raw['decode'][lb][-1]['decode_tps']} tok/s" for lb in labels))

        # 3. aggregate throughput at N concurrent streams (distinct prompts)
        agg_reps = max(1, min(a.reps, 2))
        for label in labels:
            raw["aggregate"][label] = {}
        for n in a.concurrency:
            for label in labels:
                raw["aggregate"][label][n] = []
            for r in range(agg_reps):
                order = labels if r % 2 == 0 else labels[::-1]
                for label in order:
                    srv = servers[label]
                    bodies = [C.chat_body(srv, prompts.essay_messages(1000 * n + 10 * r + i), a.agg_tokens)
                              for i in range(n)]
                    results, wall = C.run_streams(srv, bodies, chat=True)
                    bad = [x.error for x in results if not x.ok]
                    if bad:
                        rep.note(f"{label} aggregate n={n}: {len(bad)} stream(s) failed: {bad[0]}")
                    tokens = sum(x.num_tokens for x in results if x.ok)
                    raw["aggregate"][label][n].append({
                        "wall_s": wall, "tokens": tokens, "tps": tokens / wall if wall > 0 else None,
                        "token_count_source": sorted({x.token_count_source for x in results}),
                        "streams": [x.summary() for x in results],
                    })
                rep.log(f"aggregate n={n} rep {r + 1}/{agg_reps}: " + ", ".join(
                    f"{lb} {raw['aggregate'][lb][n][-1]['tps']:.1f} tok/s" for lb in labels))

        # 4. cold prefill, ~4,000 tokens, a new seed for every repetition (no cache can help)
        prefill_texts = [prompts.text(f"cold-prefill-{r}", a.prefill_tokens) for r in range(a.reps)]
        prefill_ids = [prompts.encode(t) for t in prefill_texts]
        for label in labels:
            raw["prefill"][label] = []
        for r in range(a.reps):
            order = labels if r % 2 == 0 else labels[::-1]
            for label in order:
                res = C.stream_completion(servers[label], prefill_texts[r], max_tokens=1)
                d = res.summary()
                d["prefill_tps"] = (res.prompt_tokens / res.ttft_s) if res.ok and res.prompt_tokens else None
                d["local_prompt_tokens"] = len(prefill_ids[r])
                if res.cached_tokens:
                    rep.note(f"{label} cold prefill rep {r}: {res.cached_tokens} cached tokens reported")
                if res.prompt_tokens is not None and res.prompt_tokens != len(prefill_ids[r]):
                    rep.note(f"{label} counts {res.prompt_tokens} prompt tokens, the local tokenizer {len(prefill_ids[r])}")
                raw["prefill"][label].append(d)
            rep.log(f"cold prefill rep {r + 1}/{a.reps}: " + ", ".join(
                f"{lb} {C.fmt(raw['prefill'][lb][-1]['prefill_tps'])} tok/s" for lb in labels))
        for label, srv in servers.items():
            rep.data["servers"][label]["rss_mb_end"] = srv.rss_mb()
    finally:
        for srv in servers.values():
            srv.stop()

    # 5. mlx-lm in-process (servers stopped): same decode prompts and prefill token ids
    rep.log("mlx-lm in-process (child process, same LD_PRELOAD)")
    tasks: list[dict[str, Any]] = []
    for r in range(a.reps):
        tasks.append({"id": f"decode-{r}", "kind": "decode", "prompt": prompts.chat_ids(decode_prompts[r]),
                      "max_tokens": a.decode_tokens, "reps": 1})
    for r in range(a.reps):
        tasks.append({"id": f"prefill-{r}", "kind": "prefill", "context": [], "new": prefill_ids[r], "reps": 1})
    inproc = C.run_inprocess(model_dir, tasks, log_dir)
    rep.data["inprocess"] = {"load_s": inproc["load_s"], "blas": inproc["blas"]}
    if inproc["blas"] != "openblas":
        rep.note(f"in-process mlx-lm does not run on OpenBLAS ({inproc['blas']})")
    ip_decode = [run for r in range(a.reps) for run in inproc["results"][f"decode-{r}"]["runs"]]
    ip_prefill = [(len(prefill_ids[r]) / t) for r in range(a.reps) for t in inproc["results"][f"prefill-{r}"]["times_s"]]
    ip_prefill_s = [t for r in range(a.reps) for t in inproc["results"][f"prefill-{r}"]["times_s"]]
    raw["inprocess"] = inproc
    rep.data["raw"] = raw

    # ---- figures
    S = C.summarize
    fig: dict[str, Any] = {}
    for label in labels:
        d = raw["decode"][label]
        fig[label] = {
            "decode_tps": S(x["decode_tps"] for x in d),
            "decode_ttft_s": S(x["ttft_s"] for x in d),
            "itl_median_ms": S(x.get("itl_median_ms") for x in d),
            "prefill_tps": S(x["prefill_tps"] for x in raw["prefill"][label]),
            "prefill_ttft_s": S(x["ttft_s"] for x in raw["prefill"][label]),
            "aggregate_tps": {n: S(x["tps"] for x in raw["aggregate"][label][n]) for n in a.concurrency},
            "first_ttft_s": S(st["requests"][0]["ttft_s"] for st in raw["first_vs_tenth"][label]),
            "tenth_ttft_s": S(st["requests"][9]["ttft_s"] for st in raw["first_vs_tenth"][label]),
            "steady_ttft_s": S(C.med(q["ttft_s"] for q in st["requests"][5:]) for st in raw["first_vs_tenth"][label]),
            "first_over_tenth": S(C.ratio(st["requests"][0]["ttft_s"], st["requests"][9]["ttft_s"])
                                  for st in raw["first_vs_tenth"][label]),
            "ready_s": S(st["ready_s"] for st in raw["first_vs_tenth"][label]),
            "token_count_source": sorted({x["token_count_source"] for x in d}),
        }
    fig["in-process"] = {
        "decode_tps": S(x["decode_tps"] for x in ip_decode),
        "decode_ttft_s": S(x["ttft_s"] for x in ip_decode),
        "prefill_tps": S(ip_prefill),
        "prefill_ttft_s": S(ip_prefill_s),
    }
    rep.data["figures"] = fig
    o, p, ip = fig["omlx"], fig["mlx_lm.server"], fig["in-process"]
    m = lambda x: x["median"]  # noqa: E731

    rows = [
        ["single-stream decode tok/s", C.fmt(o["decode_tps"]), C.fmt(p["decode_tps"]), C.fmt(ip["decode_tps"]),
         C.fmt(C.ratio(m(o["decode_tps"]), m(p["decode_tps"])), "x", 2),
         C.fmt(C.ratio(m(o["decode_tps"]), m(ip["decode_tps"])), "x", 2)],
        ["single-stream TTFT (~50-token chat)", C.ms(o["decode_ttft_s"]), C.ms(p["decode_ttft_s"]),
         C.ms(ip["decode_ttft_s"]), C.fmt(C.ratio(m(o["decode_ttft_s"]), m(p["decode_ttft_s"])), "x", 2),
         C.fmt(C.ratio(m(o["decode_ttft_s"]), m(ip["decode_ttft_s"])), "x", 2)],
        ["inter-chunk interval, median", C.fmt(o["itl_median_ms"], " ms"), C.fmt(p["itl_median_ms"], " ms"), "-", "", ""],
    ]
    for n in a.concurrency:
        rows.append([f"aggregate output tok/s, {n} stream(s)", C.fmt(o["aggregate_tps"][n]),
                     C.fmt(p["aggregate_tps"][n]), "-",
                     C.fmt(C.ratio(m(o["aggregate_tps"][n]), m(p["aggregate_tps"][n])), "x", 2), ""])
    rows += [
        [f"cold prefill tok/s (~{a.prefill_tokens} tokens)", C.fmt(o["prefill_tps"]), C.fmt(p["prefill_tps"]),
         C.fmt(ip["prefill_tps"]), C.fmt(C.ratio(m(o["prefill_tps"]), m(p["prefill_tps"])), "x", 2),
         C.fmt(C.ratio(m(o["prefill_tps"]), m(ip["prefill_tps"])), "x", 2)],
        ["cold prefill TTFT", C.ms(o["prefill_ttft_s"]), C.ms(p["prefill_ttft_s"]), C.ms(ip["prefill_ttft_s"]), "", ""],
        ["time to ready (process start -> /health 200)", C.fmt(o["ready_s"], " s"), C.fmt(p["ready_s"], " s"), "-", "", ""],
        [f"TTFT 1st request after start (~{a.first_prompt_tokens}-token chat)", C.ms(o["first_ttft_s"]),
         C.ms(p["first_ttft_s"]), "-", "", ""],
        ["TTFT 10th request", C.ms(o["tenth_ttft_s"]), C.ms(p["tenth_ttft_s"]), "-", "", ""],
        ["TTFT median of requests 6-10", C.ms(o["steady_ttft_s"]), C.ms(p["steady_ttft_s"]), "-", "", ""],
        ["1st / 10th TTFT", C.fmt(o["first_over_tenth"], "x"), C.fmt(p["first_over_tenth"], "x"), "-", "", ""],
    ]
    rep.table("Serving: medians [min-max] over repetitions; omlx/peer and omlx/in-process ratios of medians",
              ["figure", "omlx", "mlx_lm.server", "mlx-lm in-process", "omlx/peer", "omlx/in-proc"], rows)
    rep.table("Per first-vs-tenth start: TTFT of requests 1..10 (ms)", ["server / start"] + [str(i) for i in range(1, 11)],
              [[f"{lb} #{s + 1}"] + [C.fmt((q["ttft_s"] or 0) * 1e3, "", 0) for q in st["requests"]]
               for lb in labels for s, st in enumerate(raw["first_vs_tenth"][lb])])

    rep.target("single-stream decode vs mlx_lm.server", C.ratio(m(o["decode_tps"]), m(p["decode_tps"])), ">=", 1.0,
               "omlx tok/s / peer tok/s")
    rep.target("single-stream decode vs in-process", C.ratio(m(o["decode_tps"]), m(ip["decode_tps"])), ">=", 0.95,
               "omlx tok/s / mlx-lm generate_step tok/s")
    if 8 in a.concurrency:
        rep.target("aggregate at 8 streams vs mlx_lm.server at 8",
                   C.ratio(m(o["aggregate_tps"][8]), m(p["aggregate_tps"][8])), ">=", 1.2, "output tok/s ratio")
    rep.target("cold prefill vs mlx_lm.server", C.ratio(m(o["prefill_tps"]), m(p["prefill_tps"])), ">=", 1.0,
               f"~{a.prefill_tokens}-token prompt, new seed each repetition")
    rep.target("cold prefill vs in-process", C.ratio(m(o["prefill_tps"]), m(ip["prefill_tps"])), ">=", 0.95,
               "prompt tokens / TTFT")
    rep.target("first-request TTFT vs steady state (10th)", m(o["first_over_tenth"]), "<=", 1.2,
               f"median over {a.starts} fresh start(s) of TTFT(1st)/TTFT(10th)")
    rep.print()
    rep.write(a.out_dir, "quick" if a.quick else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix-cache benchmark (issue 3): omlx against mlx_lm.server in one run, with a physical reference.

Sections (README.md in this folder explains every figure):

1. Long prompt (~4,000 tokens, /v1/completions, max_tokens=1), per repetition a new seed:
   cold; identical again; with a short suffix; with one line in the middle changed.
2. Short chat prompt (~50 tokens with its own system line): cold, then the identical request.
3. Agent trace: 8 chat turns over a 2,000-token system prompt; each turn adds a ~300-token
   user message (tool output) after the previous reply; at one turn a line in the middle of the
   history (an earlier user message) is edited. TTFT per turn and total.
4. Resident KV bytes of omlx (``/v1/cache/stats``, hot ``num_bytes``) against unique cached
   tokens x KV bytes per token (2 * layers * kv_heads * head_dim * dtype bytes, config.json).

Physical reference: for every omlx request, the longest prefix of its prompt that omlx could
hold (the longest match among everything sent to it before: prompts + fed generated tokens,
at most prompt - 1 tokens) is prefilled in-process by mlx-lm into a prompt cache, untimed;
then the time to prefill the rest to the first token (``generate_step`` with that cache) is
the reference.

Usage:
    python benchmarks/bench_prefix_cache.py            # full run (~5-10 min on 2 cores)
    python benchmarks/bench_prefix_cache.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402

LABELS = ("omlx", "mlx_lm.server")
KINDS = {"omlx": "omlx", "mlx_lm.server": "mlx_lm"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--model-dir", type=Path, default=None, help="mlx-lm model folder (default: omlx's embedded SmolLM2)")
    p.add_argument("--reps", type=int, default=None, help="long-prompt repetitions (default 3, quick 1)")
    p.add_argument("--short-reps", type=int, default=None, help="short-prompt repetitions (default 5, quick 2)")
    p.add_argument("--trace-reps", type=int, default=None, help="agent-trace repetitions (default 2, quick 1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="long prompt length (default 4000, quick 1000)")
    p.add_argument("--suffix-tokens", type=int, default=40)
    p.add_argument("--short-tokens", type=int, default=50, help="short chat prompt length, template included")
    p.add_argument("--system-tokens", type=int, default=None, help="agent system prompt (default 2000, quick 600)")
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens added per turn (default 300, quick 100)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--edit-turn", type=int, default=5, help="the turn (1-based) that edits a line in the middle of the history")
    p.add_argument("--reply-tokens", type=int, default=None, help="max_tokens of each agent reply (default 64, quick 12)")
    p.add_argument("--omlx-arg", action="append", default=[], help="extra argument for omlx serve (repeatable)")
    p.add_argument("--peer-arg", action="append", default=[], help="extra argument for mlx_lm server (repeatable)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS for every server and the in-process run (default: OpenBLAS's own)")
    p.add_argument("--out-dir", type=Path, default=C.RESULTS_DIR)
    a = p.parse_args()
    q = a.quick
    a.reps = a.reps or (1 if q else 3)
    a.short_reps = a.short_reps or (2 if q else 5)
    a.trace_reps = a.trace_reps or (1 if q else 2)
    a.prompt_tokens = a.prompt_tokens or (1000 if q else 4000)
    a.system_tokens = a.system_tokens or (600 if q else 2000)
    a.turn_tokens = a.turn_tokens or (100 if q else 300)
    a.reply_tokens = a.reply_tokens or (12 if q else 64)
    return a


class Tracker:
    """Per-server bookkeeping: the omlx trie, the physical-reference tasks, prompt-count checks."""

    def __init__(self, prompts: C.Prompts, rep: C.Report):
        self.prompts = prompts
        self.rep = rep
        self.trie = C.Trie()
        self.tasks: list[dict[str, Any]] = []
        self.mismatches = 0

    def before(self, task_id: str, ids: list[int]) -> int:
        """Register the physical reference of a request about to be sent; returns its ideal hit."""
        ideal = min(self.trie.match(ids), len(ids) - 1)
        self.tasks.append({"id": task_id, "kind": "prefill", "context": ids[:ideal], "new": ids[ideal:], "reps": 1})
        return ideal

    def after(self, ids: list[int], res: C.StreamResult, label: str) -> None:
        if res.prompt_tokens is not None and res.prompt_tokens != len(ids):
            self.mismatches += 1
            if self.mismatches <= 3:
                self.rep.note(f"{label} counted {res.prompt_tokens} prompt tokens, the local tokenizer {len(ids)}: "
                              "the unique-token count and references are approximate")
        if label != "omlx" or not res.ok:
            return
        self.trie.add(C.served_tokens(self.prompts, ids, res))


def send(server: C.Server, tracker: Tracker | None, task_id: str, *, ids: list[int], prompt: str | None = None,
         messages: list[dict[str, Any]] | None = None, max_tokens: int = 1) -> dict[str, Any]:
    ideal = tracker.before(task_id, ids) if (tracker and server.label == "omlx") else None
    if messages is not None:
        res = C.stream_chat(server, messages, max_tokens)
    else:
        res = C.stream_completion(server, prompt, max_tokens)
    if not res.ok:
        tracker.rep.note(f"{server.label} {task_id} failed: {res.error}")
    tracker.after(ids, res, server.label)
    d = res.summary()
    d["id"] = task_id
    d["ideal_cached_tokens"] = ideal
    d["local_prompt_tokens"] = len(ids)
    d["text"] = res.text
    return d


def main() -> int:
    a = parse_args()
    C.set_blas_threads(a.blas_threads)
    model_dir = C.ensure_model_dir(a.model_dir)
    rep = C.Report("prefix_cache", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()})
    rep.data["model_dir"] = str(model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="omlx-bench-prefix-"))
    rep.log(f"model {model_dir}; logs in {log_dir}")
    prompts = C.Prompts(model_dir)
    tracker = Tracker(prompts, rep)
    raw: dict[str, Any] = {"long": {lb: [] for lb in LABELS}, "short": {lb: [] for lb in LABELS},
                           "trace": {lb: [] for lb in LABELS}}

    # ---- prompts, identical for both servers
    long_cases = [C.long_case(prompts, r, a.prompt_tokens, a.suffix_tokens) for r in range(a.reps)]
    short_cases = []
    for r in range(a.short_reps):
        sys_msg = {"role": "system", "content": "You are " + prompts.words(f"short-sys-{r}", 8) + "."}
        q = prompts.words(f"short-q-{r}", max(4, a.short_tokens - 16 - len(prompts.chat_ids([sys_msg]))))
        short_cases.append([sys_msg, {"role": "user", "content": q[0].upper() + q[1:] + "?"}])
    traces = [C.AgentTrace.build(prompts, r, a.system_tokens, a.turn_tokens, a.turns, a.edit_turn)
              for r in range(a.trace_reps)]

    servers: dict[str, C.Server] = {}
    stats: dict[str, Any] = {}
    try:
        for label in LABELS:
            srv = C.Server(KINDS[label], model_dir, a.omlx_arg if label == "omlx" else a.peer_arg, log_dir, label)
            rep.log(f"starting {label}")
            srv.start()
            srv.wait_idle()
            servers[label] = srv
            if srv.blas() != "openblas":
                rep.note(f"{label} does not run on OpenBLAS ({srv.blas()}): the comparison is not fair")
        rep.data["servers"] = {k: v.info() for k, v in servers.items()}
        try:
            stats["baseline"] = servers["omlx"].get_json("/v1/cache/stats")
        except Exception as e:
            rep.note(f"omlx /v1/cache/stats failed: {e}")
        # warm-up: a short request on each (tracked: it stays in omlx's cache)
        warm = [{"role": "user", "content": "Say hello."}]
        for label in LABELS:
            send(servers[label], tracker, "warmup", ids=prompts.chat_ids(warm), messages=warm, max_tokens=4)

        # 1. long prompt
        for r, case in enumerate(long_cases):
            order = LABELS if r % 2 == 0 else LABELS[::-1]
            for label in order:
                row = {}
                for name in ("cold", "identical", "suffix", "changed"):
                    text = case[name]
                    row[name] = send(servers[label], tracker, f"long-{r}-{name}", ids=prompts.encode(text), prompt=text)
                raw["long"][label].append(row)
            rep.log(f"long prompt rep {r + 1}/{a.reps}: " + "; ".join(
                f"{lb} " + ", ".join(f"{k} {C.ms(v['ttft_s'])}" for k, v in raw["long"][lb][-1].items()) for lb in LABELS))

        # 2. short chat prompt, cold then repeated
        for r, msgs in enumerate(short_cases):
            order = LABELS if r % 2 == 0 else LABELS[::-1]
            ids = prompts.chat_ids(msgs)
            for label in order:
                raw["short"][label].append({
                    "cold": send(servers[label], tracker, f"short-{r}-cold", ids=ids, messages=msgs, max_tokens=8),
                    "repeat": send(servers[label], tracker, f"short-{r}-repeat", ids=ids, messages=msgs, max_tokens=8),
                })
        rep.log("short prompt: " + "; ".join(
            f"{lb} cold {C.ms(C.summarize(x['cold']['ttft_s'] for x in raw['short'][lb]))} repeat "
            f"{C.ms(C.summarize(x['repeat']['ttft_s'] for x in raw['short'][lb]))}" for lb in LABELS))

        # 3. agent trace (each server builds its history from its own replies)
        for r, tr in enumerate(traces):
            order = LABELS if r % 2 == 0 else LABELS[::-1]
            for label in order:
                msgs = tr.start()
                turns = []
                for k in range(a.turns):
                    tr.next_turn(msgs, k)  # at the edit turn, a line in the middle of the history changes
                    ids = prompts.chat_ids(msgs)
                    d = send(servers[label], tracker, f"trace-{r}-turn-{k + 1}", ids=ids, messages=msgs,
                             max_tokens=a.reply_tokens)
                    d["edited"] = k + 1 == a.edit_turn
                    turns.append(d)
                    msgs.append({"role": "assistant", "content": d["text"]})
                raw["trace"][label].append(turns)
                rep.log(f"agent trace rep {r + 1}/{a.trace_reps} {label}: TTFT " +
                        " ".join(C.fmt((t["ttft_s"] or 0) * 1e3, "", 0) for t in turns) + " ms")

        try:
            stats["final"] = servers["omlx"].get_json("/v1/cache/stats")
        except Exception as e:
            rep.note(f"omlx /v1/cache/stats failed: {e}")
        for label, srv in servers.items():
            rep.data["servers"][label]["rss_mb_end"] = srv.rss_mb()
    finally:
        for srv in servers.values():
            srv.stop()

    # ---- physical references, in-process (servers stopped)
    rep.log(f"mlx-lm in-process references ({len(tracker.tasks)} prefills)")
    inproc = C.run_inprocess(model_dir, tracker.tasks, log_dir)
    if inproc["blas"] != "openblas":
        rep.note(f"in-process mlx-lm does not run on OpenBLAS ({inproc['blas']})")
    refs = {k: v["times_s"][0] for k, v in inproc["results"].items()}
    rep.data["inprocess"] = {"load_s": inproc["load_s"], "blas": inproc["blas"],
                             "references": {k: {"context": v["context_tokens"], "new": v["new_tokens"],
                                                "time_s": round(v["times_s"][0], 5)}
                                            for k, v in inproc["results"].items()}}
    rep.data["raw"] = raw
    for lb in LABELS:  # texts were needed for the trace only
        for group in (raw["long"][lb], raw["short"][lb]):
            for row in group:
                for d in row.values():
                    d.pop("text", None)
        for turns in raw["trace"][lb]:
            for d in turns:
                d["text"] = d["text"][:80]

    # ---- figures
    S, m = C.summarize, (lambda x: x["median"])
    fig: dict[str, Any] = {lb: {} for lb in LABELS}
    fig["reference"] = {}
    for name in ("cold", "identical", "suffix", "changed"):
        for lb in LABELS:
            fig[lb][f"long_{name}_ttft_s"] = S(row[name]["ttft_s"] for row in raw["long"][lb])
            fig[lb][f"long_{name}_cached"] = S(row[name]["cached_tokens"] for row in raw["long"][lb])
        fig["reference"][f"long_{name}_ttft_s"] = S(refs.get(f"long-{r}-{name}") for r in range(a.reps))
        fig["reference"][f"long_{name}_cached"] = S(row[name]["ideal_cached_tokens"] for row in raw["long"]["omlx"])
    for name in ("cold", "repeat"):
        for lb in LABELS:
            fig[lb][f"short_{name}_ttft_s"] = S(x[name]["ttft_s"] for x in raw["short"][lb])
            fig[lb][f"short_{name}_cached"] = S(x[name]["cached_tokens"] for x in raw["short"][lb])
        fig["reference"][f"short_{name}_ttft_s"] = S(refs.get(f"short-{r}-{name}") for r in range(a.short_reps))
        fig["reference"][f"short_{name}_cached"] = S(x[name]["ideal_cached_tokens"] for x in raw["short"]["omlx"])
    for lb in LABELS:
        fig[lb]["trace_total_ttft_s"] = S(sum(t["ttft_s"] or 0 for t in turns) for turns in raw["trace"][lb])
        fig[lb]["trace_turn_ttft_s"] = [S(turns[k]["ttft_s"] for turns in raw["trace"][lb]) for k in range(a.turns)]
        fig[lb]["trace_turn_cached"] = [S(turns[k]["cached_tokens"] for turns in raw["trace"][lb]) for k in range(a.turns)]
    fig["reference"]["trace_turn_ttft_s"] = [S(refs.get(f"trace-{r}-turn-{k + 1}") for r in range(a.trace_reps))
                                             for k in range(a.turns)]
    fig["reference"]["trace_total_ttft_s"] = S(sum(refs.get(f"trace-{r}-turn-{k + 1}", 0) for k in range(a.turns))
                                               for r in range(a.trace_reps))
    fig["reference"]["trace_turn_cached"] = [S(turns[k]["ideal_cached_tokens"] for turns in raw["trace"]["omlx"])
                                             for k in range(a.turns)]
    turn_ratio = [S(C.ratio(raw["trace"]["omlx"][r][k]["ttft_s"], refs.get(f"trace-{r}-turn-{k + 1}"))
                    for r in range(a.trace_reps)) for k in range(a.turns)]
    fig["omlx"]["trace_turn_over_reference"] = turn_ratio

    # resident KV bytes
    bpt, kv_shape = C.kv_bytes_per_token(model_dir)
    kv: dict[str, Any] = {"bytes_per_token": bpt, **kv_shape, "unique_cached_tokens": tracker.trie.size}
    try:
        name = servers["omlx"].model_name
        hot0 = stats["baseline"]["models"][name].get("hot", {})
        hot1 = stats["final"]["models"][name].get("hot", {})
        kv["resident_bytes"] = hot1["num_bytes"] - hot0.get("num_bytes", 0)
        kv["baseline_bytes"] = hot0.get("num_bytes", 0)
        kv["ideal_bytes"] = tracker.trie.size * bpt
        kv["ratio"] = C.ratio(kv["resident_bytes"], kv["ideal_bytes"])
        kv["hot_stats"] = hot1
        if hot1.get("num_evictions"):
            rep.note(f"omlx evicted {hot1['num_evictions']} block(s): resident bytes undercount what was cached")
    except Exception as e:
        rep.note(f"no resident-bytes figure: {type(e).__name__}: {e}")
        kv["ratio"] = None
    fig["kv"] = kv
    rep.data["figures"] = fig

    o, p, ref = fig["omlx"], fig["mlx_lm.server"], fig["reference"]

    def cached(x: dict[str, Any]) -> str:
        return C.fmt(x, "", 0)

    rows = []
    for name, desc in (("cold", "cold"), ("identical", "identical again"), ("suffix", f"+ ~{a.suffix_tokens}-token suffix"),
                       ("changed", "one middle line changed")):
        rows.append([f"long ~{a.prompt_tokens}: {desc}", C.ms(o[f"long_{name}_ttft_s"]), C.ms(p[f"long_{name}_ttft_s"]),
                     C.ms(ref[f"long_{name}_ttft_s"]),
                     f"{cached(o[f'long_{name}_cached'])} / {cached(p[f'long_{name}_cached'])} / {cached(ref[f'long_{name}_cached'])}",
                     C.fmt(C.ratio(m(o[f"long_{name}_ttft_s"]), m(p[f"long_{name}_ttft_s"])), "x", 2),
                     C.fmt(C.ratio(m(o[f"long_{name}_ttft_s"]), m(ref[f"long_{name}_ttft_s"])), "x", 2)])
    for name, desc in (("cold", "cold"), ("repeat", "repeated")):
        rows.append([f"short ~{a.short_tokens} chat: {desc}", C.ms(o[f"short_{name}_ttft_s"]), C.ms(p[f"short_{name}_ttft_s"]),
                     C.ms(ref[f"short_{name}_ttft_s"]),
                     f"{cached(o[f'short_{name}_cached'])} / {cached(p[f'short_{name}_cached'])} / {cached(ref[f'short_{name}_cached'])}",
                     C.fmt(C.ratio(m(o[f"short_{name}_ttft_s"]), m(p[f"short_{name}_ttft_s"])), "x", 2),
                     C.fmt(C.ratio(m(o[f"short_{name}_ttft_s"]), m(ref[f"short_{name}_ttft_s"])), "x", 2)])
    rows.append(["agent trace: total TTFT", C.ms(o["trace_total_ttft_s"]), C.ms(p["trace_total_ttft_s"]),
                 C.ms(ref["trace_total_ttft_s"]), "",
                 C.fmt(C.ratio(m(o["trace_total_ttft_s"]), m(p["trace_total_ttft_s"])), "x", 2),
                 C.fmt(C.ratio(m(o["trace_total_ttft_s"]), m(ref["trace_total_ttft_s"])), "x", 2)])
    rep.table("Prefix cache: TTFT medians [min-max]; cached tokens omlx / peer / ideal",
              ["case", "omlx", "mlx_lm.server", "reference", "cached o/p/ideal", "omlx/peer", "omlx/ref"], rows)
    trows = []
    for k in range(a.turns):
        first = raw["trace"]["omlx"][0][k] if raw["trace"]["omlx"] else {}
        trows.append([f"turn {k + 1}{' (edit)' if k + 1 == a.edit_turn else ''}", str(first.get("prompt_tokens")),
                      C.ms(o["trace_turn_ttft_s"][k]), C.ms(p["trace_turn_ttft_s"][k]), C.ms(ref["trace_turn_ttft_s"][k]),
                      f"{cached(o['trace_turn_cached'][k])} / {cached(p['trace_turn_cached'][k])} / {cached(ref['trace_turn_cached'][k])}",
                      C.fmt(turn_ratio[k], "x")])
    rep.table("Agent trace per turn (prompt tokens of the first repetition)",
              ["turn", "prompt", "omlx TTFT", "peer TTFT", "reference", "cached o/p/ideal", "omlx/ref"], trows)
    if kv.get("ratio") is not None:
        rep.table("Resident KV (omlx hot tier, after the run, minus its start-up content)", ["figure", "value"], [
            ["resident bytes (/v1/cache/stats hot num_bytes)", f"{kv['resident_bytes'] / 1e6:.1f} MB"],
            ["unique cached tokens (prompts + generated tokens, a trie)", str(kv["unique_cached_tokens"])],
            [f"KV bytes per token (2*{kv['layers']}*{kv['kv_heads']}*{kv['head_dim']}*{kv['dtype_bytes']})", str(bpt)],
            ["ideal bytes", f"{kv['ideal_bytes'] / 1e6:.1f} MB"],
            ["blocks / full / tails", f"{kv['hot_stats'].get('num_blocks')} / {kv['hot_stats'].get('num_full_blocks')} / "
                                      f"{kv['hot_stats'].get('num_tails')}"],
        ])

    rep.target("identical prompt: cold / identical TTFT (omlx)",
               C.ratio(m(o["long_cold_ttft_s"]), m(o["long_identical_ttft_s"])), ">=", 30, "how many times faster")
    rep.target("identical prompt TTFT vs mlx_lm.server's",
               C.ratio(m(o["long_identical_ttft_s"]), m(p["long_identical_ttft_s"])), "<=", 0.5, "omlx / peer")
    rep.target("repeated short prompt vs its cold TTFT",
               C.ratio(m(o["short_repeat_ttft_s"]), m(o["short_cold_ttft_s"])), "<=", 0.5, "omlx repeat / omlx cold")
    rep.target("prefix + suffix vs prefilling the suffix alone",
               C.ratio(m(o["long_suffix_ttft_s"]), m(ref["long_suffix_ttft_s"])), "<=", 1.5,
               "omlx TTFT / in-process suffix prefill on the cached prefix")
    rep.target("agent trace total TTFT vs mlx_lm.server's",
               C.ratio(m(o["trace_total_ttft_s"]), m(p["trace_total_ttft_s"])), "<=", 1.0, "omlx / peer")
    worst = max(((m(x) or 0), k) for k, x in enumerate(turn_ratio)) if turn_ratio else (None, 0)
    rep.target("agent trace: worst turn vs its physical reference", worst[0] or None, "<=", 1.2,
               f"turn {worst[1] + 1}; every turn is in the per-turn table")
    rep.target("resident KV bytes vs unique cached tokens x bytes/token", kv.get("ratio"), "<=", 1.05,
               f"{kv.get('unique_cached_tokens')} tokens x {bpt} B")
    rep.print()
    rep.write(a.out_dir, "quick" if a.quick else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

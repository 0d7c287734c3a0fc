"""A long cached prefix restored: TTFT of an ~18.7k-token agent prompt, cold, from RAM, from SSD (issue 27).

No Claude Code needed. The prompt is shaped like Claude Code's default first request: the 24 tools of
the recorded Claude Code request (``tests/fixtures/client_requests/claude_code__messages_stream_tool_turn1.json``,
its ``<text N chars>`` placeholders filled with the fixture's words in order) and a system prompt cut
so that the whole prompt before the question is ~``--prompt-tokens`` tokens (about 5.4k of system text
and 13.3k of tools at the default 18,700), then a short user question that differs per request (and
from every earlier run's).

The text is fixed: ``benchmarks/fixtures/long_prefix_source.txt`` (92 KB, real code: the head of this
repository's ``omlx/`` modules in path order, each under a ``## path`` heading, frozen at commit
9210a65), so the prompt's tokens are the same at every commit and a cache filled at one commit is hit
at another. (Until then the text was read from the live source, and any change to the first ~75 KB
of ``omlx/`` made the kept cache miss.) It holds enough for ``--prompt-tokens`` up to the model's 32k
context.
It goes through the openai SDK (``chat.completions.create``, streamed, greedy) to a real
``omlx serve`` of Qwen2.5-Coder-0.5B-Instruct:

1. ``cold``: nothing cached (fresh base path). Skipped with ``--reuse`` when the work folder
   already holds a populated cache (the cold prefill takes minutes on a CPU).
2. ``ram``: ``--reps`` requests with other questions: the system prompt and tools from the hot tier.
3. ``ssd``: ``--restarts`` times: the write queue waited out, a clean stop (SIGTERM flushes the hot
   tier), the page cache dropped for the cache files, a new server on the same base path, one
   request: the prefix from the SSD tier. Then one more ``ram`` request on that server.

Per request: the client's TTFT (send to the first streamed delta with text or a tool call), and
from ``/v1/admin/recent`` the server's ``ttft_ms``, prompt / cached / cold-cached tokens.

Measured (2026-12-07 22:25-23:13 UTC; the 2-core AMD EPYC VM, x86_64, 24 GiB, MLX 0.32.4 CPU,
OpenBLAS; other agents' tests beside it, load average given per figure; server TTFTs from
``/v1/admin/recent``; rows in ``benchmarks/results/long_prefix_restore-{cold,before,after}-*-20261207-*.json``):

- cold: 18,721 tokens, 18,718 prefilled, 1,530 s (12-18 tok/s; load 1.3-6).
- ``--reuse --reps 3 --restarts 2`` from a copy of that cache, four runs of each commit alternated
  (load 2.6-5.1): after the copy cut (``d6518fb``) RAM hits 2.09-9.53 s, SSD hits 2.88-13.1 s;
  before it (``553221b``) RAM 2.17-7.31 s, SSD 2.93-8.17 s. The load swings more than the code
  moves: `diag_interleaved_hits.py` compares the two commits request by request (after: 17 of 20
  RAM hits faster, by 0.49 s at the median; README, issue 27).

Usage:
    python benchmarks/bench_long_prefix_restore.py --work-dir /tmp/long-prefix [--reuse] [--reps 3] [--restarts 2]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
from bench_ssd_cache import drop_page_cache, wait_written  # noqa: E402

REPO = C.REPO
SOURCE_FIXTURE = REPO / "benchmarks" / "fixtures" / "long_prefix_source.txt"
FIXTURE = REPO / "tests" / "fixtures" / "client_requests" / "claude_code__messages_stream_tool_turn1.json"
DEFAULT_MODEL = C.TEST_HOME / "models" / "Qwen2.5-Coder-0.5B-Instruct"
QUESTIONS = ["What is the capital of France? Answer in one word.", "What is 6 times 7? Answer with a number.",
             "Name a primary colour. One word.", "What is the opposite of cold? One word.",
             "How many legs does a spider have? A number.", "Which planet is called the red planet? One word.",
             "What is 10 minus 3? A number.", "What colour is the sky on a clear day? One word."]


def source_text() -> str:
    """Real text for the system prompt and the tools' placeholders, the same at every commit: the head of
    this package's modules in path order, each under a heading, frozen in a fixture."""
    return SOURCE_FIXTURE.read_text(encoding="utf-8")


def build_prompt(prompts: C.Prompts, num_tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """(system prompt, OpenAI tools): the tools of the recorded Claude Code request, the system prompt cut
    so that the rendered prompt before the question is about ``num_tokens`` tokens (by the model's tokenizer)."""
    text = source_text()
    filler = iter(re.findall(r"[A-Za-z]+", text))

    def fill(m: re.Match[str]) -> str:
        n, out = int(m.group(1)), []
        while sum(len(w) + 1 for w in out) < n:
            w = next(filler, None)
            if w is None:
                raise SystemExit(f"{SOURCE_FIXTURE} has too few words for the tools' placeholders")
            out.append(w)
        return " ".join(out)[:n]

    body = json.loads(re.sub(r"<text (\d+) chars>", fill, FIXTURE.read_text()))["body"]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in body["tools"]]

    def count(system: str) -> int:
        text = prompts.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": "?"}], tools=tools,
                                                     add_generation_prompt=True, tokenize=False)
        return len(prompts.tokenizer.encode(text, add_special_tokens=False))

    lo, hi = 0, len(text)  # the longest head of `text` whose prompt fits num_tokens (bisection on characters)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(text[:mid]) <= num_tokens else (lo, mid)
    return text[:lo], tools


def ask(client: Any, model: str, system: str, tools: list[dict[str, Any]], question: str,
        max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request; client-side TTFT (s) to the first delta with text or a tool call."""
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        tools=tools, max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            if (d.content or d.tool_calls) and ttft is None:
                ttft = time.perf_counter() - t0
            if d.content:
                text.append(d.content)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (usage.prompt_tokens_details.cached_tokens
                              if usage and usage.prompt_tokens_details else None)}


def server_record(srv: C.Server) -> dict[str, Any]:
    """The newest ``/v1/admin/recent`` record (the request just answered)."""
    rec = srv.get_json("/v1/admin/recent?limit=1")["requests"][0]
    return {k: rec.get(k) for k in ("ttft_ms", "num_prompt_tokens", "num_cached_tokens", "num_cached_tokens_cold",
                                    "num_prefilled_tokens")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--prompt-tokens", type=int, default=18700)
    ap.add_argument("--work-dir", type=Path, required=True, help="the kept base path's parent (cache, logs)")
    ap.add_argument("--reuse", action="store_true", help="skip the cold request (the work folder holds its cache)")
    ap.add_argument("--reps", type=int, default=3, help="RAM hits after the cold request")
    ap.add_argument("--restarts", type=int, default=2, help="restarts, each followed by an SSD hit and a RAM hit")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--omlx-arg", action="append", default=[])
    ap.add_argument("--py-spy", type=Path, default=None,
                    help="a py-spy executable: each hit is sampled (raw folded stacks, every thread, with idle "
                         "frames) into the work folder's profiles/")
    a = ap.parse_args()
    from openai import OpenAI

    rep = C.Report("long_prefix_restore", {k: str(v) for k, v in vars(a).items()})
    work = a.work_dir.resolve()
    base, logs = work / "base", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prompts = C.Prompts(a.model_dir)
    system, tools = build_prompt(prompts, a.prompt_tokens)
    rows: list[dict[str, Any]] = []
    qi = 0
    run_id = time.strftime("%H%M%S")

    def one(srv: C.Server, phase: str) -> None:
        nonlocal qi
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=3600, max_retries=0)
        spy = None
        if a.py_spy is not None and phase != "cold":
            (work / "profiles").mkdir(exist_ok=True)
            out = work / "profiles" / f"{qi:02d}-{phase}.txt"
            spy = subprocess.Popen([str(a.py_spy), "record", "-p", str(srv.proc.pid), "-o", str(out), "-f", "raw",
                                    "-r", "200", "--threads", "--idle", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attached
        question = f"{QUESTIONS[qi % len(QUESTIONS)]} (ask {run_id}-{qi})"  # never asked before: ~20 tokens to prefill
        r = ask(client, srv.model_name, system, tools, question, a.max_tokens)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        qi += 1
        r.update(server_record(srv))
        if phase != "cold":  # the first hit after a start comes from the SSD tier whatever the step (--reuse)
            phase = "ssd" if 2 * (r["num_cached_tokens_cold"] or 0) > (r["num_cached_tokens"] or 0) else "ram"
        r["phase"] = phase
        rows.append(r)
        rep.log(f"{phase}: TTFT {r['ttft_s']:.2f} s (server {r['ttft_ms']} ms), prompt {r['num_prompt_tokens']}, "
                f"cached {r['num_cached_tokens']} (cold {r['num_cached_tokens_cold']}), {r['text']!r}")

    def start() -> C.Server:
        srv = C.Server("omlx", a.model_dir, a.omlx_arg, logs, base_path=base).start()
        srv.wait_idle()
        return srv

    srv = start()
    try:
        if not a.reuse:
            one(srv, "cold")
        for _ in range(a.reps):
            one(srv, "ram")
        for _ in range(a.restarts):
            wait_written(srv)
            srv.stop(timeout_s=300)
            drop_page_cache(base / "cache", try_global=False)
            srv = start()
            one(srv, "ssd")
            one(srv, "ram")
    finally:
        srv.stop(timeout_s=300)
    for phase in ("cold", "ram", "ssd"):
        vals = [r["ttft_s"] for r in rows if r["phase"] == phase]
        if vals:
            s = C.summarize(vals)
            rep.log(f"{phase}: TTFT {C.fmt(s, ' s')} over {len(vals)}")
    rep.data["rows"] = rows
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

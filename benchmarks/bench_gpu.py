"""omlx against mlx-lm on one GPU, side by side, in one time-bounded run (the H200 figures).

Three contenders on the same model folder (made for the H200 by ``.gpu-b/make_model.py``: a
Llama-3.2-3B-shaped model with random bf16 weights and the SmolLM2 tokenizer):

- **in-process mlx-lm** in a child process (no HTTP): ``mlx_lm.stream_generate`` for one
  stream, a raw ``BatchGenerator`` for N sequences, ``generate_step`` (prefill_step_size
  2048, greedy) to the first token for prefill.
- **omlx** over HTTP: ``python -m omlx serve --model M --base-path <fresh temp dir>
  --max-concurrent-requests 32`` (prefix cache and SSD tier on, the defaults), plus a second
  one with ``--no-cache`` for the cache-on/off and write-back comparisons.
- **mlx_lm.server**: ``python -m mlx_lm server --model M`` (requests carry no ``model``).

All servers are started at once (their start-ups overlap); the in-process child loads and warms
up meanwhile, then waits until every server is up and warmed before it measures; after that
exactly one contender is measured at a time (the others sit idle, holding their GPU memory).
Before every omlx measurement the script waits (bounded) until omlx's SSD write queue is empty
(``/v1/cache/stats`` cold ``num_queued`` == 0), so earlier requests' write-back does not leak
into figures other than the write-back one.

Requests: ``/v1/completions`` with a text prompt (no chat template, so the random model's
tokenizer config does not matter), ``temperature: 0``, streamed with
``stream_options.include_usage``. Every measurement has its own prompt of random words that
starts with its own random words, so no cache helps unless a figure is about the cache. omlx
has no ``ignore_eos`` (``logit_bias`` against EOS would add a logits processor to every step,
which changes what is measured), so replies can end early at an EOS; the random-weight model
rarely emits one. Generated tokens are ``usage.completion_tokens`` (content chunks only when a
server sends no usage; the JSON records ``finish_reason`` and the count of each request).

Figures and targets (ratios are ratios of medians over repetitions):

1. **decode, 1 stream**: a ~64-token prompt, 256 tokens; tok/s = (tokens - 1) / (last content
   chunk - first content chunk), the same formula over ``stream_generate``'s yields in-process.
   omlx >= 0.9x in-process, omlx >= 2x mlx_lm.server. Each repetition runs its prompt on omlx,
   mlx_lm.server and the in-process child one after another, in an order that rotates (the
   device's own speed drifts from minute to minute: in-process ``stream_generate`` alone ranged
   103-279 tok/s within single runs of 2026-12-04, so ratios are taken between contenders that
   ran side by side in time).
2. **aggregate decode at 8 streams**: 8 distinct prompts sent at once, 256 tokens each: all
   generated tokens / wall time from the first send to the end of the last stream (the short
   prompts' prefill included). omlx >= 2x mlx_lm.server. The same prompts go to omlx
   ``--no-cache``: cache on >= 0.95x cache off.
3. **aggregate decode at 32 streams**, 128 tokens each: omlx >= 0.9x a raw ``BatchGenerator``
   (completion batch 32, mlx-lm's default prefill batch of 8 as in mlx_lm.server, no stop
   tokens) on the same 32 prompts, timed the same way (insert to last token). The in-process
   figure at 8 sequences is in the table too, for information.
4. **cold 4,096-token prefill**: TTFT of a never-seen prompt (max_tokens 1) <= 1.2x the
   in-process time to the first token on the same text; **the identical prompt again**:
   TTFT <= 10 ms; **the prompt with its middle line replaced**: TTFT <= 1.2x the in-process
   time to prefill the tokens after the edit (the longest common token prefix of the original
   and the edited prompt is prefilled into a cache untimed, then ``generate_step`` on the rest
   is timed to its first token). A cache that reuses only whole KV blocks (256 tokens) must
   also recompute the part of the edited block before the edit, so the in-process time from
   that block boundary is shown too (``block:``, for information). mlx_lm.server gets the same
   three requests (its own prompt cache), for information.
5. **TPOT during SSD write-back**: on omlx (SSD tier on), per repetition: wait until the write
   queue is empty, run a 256-token decode stream (*quiet*); then send K distinct never-seen
   4k-token prompts one after another (max_tokens 1; each stores 16 new full blocks, which the
   tier queues for disk) and start the same kind of stream the moment the last one returns
   (*write-back*). ``/v1/cache/stats`` is polled every 50 ms during both streams (the same
   load on the server either way). The write-back window ends at the first poll that sees an
   empty queue and after which no more bytes get written (else at the stream's end); TPOT = mean interval between content chunks over the chunks inside that
   window, and the quiet figure uses the same chunk positions of the quiet stream (so decode at
   the same context lengths is compared). Target: write-back / quiet <= 1.05. Why this and not
   a second server with ``--no-ssd-cache``: the same process with the same hot cache, memory
   and batch state is compared with itself, and the only thing that differs is whether the
   writer is busy; the window and the bytes written during it (``num_written_bytes`` deltas)
   prove it was. When the queue was already empty at the stream's start, or the window holds
   fewer than 8 intervals, the figure is flagged in its detail (and is N/A when the window
   holds none). The window is short by design of the tier: its write queue holds at most
   256 MB (more low-priority blocks are dropped, ``num_queue_drops``), so after the prompts at
   most that much is left to write (~9 blocks of the 3B model, 29 MB each); K = 3 fills it.
   For information the same sequence (K prompts then a stream) is timed on omlx
   ``--no-cache`` (no write-back at all).
6. **TPOT while another request prefills 4k tokens**: a 256-token decode stream A alone (its
   mean chunk interval), then another stream A' that, after its 16th content chunk, is joined
   by a request B with a never-seen 4k-token prompt (max_tokens 1). TPOT during = mean of A'
   chunk intervals that overlap B's prefill window [B sent, B's first token]; the alone figure
   uses the same chunk positions of A. Target: during / alone <= 2. ``max ITL`` in the window is
   reported too. mlx_lm.server is measured the same way, for information.

Also recorded: each omlx server's ``/v1/admin/recent`` (its per-request TTFT and prefilled
tokens, engine side), omlx's prefill chunk size when its log says ("prefill chunk ...") or ``/health``
has a key naming it (absent: null), every raw measurement, the servers' start-up seconds and
log tails, versions, the GPU (``nvidia-smi``), and notes.

Time: every phase is bounded (``--budget-s`` from the script's start; a phase or repetition
that would not fit is skipped with a note; requests time out), and the JSON is rewritten after
every phase, so a run killed from outside still leaves its figures. The JSON goes to
``benchmarks/results/gpu-<YYYYmmdd-HHMMSS>.json`` (``gpu-quick-...`` with ``--quick``) and is
copied to ``$OUT/`` when ``OUT`` is set.

Usage (H200; ~4-6 min after the model exists)::

    python3 benchmarks/bench_gpu.py --model /tmp/model-3b
    .venv/bin/python benchmarks/bench_gpu.py --quick      # CPU smoke run, default SmolLM2-135M

Needs: httpx and tokenizers here; mlx, mlx-lm (child process and servers), omlx's deps.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
DEFAULT_MODEL = Path(os.environ.get("OMLX_TEST_HOME", REPO / ".omlx-test")) / "models" / "SmolLM2-135M-Instruct"
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0")

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain window garden kitchen engine signal "
    "market village station library doctor teacher student farmer pilot captain bridge tunnel harbor "
    "forest desert island valley ocean planet comet orbit crystal mineral copper silver iron marble "
    "paper letter record report message answer question theory method result sample measure "
    "battery circuit sensor motor valve pump filter pipe cable switch socket module kernel buffer cache "
    "thread packet router server client browser editor compiler parser token vector matrix "
    "table column index query schema field value array object string integer float boolean "
    "red blue green yellow purple orange silent quick slow bright dark heavy light early late "
    "ancient modern simple complex careful rapid gentle strong narrow broad hidden open closed "
    "runs builds carries finds keeps moves opens reads writes sends holds turns takes gives shows "
    "measures checks counts draws fills joins lifts marks needs plans pulls pushes raises sorts "
    "under over between through across around before after during against within without "
    "north south east west spring summer autumn winter morning evening night noon"
).split()


# ---------------------------------------------------------------------------------------------
# sizes


def sizes(quick: bool) -> dict[str, Any]:
    if quick:  # CPU smoke run: every phase once, small
        return dict(long_tokens=256, short_tokens=32, decode_tokens=16, mid_streams=2, mid_tokens=16,
                    high_streams=4, high_tokens=16, decode_reps=2, mid_reps=1, high_reps=1, prefill_reps=1,
                    interf_reps=1, interf_after=4, ssd_reps=1, ssd_prompts=2, request_timeout_s=240.0,
                    start_timeout_s=240.0, inproc_timeout_s=300.0, drain_timeout_s=20.0)
    return dict(long_tokens=4096, short_tokens=64, decode_tokens=256, mid_streams=8, mid_tokens=256,
                high_streams=32, high_tokens=128, decode_reps=3, mid_reps=2, high_reps=2, prefill_reps=3,
                interf_reps=2, interf_after=16, ssd_reps=2, ssd_prompts=3, request_timeout_s=60.0,
                start_timeout_s=240.0, inproc_timeout_s=200.0, drain_timeout_s=20.0)


# ---------------------------------------------------------------------------------------------
# prompts


class PromptMaker:
    """Random-word prompts of a given length in the model's tokens (``tokenizer.json``).

    Every prompt starts with its own random words and a number, so two prompts share at most a
    token or two of prefix.
    """

    def __init__(self, model_dir: Path, seed: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=True).ids)

    def line(self) -> str:
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 14))]
        words[0] = words[0].capitalize()
        return " ".join(words) + "."

    def lines(self, num_tokens: int) -> list[str]:
        head = f"{self.rng.choice(WORDS).capitalize()} {self.rng.choice(WORDS)} {self.rng.randrange(10**8)}: "
        out = [head + self.line()]
        est = self.count(out[0])
        while est < num_tokens + 20:
            ln = self.line()
            out.append(ln)
            est += self.count(ln) + 1
        lo, hi = 1, len(out)  # the most lines that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count("\n".join(out[:mid])) <= num_tokens:
                lo = mid
            else:
                hi = mid - 1
        out = out[:lo]
        extra = self.line().rstrip(".").split(" ")  # fill up to num_tokens with words of one more line
        while extra:
            cand = out + [" ".join(extra)]
            if self.count("\n".join(cand)) <= num_tokens:
                out = cand
                break
            extra.pop()
        return out

    def text(self, num_tokens: int) -> str:
        return "\n".join(self.lines(num_tokens))

    def edited_pair(self, num_tokens: int) -> tuple[str, str]:
        """A prompt and the same with its middle line replaced by another random line."""
        lines = self.lines(num_tokens)
        edited = list(lines)
        mid = len(lines) // 2
        new = self.line()
        while new == lines[mid]:
            new = self.line()
        edited[mid] = new
        return "\n".join(lines), "\n".join(edited)


# ---------------------------------------------------------------------------------------------
# servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_env(env: dict[str, str]) -> dict[str, str]:
    """On a Linux CPU machine the mlx-lm processes get the OpenBLAS omlx preloads itself."""
    env = dict(env)
    for lib in OPENBLAS:
        if Path(lib).exists() and lib not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = (lib + " " + env.get("LD_PRELOAD", "")).strip()
            break
    return env


class Srv:
    """A server child process (own process group) on a free port."""

    def __init__(self, label: str, kind: str, model: Path, args: list[str], log_dir: Path):
        self.label, self.kind, self.model, self.args = label, kind, model, list(args)
        self.port = free_port()
        self.log_path = log_dir / f"{label}.log"
        self.base_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None
        self.ready_s: float | None = None
        self.error: str | None = None
        self.t_start = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.error is None and self.ready_s is not None and self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        env = dict(os.environ)
        env.setdefault("COLUMNS", "400")  # rich log lines unwrapped (grep-able)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.kind == "omlx":
            self.base_path = Path(tempfile.mkdtemp(prefix=f"bench-gpu-{self.label}-"))
            env.setdefault("OMLX_LOG_LEVEL", "INFO")
            cmd = [sys.executable, "-m", "omlx", "serve", "--model", str(self.model), "--host", "127.0.0.1",
                   "--port", str(self.port), "--base-path", str(self.base_path), *self.args]
        else:
            env = blas_env(env)
            cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model), "--host", "127.0.0.1",
                   "--port", str(self.port), *self.args]
        self.cmd = cmd
        self.t_start = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                                         start_new_session=True)

    async def wait_ready(self, client: Any, deadline: float) -> None:
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                self.error = f"exited with {self.proc.returncode}: {self.log_tail(1500)}"
                return
            try:
                r = await client.get(self.url + "/health", timeout=3)
                if r.status_code == 200:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.25)
        else:
            self.error = "not ready before the start-up deadline"
            return
        self.ready_s = time.perf_counter() - self.t_start
        if self.kind == "omlx":
            try:
                self.model_id = (await client.get(self.url + "/v1/models", timeout=10)).json()["data"][0]["id"]
            except Exception as e:
                self.error = f"/v1/models failed: {e}"

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        b: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                             "stream_options": {"include_usage": True}}
        if self.model_id:
            b["model"] = self.model_id
        return b

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, timeout_s: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.base_path is not None:
            shutil.rmtree(self.base_path, ignore_errors=True)
            self.base_path = None

    def info(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "port": self.port, "cmd": getattr(self, "cmd", None),
                "ready_s": _r(self.ready_s, 2), "error": self.error, "log": str(self.log_path)}


# ---------------------------------------------------------------------------------------------
# streaming client


async def stream(client: Any, srv: Srv, prompt: str, max_tokens: int, timeout_s: float,
                 on_chunk: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One streamed /v1/completions request; times are absolute ``perf_counter`` seconds."""
    body = srv.body(prompt, max_tokens)
    res: dict[str, Any] = {"ok": False, "error": None, "t_send": time.perf_counter(), "chunks": [],
                           "completion_tokens": None, "prompt_tokens": None, "cached_tokens": None,
                           "finish_reason": None, "count_source": "chunks"}
    import httpx
    from httpx_sse import aconnect_sse

    try:
        async with aconnect_sse(client, "POST", srv.url + "/v1/completions", json=body,
                                timeout=httpx.Timeout(timeout_s, connect=10.0)) as source:
            resp = source.response
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for event in source.aiter_sse():
                now = time.perf_counter()
                if not event.data:
                    continue
                if event.data == "[DONE]":
                    break
                obj = event.json()
                usage = obj.get("usage")
                if usage:
                    res["prompt_tokens"] = usage.get("prompt_tokens")
                    res["completion_tokens"] = usage.get("completion_tokens")
                    res["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    res["count_source"] = "usage"
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        res["chunks"].append(now)
                        if on_chunk:
                            on_chunk(len(res["chunks"]))
                    if ch.get("finish_reason"):
                        res["finish_reason"] = ch["finish_reason"]
                        res.setdefault("t_finish", now)
        res["t_end"] = time.perf_counter()
        first = res["chunks"][0] if res["chunks"] else res.get("t_finish")
        res["ttft_s"] = None if first is None else first - res["t_send"]
        res["ok"] = first is not None
        if not res["ok"]:
            res["error"] = "no content and no finish_reason"
    except Exception as e:  # recorded, never raised
        res["error"] = f"{type(e).__name__}: {e}"
        res["t_end"] = time.perf_counter()
    return res


def ntok(res: dict[str, Any]) -> int:
    n = res.get("completion_tokens")
    return n if n is not None else len(res.get("chunks") or [])


def decode_tps(res: dict[str, Any]) -> float | None:
    c = res.get("chunks") or []
    n = ntok(res)
    if len(c) < 2 or n < 2 or c[-1] <= c[0]:
        return None
    return (n - 1) / (c[-1] - c[0])


def itls(res: dict[str, Any]) -> list[float]:
    c = res.get("chunks") or []
    return [b - a for a, b in zip(c, c[1:])]


def slim(res: dict[str, Any], t0: float | None = None, keep_chunks: bool = False) -> dict[str, Any]:
    """A request's record for the JSON (times relative to its send, in ms)."""
    t0 = res["t_send"] if t0 is None else t0
    d = {k: res.get(k) for k in ("ok", "error", "prompt_tokens", "cached_tokens", "completion_tokens",
                                 "count_source", "finish_reason")}
    d["ttft_ms"] = _r(None if res.get("ttft_s") is None else res["ttft_s"] * 1e3, 2)
    d["decode_tps"] = _r(decode_tps(res), 2)
    d["content_chunks"] = len(res.get("chunks") or [])
    iv = itls(res)
    if iv:
        d["itl_median_ms"] = _r(statistics.median(iv) * 1e3, 2)
        d["itl_max_ms"] = _r(max(iv) * 1e3, 2)
    if keep_chunks:
        d["send_ms"] = _r((res["t_send"] - t0) * 1e3, 1)
        d["chunk_ms"] = [round((t - t0) * 1e3, 1) for t in res.get("chunks") or []]
    return d


async def wave(client: Any, srv: Srv, prompts: list[str], max_tokens: int, timeout_s: float) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*[stream(client, srv, p, max_tokens, timeout_s) for p in prompts])
    return list(res), time.perf_counter() - t0


async def cold_stats(client: Any, srv: Srv) -> dict[str, Any] | None:
    try:
        r = await client.get(srv.url + "/v1/cache/stats", timeout=5)
        models = r.json().get("models") or {}
        m = models.get(srv.model_id) or next(iter(models.values()), {})
        c = m.get("cold") or {}
        return c if c.get("enabled") else None
    except Exception:
        return None


async def wait_ssd_idle(client: Any, srv: Srv, max_s: float) -> dict[str, Any]:
    """Wait (bounded) until omlx's SSD write queue is empty; returns what was seen."""
    t0 = time.perf_counter()
    c = None
    while time.perf_counter() - t0 < max_s:
        c = await cold_stats(client, srv)
        if c is None or not c.get("num_queued"):
            break
        await asyncio.sleep(0.1)
    return {"waited_s": _r(time.perf_counter() - t0, 2), "num_queued": None if c is None else c.get("num_queued"),
            "ssd": c is not None}


class Poller:
    """Samples ``/v1/cache/stats`` cold counters every ``interval_s`` while running."""

    def __init__(self, client: Any, srv: Srv, interval_s: float = 0.05):
        self.client, self.srv, self.interval_s = client, srv, interval_s
        self.samples: list[tuple[float, int | None, int | None]] = []  # (t, num_queued, num_written_bytes)
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            c = await cold_stats(self.client, self.srv)
            self.samples.append((time.perf_counter(), None if c is None else c.get("num_queued"),
                                 None if c is None else c.get("num_written_bytes")))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


# ---------------------------------------------------------------------------------------------
# statistics and report


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def summ(values: list[float | None]) -> dict[str, Any]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def med(values: list[float | None]) -> float | None:
    return summ(values)["median"]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt_s(s: dict[str, Any], scale: float = 1.0, nd: int | None = None) -> str:
    if not s or s.get("median") is None:
        return "-"

    def f(x: float) -> str:
        x = x * scale
        d = nd if nd is not None else (0 if abs(x) >= 100 else (1 if abs(x) >= 10 else 2))
        return f"{x:.{d}f}"

    return f(s["median"]) if s["n"] <= 1 else f"{f(s['median'])} [{f(s['min'])}-{f(s['max'])}]"


def mean(v: list[float]) -> float | None:
    return sum(v) / len(v) if v else None


class Run:
    """Everything measured, the JSON path, and the budget."""

    def __init__(self, args: argparse.Namespace, sz: dict[str, Any]):
        self.t0 = time.perf_counter()
        self.args, self.sz = args, sz
        self.deadline = self.t0 + args.budget_s
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = Path(args.out_dir) / f"gpu{'-quick' if args.quick else ''}-{stamp}.json"
        self.data: dict[str, Any] = {"benchmark": "gpu", "args": vars(args), "sizes": sz, "machine": machine_info(),
                                     "notes": [], "phases": {}, "raw": {}, "figures": {}, "targets": []}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def note(self, msg: str) -> None:
        self.data["notes"].append(msg)
        self.log("note: " + msg)

    def save(self) -> None:
        self.data["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.data, indent=1, default=str) + "\n"
        self.path.write_text(text)
        out = os.environ.get("OUT")
        if out:
            try:
                Path(out).mkdir(parents=True, exist_ok=True)
                (Path(out) / self.path.name).write_text(text)
            except OSError as e:
                print(f"cannot copy the JSON to $OUT: {e}", flush=True)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                            "host": platform.node(), "platform": platform.platform(), "cores": os.cpu_count(),
                            "python": platform.python_version(),
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        info["gpu"] = out or None
    except Exception:
        info["gpu"] = None
    try:
        info["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=5).stdout.strip() or None
        info["git_dirty"] = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                                capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:
        pass
    return info


# ---------------------------------------------------------------------------------------------
# in-process mlx-lm (child process)


def inprocess_child(job_path: str, out_path: str) -> None:
    """Load, warm up, signal ready, run single-stream repetitions when asked (`InprocTurns`),
    wait for go, measure the rest, write the JSON answer."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    job = json.loads(Path(job_path).read_text())
    step = int(job["prefill_step_size"])
    t = time.perf_counter()
    model, tokenizer = load(job["model"])
    out: dict[str, Any] = {"load_s": time.perf_counter() - t, "device": str(mx.default_device()),
                           "mlx": mx.__version__, "prefill_step_size": step, "results": {}}
    try:
        import mlx_lm

        out["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    enc = lambda text: list(tokenizer.encode(text))  # noqa: E731  (what the servers' /v1/completions do)

    def first_token(prompt: list[int], cache: list[Any]) -> float:
        t = time.perf_counter()
        gen = generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=cache, prefill_step_size=step)
        next(gen)
        dt = time.perf_counter() - t
        gen.close()
        mx.synchronize()
        return dt

    def cache_with(context: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        if not context:
            return cache
        ids = mx.array(context)
        for i in range(0, len(context), step):
            model(ids[i:i + step][None], cache=cache)
            mx.eval([c.keys for c in cache] + [c.values for c in cache])
        n = len(context)
        fresh = []
        for c in cache:
            k, v = c.keys[..., :n, :], c.values[..., :n, :]
            mx.eval(k, v)
            kc = KVCache()
            kc.state = (k, v, n)
            fresh.append(kc)
        return fresh

    def decode(text: str, max_tokens: int) -> dict[str, Any]:
        ids = enc(text)
        t = time.perf_counter()
        stamps: list[float] = []
        last = None
        for resp in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, prefill_step_size=step):
            stamps.append(time.perf_counter() - t)
            last = resp
        n = last.generation_tokens if last is not None else 0
        return {"prompt_tokens": len(ids), "tokens": n, "ttft_s": stamps[0] if stamps else None,
                "finish_reason": last.finish_reason if last is not None else None,
                "decode_tps": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else None,
                "mlx_generation_tps": last.generation_tps if last is not None else None}

    def batch(texts: list[str], max_tokens: int) -> dict[str, Any]:
        prompts = [enc(x) for x in texts]
        n = len(prompts)
        gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=None, completion_batch_size=max(32, n),
                             prefill_step_size=step)  # mlx-lm's default prefill batch (8), as mlx_lm.server
        t = time.perf_counter()
        uids = gen.insert(prompts, [max_tokens] * n)
        counts = {u: 0 for u in uids}
        first: dict[int, float] = {}
        end = t
        while True:
            resps = gen.next_generated()
            if not resps:
                break
            end = time.perf_counter()
            for r in resps:
                if r.finish_reason != "stop":
                    counts[r.uid] += 1
                first.setdefault(r.uid, end)
        gen.close()
        wall = end - t
        total = sum(counts.values())
        last_first = max(first.values()) if first else t
        return {"n": n, "prefill_batch_size": gen.prefill_batch_size, "tokens": total, "wall_s": wall, "aggregate_tps": total / wall if wall > 0 else None,
                "decode_only_tps": (total - n) / (end - last_first) if end > last_first else None}

    # Warm-up (untimed), like a server's: short and long prefill, a decode, the batch shapes.
    rng = random.Random(1)
    first_token([rng.randrange(1000, 20000) for _ in range(16)], make_prompt_cache(model))
    first_token(enc(job["warm_long"]), make_prompt_cache(model))
    decode(job["warm_short"][0], 8)
    for nb in sorted({len(b["texts"]) for b in job["batch"]}):
        batch((job["warm_short"] * nb)[:nb], 4)
    Path(job["ready_file"]).write_text("ready")
    t_wait = time.perf_counter()
    res = out["results"]
    # Single-stream decode, one repetition per request file, taken turn about with the servers'
    # (phase_decode1): the device's speed drifts between minutes, so a ratio is only fair between
    # repetitions that ran side by side in time.
    turns = Path(job["decode_turn_dir"])
    decoded: list[dict[str, Any]] = []
    while not Path(job["go_file"]).exists():
        turn = turns / f"turn-{len(decoded)}"
        if turn.exists() and len(decoded) < len(job["decode"]):
            decoded.append(decode(job["decode"][len(decoded)], job["decode_tokens"]))
            (turns / f"done-{len(decoded) - 1}.json").write_text(json.dumps(decoded[-1]))
            continue
        if time.perf_counter() - t_wait > job["go_timeout_s"]:
            out["error"] = "no go signal"
            break
        time.sleep(0.002)
    out["waited_s"] = time.perf_counter() - t_wait
    if decoded:
        res["decode"] = decoded
    bs = int(job["block_size"])

    def edit_case(orig: str, edited: str) -> dict[str, Any]:
        a, b = enc(orig), enc(edited)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        n = min(n, len(b) - 1)
        nb = (n // bs) * bs
        return {"prompt_tokens": len(b), "common_prefix": n, "block_boundary": nb,
                "suffix_s": first_token(b[n:], cache_with(b[:n])),
                "suffix_block_aligned_s": first_token(b[nb:], cache_with(b[:nb]))}

    sections = [
        ("decode", lambda: res.get("decode") or [decode(x, job["decode_tokens"]) for x in job["decode"]]),
        ("batch", lambda: {str(len(b["texts"])): [batch(b["texts"], b["max_tokens"]) for _ in range(b["reps"])]
                           for b in job["batch"]}),
        ("prefill_cold", lambda: [{"prompt_tokens": len(enc(x)), "ttft_s": first_token(enc(x), make_prompt_cache(model))}
                                  for x in job["prefill_cold"]]),
        ("prefill_edit", lambda: [edit_case(a, b) for a, b in job["prefill_edit"]]),
    ]
    for name, fn in sections if "error" not in out else []:
        try:
            res[name] = fn()
        except Exception as e:  # the other sections still run
            out.setdefault("section_errors", {})[name] = f"{type(e).__name__}: {e}"
        Path(out_path).write_text(json.dumps(out))
    out["peak_memory_gb"] = mx.get_peak_memory() / 1e9
    Path(out_path).write_text(json.dumps(out))


def launch_child(job: dict[str, Any], work: Path) -> tuple[subprocess.Popen, Path, Path]:
    jp, op, lp = work / "inproc-job.json", work / "inproc-out.json", work / "inproc.log"
    jp.write_text(json.dumps(job))
    log = open(lp, "w")
    env = blas_env(dict(os.environ))
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--inprocess-child", str(jp), str(op)],
                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(), start_new_session=True)
    log.close()
    return p, op, lp


# ---------------------------------------------------------------------------------------------
# phases


async def warm_up(run: Run, client: Any, srv: Srv, pm_warm: dict[str, Any]) -> None:
    sz = run.sz
    t = time.perf_counter()
    rs = [await stream(client, srv, pm_warm["short"][0], 8, sz["request_timeout_s"] * 3)]
    rs.append(await stream(client, srv, pm_warm["long"][srv.label], 2, sz["request_timeout_s"]))
    w, _ = await wave(client, srv, pm_warm["short"][:sz["high_streams"]], 4, sz["request_timeout_s"])
    errs = [r["error"] for r in rs + w if not r["ok"]]
    run.data["phases"].setdefault("warm_up", {})[srv.label] = {"s": _r(time.perf_counter() - t, 2), "errors": errs[:3],
                                                               "prompt_tokens_long": rs[1].get("prompt_tokens")}
    if errs:
        run.note(f"{srv.label}: warm-up errors: {errs[:2]}")


async def ssd_idle(run: Run, client: Any, srv: Srv, where: str) -> None:
    if srv.kind != "omlx" or not srv.up:
        return
    w = await wait_ssd_idle(client, srv, run.sz["drain_timeout_s"])
    if w["ssd"] and w["num_queued"]:
        run.note(f"{srv.label}: SSD queue still holds {w['num_queued']} blocks before {where} "
                 f"(waited {w['waited_s']} s)")


def fits(run: Run, phase: str, est_s: float) -> bool:
    if run.left() < est_s:
        run.note(f"{phase}: skipped (about {est_s:.0f} s needed, {max(0.0, run.left()):.0f} s of the budget left)")
        return False
    return True


class InprocTurns:
    """The in-process child's single-stream repetitions, one per call, taken in turn with the
    servers' (see `inprocess_child`); ``None`` once the child is gone or too slow to answer."""

    def __init__(self, turn_dir: Path, child: subprocess.Popen, timeout_s: float):
        self.dir, self.child, self.timeout_s = turn_dir, child, timeout_s
        self.num_done = 0

    async def decode(self) -> dict[str, Any] | None:
        i = self.num_done
        (self.dir / f"turn-{i}").write_text("go")
        done = self.dir / f"done-{i}.json"
        t = time.perf_counter()
        while not done.exists():
            if self.child.poll() is not None or time.perf_counter() - t > self.timeout_s:
                return None
            await asyncio.sleep(0.01)
        self.num_done += 1
        return json.loads(done.read_text())


async def phase_decode1(run: Run, client: Any, srvs: list[Srv], prompts: list[str],
                        inproc: InprocTurns | None = None) -> None:
    """Each repetition runs the same prompt on every contender, in an order that rotates, the
    in-process ``stream_generate`` among them when ``inproc`` is given."""
    sz = run.sz
    raw: dict[str, list] = run.data["raw"].setdefault("decode_1", {s.label: [] for s in srvs})
    contenders: list[Srv | None] = [*srvs, None] if inproc is not None else list(srvs)
    rep_s = None
    for rep, p in enumerate(prompts):
        if rep_s is not None and run.left() < rep_s * 1.5:
            run.note(f"decode_1: stopped after {rep} repetitions (budget)")
            break
        t = time.perf_counter()
        k = rep % len(contenders)
        order = contenders[k:] + contenders[:k]
        for s in order:
            if s is None:
                got = await inproc.decode()
                if got is None:
                    run.note("decode_1: the in-process child did not answer; its single stream runs after the servers'")
                    contenders.remove(None)
                    inproc = None
                continue
            await ssd_idle(run, client, s, "decode_1")
            r = await stream(client, s, p, sz["decode_tokens"], sz["request_timeout_s"])
            raw[s.label].append(slim(r))
        rep_s = time.perf_counter() - t


async def phase_streams(run: Run, client: Any, srvs: list[Srv], waves: list[list[str]], max_tokens: int,
                        name: str) -> None:
    sz = run.sz
    raw: dict[str, list] = run.data["raw"].setdefault(name, {s.label: [] for s in srvs})
    rep_s = None
    for rep, prompts in enumerate(waves):
        if rep_s is not None and run.left() < rep_s * 1.5:
            run.note(f"{name}: stopped after {rep} repetitions (budget)")
            break
        t = time.perf_counter()
        order = srvs if rep % 2 == 0 else list(reversed(srvs))
        for s in order:
            await ssd_idle(run, client, s, name)
            res, wall = await wave(client, s, prompts, max_tokens, sz["request_timeout_s"] * 3)
            ok = [r for r in res if r["ok"]]
            tokens = sum(ntok(r) for r in ok)
            raw[s.label].append({"wall_s": _r(wall), "tokens": tokens, "num_ok": len(ok),
                                 "aggregate_tps": _r(tokens / wall if ok and wall > 0 else None, 2),
                                 "errors": [r["error"] for r in res if not r["ok"]][:3],
                                 "finish_reasons": sorted({str(r["finish_reason"]) for r in res}),
                                 "completion_tokens": [ntok(r) for r in res]})
        rep_s = time.perf_counter() - t


async def phase_prefill(run: Run, client: Any, srvs: list[Srv], pairs: list[tuple[str, str]]) -> None:
    sz = run.sz
    raw: dict[str, list] = run.data["raw"].setdefault("prefill", {s.label: [] for s in srvs})
    rep_s = None
    for rep, (orig, edited) in enumerate(pairs):
        if rep_s is not None and run.left() < rep_s * 1.5:
            run.note(f"prefill: stopped after {rep} repetitions (budget)")
            break
        t = time.perf_counter()
        order = srvs if rep % 2 == 0 else list(reversed(srvs))
        for s in order:
            await ssd_idle(run, client, s, "prefill")
            d = {}
            for case, text in (("cold", orig), ("identical", orig), ("edited", edited)):
                d[case] = slim(await stream(client, s, text, 1, sz["request_timeout_s"]))
            raw[s.label].append(d)
        rep_s = time.perf_counter() - t


async def phase_interference(run: Run, client: Any, srvs: list[Srv], items: list[tuple[str, str, str]]) -> None:
    """Per repetition: stream A alone; stream A' joined by a cold long prompt B after k chunks."""
    sz = run.sz
    k = sz["interf_after"]
    raw: dict[str, list] = run.data["raw"].setdefault("interference", {s.label: [] for s in srvs})
    rep_s = None
    for rep, (pa, pa2, pb) in enumerate(items):
        if rep_s is not None and run.left() < rep_s * 1.5:
            run.note(f"interference: stopped after {rep} repetitions (budget)")
            break
        t = time.perf_counter()
        for s in srvs:
            await ssd_idle(run, client, s, "interference")
            alone = await stream(client, s, pa, sz["decode_tokens"], sz["request_timeout_s"])
            await ssd_idle(run, client, s, "interference")
            go = asyncio.Event()
            ta = asyncio.create_task(stream(client, s, pa2, sz["decode_tokens"], sz["request_timeout_s"],
                                            on_chunk=lambda n: go.set() if n >= k else None))
            waiter = asyncio.create_task(go.wait())
            await asyncio.wait({ta, waiter}, return_when=asyncio.FIRST_COMPLETED)
            b = None
            if go.is_set() and not ta.done():
                b = await stream(client, s, pb, 1, sz["request_timeout_s"])
            waiter.cancel()
            a2 = await ta
            d: dict[str, Any] = {"alone": slim(alone), "with_prefill": slim(a2, keep_chunks=True)}
            if b is None:
                d["error"] = "the stream ended before the prefill request could be sent"
            else:
                d["prefill"] = slim(b, t0=a2["t_send"], keep_chunks=True)
                d["prefill"]["send_ms"] = _r((b["t_send"] - a2["t_send"]) * 1e3, 1)
                w0, w1 = b["t_send"], b["t_send"] + (b["ttft_s"] or 0.0)
                c = a2["chunks"]
                idx = [i for i in range(len(c) - 1) if c[i + 1] > w0 and c[i] < w1]
                during = [c[i + 1] - c[i] for i in idx]
                al = itls(alone)
                same = [al[i] for i in idx if i < len(al)]
                d.update({"window_ms": _r((w1 - w0) * 1e3, 2), "window_intervals": idx,
                          "tpot_during_ms": _r(1e3 * mean(during), 3) if during else None,
                          "max_itl_during_ms": _r(1e3 * max(during), 3) if during else None,
                          "tpot_alone_ms": _r(1e3 * mean(same), 3) if same else None,
                          "tpot_alone_all_ms": _r(1e3 * mean(al), 3) if al else None})
            raw[s.label].append(d)
        rep_s = time.perf_counter() - t


async def phase_ssd(run: Run, client: Any, main: Srv, nocache: Srv | None, reps: list[dict[str, Any]]) -> None:
    sz = run.sz
    raw: dict[str, list] = run.data["raw"].setdefault("ssd_writeback", {"omlx": [], "omlx_nocache": []})
    rep_s = None
    for rep, item in enumerate(reps):
        if rep_s is not None and run.left() < rep_s * 1.3:
            run.note(f"ssd_writeback: stopped after {rep} repetitions (budget)")
            break
        t = time.perf_counter()
        idle = await wait_ssd_idle(client, main, max(sz["drain_timeout_s"], 30.0))
        d: dict[str, Any] = {"drain_before": idle}
        # quiet stream
        pq = Poller(client, main)
        pq.start()
        quiet = await stream(client, main, item["quiet"], sz["decode_tokens"], sz["request_timeout_s"])
        await pq.stop()
        # K cold long prompts, then the stream at once
        longs = [slim(await stream(client, main, p, 1, sz["request_timeout_s"])) for p in item["longs"]]
        pw = Poller(client, main)
        pw.start()
        wb = await stream(client, main, item["wb"], sz["decode_tokens"], sz["request_timeout_s"])
        await pw.stop()
        c = wb["chunks"]
        s0 = [x for x in pw.samples if x[0] <= (c[0] if c else wb["t_send"])]
        start_sample = s0[-1] if s0 else (pw.samples[0] if pw.samples else None)
        # The window ends at the first poll (after the first chunk) that sees an empty queue and no
        # byte written after it; else the writer was busy through the stream's end.
        final_w = pw.samples[-1][2] if pw.samples else None
        empty_t = next((x[0] for x in pw.samples
                        if x[1] == 0 and x[2] == final_w and (not c or x[0] >= c[0])), None)
        w_end = empty_t if empty_t is not None else (c[-1] if c else wb["t_send"])
        idx = [i for i in range(len(c) - 1) if c[i + 1] <= w_end]
        in_win = [c[i + 1] - c[i] for i in idx]
        ql = itls(quiet)
        same = [ql[i] for i in idx if i < len(ql)]
        wb_in_win = [x for x in pw.samples if x[0] <= w_end]
        bytes_w = None
        if start_sample and wb_in_win and start_sample[2] is not None and wb_in_win[-1][2] is not None:
            bytes_w = wb_in_win[-1][2] - start_sample[2]
        qbytes = None
        if pq.samples and pq.samples[0][2] is not None and pq.samples[-1][2] is not None:
            qbytes = pq.samples[-1][2] - pq.samples[0][2]
        d.update({"quiet": slim(quiet), "longs": longs, "writeback": slim(wb),
                  "queued_at_stream_start": None if start_sample is None else start_sample[1],
                  "window_ms": _r((w_end - c[0]) * 1e3, 1) if c else None,
                  "window_intervals": len(idx), "written_bytes_in_window": bytes_w,
                  "written_bytes_during_quiet": qbytes,
                  "queue_empty_seen": empty_t is not None,
                  "tpot_writeback_ms": _r(1e3 * mean(in_win), 3) if in_win else None,
                  "tpot_quiet_ms": _r(1e3 * mean(same), 3) if same else None,
                  "tpot_writeback_all_ms": _r(1e3 * mean(itls(wb)), 3) if itls(wb) else None,
                  "tpot_quiet_all_ms": _r(1e3 * mean(ql), 3) if ql else None,
                  "samples": [(round((x[0] - wb["t_send"]) * 1e3, 1), x[1], x[2]) for x in pw.samples][:400]})
        after = await cold_stats(client, main)
        d["cold_after"] = None if after is None else {k: after.get(k) for k in (
            "num_writes", "num_written_bytes", "num_queued", "num_queue_drops", "num_budget_drops", "num_evictions")}
        raw["omlx"].append(d)
        if nocache is not None and nocache.up:  # the same sequence with no cache at all (information)
            for p in item["longs_nc"]:
                await stream(client, nocache, p, 1, sz["request_timeout_s"])
            nc = await stream(client, nocache, item["wb_nc"], sz["decode_tokens"], sz["request_timeout_s"])
            ncl = itls(nc)
            raw["omlx_nocache"].append({"stream": slim(nc), "tpot_all_ms": _r(1e3 * mean(ncl), 3) if ncl else None,
                                        "tpot_same_positions_ms": _r(1e3 * mean([ncl[i] for i in idx if i < len(ncl)]), 3)
                                        if idx and ncl else None})
        rep_s = time.perf_counter() - t


def prefill_chunk_info(main: Srv, health: Any) -> dict[str, Any]:
    text = re.sub(r"\s*\n\s{8,}", " ", main.log_text())  # rejoin wrapped log lines
    hits = [m.group(0).strip() for m in re.finditer(r"[^\n]{0,120}prefill[ _-]?chunk[^\n]{0,160}", text, re.I)]
    keys: list[tuple[str, Any]] = []

    def walk(o: Any, path: str) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                if re.search(r"prefill|chunk", str(k), re.I):
                    keys.append((p, v))
                walk(v, p)
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")

    walk(health, "")
    size = mixed = decode_ms = None
    for h in hits:  # e.g. "M: prefill chunk 2048 tokens alone, 256 beside decoding streams (decode step 9.1 ms; ...)"
        m = re.search(r"prefill[ _-]?chunk\D{0,40}?(\d{2,6})", h, re.I)
        if m:
            size = int(m.group(1))
            m2 = re.search(r"(\d{1,6})\s+(?:tokens\s+)?beside\s+decoding", h)
            mixed = int(m2.group(1)) if m2 else None
            m3 = re.search(r"decode\s+step\s+([\d.]+)\s*ms", h)
            decode_ms = float(m3.group(1)) if m3 else None
            break
    if size is None:
        for _p, v in keys:
            if isinstance(v, int) and not isinstance(v, bool):
                size = v
                break
    return {"chunk_tokens": size, "mixed_chunk_tokens": mixed, "decode_step_ms": decode_ms, "log_lines": hits[:5],
            "health_keys": [(p, v) for p, v in keys][:10]}


# ---------------------------------------------------------------------------------------------
# figures and targets


def figures(run: Run) -> None:
    raw, F = run.data["raw"], {}
    ip = (run.data.get("inprocess") or {}).get("results") or {}
    T: list[dict[str, Any]] = []

    def target(name: str, value: float | None, op: str, thr: float, unit: str = "x", detail: str = "") -> None:
        st = "N/A" if value is None else ("PASS" if (value <= thr if op == "<=" else value >= thr) else "MISS")
        T.append({"name": name, "value": _r(value, 4), "op": op, "threshold": thr, "unit": unit,
                  "status": st, "detail": detail})

    # 1. decode 1 stream
    d1 = raw.get("decode_1", {})
    F["decode_1_tps"] = {k: summ([r["decode_tps"] for r in v if r["ok"]]) for k, v in d1.items()}
    F["decode_1_tps"]["inprocess"] = summ([r["decode_tps"] for r in ip.get("decode", [])])
    o, p, i = (F["decode_1_tps"].get(k, {}).get("median") for k in ("omlx", "mlx_lm.server", "inprocess"))
    target("decode 1 stream: omlx / in-process stream_generate", ratio(o, i), ">=", 0.9,
           detail=f"{_f(o)} vs {_f(i)} tok/s")
    target("decode 1 stream: omlx / mlx_lm.server", ratio(o, p), ">=", 2.0, detail=f"{_f(o)} vs {_f(p)} tok/s")

    # 2./3. aggregate
    for name, n in (("streams_mid", run.sz["mid_streams"]), ("streams_high", run.sz["high_streams"])):
        st = raw.get(name, {})
        F[f"{name}_aggregate_tps"] = {k: summ([r["aggregate_tps"] for r in v]) for k, v in st.items()}
        F[f"{name}_aggregate_tps"]["inprocess"] = summ(
            [b["aggregate_tps"] for b in (ip.get("batch") or {}).get(str(n), [])])
    m = F.get("streams_mid_aggregate_tps", {})
    o, p, nc = (m.get(k, {}).get("median") for k in ("omlx", "mlx_lm.server", "omlx_nocache"))
    n_mid, n_high = run.sz["mid_streams"], run.sz["high_streams"]
    target(f"aggregate {n_mid} streams: omlx / mlx_lm.server", ratio(o, p), ">=", 2.0, detail=f"{_f(o)} vs {_f(p)} tok/s")
    target(f"aggregate {n_mid} streams: prefix cache on / off", ratio(o, nc), ">=", 0.95,
           detail=f"{_f(o)} vs {_f(nc)} tok/s")
    h = F.get("streams_high_aggregate_tps", {})
    o, i = h.get("omlx", {}).get("median"), h.get("inprocess", {}).get("median")
    target(f"aggregate {n_high} streams: omlx / in-process BatchGenerator({n_high})", ratio(o, i), ">=", 0.9,
           detail=f"{_f(o)} vs {_f(i)} tok/s")

    # 4. prefill
    pf = raw.get("prefill", {})
    for case in ("cold", "identical", "edited"):
        F[f"prefill_{case}_ttft_ms"] = {k: summ([r[case]["ttft_ms"] for r in v if r[case]["ok"]]) for k, v in pf.items()}
    F["prefill_cold_ttft_ms"]["inprocess"] = summ([1e3 * r["ttft_s"] for r in ip.get("prefill_cold", [])])
    F["prefill_edited_ttft_ms"]["inprocess"] = summ([1e3 * r["suffix_s"] for r in ip.get("prefill_edit", [])])
    F["prefill_edited_ttft_ms"]["inprocess (from block boundary)"] = summ(
        [1e3 * r["suffix_block_aligned_s"] for r in ip.get("prefill_edit", [])])
    F["prefill_cached_tokens"] = {k: {c: [r[c]["cached_tokens"] for r in v] for c in ("cold", "identical", "edited")}
                                  for k, v in pf.items()}
    F["prefill_prompt_tokens"] = {k: [r["cold"]["prompt_tokens"] for r in v] for k, v in pf.items()}
    o, i = F["prefill_cold_ttft_ms"].get("omlx", {}).get("median"), F["prefill_cold_ttft_ms"]["inprocess"]["median"]
    L = run.sz["long_tokens"]
    target(f"cold {L}-token prefill TTFT: omlx / in-process", ratio(o, i), "<=", 1.2, detail=f"{_f(o)} vs {_f(i)} ms")
    o = F["prefill_identical_ttft_ms"].get("omlx", {}).get("median")
    target(f"identical {L}-token prompt again: omlx TTFT", o, "<=", 10.0, unit=" ms",
           detail=f"cached_tokens {F['prefill_cached_tokens'].get('omlx', {}).get('identical')}")
    o, i = F["prefill_edited_ttft_ms"].get("omlx", {}).get("median"), F["prefill_edited_ttft_ms"]["inprocess"]["median"]
    sfx = [r["prompt_tokens"] - r["common_prefix"] for r in ip.get("prefill_edit", [])]
    target("middle line edited: omlx TTFT / in-process suffix prefill", ratio(o, i), "<=", 1.2,
           detail=f"{_f(o)} vs {_f(i)} ms; tokens after the edit {sfx}")

    # 4k / prefill interference
    it = raw.get("interference", {})
    F["interference"] = {}
    for k, v in it.items():
        F["interference"][k] = {"tpot_alone_ms": summ([r.get("tpot_alone_ms") for r in v]),
                                "tpot_during_ms": summ([r.get("tpot_during_ms") for r in v]),
                                "max_itl_during_ms": summ([r.get("max_itl_during_ms") for r in v]),
                                "ratio": summ([ratio(r.get("tpot_during_ms"), r.get("tpot_alone_ms")) for r in v])}
    x = F["interference"].get("omlx", {})
    target(f"TPOT while another request prefills {L} tokens / alone (omlx)",
           ratio((x.get("tpot_during_ms") or {}).get("median"), (x.get("tpot_alone_ms") or {}).get("median")),
           "<=", 2.0, detail=f"{fmt_s(x.get('tpot_during_ms', {}))} vs {fmt_s(x.get('tpot_alone_ms', {}))} ms; "
                              f"max ITL {fmt_s(x.get('max_itl_during_ms', {}))} ms")

    # SSD write-back
    sw = (raw.get("ssd_writeback") or {}).get("omlx", [])
    if sw:
        wb, q = summ([r.get("tpot_writeback_ms") for r in sw]), summ([r.get("tpot_quiet_ms") for r in sw])
        F["ssd_writeback"] = {"tpot_writeback_ms": wb, "tpot_quiet_ms": q,
                              "tpot_nocache_ms": summ([r.get("tpot_all_ms") for r in
                                                       (raw.get("ssd_writeback") or {}).get("omlx_nocache", [])]),
                              "window_intervals": [r.get("window_intervals") for r in sw],
                              "written_bytes_in_window": [r.get("written_bytes_in_window") for r in sw],
                              "queued_at_stream_start": [r.get("queued_at_stream_start") for r in sw]}
        flags = []
        if any(not r.get("queued_at_stream_start") for r in sw):
            flags.append("queue empty at a stream's start")
        if any((r.get("window_intervals") or 0) < 8 for r in sw):
            flags.append("window < 8 intervals")
        if any(not r.get("written_bytes_in_window") for r in sw):
            flags.append("no bytes written in a window")
        target("TPOT during SSD write-back / quiet (omlx)", ratio(wb["median"], q["median"]), "<=", 1.05,
               detail=f"{fmt_s(wb)} vs {fmt_s(q)} ms over {F['ssd_writeback']['window_intervals']} intervals; "
                      f"written {F['ssd_writeback']['written_bytes_in_window']} B"
                      + (f"; FLAGS: {', '.join(flags)}" if flags else ""))
    else:
        target("TPOT during SSD write-back / quiet (omlx)", None, "<=", 1.05, detail="not measured")
    run.data["figures"], run.data["targets"] = F, T


def _f(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}")


def print_report(run: Run) -> None:
    F = run.data["figures"]
    cols = ["in-process", "omlx", "omlx_nocache", "mlx_lm.server"]
    rows = [("decode 1 stream (tok/s)", F.get("decode_1_tps", {})),
            (f"aggregate {run.sz['mid_streams']} streams (tok/s)", F.get("streams_mid_aggregate_tps", {})),
            (f"aggregate {run.sz['high_streams']} streams (tok/s)", F.get("streams_high_aggregate_tps", {})),
            (f"cold {run.sz['long_tokens']}-token prefill TTFT (ms)", F.get("prefill_cold_ttft_ms", {})),
            ("identical prompt again TTFT (ms)", F.get("prefill_identical_ttft_ms", {})),
            ("middle line edited TTFT (ms)", F.get("prefill_edited_ttft_ms", {}))]
    itf = F.get("interference", {})
    rows.append(("TPOT alone (ms)", {k: v["tpot_alone_ms"] for k, v in itf.items()}))
    rows.append((f"TPOT during {run.sz['long_tokens']}-tok prefill (ms)", {k: v["tpot_during_ms"] for k, v in itf.items()}))
    sw = F.get("ssd_writeback")
    if sw:
        rows.append(("TPOT quiet, SSD idle (ms)", {"omlx": sw["tpot_quiet_ms"], "omlx_nocache": sw["tpot_nocache_ms"]}))
        rows.append(("TPOT during SSD write-back (ms)", {"omlx": sw["tpot_writeback_ms"]}))
    table = [["figure"] + cols]
    for name, d in rows:
        ipk = "inprocess"
        cells = [fmt_s(d.get(ipk, {}))]
        if name.startswith("middle") and d.get("inprocess (from block boundary)", {}).get("median") is not None:
            cells[0] += f" (block: {fmt_s(d['inprocess (from block boundary)'])})"
        cells += [fmt_s(d.get(c, {})) for c in cols[1:]]
        table.append([name] + cells)
    print()
    print(_table(table))
    print()
    t = [["target", "measured", "needed", "status", "detail"]]
    for x in run.data["targets"]:
        v = "-" if x["value"] is None else (f"{x['value']:.2f}{x['unit']}" if x["unit"] == "x" else f"{x['value']:.1f}{x['unit']}")
        t.append([x["name"], v, f"{x['op']} {x['threshold']:g}{x['unit']}", x["status"], x["detail"]])
    print(_table(t))
    pc = run.data.get("prefill_chunk", {})
    print(f"\nomlx prefill chunk: {pc.get('chunk_tokens')} alone, {pc.get('mixed_chunk_tokens')} beside decoding "
          f"(log: {pc.get('log_lines')[0] if pc.get('log_lines') else 'no such line'})")
    ip = run.data.get("inprocess") or {}
    print(f"in-process: device {ip.get('device')}, load {_f(ip.get('load_s'))} s; servers ready after "
          + ", ".join(f"{s['label']} {s['ready_s']} s" for s in run.data.get("servers", [])))
    for n in run.data["notes"]:
        print("note:", n)
    print(f"results written to {run.path}" + (f" (and $OUT)" if os.environ.get("OUT") else ""))


def _table(rows: list[list[str]]) -> str:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(str(c).ljust(w[i]) if i == 0 or i == len(r) - 1 else str(c).rjust(w[i])
                             for i, c in enumerate(r)))
        if j == 0:
            out.append("  ".join("-" * x for x in w))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# main


async def main_async(run: Run) -> None:
    import httpx

    args, sz = run.args, run.sz
    model = Path(args.model).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    run.data["work_dir"] = str(work)
    pm = PromptMaker(model, args.seed)
    L, S = sz["long_tokens"], sz["short_tokens"]
    labels = ["omlx", "omlx_nocache", "mlx_lm.server"]
    t = time.perf_counter()
    P: dict[str, Any] = {
        "warm": {"short": [pm.text(S) for _ in range(sz["high_streams"])], "long": {k: pm.text(L) for k in labels}},
        "decode": [pm.text(S) for _ in range(sz["decode_reps"])],
        "mid": [[pm.text(S) for _ in range(sz["mid_streams"])] for _ in range(sz["mid_reps"])],
        "high": [[pm.text(S) for _ in range(sz["high_streams"])] for _ in range(sz["high_reps"])],
        "prefill": [pm.edited_pair(L) for _ in range(sz["prefill_reps"])],
        "interf": [(pm.text(S), pm.text(S), pm.text(L)) for _ in range(sz["interf_reps"])],
        "ssd": [{"quiet": pm.text(S), "wb": pm.text(S), "longs": [pm.text(L) for _ in range(sz["ssd_prompts"])],
                 "wb_nc": pm.text(S), "longs_nc": [pm.text(L) for _ in range(sz["ssd_prompts"])]}
                for _ in range(sz["ssd_reps"])],
    }
    run.data["prompt_tokens_local"] = {"long": pm.count(P["prefill"][0][0]), "short": pm.count(P["decode"][0])}
    run.log(f"prompts built in {time.perf_counter() - t:.1f} s (long {run.data['prompt_tokens_local']['long']} "
            f"tokens, short {run.data['prompt_tokens_local']['short']})")

    n_conc = str(max(32, sz["high_streams"]))
    srvs = {"omlx": Srv("omlx", "omlx", model, ["--max-concurrent-requests", n_conc, *args.omlx_arg], work),
            "omlx_nocache": Srv("omlx_nocache", "omlx", model,
                                ["--no-cache", "--max-concurrent-requests", n_conc, *args.omlx_arg], work),
            "mlx_lm.server": Srv("mlx_lm.server", "mlx_lm", model, list(args.peer_arg), work)}
    job = {"model": str(model), "prefill_step_size": 2048, "ready_file": str(work / "inproc.ready"),
           "go_file": str(work / "inproc.go"), "go_timeout_s": sz["start_timeout_s"] + 120,
           "decode_turn_dir": str(work),
           "warm_long": pm.text(L), "warm_short": P["warm"]["short"][:2],
           "decode": P["decode"], "decode_tokens": sz["decode_tokens"],
           "batch": [{"texts": w, "max_tokens": sz["mid_tokens"], "reps": 1} for w in P["mid"][:1]]
           + [{"texts": P["high"][0], "max_tokens": sz["high_tokens"], "reps": sz["high_reps"]}],
           "prefill_cold": [a for a, _ in P["prefill"]], "prefill_edit": P["prefill"], "block_size": 256}
    if sz["mid_streams"] == sz["high_streams"]:
        job["batch"] = job["batch"][1:]
    child, child_out, child_log = launch_child(job, work)
    for s in srvs.values():
        s.launch()
    run.log("servers and in-process child launched: " + ", ".join(f"{s.label}:{s.port}" for s in srvs.values()))
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=0),
                                     timeout=httpx.Timeout(sz["request_timeout_s"], connect=10.0)) as client:
            deadline = time.perf_counter() + min(sz["start_timeout_s"], max(30.0, run.left() - 120))
            await asyncio.gather(*[s.wait_ready(client, deadline) for s in srvs.values()])
            run.data["servers"] = [s.info() for s in srvs.values()]
            for s in srvs.values():
                if s.error:
                    run.note(f"{s.label} failed to start: {s.error[:800]}")
                else:
                    run.log(f"{s.label} ready in {s.ready_s:.1f} s")
            up = [s for s in srvs.values() if s.up]
            for s in up:
                await warm_up(run, client, s, P["warm"])
            main = srvs["omlx"]
            health = None
            if main.up:
                try:
                    health = (await client.get(main.url + "/health")).json()
                except Exception:
                    pass
                await ssd_idle(run, client, main, "the in-process run")
            run.data["omlx_health"] = health
            run.data["prefill_chunk"] = prefill_chunk_info(main, health)
            # in-process: wait for its warm-up; its single stream takes turns with the servers'
            # (decode_1), then it measures the rest while the servers are idle
            t = time.perf_counter()
            ready = Path(job["ready_file"])
            while not ready.exists() and child.poll() is None and time.perf_counter() - t < sz["inproc_timeout_s"]:
                await asyncio.sleep(0.1)
            omlx_up = [s for s in (srvs["omlx"], srvs["mlx_lm.server"]) if s.up]
            if ready.exists() and fits(run, "decode_1", 10):
                run.log("warm-ups done; phase decode_1 (servers and in-process in turn) ...")
                t = time.perf_counter()
                await phase_decode1(run, client, omlx_up, P["decode"],
                                    InprocTurns(work, child, sz["request_timeout_s"]))
                run.data["phases"]["decode_1"] = {"s": _r(time.perf_counter() - t, 2)}
                run.save()
            run.log("in-process run starts")
            Path(job["go_file"]).write_text("go")
            t = time.perf_counter()
            while child.poll() is None and time.perf_counter() - t < sz["inproc_timeout_s"]:
                await asyncio.sleep(0.1)
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                run.note("in-process child timed out")
            if child_out.exists():
                run.data["inprocess"] = json.loads(child_out.read_text())
                run.log(f"in-process done in {time.perf_counter() - t:.1f} s (device {run.data['inprocess'].get('device')})")
            else:
                run.note(f"in-process child failed: {child_log.read_text(errors='replace')[-1500:]}")
            run.save()

            all_up = [s for s in srvs.values() if s.up]
            phases: list[tuple[str, float, Callable[[], Any]]] = [
                ("decode_1", 10, lambda: phase_decode1(run, client, omlx_up, P["decode"])),
                ("streams_mid", 15, lambda: phase_streams(run, client, all_up, P["mid"], sz["mid_tokens"], "streams_mid")),
                ("streams_high", 15, lambda: phase_streams(run, client, omlx_up, P["high"], sz["high_tokens"],
                                                           "streams_high")),
                ("prefill", 8, lambda: phase_prefill(run, client, omlx_up, P["prefill"])),
                ("interference", 12, lambda: phase_interference(run, client, omlx_up, P["interf"])),
                ("ssd_writeback", 20, lambda: phase_ssd(run, client, main, srvs["omlx_nocache"], P["ssd"])
                 if main.up else asyncio.sleep(0)),
            ]
            for name, est, fn in phases:
                if name in run.data["phases"]:  # decode_1, run beside the in-process child above
                    continue
                if not fits(run, name, est):
                    continue
                t = time.perf_counter()
                run.log(f"phase {name} ...")
                try:
                    await asyncio.wait_for(fn(), timeout=max(5.0, run.left()))
                except asyncio.TimeoutError:
                    run.note(f"{name}: cut off at the budget")
                except Exception as e:
                    run.note(f"{name}: failed: {type(e).__name__}: {e}")
                run.data["phases"][name] = {"s": _r(time.perf_counter() - t, 2)}
                run.log(f"phase {name} done in {time.perf_counter() - t:.1f} s")
                try:
                    figures(run)
                except Exception as e:
                    run.note(f"figures failed after {name}: {type(e).__name__}: {e}")
                run.save()
            run.data["prefill_chunk"] = prefill_chunk_info(main, health)
            # The servers' own per-request record (engine-side TTFT, prefilled tokens): where a
            # slow client-side figure spent its time, HTTP path or engine.
            for s in (x for x in srvs.values() if x.up and x.kind == "omlx"):
                try:
                    r = await client.get(s.url + "/v1/admin/recent?limit=200", timeout=5)
                    run.data.setdefault("omlx_recent", {})[s.label] = r.json().get("requests")
                except Exception as e:
                    run.note(f"{s.label}: /v1/admin/recent failed: {type(e).__name__}: {e}")
            for s in srvs.values():
                if s.proc is not None and s.proc.poll() is not None and s.ready_s is not None:
                    run.note(f"{s.label} exited during the run ({s.proc.returncode}): {s.log_tail(600)}")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        for s in srvs.values():
            s.terminate()
        for s in srvs.values():
            s.reap(8.0)
        run.data["server_log_tails"] = {s.label: s.log_tail(2500) for s in srvs.values()}
        run.data["servers"] = [s.info() for s in srvs.values()]
        if os.environ.get("OUT"):  # the logs too (their last 300 KB), for a run on a machine that goes away
            try:
                logs = Path(os.environ["OUT"]) / "bench-gpu-logs"
                logs.mkdir(parents=True, exist_ok=True)
                for f in [s.log_path for s in srvs.values()] + [child_log]:
                    if f.exists():
                        data = f.read_bytes()[-300_000:]
                        (logs / f.name).write_bytes(data)
            except OSError as e:
                print(f"cannot copy the logs to $OUT: {e}", flush=True)
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--inprocess-child":
        inprocess_child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="mlx-lm model folder (default: the imported SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition (CPU smoke run)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-time budget of the whole script (default 400)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--omlx-arg", action="append", default=[], help="extra omlx serve argument (repeat)")
    ap.add_argument("--peer-arg", action="append", default=[], help="extra mlx_lm server argument (repeat)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temp folder with server logs")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").exists():
        print(f"no model at {args.model} (config.json missing)", file=sys.stderr)
        return 2
    run = Run(args, sizes(args.quick))
    run.log(f"bench_gpu: model {args.model}, quick={args.quick}, budget {args.budget_s:.0f} s, JSON {run.path}")

    def _term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    try:
        asyncio.run(main_async(run))
    except KeyboardInterrupt as e:
        run.note(f"interrupted: {e}")
    try:
        figures(run)
    except Exception as e:
        run.note(f"figures failed: {type(e).__name__}: {e}")
    run.save()
    print_report(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())

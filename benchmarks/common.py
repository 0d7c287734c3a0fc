"""Shared pieces of the omlx benchmarks: servers, a streaming client, prompts, stats, reports.

Nothing here is timed by itself. The pieces are:

- `Server`: start and stop an ``omlx serve`` or ``mlx_lm server`` child process on a free port,
  both with the same OpenBLAS preload (``omlx serve`` re-executes itself with it; the peer
  gets ``LD_PRELOAD``), and wait until ``/health`` answers 200.
- `stream_chat` / `stream_completion` / `run_streams`: an SSE client over httpx that records,
  per request, the time of the first content chunk (TTFT) and of every later content chunk.
  Tokens are counted from the ``stream_options.include_usage`` chunk (``completion_tokens``)
  when the server sends one, else from the number of content chunks; every result says which
  (``token_count_source``).
- `Prompts`: deterministic text from a seed, with lengths counted by the model's own tokenizer
  (transformers ``AutoTokenizer`` on the model folder, offline).
- `summarize`, `Report`: median/min/max over repeats, a rich table and a JSON file.
- `run_inprocess`: mlx-lm in a child process (no HTTP) with the same ``LD_PRELOAD``: prefill
  and decode timings used as the physical reference. This file is also that child's entry
  point (``python benchmarks/common.py inprocess JOB.json OUT.json``).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from omlx.bench.client import StreamResult as ClientStreamResult

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
TEST_HOME = Path(os.environ.get("OMLX_TEST_HOME", REPO / ".omlx-test"))
DEFAULT_MODEL_DIR = TEST_HOME / "models" / "SmolLM2-135M-Instruct"
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


# ---------------------------------------------------------------------------------------------
# environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_blas_threads(n: int | None) -> None:
    """Pin OPENBLAS_NUM_THREADS for every child (servers and in-process run) when ``n`` is given."""
    if n:
        os.environ["OPENBLAS_NUM_THREADS"] = str(n)


def openblas_path() -> str | None:
    if sys.platform != "linux":
        return None
    for p in OPENBLAS_CANDIDATES:
        if Path(p).exists():
            return p
    return None


def blas_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with OpenBLAS in ``LD_PRELOAD`` on Linux."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path()
    if lib:
        pre = env.get("LD_PRELOAD", "")
        if lib not in pre.split():
            env["LD_PRELOAD"] = (lib + " " + pre).strip()
    return env


def process_blas(pid: int | str = "self") -> str:
    """The BLAS a running process has mapped: 'openblas', 'reference', 'accelerate' or '?'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open(f"/proc/{pid}/maps") as f:
            libs = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return "?"
    if any("openblas" in os.path.basename(x) for x in libs):
        return "openblas"
    if any(os.path.basename(x).startswith("libblas") for x in libs):
        return "reference"
    return "?"


def ensure_model_dir(model_dir: Path | None) -> Path:
    """The model folder to benchmark; imports omlx's embedded default once if it is missing."""
    if model_dir is not None:
        return Path(model_dir).resolve()
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from omlx.engine.embedded import ensure_default_model

        return Path(ensure_default_model(TEST_HOME / "models", progress=True))
    return DEFAULT_MODEL_DIR


def machine_info() -> dict[str, Any]:
    """Where and when the figures were taken (for the JSON and the README)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        mem_gb = round(psutil.virtual_memory().total / 1e9, 1)
    except Exception:
        mem_gb = None
    versions: dict[str, str] = {"python": platform.python_version()}
    for mod in ("mlx", "mlx_lm", "omlx", "transformers", "httpx"):
        try:
            if mod == "mlx":
                import mlx.core as mx

                versions[mod] = mx.__version__
            else:
                versions[mod] = __import__(mod).__version__
        except Exception:
            pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                                    text=True, timeout=5).stdout.strip())
    except Exception:
        commit, dirty = "?", None
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "openblas": openblas_path(),
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMLX_", "OPENBLAS_", "OMP_", "MLX_"))},
    }


def busy_warning() -> str | None:
    """A warning when the machine is already busy (figures will be noisy)."""
    load1 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load1 > 0.5 * cores:
        return (f"machine busy before the run: 1-min load average {load1:.1f} on {cores} cores; "
                "timings will be noisy and targets unreliable")
    return None


# ---------------------------------------------------------------------------------------------
# servers


class Server:
    """A benchmarked server child process (its own process group, so stop() ends all of it).

    Args:
        kind: "omlx" or "mlx_lm".
        model_dir: the mlx-lm model folder (omlx: served as the embedded default when it is
            omlx's default folder, else passed with ``--model``).
        extra_args: more command-line arguments.
        log_dir: where the server's log goes.
        base_path: omlx's ``--base-path``, kept after ``stop()`` (a restart reuses its SSD
            cache); default: a temp folder deleted by ``stop()``.
    """

    def __init__(self, kind: str, model_dir: Path, extra_args: Sequence[str] = (), log_dir: Path | None = None,
                 label: str | None = None, base_path: Path | None = None):
        if kind not in ("omlx", "mlx_lm"):
            raise ValueError(kind)
        self.kind = kind
        self.label = label or ("omlx" if kind == "omlx" else "mlx_lm.server")
        self.model_dir = Path(model_dir)
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omlx-bench-"))
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.model_name: str | None = None  # the "model" field requests carry (None: omitted)
        self.ready_s: float | None = None  # Popen -> /health 200
        self.base_path: Path | None = None
        self.keep_base_path = base_path is not None
        self.stopped_clean: bool | None = None
        self._given_base_path = Path(base_path) if base_path is not None else None
        self.log_path: Path | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> tuple[list[str], dict[str, str]]:
        if self.kind == "omlx":
            if self._given_base_path is not None:
                self.base_path = self._given_base_path
                self.base_path.mkdir(parents=True, exist_ok=True)
            else:
                self.base_path = Path(tempfile.mkdtemp(prefix="omlx-bench-home-"))
            models = self.base_path / "models"
            if not models.is_symlink():
                models.symlink_to(self.model_dir.resolve().parent, target_is_directory=True)
            cmd = [sys.executable, "-m", "omlx", "serve", "--port", str(self.port), "--base-path", str(self.base_path)]
            if self.model_dir.resolve() != DEFAULT_MODEL_DIR.resolve():
                cmd += ["--model", str(self.model_dir)]
            env = dict(os.environ)
            env.setdefault("OMLX_LOG_LEVEL", "INFO")
            return cmd + self.extra_args, env  # omlx preloads OpenBLAS itself (re-exec)
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model_dir), "--port", str(self.port)]
        return cmd + self.extra_args, blas_env()

    def start(self, timeout_s: float = 600) -> "Server":
        import httpx

        self.port = free_port()
        cmd, env = self._command()
        self.log_path = self.log_dir / f"{self.kind}-{self.port}.log"
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            self.stop()
            raise RuntimeError(f"{self.label} did not become ready in {timeout_s}s:\n{self.log()}")
        if self.kind == "omlx":
            data = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
            self.model_name = data[0]["id"]
        else:
            self.model_name = None  # mlx_lm.server: "default_model", the --model folder
        return self

    def wait_idle(self, cpu_percent: float = 10.0, settle_s: float = 0.5, timeout_s: float = 300) -> float:
        """Wait until the server process uses less than ``cpu_percent`` CPU (loading done).

        Returns:
            Seconds waited.
        """
        import psutil

        t0 = time.perf_counter()
        p = psutil.Process(self.proc.pid)
        p.cpu_percent(None)
        while time.perf_counter() - t0 < timeout_s:
            time.sleep(settle_s)
            if p.cpu_percent(None) < cpu_percent:
                break
        return time.perf_counter() - t0

    def blas(self) -> str:
        return process_blas(self.proc.pid) if self.proc else "?"

    def rss_mb(self) -> float | None:
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            return round(sum(c.memory_info().rss for c in [p, *p.children(recursive=True)]) / 1e6, 1)
        except Exception:
            return None

    def get_json(self, path: str) -> Any:
        import httpx

        return httpx.get(self.url + path, timeout=30).json()

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except (OSError, AttributeError):
            return ""

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (a clean stop: omlx flushes its KV hot tier to the SSD tier); SIGKILL after
        ``timeout_s``. ``stopped_clean`` says which it took."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
                self.stopped_clean = True
            except subprocess.TimeoutExpired:
                self.stopped_clean = False
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.base_path is not None and not self.keep_base_path:  # a models symlink and omlx's own files
            shutil.rmtree(self.base_path, ignore_errors=True)
            self.base_path = None

    def info(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "port": self.port, "ready_s": _r(self.ready_s),
                "blas": self.blas(), "rss_mb": self.rss_mb(), "log": str(self.log_path),
                "args": self.extra_args}


# ---------------------------------------------------------------------------------------------
# streaming client


class StreamResult(ClientStreamResult):
    """One streamed request, timed at the client: `omlx.bench.client.StreamResult` (the fields)
    with these scripts' figures. Their ``decode_tps`` spans first to last content chunk (not to
    the end of the stream), and ``summary`` keeps inter-chunk intervals.
    """

    __slots__ = ()

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first / time from first to last content chunk."""
        if len(self.chunk_times) < 2 or self.num_tokens < 2:
            return None
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (self.num_tokens - 1) / span if span > 0 else None

    @property
    def itl_s(self) -> list[float]:
        """Intervals between content chunks (one token each, except where a chunk held several)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def summary(self, keep_times: bool = False) -> dict[str, Any]:
        d = {
            "ok": self.ok, "error": self.error, "ttft_s": _r(self.ttft_s), "total_s": _r(self.total_s),
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.num_tokens, "token_count_source": self.token_count_source,
            "content_chunks": self.num_content_chunks,
            "finish_reason": self.finish_reason, "decode_tps": _r(self.decode_tps, 2),
        }
        itl = self.itl_s
        if itl:
            d["itl_median_ms"] = _r(statistics.median(itl) * 1e3, 2)
            d["itl_max_ms"] = _r(max(itl) * 1e3, 2)
        if keep_times:
            d["chunk_times_ms"] = [round(t * 1e3, 1) for t in self.chunk_times]
        return d


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def chat_body(server: Server, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if server.model_name:
        body["model"] = server.model_name
    return body


def completion_body(server: Server, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}
    if server.model_name:
        body["model"] = server.model_name
    return body


async def _stream(client: Any, url: str, body: dict[str, Any], chat: bool) -> StreamResult:
    from httpx_sse import aconnect_sse

    res = StreamResult()
    t0 = time.perf_counter()
    res.t_send = t0
    finish_t: float | None = None
    try:
        # httpx-sse does the SSE framing (omlx's keep-alive comments are skipped); an error status
        # is read as a body first, before it could raise SSEError for a JSON content type.
        async with aconnect_sse(client, "POST", url, json=body) as source:
            resp = source.response
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:500]
                return res
            async for event in source.aiter_sse():
                now = time.perf_counter() - t0  # an event is complete when its blank line arrives
                if not event.data:
                    continue
                if event.data == "[DONE]":
                    break
                obj = event.json()
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    res.token_count_source = "usage"
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        res.chunk_times.append(now)
                        res.num_content_chunks += 1
                        res.text += text
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                        finish_t = now
        res.total_s = time.perf_counter() - t0
        # TTFT: the first chunk with text; a reply whose only token has no text (rare) falls back
        # to the chunk carrying finish_reason.
        res.ttft_s = res.chunk_times[0] if res.chunk_times else finish_t
        res.ok = res.ttft_s is not None
        if not res.ok:
            res.error = "no content and no finish_reason in the stream"
    except Exception as e:  # reported, never raised: a benchmark keeps going
        res.error = f"{type(e).__name__}: {e}"
        res.total_s = time.perf_counter() - t0
    return res


def _client(n: int = 1) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0),
                             limits=httpx.Limits(max_connections=max(8, 2 * n), max_keepalive_connections=0))


async def _run_streams(server: Server, bodies: list[dict[str, Any]], chat: bool) -> tuple[list[StreamResult], float]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with _client(len(bodies)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_stream(client, server.url + path, b, chat) for b in bodies])
        wall = time.perf_counter() - t0
    return list(results), wall


def run_streams(server: Server, bodies: list[dict[str, Any]], chat: bool = True) -> tuple[list[StreamResult], float]:
    """Send all ``bodies`` at once (one connection each); returns results and wall seconds."""
    return asyncio.run(_run_streams(server, bodies, chat))


def stream_chat(server: Server, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> StreamResult:
    (r,), _ = run_streams(server, [chat_body(server, messages, max_tokens, **extra)], chat=True)
    return r


def stream_completion(server: Server, prompt: str, max_tokens: int, **extra: Any) -> StreamResult:
    (r,), _ = run_streams(server, [completion_body(server, prompt, max_tokens, **extra)], chat=False)
    return r


# ---------------------------------------------------------------------------------------------
# prompts

# The seeded text of `omlx bench` (one word list and topic list for every benchmark).
from omlx.bench.prompts import TOPICS, WORDS  # noqa: E402,F401
from omlx.bench.prompts import line as _line  # noqa: E402


class Prompts:
    """Seeded prompt text whose lengths are counted with the model's own tokenizer.

    Args:
        model_dir: the mlx-lm folder (holds tokenizer.json, tokenizer_config.json and the template).
    """

    def __init__(self, model_dir: Path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        """What a server's /v1/completions does with a text prompt (tokenizer.encode)."""
        return list(self.tokenizer.encode(text))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the chat template applied with the generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def reply_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def line(rng: random.Random, tag: str = "") -> str:
        return _line(rng, tag)

    def lines(self, seed: int | str, num_tokens: int, tag: str = "") -> list[str]:
        """Lines of text (joined by "\\n") of at most ``num_tokens`` tokens, within a word of it.

        The first word depends on the seed, so two seeds share (almost) no token prefix.
        """
        rng = random.Random(f"omlx-bench:{seed}")
        out: list[str] = []
        est = 0
        while est < num_tokens:
            ln = self.line(rng, tag)
            out.append(ln)
            est += self.count(ln) + 1
        while out:
            n = self.count("\n".join(out))
            if n <= num_tokens:
                break
            words = out[-1].split(" ")
            if len(words) <= 1:
                out.pop()
            else:
                out[-1] = " ".join(words[:-1])
        return out

    def text(self, seed: int | str, num_tokens: int) -> str:
        return "\n".join(self.lines(seed, num_tokens))

    def words(self, seed: int | str, num_tokens: int) -> str:
        """One line of words (a short suffix or chat message) of about ``num_tokens`` tokens."""
        rng = random.Random(f"omlx-bench-words:{seed}")
        words: list[str] = []
        while self.count(" ".join(words)) < num_tokens:
            words.append(rng.choice(WORDS))
        return " ".join(words[:-1] if self.count(" ".join(words)) > num_tokens else words)

    def essay_messages(self, seed: int) -> list[dict[str, str]]:
        """A short chat request that makes the model write at length (for decode figures)."""
        rng = random.Random(f"omlx-bench-essay:{seed}")
        topic = TOPICS[seed % len(TOPICS)]
        extra = " ".join(rng.choice(WORDS) for _ in range(4))
        return [{"role": "user", "content": f"Write a long, detailed essay about {topic}. "
                                            f"Cover many aspects in depth (keywords: {extra})."}]


def long_case(prompts: Prompts, rep: int, num_tokens: int, suffix_tokens: int = 40) -> dict[str, str]:
    """The ~``num_tokens``-token prompt of the prefix-cache benchmarks (lines of words, seed ``long-{rep}``).

    Returns:
        ``{"cold", "identical", "suffix", "changed"}`` -> prompt text: the prompt twice, the
        prompt plus ``\nQuestion: ...?`` of about ``suffix_tokens`` tokens, and the prompt
        with its middle line replaced.
    """
    lines = prompts.lines(f"long-{rep}", num_tokens)
    base = "\n".join(lines)
    suffix = "\nQuestion: " + prompts.words(f"suffix-{rep}", suffix_tokens - 3) + "?"
    changed = list(lines)
    changed[len(changed) // 2] = Prompts.line(random.Random(f"edit-long-{rep}"))
    return {"cold": base, "identical": base, "suffix": base + suffix, "changed": "\n".join(changed)}


@dataclass
class AgentTrace:
    """The agent trace of the prefix-cache benchmarks: a system prompt and one user message per turn.

    At turn ``edit_turn`` (1-based; 0 or a turn past the end: never) a line in the middle of
    the user message ``edit_index`` (an earlier turn's) is replaced by ``edited``, as an agent
    that rewrites a file it showed before. Replies come from the server under test, so each
    server's history holds its own replies.
    """

    system: str
    users: list[list[str]]
    edit_turn: int
    edit_index: int
    edited: list[str]

    @classmethod
    def build(cls, prompts: Prompts, rep: int, system_tokens: int, turn_tokens: int, num_turns: int,
              edit_turn: int) -> "AgentTrace":
        """Seeded texts (``trace-sys-{rep}``, ``trace-{rep}-turn-{k}``): ~``system_tokens`` of
        system prompt, ~``turn_tokens`` per user message."""
        system = "\n".join(prompts.lines(f"trace-sys-{rep}", system_tokens, tag=""))
        users = [prompts.lines(f"trace-{rep}-turn-{k}", turn_tokens) for k in range(num_turns)]
        edit_index = max(0, edit_turn // 2 - 1)
        edited = list(users[edit_index])
        edited[len(edited) // 2] = Prompts.line(random.Random(f"trace-edit-{rep}"))
        return cls(system, users, edit_turn, edit_index, edited)

    def start(self) -> list[dict[str, Any]]:
        """The history before turn 1: the system message."""
        return [{"role": "system", "content": self.system}]

    def next_turn(self, msgs: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
        """Append turn ``turn``'s (0-based) user message to ``msgs`` (in place, edit applied); returns it.

        The caller appends the server's reply as ``{"role": "assistant", ...}`` afterwards.
        """
        if turn + 1 == self.edit_turn:
            msgs[1 + 2 * self.edit_index] = {"role": "user", "content": "\n".join(self.edited)}
        msgs.append({"role": "user", "content": "\n".join(self.users[turn])})
        return msgs


class Trie:
    """Every token sequence a server could have kept (prompt + generated tokens).

    ``add`` returns how many tokens were new; ``match`` the longest prefix already present;
    ``size`` counts the unique tokens.
    """

    def __init__(self) -> None:
        self.root: dict[Any, Any] = {}
        self.size = 0

    def add(self, seq: list[Any]) -> int:
        node, new = self.root, 0
        for t in seq:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                new += 1
            node = nxt
        self.size += new
        return new

    def match(self, seq: list[Any]) -> int:
        node, n = self.root, 0
        for t in seq:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n


def served_tokens(prompts: Prompts, ids: list[int], res: StreamResult) -> list[Any]:
    """Everything a server saw for one request: the prompt ids, the generated tokens and the EOS.

    The generated tokens are re-tokenized from the reply text (a server's own ids are not
    sent); when that gives fewer than ``completion_tokens``, unique stand-ins pad it, and an
    EOS is appended when the request stopped on one (``finish_reason == "stop"``).
    """
    n = res.num_tokens
    gen: list[Any] = prompts.reply_ids(res.text)[:n]
    gen += [("gen", hash(tuple(ids)), i) for i in range(len(gen), n)]
    if res.finish_reason == "stop":
        gen.append(prompts.eos_id)
    return list(ids) + gen


def kv_bytes_per_token(model_dir: Path) -> tuple[int, dict[str, Any]]:
    """KV bytes per token from ``config.json``: 2 x layers x kv_heads x head_dim x dtype bytes.

    Returns:
        The bytes, and the factors (``layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``dtype_bytes``).
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    layers = tc["num_hidden_layers"]
    kv_heads = tc.get("num_key_value_heads", tc["num_attention_heads"])
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    nbytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    if cfg.get("quantization") and dtype == "float32":
        nbytes = 2
    return 2 * layers * kv_heads * head_dim * nbytes, {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                                                       "dtype": dtype, "dtype_bytes": nbytes}


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---------------------------------------------------------------------------------------------
# statistics and reports


from omlx.bench.report import summarize  # noqa: E402  (median/min/max/n, shared with omlx bench)


def med(values: Iterable[float | None]) -> float | None:
    return summarize(values)["median"]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: Any, unit: str = "", nd: int | None = None) -> str:
    if x is None:
        return "-"
    if isinstance(x, dict):  # a summarize() result
        if x.get("median") is None:
            return "-"
        m, lo, hi, n = x["median"], x["min"], x["max"], x["n"]
        s = fmt(m, unit, nd)
        return s if n <= 1 else f"{s} [{fmt(lo, '', nd)}-{fmt(hi, '', nd)}]"
    if isinstance(x, float):
        if nd is None:
            nd = 0 if abs(x) >= 100 else (1 if abs(x) >= 10 else (2 if abs(x) >= 1 else 3))
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def ms(x: Any) -> str:
    """Seconds (or a summarize() of seconds) shown in milliseconds."""
    if isinstance(x, dict):
        if x.get("median") is None:
            return "-"
        y = {k: (v * 1e3 if isinstance(v, (int, float)) and k != "n" else v) for k, v in x.items()}
        return fmt(y, " ms")
    return "-" if x is None else fmt(x * 1e3, " ms")


@dataclass
class Target:
    name: str
    value: float | None  # the measured ratio (or figure)
    op: str  # "<=" or ">="
    threshold: float
    detail: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "N/A"
        ok = self.value <= self.threshold if self.op == "<=" else self.value >= self.threshold
        return "PASS" if ok else "MISS"


class Report:
    """Figures (rich tables) and targets (PASS/MISS), printed and written as JSON."""

    def __init__(self, name: str, args: dict[str, Any]):
        self.name = name
        self.data: dict[str, Any] = {"benchmark": name, "args": args, "machine": machine_info(), "notes": []}
        self.tables: list[tuple[str, list[str], list[list[str]]]] = []
        self.targets: list[Target] = []
        from rich.console import Console

        self.console = Console(width=max(120, int(os.environ.get("COLUMNS", "0") or 0)))
        w = busy_warning()
        if w:
            self.note(w)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        from rich.markup import escape

        self.console.print(f"[yellow]note:[/yellow] {escape(text)}")

    def log(self, text: str) -> None:
        from rich.markup import escape

        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {escape(text)}")

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.tables.append((title, columns, [[str(c) for c in r] for r in rows]))

    def target(self, name: str, value: float | None, op: str, threshold: float, detail: str = "") -> Target:
        t = Target(name, value, op, threshold, detail)
        self.targets.append(t)
        return t

    def print(self) -> None:
        from rich.markup import escape
        from rich.table import Table

        for title, cols, rows in self.tables:
            t = Table(title=escape(title), title_justify="left", show_lines=False)
            for i, c in enumerate(cols):
                t.add_column(escape(c), justify="left" if i == 0 else "right")
            for r in rows:
                t.add_row(*[escape(c) for c in r])
            self.console.print(t)
        if self.targets:
            t = Table(title="Targets", title_justify="left")
            for c in ("target", "measured", "needed", "", "detail"):
                t.add_column(c, justify="left" if c in ("target", "detail") else "right")
            for x in self.targets:
                color = {"PASS": "green", "MISS": "red"}.get(x.status, "yellow")
                t.add_row(escape(x.name), fmt(x.value, "x", 2), f"{x.op} {x.threshold:g}x",
                          f"[{color}]{x.status}[/{color}]", escape(x.detail))
            self.console.print(t)

    def write(self, out_dir: Path = RESULTS_DIR, tag: str = "") -> Path:
        self.data["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        self.data["tables"] = [{"title": t, "columns": c, "rows": r} for t, c, r in self.tables]
        self.data["targets"] = [{**asdict(t), "status": t.status} for t in self.targets]
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = out_dir / f"{self.name}{('-' + tag) if tag else ''}-{stamp}.json"
        path.write_text(json.dumps(self.data, indent=1, default=_json_default) + "\n")
        self.console.print(f"results written to {path}")
        return path


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "summary"):
        return o.summary()
    return str(o)


# ---------------------------------------------------------------------------------------------
# mlx-lm in-process (child process, no HTTP)


def run_inprocess(model_dir: Path, tasks: list[dict[str, Any]], log_dir: Path | None = None,
                  prefill_step_size: int = 2048, timeout_s: float = 1800) -> dict[str, Any]:
    """Run mlx-lm in a child process with the OpenBLAS preload; returns its JSON answer.

    Tasks (each has an ``id`` and ``reps``):
        {"kind": "prefill", "context": [ids], "new": [ids]}: the context is prefilled into a
            prompt cache (untimed) and copied afresh for every repetition; the time is from
            handing ``new`` to ``mlx_lm.generate.generate_step`` with that cache to its first
            token (a cold prefill when the context is empty).
        {"kind": "decode", "prompt": [ids], "max_tokens": N}: generate_step from an empty cache;
            TTFT and the time of every token until N tokens or an EOS.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="omlx-bench-"))
    job = log_dir / "inprocess-job.json"
    out = log_dir / "inprocess-out.json"
    job.write_text(json.dumps({"model_dir": str(model_dir), "tasks": tasks, "prefill_step_size": prefill_step_size}))
    with open(log_dir / "inprocess.log", "w") as log:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "inprocess", str(job), str(out)],
                           env=blas_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=str(REPO))
    if p.returncode != 0:
        raise RuntimeError(f"in-process mlx-lm failed ({p.returncode}):\n{(log_dir / 'inprocess.log').read_text()[-4000:]}")
    return json.loads(out.read_text())


def _inprocess_main(job_path: str, out_path: str) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    job = json.loads(Path(job_path).read_text())
    step = int(job.get("prefill_step_size", 2048))
    t0 = time.perf_counter()
    model, tokenizer = load(job["model_dir"])
    load_s = time.perf_counter() - t0
    eos = set(tokenizer.eos_token_ids)

    def first_token(prompt: list[int], cache: list[Any]) -> float:
        t = time.perf_counter()
        gen = generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=cache, prefill_step_size=step)
        next(gen)
        dt = time.perf_counter() - t
        gen.close()
        mx.synchronize()
        return dt

    def context_cache(context: list[int]) -> Any:
        """Prefill ``context`` once; returns a factory of fresh caches holding it."""
        if not context:
            return lambda: make_prompt_cache(model)
        cache = make_prompt_cache(model)
        ids = mx.array(context)
        for i in range(0, len(context), step):
            model(ids[i:i + step][None], cache=cache)
            mx.eval([c.state for c in cache])
        n = len(context)
        saved = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
        mx.eval(saved)

        def fresh() -> list[Any]:
            out = []
            for k, v in saved:
                c = KVCache()
                c.state = (k, v, n)
                out.append(c)
            return out

        return fresh

    # Warm-up like a server's: a short and a mid-size prompt, untimed.
    rng = random.Random(0)
    for n in (16, 300):
        first_token([rng.randrange(1000, 20000) for _ in range(n)], make_prompt_cache(model))

    results: dict[str, Any] = {}
    for task in job["tasks"]:
        reps = int(task.get("reps", 1))
        if task["kind"] == "prefill":
            factory = context_cache(task["context"])
            times = [first_token(task["new"], factory()) for _ in range(reps)]
            results[task["id"]] = {"context_tokens": len(task["context"]), "new_tokens": len(task["new"]),
                                   "times_s": times}
        elif task["kind"] == "decode":
            runs = []
            for _ in range(reps):
                t = time.perf_counter()
                stamps: list[float] = []
                for tok, _lp in generate_step(mx.array(task["prompt"]), model, max_tokens=task["max_tokens"],
                                              prefill_step_size=step):
                    if tok in eos:
                        break
                    stamps.append(time.perf_counter() - t)
                mx.synchronize()
                n = len(stamps)
                runs.append({"ttft_s": stamps[0] if stamps else None, "tokens": n,
                             "decode_tps": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else None})
            results[task["id"]] = {"prompt_tokens": len(task["prompt"]), "runs": runs}
        else:
            raise ValueError(f"unknown task kind {task['kind']!r}")
    Path(out_path).write_text(json.dumps({"load_s": load_s, "blas": process_blas("self"),
                                          "prefill_step_size": step, "results": results}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "inprocess":
        _inprocess_main(sys.argv[2], sys.argv[3])
    else:
        print("usage: python benchmarks/common.py inprocess JOB.json OUT.json  (used by the benchmarks)")
        sys.exit(2)

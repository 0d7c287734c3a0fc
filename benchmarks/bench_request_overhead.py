"""Request overhead: from a 60 KB Claude Code ``POST /v1/messages`` body to the engine's admission.

In-process, one model (SmolLM2-135M-Instruct from ``.omlx-test/models``, loaded once through the
real `EnginePool`), no HTTP: the route handler (`omlx.api.anthropic.create_message`, with its
``holding`` decorator) is called with a stand-in for Sanic's request that carries the raw body
bytes, and the engine's ``submit`` is replaced by one that notes the time and refuses the request
(`RateLimitError`, the queue-full answer), so nothing is generated. What is timed is everything
omlx does between Sanic handing it the body and the engine admitting the request: parsing and
validating the body, resolving the model and taking its lease (a hop to the pool's thread),
mapping messages and tools, applying the model's settings, rendering the chat template,
tokenizing, clamping to the context and building the `Request`. Sanic's own HTTP parsing is the
same before and after and is not in the figure.

The body is the recorded Claude Code request ``tests/fixtures/client_requests/
claude_code__messages_stream_tool_turn1.json`` (24 tools, system blocks, thinking adaptive,
context_management, output_config, metadata) with each ``<text N chars>`` placeholder filled with
N characters of text: about 65 KB, as Claude Code sends on its first turn.

Run it against another tree with PYTHONPATH (the script itself only needs the old tree to have
`omlx.api.anthropic.create_message` and `omlx.api.app.create_app`)::

    python benchmarks/bench_request_overhead.py                       # this tree
    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base python benchmarks/bench_request_overhead.py --tag base

Figures: median, p10 and p90 of ``--reps`` (default 100) timed requests after ``--warmup``
untimed ones, in ms, and of each request the part spent in the chat template
(``apply_chat_template``) and the tokenizer (`omlx.engine.token_cache.encode`), which both trees
do alike, and the rest; the JSON goes to ``benchmarks/results/request_overhead-<tag>-<date>.json``.
``--template`` serves the same weights with another chat template: SmolLM2's own renders neither
the tools nor the system prompt's length into the prompt, the test suite's Qwen3-shaped one does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "client_requests" / "claude_code__messages_stream_tool_turn1.json"
RESULTS_DIR = REPO / "benchmarks" / "results"
_WORDS = "the quick brown fox jumps over a lazy dog while reading files and running commands".split()


def _fill(m: re.Match[str]) -> str:
    n, out, size, i = int(m.group(1)), [], 0, 0
    while size < n:
        w = _WORDS[i % len(_WORDS)]
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)[:n]


def claude_code_body(model: str) -> bytes:
    """The recorded Claude Code first turn with its texts filled in (about 65 KB), for ``model``."""
    body = json.loads(FIXTURE.read_text())["body"]
    body["model"] = model
    return re.sub(r"<text (\d+) chars>", _fill, json.dumps(body)).encode()


class _Admitted(Exception):
    pass


def _git_commit(tree: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import omlx
    from omlx.api import anthropic as anthropic_routes
    from omlx.api.app import create_app
    from omlx.config import ModelSettings, ServerConfig
    from omlx.errors import RateLimitError
    from omlx.pool import EnginePool

    home = Path(tempfile.mkdtemp(prefix="omlx-bench-overhead-"))
    (home / "models").mkdir()
    src = Path(args.models_dir).resolve() / args.model
    if args.template:  # the same weights with another chat template (as tests/integration/test_anthropic_api.py does)
        dest = home / "models" / args.model
        dest.mkdir()
        for f in src.iterdir():
            if f.name != "tokenizer_config.json":
                (dest / f.name).symlink_to(f)
        tc = json.loads((src / "tokenizer_config.json").read_text())
        tc["chat_template"] = Path(args.template).read_text()
        (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    else:
        (home / "models" / args.model).symlink_to(src)
    settings = {args.model: ModelSettings(context_length=args.context_length)} if args.context_length else {}
    cfg = ServerConfig(base_path=str(home), model_settings=settings)
    pool = EnginePool(cfg)
    model = pool.register(args.model)
    pool.preload(warmup=False)
    app = create_app(cfg, pool, {}, name="omlx_bench_overhead")
    entry = pool.entries()[0]
    admitted: list[float] = []

    def submit(request: Any, sink: Any) -> None:  # the engine's admission: note it, then refuse
        admitted.append(time.perf_counter())
        raise RateLimitError("benchmark: not generating")

    entry.engine.submit = submit
    # time spent in the chat template and the tokenizer, which both trees must do: the rest is overhead
    from omlx.engine import token_cache

    in_template: list[float] = []
    # watched on the tokenizer object, not its class: a class with an apply_chat_template of its own
    # is one that may read the tools (omlx.engine.chat.template_reads_tools)
    hf = entry.loaded.tokenizer._tokenizer
    apply, encode = hf.apply_chat_template, token_cache.encode

    def timed(f: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                in_template.append(time.perf_counter() - t)
        return call

    hf.apply_chat_template = timed(apply)
    token_cache.encode = timed(encode)
    raw = claude_code_body(model)
    handler = anthropic_routes.create_message

    async def one() -> tuple[float, float]:
        http = SimpleNamespace(app=app, body=raw, ctx=SimpleNamespace(), method="POST", path="/v1/messages",
                               headers={"anthropic-version": "2023-06-01", "content-type": "application/json"},
                               transport=None, args={}, query_string="beta=true")
        in_template.clear()
        t0 = time.perf_counter()
        try:
            await handler(http)
        except RateLimitError:
            pass
        if not admitted:
            raise RuntimeError("the request never reached the engine")
        return admitted.pop() - t0, sum(in_template)

    for _ in range(args.warmup):
        await one()
    times = [await one() for _ in range(args.reps)]
    del hf.apply_chat_template
    token_cache.encode = encode
    pool.stop()
    ms = sorted(t * 1e3 for t, _ in times)
    rest = sorted((t - r) * 1e3 for t, r in times)
    q = statistics.quantiles(ms, n=10)
    return {
        "name": "request_overhead", "tag": args.tag, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "omlx_tree": str(Path(omlx.__file__).resolve().parent.parent), "commit": _git_commit(Path(omlx.__file__).parent),
        "python": sys.version.split()[0], "body_bytes": len(raw), "model": model, "reps": args.reps, "warmup": args.warmup,
        "median_ms": round(statistics.median(ms), 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
        "min_ms": round(ms[0], 4),
        "template_tokenizer_median_ms": round(statistics.median(sorted(r * 1e3 for _, r in times)), 4),
        "outside_template_median_ms": round(statistics.median(rest), 4), "template": args.template,
        "raw_ms": [round(t * 1e3, 4) for t, _ in times], "raw_template_ms": [round(r * 1e3, 4) for _, r in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--models-dir", default=str(REPO / ".omlx-test" / "models"))
    ap.add_argument("--template", default=None,
                    help="a chat template file to serve the model with (e.g. tests/fixtures/chat_templates/"
                         "chatml_tools_thinking.jinja, which renders Claude Code's 24 tools into the prompt)")
    ap.add_argument("--context-length", type=int, default=None,
                    help="the model's context_length setting (the tools template renders the body into ~13,300 "
                         "tokens, more than SmolLM2's 8192; nothing is generated, so any value that fits will do)")
    ap.add_argument("--tag", default="this-tree")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()
    res = asyncio.run(_run(args))
    print(f"{res['tag']} ({res['commit']}): {res['body_bytes']} B body, median {res['median_ms']:.3f} ms "
          f"(p10 {res['p10_ms']:.3f}, p90 {res['p90_ms']:.3f}) over {res['reps']} requests; chat template + "
          f"tokenizer {res['template_tokenizer_median_ms']:.3f} ms, the rest {res['outside_template_median_ms']:.3f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"request_overhead-{res['tag']}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(res, indent=1))
    print(path)


if __name__ == "__main__":
    main()

"""The real Claude Code's default first prompt (~18.7k tokens) against omlx on Qwen2.5-Coder-0.5B: times (issue 27).

Runs the three sessions of `tests/claude_sessions.py` (A: nothing cached; B: a new process, the
system prompt and tools from the hot tier; C: after a server restart, from the SSD tier) in a
loopback-only namespace, and prints one row per session: wall time of ``claude -p``, its
requests in ``/v1/admin/recent`` (outcome, prompt / cached / prefilled tokens, TTFT). The same
sessions, with assertions instead of figures, are the slow test
`tests/integration/test_claude_code_long_prompt.py`. Needs root, the real Claude Code
(scripts/setup.sh) and the Qwen wheels (tests/helpers.py `qwen_model_dir`). Session A takes
minutes on a CPU; the figures depend on the machine's load, so the README states both.

Usage: python benchmarks/bench_claude_long_prompt.py [--out benchmarks/results/claude-long-prompt-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.claude_sessions import run_sessions  # noqa: E402


def summary(result: dict) -> list[dict]:
    """One row per session: wall_s, num_requests, outcomes, and for its answering (last) request
    num_prompt_tokens, num_cached_tokens, ttft_s; num_prefilled_tokens summed over all its requests."""
    rows = []
    for s in result["sessions"]:
        recs = s["records"]
        last = recs[-1] if recs else {}
        first = recs[0] if recs else {}
        rows.append({
            "session": s["name"], "rc": s["rc"], "wall_s": s["wall_s"], "num_requests": len(recs),
            "outcomes": [r["outcome"] for r in recs],
            "first_prompt_tokens": first.get("num_prompt_tokens"), "first_cached_tokens": first.get("num_cached_tokens"),
            "first_cached_tokens_cold": first.get("num_cached_tokens_cold"),
            "first_ttft_s": None if first.get("ttft_ms") is None else round(first["ttft_ms"] / 1e3, 2),
            "sum_prefilled_tokens": sum(r["num_prefilled_tokens"] for r in recs),
            "last_ttft_s": None if last.get("ttft_ms") is None else round(last["ttft_ms"] / 1e3, 2),
            "answer": (s.get("result") or {}).get("result"),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / f"claude-long-prompt-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    ap.add_argument("--session-timeout-s", type=float, default=3600)
    a = ap.parse_args()
    raw = Path(a.out).with_suffix(".raw.json")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    result = run_sessions(raw, session_timeout_s=a.session_timeout_s, timeout_s=3 * a.session_timeout_s + 1200)
    rows = summary(result)
    Path(a.out).write_text(json.dumps({"started": started, "machine": f"{platform.machine()} {platform.node()}",
                                       "sessions": rows}, indent=1))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

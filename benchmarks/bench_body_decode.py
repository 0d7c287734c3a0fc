"""Decoding and validating a 60 KB Claude Code body: pydantic (omlx's request models) vs msgspec.

The measurement behind the choice of pydantic for `omlx.api.bodies` (issue 20). The body is
bench_request_overhead.py's (the recorded Claude Code first turn, texts filled in: 65 KB). The
msgspec side is an equivalent ``Struct`` decoder for the same fields (no cross-field rules, no
custom messages), written here; msgspec is not an omlx dependency::

    pip install --target /tmp/msgspec msgspec
    PYTHONPATH=/tmp/msgspec python benchmarks/bench_body_decode.py

Prints the median of ``--reps`` calls of each, in ms (without msgspec importable, its rows are
left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal, Union

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pydantic_core  # noqa: E402

from bench_request_overhead import claude_code_body  # noqa: E402
from omlx.api.bodies.anthropic import MessagesRequest  # noqa: E402


def _median_ms(f: Callable[[], Any], reps: int) -> float:
    for _ in range(30):
        f()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


try:  # the same fields as MessagesRequest, as msgspec Structs (module level: the annotations are strings)
    import msgspec

    class MThinking(msgspec.Struct):
        type: Literal["enabled", "adaptive", "disabled"]
        budget_tokens: int | None = None

    class MTool(msgspec.Struct):
        name: str
        type: str | None = None
        description: str | None = None
        input_schema: dict[str, Any] | None = None
        strict: bool | None = None

    class MMessage(msgspec.Struct):
        role: Literal["user", "assistant", "system"]
        content: Union[str, list[dict[str, Any]]]

    class MToolChoice(msgspec.Struct):
        type: Literal["auto", "any", "tool", "none"]
        name: str | None = None
        disable_parallel_tool_use: bool | None = None

    class MMessages(msgspec.Struct):
        model: str
        max_tokens: int
        messages: list[MMessage]
        system: Union[str, list[dict[str, Any]], None] = None
        tools: list[MTool] | None = None
        tool_choice: MToolChoice | None = None
        thinking: MThinking | None = None
        stream: bool = False
        stop_sequences: list[str] | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        metadata: dict[str, Any] | None = None
except ImportError:
    msgspec = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    raw = claude_code_body("SmolLM2-135M-Instruct")
    rows: list[tuple[str, Callable[[], Any]]] = [
        ("json.loads (stdlib, no validation)", lambda: json.loads(raw)),
        ("pydantic_core.from_json (no validation)", lambda: pydantic_core.from_json(raw)),
        ("pydantic MessagesRequest.model_validate_json", lambda: MessagesRequest.model_validate_json(raw)),
        ("pydantic from_json + model_validate (omlx's parse_body)",
         lambda: MessagesRequest.model_validate(pydantic_core.from_json(raw))),
    ]
    if msgspec is not None:
        dec = msgspec.json.Decoder(MMessages)
        rows += [("msgspec.json.decode (no validation)", lambda: msgspec.json.decode(raw)),
                 ("msgspec Struct decode + validate", lambda: dec.decode(raw))]
    else:
        print("msgspec is not importable: its rows are left out")
    print(f"{len(raw)} B body, median of {args.reps}:")
    for name, f in rows:
        print(f"{_median_ms(f, args.reps):8.4f} ms  {name}")


if __name__ == "__main__":
    main()

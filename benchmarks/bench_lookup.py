"""Prompt-lookup speculative decoding, in-process: the ``edit`` scenario with drafting on and off.

Scenarios: ``edit`` (a source file goes in the prompt and the model is asked to return it with
one change: output repeats input), ``chat`` (a short question answered in prose: little to look
up, so speculation should switch itself off and cost at most a few percent) and ``batch`` (four
edits with different renames decoded together in one merged batch: every row's draft verified
in one forward pass). For each, greedy decode tokens/s (all rows together) of omlx's `BatchRunner` with ``num_draft_tokens`` = 0 (off) and K, the tokens
checked equal, and the acceptance counters. Default model: the test model (SmolLM2-135M-Instruct).

Measured (README, Measured performance): H200, SmolLM2-135M float32, 300 tokens, edit 1.34x at
K=6 and 1.56x at K=10, chat 0.94x (noise: 4 verify steps, then off); 2-core CPU, edit 0.77x.

    .venv/bin/python benchmarks/bench_lookup.py [--model DIR] [--scenario edit|chat|batch|all] [--draft 6]
        [--max-tokens 200] [--reps 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ensure_model_dir  # noqa: E402
from omlx.engine.runner import BatchRunner  # noqa: E402
from omlx.kernels.status import gpu_backend  # noqa: E402


def edit_prompt(tokenizer, old: str = "draft", new: str = "guess") -> list[int]:
    import omlx.engine.lookup as source

    code = inspect.getsource(source.PromptLookup.propose)
    msg = ("Here is a Python function:\n\n```python\n" + code + "```\n\nReturn the whole function "
           f"unchanged except that the variable `{old}` is renamed to `{new}`. Reply with the code only.")
    return tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)


#: The ``batch`` scenario's concurrent requests: the edit with four different renames.
BATCH_RENAMES = [("draft", "guess"), ("history", "seen"), ("tail", "suffix"), ("length", "size")]


def chat_prompt(tokenizer) -> list[int]:
    msg = "Why is the sky blue? Answer in a few paragraphs for a curious child."
    return tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)


SCENARIOS = {"edit": edit_prompt, "chat": chat_prompt}


def run(model, prompts: list[list[int]], eos: list[int], draft: int,
        max_tokens: int, pad_shapes: bool) -> tuple[list[list[int]], float, BatchRunner]:
    """Decode ``prompts`` together (inserted at once); returns each one's tokens, the decode
    tokens/s of all of them together (from the first token to the last, first tokens excluded),
    and the runner (its draft counters)."""
    runner = BatchRunner(model, stop_tokens=[(t,) for t in eos], prefill_step_size=2048, block_size=256,
                         num_draft_tokens=draft, pad_shapes=pad_shapes)
    uids = runner.insert_segments([[p] for p in prompts], max_tokens=[max_tokens] * len(prompts))
    toks: dict[int, list[int]] = {u: [] for u in uids}
    t_first = None
    while len(runner):
        _, gen = runner.next()
        for r in gen:
            if t_first is None:
                t_first = time.perf_counter()
            toks[r.uid].append(r.token)
    dt = time.perf_counter() - t_first  # decode time after the first token
    n = sum(len(t) for t in toks.values()) - len(prompts)
    return [toks[u] for u in uids], n / dt, runner


def measure(model, tok, prompts: list[list[int]], draft: int, max_tokens: int, reps: int, pad_shapes: bool) -> dict:
    """One scenario: ``reps`` alternating off/on pairs; the speed ratio on/off and acceptance."""
    rows = []
    for rep in range(reps):
        for k in (0, draft) if rep % 2 == 0 else (draft, 0):
            toks, tps, r = run(model, prompts, list(tok.eos_token_ids), k, max_tokens, pad_shapes)
            rows.append({"draft": k, "tokens": sum(len(t) for t in toks), "decode_tok_s": round(tps, 2), "ids": toks,
                         "verify_steps": r.num_spec_steps, "drafted": r.num_drafted_tokens,
                         "accepted": r.num_accepted_tokens})
    off = [r for r in rows if r["draft"] == 0]
    on = [r for r in rows if r["draft"] == draft]
    return {"prompt_tokens": [len(p) for p in prompts], "tokens_equal": all(r["ids"] == off[0]["ids"] for r in rows),
            "first_difference": [first_difference(r["ids"], off[0]["ids"]) for r in rows],
            "speedup": round(sum(r["decode_tok_s"] for r in on) / sum(r["decode_tok_s"] for r in off), 2),
            "acceptance": round(on[0]["accepted"] / max(1, on[0]["drafted"]), 3),
            "tokens_per_verify_step": round(on[0]["accepted"] / max(1, on[0]["verify_steps"]) + 1, 2),
            "runs": [{k: v for k, v in r.items() if k != "ids"} for r in rows]}


def first_difference(ids: list[list[int]], ref: list[list[int]]) -> list[int | None]:
    """Per sequence, the index of the first token where ``ids`` differs from ``ref`` (None: equal)."""
    out: list[int | None] = []
    for a, b in zip(ids, ref):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out.append(i if i is not None or len(a) == len(b) else min(len(a), len(b)))
    return out


def scenario_prompts(name: str, tok) -> list[list[int]]:
    """The prompts of scenario ``name`` (``batch``: the edit with each of `BATCH_RENAMES`, decoded
    together; the others one prompt)."""
    if name == "batch":
        return [edit_prompt(tok, old, new) for old, new in BATCH_RENAMES]
    return [SCENARIOS[name](tok)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--scenario", choices=[*SCENARIOS, "batch", "all"], default="all")
    ap.add_argument("--draft", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pad-shapes", choices=["auto", "on", "off"], default="auto",
                    help="repeating verify shapes (auto: on for CUDA, as the engine does)")
    a = ap.parse_args()
    # auto: as the engine sets it (`omlx.engine.factory`), repeating attention shapes on CUDA
    pad_shapes = gpu_backend() == "cuda" if a.pad_shapes == "auto" else a.pad_shapes == "on"
    path = str(ensure_model_dir(Path(a.model) if a.model else None))
    model, tok = load(path)
    names = [*SCENARIOS, "batch"] if a.scenario == "all" else [a.scenario]
    for n in names:  # warm-up of both paths: a device may compile kernels for each new shape
        for k in (0, a.draft):
            run(model, scenario_prompts(n, tok), list(tok.eos_token_ids), k, 48, pad_shapes)
    summary = {"model": path, "device": str(mx.default_device()), "machine": platform.machine(), "pad_shapes": pad_shapes,
               "mlx": mx.__version__, "draft": a.draft, "max_tokens": a.max_tokens,
               "scenarios": {n: measure(model, tok, scenario_prompts(n, tok), a.draft, a.max_tokens, a.reps, pad_shapes)
                             for n in names},
               "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

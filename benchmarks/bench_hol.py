"""Head-of-line blocking: short turns on cached conversations while long fresh prompts prefill.

The scenario of a fresh user's report (2026-12-04, 2 CPU cores): 8 agents chat on their own
cached conversations while 2 other clients send long first prompts; 3-4 of the 8 short turns
stalled 35-41 s, each waiting for a long prefill it shares nothing with.

One ``omlx serve`` (``--max-concurrent-requests`` = streams + long prompts, so nothing waits in
the scheduler's queue; the rest are the defaults) on the embedded SmolLM2-135M-Instruct unless
``--model`` names another folder. Per repetition:

1. **prime**: ``--streams`` conversations, each a system prompt of ~``--system-tokens`` random
   words (its own seed) and a question, sent at once; the replies become their history.
2. **alone**: a short new user message (~``--turn-tokens``) on every conversation, sent at once
   and nothing else: the TTFT a turn gets when no long prefill runs.
3. **during**: ``--long`` never-seen prompts of ~``--long-tokens`` tokens (completions, random
   words) and one more short message on every conversation, all sent at once (the long ones
   first).

Figures: TTFT of the turns alone and during (median, max), TTFT of the long prompts, the turns'
``cached_tokens``. Targets: every turn during the long prefills gets its first token before the
first long prompt does (no turn waits for a long prefill), and the median turn TTFT during is
within 3x of the median alone. Greedy, ``--max-tokens`` tokens per reply.
Writes ``benchmarks/results/hol-<time>.json``.

    python benchmarks/bench_hol.py                 # 8 turns + 2 x 1,700-token prompts, 2 repeats
    python benchmarks/bench_hol.py --model /tmp/model-3b --long-tokens 8000 --repeats 3   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common as C  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="mlx-lm model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--streams", type=int, default=8, help="cached conversations taking a short turn")
    p.add_argument("--long", type=int, default=2, help="long never-seen prompts sent with the turns (0: the turns alone only)")
    p.add_argument("--long-tokens", type=int, default=1700)
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--omlx-arg", action="append", default=[], help="extra omlx serve argument (repeat)")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    return p.parse_args()


def _turn(prompts: C.Prompts, history: list[dict[str, str]], seed: str, n: int) -> list[dict[str, str]]:
    return history + [{"role": "user", "content": prompts.words(seed, n)}]


def _ttfts(results: list[C.StreamResult]) -> list[float]:
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[:3]}")
    return [r.ttft_s for r in results]


def main() -> int:
    a = parse_args()
    model_dir = C.ensure_model_dir(a.model)
    prompts = C.Prompts(model_dir)
    rep = C.Report("hol", vars(a) | {"model": str(model_dir)})
    server = C.Server("omlx", model_dir, ["--max-concurrent-requests", str(a.streams + a.long), *a.omlx_arg]).start()
    rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    try:
        server.wait_idle()
        for r in range(a.repeats):
            tag = f"r{r}"
            convs = [[{"role": "system", "content": prompts.text(f"hol-sys-{tag}-{i}", a.system_tokens)},
                      {"role": "user", "content": prompts.words(f"hol-q-{tag}-{i}", a.turn_tokens)}]
                     for i in range(a.streams)]
            rep.log(f"{tag}: prime {a.streams} conversations")
            primed, _ = C.run_streams(server, [C.chat_body(server, m, a.max_tokens) for m in convs])
            _ttfts(primed)
            convs = [m + [{"role": "assistant", "content": p.text}] for m, p in zip(convs, primed)]
            rep.log(f"{tag}: {a.streams} turns alone")
            alone_msgs = [_turn(prompts, m, f"hol-t1-{tag}-{i}", a.turn_tokens) for i, m in enumerate(convs)]
            alone, _ = C.run_streams(server, [C.chat_body(server, m, a.max_tokens) for m in alone_msgs])
            t_alone = _ttfts(alone)
            convs = [m + [{"role": "assistant", "content": p.text}] for m, p in zip(alone_msgs, alone)]
            if not a.long:  # --long 0: the turns alone only (a diagnostic of the turns' own cost)
                runs.append({"alone_ttft_s": t_alone})
                rows.append([tag, C.ms(C.med(t_alone)), C.ms(max(t_alone)), "-", "-", "-", "-"])
                rep.log(f"{tag}: turns alone {C.ms(C.med(t_alone))} median, {C.ms(max(t_alone))} max")
                continue
            rep.log(f"{tag}: {a.long} long prompts of ~{a.long_tokens} tokens + {a.streams} turns at once")
            long_bodies = [C.completion_body(server, prompts.text(f"hol-long-{tag}-{j}", a.long_tokens), a.max_tokens)
                           for j in range(a.long)]
            turn_bodies = [C.chat_body(server, _turn(prompts, m, f"hol-t2-{tag}-{i}", a.turn_tokens), a.max_tokens)
                           for i, m in enumerate(convs)]
            # completions for the long prompts, chat for the turns, in one event loop
            async def both() -> tuple[list[C.StreamResult], list[C.StreamResult]]:
                async with C._client(len(long_bodies) + len(turn_bodies)) as client:
                    longs = [asyncio.ensure_future(C._stream(client, server.url + "/v1/completions", b, False))
                             for b in long_bodies]
                    await asyncio.sleep(0.05)  # the long prompts arrive first
                    turns = [asyncio.ensure_future(C._stream(client, server.url + "/v1/chat/completions", b, True))
                             for b in turn_bodies]
                    return list(await asyncio.gather(*longs)), list(await asyncio.gather(*turns))

            longs, during = asyncio.run(both())
            t_long = _ttfts(longs)
            t_during = [t - 0.05 for t in _ttfts(during)]  # from the turn's own send
            run = {"alone_ttft_s": t_alone, "during_ttft_s": t_during, "long_ttft_s": t_long,
                   "long_prompt_tokens": [x.prompt_tokens for x in longs],
                   "turn_prompt_tokens": [x.prompt_tokens for x in during],
                   "turn_cached_tokens": [x.cached_tokens for x in during]}
            runs.append(run)
            rows.append([tag, C.ms(C.med(t_alone)), C.ms(max(t_alone)), C.ms(C.med(t_during)), C.ms(max(t_during)),
                         " / ".join(C.ms(t) for t in t_long), f"{C.med(run['turn_cached_tokens'])}/{C.med(run['turn_prompt_tokens'])}"])
            rep.log(f"{tag}: turns alone {C.ms(C.med(t_alone))} median, during {C.ms(C.med(t_during))} median, "
                    f"{C.ms(max(t_during))} max; long {[C.ms(t) for t in t_long]}")
    finally:
        server.stop()
    rep.data["runs"] = runs
    rep.table(f"TTFT of {a.streams} short turns on cached conversations, alone and beside {a.long} long "
              f"prompts (~{a.long_tokens} tokens)",
              ["repeat", "alone median", "alone max", "during median", "during max", "long prompts", "turn cached/prompt (median)"],
              rows)
    if not a.long:
        rep.print()
        rep.write(tag=a.tag)
        return 0
    worst_turn = max(max(x["during_ttft_s"]) for x in runs)
    first_long = min(min(x["long_ttft_s"]) for x in runs)
    rep.target("slowest turn during / first long prompt's TTFT", C.ratio(worst_turn, first_long), "<=", 1.0,
               "every turn starts before a long prompt's first token")
    rep.target("median turn TTFT during / alone",
               C.ratio(C.med(t for x in runs for t in x["during_ttft_s"]), C.med(t for x in runs for t in x["alone_ttft_s"])),
               "<=", 3.0)
    rep.print()
    rep.write(tag=a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())

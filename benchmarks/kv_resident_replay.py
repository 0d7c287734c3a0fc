"""Resident hot-tier KV against the ideal, replayed in-process (no timing, so load does not matter).

Replays the prefix-cache benchmark's workload (warm-up chat; long prompt cold, identical, plus a
suffix, middle line changed; two short chats twice; the 8-turn agent trace with an edit at turn
5) through one omlx engine with greedy decoding, then compares the tokens held in hot blocks
with the unique tokens that have KV (a trie over every prompt + generated tokens but the last).
Prints each block (full or tail, index, tokens, most tokens shared with a sibling) and the ratio;
the issue's target is <= 1.05x.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/kv_resident_replay.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.common as C  # noqa: E402
from omlx.cache.paged import common_prefix_len  # noqa: E402
from omlx.cli.common import config_from  # noqa: E402
from omlx.config import ModelSettings  # noqa: E402
from omlx.engine.factory import load_chat_model  # noqa: E402
from omlx.request import Request, SamplingParams, TextDelta  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~1,000-token prompt, 600-token system prompt, 12-token replies")
    p.add_argument("--model-dir", type=Path, default=None)
    a = p.parse_args()
    prompt_tokens, system_tokens, turn_tokens, reply = (1000, 600, 100, 12) if a.quick else (4000, 2000, 300, 64)
    md = C.ensure_model_dir(a.model_dir)
    entry = load_chat_model("m", md, ModelSettings(), config_from({"cache.ssd_enabled": False, "base_path": tempfile.mkdtemp(prefix="omlx-replay-")}, None), warmup=False)
    engine, tok, P = entry.engine, entry.loaded.tokenizer, C.Prompts(md)
    sequences: list[list[int]] = []

    def run(ids: list[int], n: int) -> list[int]:
        evs = engine.run_sync(Request("m", list(ids), SamplingParams(max_tokens=n, temperature=0.0)))
        gen = [t for ev in evs if isinstance(ev, TextDelta) for t in ev.token_ids]
        sequences.append(list(ids) + gen)
        return gen

    try:
        run(P.chat_ids([{"role": "user", "content": "Say hello."}]), 4)
        case = C.long_case(P, 0, prompt_tokens, 40)
        for name in ("cold", "identical", "suffix", "changed"):
            run(P.encode(case[name]), 1)
        for r in range(2):
            sys_msg = {"role": "system", "content": "You are " + P.words(f"short-sys-{r}", 8) + "."}
            q = P.words(f"short-q-{r}", max(4, 50 - 16 - len(P.chat_ids([sys_msg]))))
            msgs = [sys_msg, {"role": "user", "content": q[0].upper() + q[1:] + "?"}]
            run(P.chat_ids(msgs), 8)
            run(P.chat_ids(msgs), 8)
        trace = C.AgentTrace.build(P, 0, system_tokens, turn_tokens, 8, 5)
        msgs = trace.start()
        for k in range(8):
            trace.next_turn(msgs, k)
            msgs.append({"role": "assistant", "content": tok.decode(run(P.chat_ids(msgs), reply))})
        pool = engine.prefix_cache.pool  # type: ignore[union-attr]
        trie = C.Trie()
        for s in sequences:
            trie.add(s[:-1])  # the last generated token is never fed back: no KV
        held = 0
        for b in sorted(pool.blocks(), key=lambda b: b.block_id):
            sibs = [s for s in pool._children.get(b.parent_hash, {}).values() if s is not b]
            shared = max((common_prefix_len(b.token_ids, s.token_ids) for s in sibs), default=0)
            held += len(b.token_ids)
            print(f"block {b.block_id:3d} {'tail' if b.is_tail else 'full'} index {b.block_index:2d} "
                  f"tokens {len(b.token_ids):3d} shared with a sibling {shared}")
        st = pool.stats()
        print(f"tokens in blocks {held}, unique tokens with KV {trie.size}: {held / trie.size:.3f}x "
              f"({st.num_full_blocks} full, {st.num_tails} tails, {st.num_dropped_tails} tails dropped)")
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

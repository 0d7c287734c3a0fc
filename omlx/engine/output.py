"""Turning sampled token ids into output text: streaming detokenization, stop strings, logprobs.

One `OutputState` per request. It never emits a partial UTF-8 code point (mlx-lm's streaming
detokenizer holds those back) and never emits text that could still turn out to be the start of
a stop string; a matched stop string and everything after it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from omlx.request import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed (char -> byte). Source: openai/gpt-2 encoder.py."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes of one token (byte-level BPE vocab pieces, or decoded text otherwise)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    dec = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in dec for ch in piece):
        return bytes(dec[ch] for ch in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


def _held_suffix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass(slots=True)
class OutputState:
    """Streaming text state of one request.

    Attributes:
        detokenizer: a per-request copy of mlx-lm's streaming detokenizer.
        stops: stop strings.
        pending: text decoded but not yet emitted (could start a stop string).
        pending_ids, pending_logprobs: tokens (and logprobs) not yet attached to an emitted delta.
    """

    detokenizer: object
    stops: tuple[str, ...]
    pending: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    matched_stop: str | None = None

    def add(self, token_id: int, logprob: TokenLogprob | None) -> str:
        """Feed one sampled token; returns the text now safe to emit ('' if held back)."""
        self.detokenizer.add_token(token_id)
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        self.pending += self.detokenizer.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        """Flush the detokenizer; returns the remaining text (minus any stop string)."""
        self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        return self._release(final=True)

    def take_tokens(self) -> tuple[list[int], list[TokenLogprob]]:
        ids, lps = self.pending_ids, self.pending_logprobs
        self.pending_ids, self.pending_logprobs = [], []
        return ids, lps

    def _release(self, final: bool) -> str:
        if self.matched_stop is not None:
            return ""
        if self.stops:
            cut = min(((i, s) for s in self.stops if (i := self.pending.find(s)) >= 0), default=None)
            if cut is not None:
                idx, stop = cut
                out = self.pending[:idx]
                self.pending = ""
                self.matched_stop = stop
                return out
            if not final:
                hold = _held_suffix_len(self.pending, self.stops)
                out = self.pending[: len(self.pending) - hold]
                self.pending = self.pending[len(self.pending) - hold :]
                return out
        out, self.pending = self.pending, ""
        return out

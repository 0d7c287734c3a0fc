"""Prompt-lookup drafting: propose a sequence's next tokens by finding its last n tokens earlier in it.

A coding agent's output repeats its input (an edit rewrites a file it was just shown; a tool
call quotes paths from the context), so the tokens that followed the last earlier occurrence
of the current n-gram are a good guess of what comes next. The runner verifies the guess in
one forward pass (`omlx.engine.runner.BatchRunner`, ``num_draft_tokens``); this module only
proposes. The method is prompt-lookup / n-gram decoding as in llama.cpp's lookup decoding and
vLLM's ``ngram`` speculator (A. Saxena, "Prompt Lookup Decoding", 2023).
"""

from __future__ import annotations

from typing import Sequence


class PromptLookup:
    """An incremental index of one sequence's n-grams (``min_ngram..max_ngram`` tokens).

    The index maps each n-gram to the position just after its most recent occurrence; it is
    extended lazily to the history each `propose` call is given, so appending tokens costs
    ``max_ngram - min_ngram + 1`` dict writes per token and a proposal a few dict reads.

    Args:
        max_ngram: longest suffix tried first (a longer match is a safer guess).
        min_ngram: shortest suffix tried.
    """

    __slots__ = ("max_ngram", "min_ngram", "_index", "_indexed")

    def __init__(self, *, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending before every position < this are in the index

    def propose(self, history: Sequence[int], k: int, last: int | None = None) -> list[int]:
        """Up to ``k`` tokens to follow ``history`` (and then ``last``, when given); empty when
        its last n tokens (for every n tried) occur nowhere earlier.

        Args:
            history: the sequence's tokens so far (prompt and output); must only grow between
                calls (the index is extended, never rebuilt). Read in place, never copied.
            k: most tokens to propose (>= 0).
            last: a newest token not yet in ``history`` (the runner's token to feed next).
        """
        if k <= 0:
            return []
        tail = () if last is None else (last,)
        length = len(history) + len(tail)  # positions of history + tail
        self._extend(history, length - 1)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._index[n].get((*history[length - n :], *tail))
            if end is None:
                continue
            draft = list(history[end : end + k])
            if len(draft) < k and tail and end + len(draft) == len(history):
                draft.append(last)  # type: ignore[arg-type]  # the match runs into the newest token
            return draft
        return []

    def _extend(self, history: Sequence[int], upto: int) -> None:
        """Index every n-gram that ends at a position < ``upto`` and is followed by a token."""
        for end in range(max(self._indexed, 1), upto):
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(history[end - n : end])] = end
        self._indexed = max(self._indexed, upto)

"""Remembered prompt tokenization (`omlx.engine.token_cache`) with the default model's real
tokenizer: a hit returns exactly what the tokenizer returns, the flag is part of the key, the
LRU bounds hold, and an unloaded tokenizer's entries go with it."""

from __future__ import annotations

import gc

from omlx.engine import token_cache


class Counting:
    """The real tokenizer, counting its encode calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def encode(self, text, add_special_tokens):
        self.calls += 1
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


TEXT = "<|im_start|>user\n" + " ".join(f"Line {i}: fix the bug in parse_{i}()." for i in range(300)) + "<|im_end|>\n"


def test_a_repeated_text_is_tokenized_once_and_gives_the_same_ids(tokenizer):
    tok = Counting(tokenizer)
    want = tokenizer.encode(TEXT, add_special_tokens=False)
    first = token_cache.encode(tok, TEXT, add_special_tokens=False)
    first.append(-1)  # the caller owns its list: the remembered ids are not changed
    again = token_cache.encode(tok, TEXT, add_special_tokens=False)
    assert again == want and tok.calls == 1
    with_bos = token_cache.encode(tok, TEXT, add_special_tokens=True)
    assert with_bos == tokenizer.encode(TEXT, add_special_tokens=True) and tok.calls == 2
    edited = TEXT.replace("Line 150", "Line 151")
    assert token_cache.encode(tok, edited, add_special_tokens=False) == tokenizer.encode(edited, add_special_tokens=False)
    assert tok.calls == 3


def test_short_texts_are_not_kept_and_the_lru_is_bounded(tokenizer, monkeypatch):
    tok = Counting(tokenizer)
    token_cache.encode(tok, "hi", add_special_tokens=False)
    token_cache.encode(tok, "hi", add_special_tokens=False)
    assert tok.calls == 2
    monkeypatch.setattr(token_cache, "MAX_ENTRIES", 3)
    texts = [f"{i} " + TEXT for i in range(5)]
    for t in texts:
        token_cache.encode(tok, t, add_special_tokens=False)
    entries = token_cache._caches[tok]
    assert len(entries.by_text) == 3 and entries.num_tokens == sum(len(a) for a in entries.by_text.values())
    calls = tok.calls
    token_cache.encode(tok, texts[0], add_special_tokens=False)  # evicted: tokenized again
    token_cache.encode(tok, texts[4], add_special_tokens=False)  # kept
    assert tok.calls == calls + 1


def test_a_tokenizer_that_goes_away_takes_its_entries(tokenizer):
    tok = Counting(tokenizer)
    token_cache.encode(tok, TEXT, add_special_tokens=False)
    n = len(token_cache._caches)
    del tok
    gc.collect()
    assert len(token_cache._caches) == n - 1


def test_a_repeated_completion_prompt_text_is_tokenized_once(tokenizer):
    """/v1/completions with a text prompt (`omlx.api.prepare.render`) goes through the same
    memory as a chat prompt: the identical 4k prompt of issue 18's benchmark skipped nothing
    before (~30 ms of a whole-prompt hit on the 2-core CPU)."""
    from types import SimpleNamespace

    from omlx.api.prepare import Turn, render

    tok = Counting(tokenizer)
    entry = SimpleNamespace(loaded=SimpleNamespace(tokenizer=tok))  # render reads only the tokenizer
    text = TEXT.replace("<|im_start|>", "").replace("<|im_end|>", "") + " completion"
    first = render(entry, Turn(prompt=text), None)
    again = render(entry, Turn(prompt=text), None)
    assert first.token_ids == again.token_ids == tokenizer.encode(text) and tok.calls == 1

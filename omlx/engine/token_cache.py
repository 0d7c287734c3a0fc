"""Prompt tokenization, remembered: the token ids of recently rendered prompt texts, per tokenizer.

A repeated prompt (a client's retry, the same agent turn sent twice, a benchmark) skips the
tokenizer: for a ~4,000-token chat prompt on a 2-core CPU, ``tokenizer.encode`` was ~18 ms of a
~24 ms request that was otherwise a whole-prompt hit of the prefix cache (py-spy, 2026-12-02).
Exact by construction: the key is the whole text and the ``add_special_tokens`` flag, the value
what this tokenizer returned for it, and tokenization is a pure function of those.
"""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 64  # texts kept per tokenizer
MAX_TOKENS = 2_000_000  # token ids kept per tokenizer (int32: 8 MB)
MIN_CHARS = 2048  # shorter texts tokenize in well under a millisecond: not kept

_lock = threading.Lock()
_caches: weakref.WeakKeyDictionary[Any, "_Entries"] = weakref.WeakKeyDictionary()


class _Entries:
    __slots__ = ("by_text", "num_tokens")

    def __init__(self) -> None:
        self.by_text: OrderedDict[tuple[str, bool], array] = OrderedDict()
        self.num_tokens = 0


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``, from memory when this tokenizer
    tokenized the same text with the same flag recently (LRU, `MAX_ENTRIES` / `MAX_TOKENS`).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (any object with ``encode``; weakly referenced,
            so an unloaded model's entries go with it).
        text: the prompt text.

    Returns:
        A new list of token ids (the caller may change it).
    """
    if len(text) < MIN_CHARS:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    key = (text, add_special_tokens)
    with _lock:
        entries = _caches.get(tokenizer)
        hit = entries.by_text.get(key) if entries is not None else None
        if hit is not None:
            entries.by_text.move_to_end(key)
            return hit.tolist()
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    with _lock:
        entries = _caches.get(tokenizer)
        if entries is None:
            entries = _caches[tokenizer] = _Entries()
        if key not in entries.by_text and len(ids) <= MAX_TOKENS:
            entries.by_text[key] = array("i", ids)
            entries.num_tokens += len(ids)
            while len(entries.by_text) > MAX_ENTRIES or entries.num_tokens > MAX_TOKENS:
                _, old = entries.by_text.popitem(last=False)
                entries.num_tokens -= len(old)
    return ids

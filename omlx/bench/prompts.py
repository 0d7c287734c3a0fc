"""Seeded prompt text whose length is counted in the served model's tokens.

Text comes from a fixed word list and a seed (``random.Random``), so every run, machine and
server sees the same prompts. Lengths are counted by a `TokenCounter`, chosen in this order
(`make_counter`):

1. ``tokenizer`` — a local model folder (``--tokenizer DIR``): its ``tokenizer.json`` through the
   ``tokenizers`` library, exactly what the server tokenizes with (no chat template).
2. ``server`` — the server's ``POST /v1/messages/count_tokens`` (omlx and Anthropic-shaped
   servers): the count of a one-message prompt minus that of an empty one.
3. ``estimate`` — 1.3 tokens per word, for servers with neither; the JSON says so.

Either way the figures use the server's own ``usage.prompt_tokens``; the counter only sizes
the prompts. Must not: import anything of omlx's server (this is an HTTP client).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Protocol

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain window garden kitchen engine signal "
    "market village station library doctor teacher student farmer pilot captain bridge tunnel harbor "
    "forest desert island valley ocean planet comet orbit crystal mineral copper silver iron marble "
    "paper letter record report message answer question theory method result sample measure "
    "battery circuit sensor motor valve pump filter pipe cable switch socket module kernel buffer cache "
    "thread socket packet router server client browser editor compiler parser token vector matrix "
    "table column index query schema field value array object string integer float boolean "
    "red blue green yellow purple orange silent quick slow bright dark heavy light early late "
    "ancient modern simple complex careful rapid gentle strong narrow broad hidden open closed "
    "runs builds carries finds keeps moves opens reads writes sends holds turns takes gives shows "
    "measures checks counts draws fills joins lifts marks needs plans pulls pushes raises sorts "
    "under over between through across around before after during against within without "
    "north south east west spring summer autumn winter morning evening night noon"
).split()

TOPICS = (
    "the history of the Roman Empire", "how volcanoes form", "the life cycle of stars", "the invention of printing",
    "the water cycle", "the causes of the French Revolution", "how computers store numbers", "the migration of birds",
    "the evolution of jazz music", "the construction of medieval castles", "how vaccines train the immune system",
    "the age of exploration", "the chemistry of cooking", "the design of suspension bridges",
    "the ecology of coral reefs", "the industrial revolution in Britain", "the physics of flight",
    "the history of mathematics", "how rivers shape landscapes", "the origins of the Olympic games",
)


class TokenCounter(Protocol):
    """Counts the tokens of a text the way the served model does."""

    source: str  # "tokenizer", "server" or "estimate"

    def count(self, text: str) -> int: ...


class TokenizerCounter:
    """``tokenizer.json`` of a local model folder, through the ``tokenizers`` library.

    Raises:
        FileNotFoundError: the folder has no tokenizer.json.
    """

    source = "tokenizer"

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        path = Path(model_dir).expanduser() / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --tokenizer needs a model folder with tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))

    @functools.lru_cache(maxsize=4096)
    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


class EstimateCounter:
    """1.3 tokens per word: only sizes prompts when nothing better is reachable."""

    source = "estimate"

    def count(self, text: str) -> int:
        return round(1.3 * len(text.split()))


def line(rng: random.Random, tag: str = "") -> str:
    """One sentence of 8-14 words from `WORDS` (the first capitalized, a final period)."""
    n = rng.randint(8, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return (tag + " ".join(words) + ".").strip()


class PromptFactory:
    """Deterministic text of a given length in tokens.

    Args:
        counter: how tokens are counted (a few counts per text: a remote counter is fine).
    """

    def __init__(self, counter: TokenCounter):
        self.counter = counter

    def lines(self, seed: int | str, num_tokens: int, tag: str = "") -> list[str]:
        """Sentences (to be joined by "\\n") of at most ``num_tokens`` tokens, within one sentence
        (~15 tokens) of it. The first words depend on the seed, so two seeds share no prefix."""
        rng = random.Random(f"omlx-bench:{seed}")
        out = [line(rng, tag) for _ in range(4)]
        per_line = max(1.0, self.counter.count("\n".join(out)) / len(out))
        while len(out) * per_line < num_tokens * 1.1 + per_line:
            out.append(line(rng, tag))
        while self.counter.count("\n".join(out)) < num_tokens:  # the estimate was short
            out.extend(line(rng, tag) for _ in range(max(1, len(out) // 8)))
        lo, hi = 0, len(out)  # the most lines whose text fits: binary search, O(log n) counts
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.counter.count("\n".join(out[:mid])) <= num_tokens:
                lo = mid
            else:
                hi = mid - 1
        return out[:lo]

    def text(self, seed: int | str, num_tokens: int, tag: str = "") -> str:
        return "\n".join(self.lines(seed, num_tokens, tag))

    def code(self, seed: int | str, num_tokens: int) -> tuple[str, list[str]]:
        """A Python module of at most ``num_tokens`` tokens (within one function, ~60 tokens):
        small functions named from `WORDS`, each with a docstring, a loop and a return.

        Returns:
            (source, the function names in order).
        """
        rng = random.Random(f"omlx-bench-code:{seed}")
        funcs: list[str] = []
        names: list[str] = []
        while True:
            name = "_".join(rng.choice(WORDS) for _ in range(2)) + f"_{len(names)}"
            a, b = rng.sample(WORDS, 2)
            fn = (f"def {name}({a}, {b}=None):\n"
                  f'    """{line(rng)}"""\n'
                  f"    total = 0\n"
                  f"    for item in {a}:\n"
                  f"        if {b} is None or item != {b}:\n"
                  f"            total += len(str(item)) * {rng.randint(2, 9)}\n"
                  f"    return total\n")
            if funcs and self.counter.count("\n".join(funcs + [fn])) > num_tokens:
                return "\n".join(funcs), names
            funcs.append(fn)
            names.append(name)

    def words(self, seed: int | str, num_words: int) -> str:
        """A line of ``num_words`` words (a short suffix or chat message)."""
        rng = random.Random(f"omlx-bench-words:{seed}")
        return " ".join(rng.choice(WORDS) for _ in range(num_words))

    @staticmethod
    def essay(seed: int) -> str:
        """A short request that makes a model write at length (for decode figures)."""
        rng = random.Random(f"omlx-bench-essay:{seed}")
        topic = TOPICS[seed % len(TOPICS)]
        extra = " ".join(rng.choice(WORDS) for _ in range(4))
        return f"Write a long, detailed essay about {topic}. Cover many aspects in depth (keywords: {extra})."

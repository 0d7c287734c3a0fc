"""The transformers reference figures of the real test models, and how tests recompute them.

`tests/data/reference_perplexity.json` holds one entry per model id, written by
`benchmarks/reference_perplexity.py` (transformers' own GGUF loader, run in a throwaway venv with
torch): perplexity on `tests/data/perplexity_paragraph.txt`, the sha256 of its token ids, the ids
of a few tokenizer samples, the config transformers built and a greedy continuation, with
provenance. The functions here repeat that script's method exactly, in MLX.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def reference(model_id: str) -> dict[str, Any]:
    """The JSON entry for `model_id` (e.g. "SmolLM2-135M-Instruct", "gemma-3-270m")."""
    return json.loads((DATA / "reference_perplexity.json").read_text(encoding="utf-8"))[model_id]


def token_ids_sha256(ids: list[int]) -> str:
    """As in benchmarks/reference_perplexity.py: sha256 of little-endian uint32 ids."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little") for i in ids)).hexdigest()


def paragraph_ids(tokenizer: Any) -> list[int]:
    """The paragraph (surrounding whitespace stripped), encoded with the tokenizer's defaults."""
    text = (DATA / "perplexity_paragraph.txt").read_text(encoding="utf-8").strip()
    return list(tokenizer.encode(text))


def perplexity(model: Any, ids: list[int]) -> float:
    """exp(mean cross-entropy of ids[1:]) from one float32 forward pass over ids[:-1]."""
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    return math.exp(nll.item())

"""A pipeline stage: one rank's contiguous layer range of any mlx-lm model with ``model.layers``.

Owns: loading only the weights a rank needs (its layers; the embeddings on rank 0; the final
norm and head on the last rank) and the stage's forward pass, which moves hidden states between
ranks over ``mx.distributed``. Must not: schedule requests, speak HTTP or choose the ranges (the
planner, ``omlx.cluster.plan``, does).

mlx-lm's own ``PipelineMixin`` (``mlx_lm/models/pipeline.py``) covers a few model families, splits
layers evenly and puts the first layers on the last rank. This wrapper composes any model whose
language model is ``embed_tokens -> layers(h, mask, cache) -> norm -> lm_head`` (llama, mistral,
qwen2/3, phi3 and most others) and takes arbitrary ranges ``[start, end)`` with rank 0 first.

Data flow of one forward (``B, L = inputs.shape``, ``D`` = hidden size, ``V`` = vocabulary)::

    rank 0:     h = embed(inputs)                      (B, L, D)
    rank r>0:   h = recv from rank r-1                 (B, L, D)
    every rank: h = layers[start:end](h)               its own KV cache per layer
    rank r<N-1: send h to rank r+1
    rank N-1:   logits = head(norm(h[:, -1:]))         (B, 1, V)
    every rank: logits = all_sum(logits or zeros)      so every rank samples the same token

Only the last position's logits are computed: omlx's BatchRunner reads ``logits[:, -1]``
and feeds every sampled step as ``L = 1``, so they equal the single-node logits bit for bit.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from omlx.errors import ModelImportError

logger = logging.getLogger(__name__)

# Families whose inner model is exactly embed -> layers(h, mask, cache=c) -> norm, checked
# against their mlx-lm source (mlx-lm 0.32). Others load with a startup warning.
VERIFIED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2"})


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Layers ``[start, end)`` of one rank."""

    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def parse_ranges(text: str) -> list[LayerRange]:
    """``"0:15,15:30"`` -> ranges in rank order.

    Raises:
        ValueError: malformed, empty, or not contiguous from layer 0.
    """
    ranges: list[LayerRange] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition(":")
        if not sep:
            raise ValueError(f"bad range {part.strip()!r}: expected START:END")
        try:
            r = LayerRange(int(a), int(b))
        except ValueError as e:
            raise ValueError(f"bad range {part.strip()!r}: expected integers START:END") from e
        if r.num_layers <= 0:
            raise ValueError(f"range {part.strip()!r} is empty: END must be > START")
        expected = ranges[-1].end if ranges else 0
        if r.start != expected:
            raise ValueError(f"range {part.strip()!r} must start at layer {expected} (ranges are contiguous from 0)")
        ranges.append(r)
    return ranges


def _inner_model(model: nn.Module) -> nn.Module:
    """The module that holds ``layers`` (``model.model``, or ``model.language_model.model``)."""
    for path in ("model", "language_model.model", "language_model"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "layers") and hasattr(obj, "embed_tokens"):
            return obj
    raise ModelImportError(
        f"{type(model).__module__}: no inner model with `layers` and `embed_tokens`; "
        "the cluster stage wrapper cannot split this model")


class StageModel(nn.Module):
    """One rank's part of a model, callable like an mlx-lm model: ``(B, L) ids -> (B, 1, V)``.

    Args:
        model: the full mlx-lm model, loaded lazily (weights not yet evaluated).
        layer_range: this rank's layers.
        num_layers: the model's total layer count.
        group: the ``mx.distributed`` group (rank 0 holds the first layers).
        model_type: ``config.json``'s ``model_type`` (for the verified-family check).

    Attributes:
        hidden_dtype, vocab_size, logits_dtype: set by ``configure`` once every rank has told the
            others (only rank 0 knows the embedding's dtype, only the last rank the head's).
    """

    def __init__(self, model: nn.Module, layer_range: LayerRange, num_layers: int, group: Any,
                 model_type: str):
        super().__init__()
        inner = _inner_model(model)
        self.rank = group.rank()
        self.size = group.size()
        self.group = group
        self.layer_range = layer_range
        self.model_type = model_type
        self.first = layer_range.start == 0
        self.last = layer_range.end == num_layers
        if len(inner.layers) != num_layers:
            raise ModelImportError(f"model has {len(inner.layers)} layers, config says {num_layers}")
        self.layers = list(inner.layers[layer_range.start:layer_range.end])
        args = getattr(model, "args", None) or getattr(inner, "args", None)
        window = getattr(args, "sliding_window", None)
        # Per-layer attention window, as the families with mixed layers mark them.
        self._windows = [window if (getattr(l, "use_sliding", False) or getattr(l, "is_sliding", False)) else None
                         for l in self.layers]
        template = model.make_cache() if hasattr(model, "make_cache") else None
        self._cache_template = template[layer_range.start:layer_range.end] if template else None
        tied = not hasattr(model, "lm_head")
        if self.first:
            self.embed_tokens = inner.embed_tokens
        if self.last:
            self.norm = inner.norm
            if tied:
                self.head_embed = inner.embed_tokens
            else:
                self.lm_head = model.lm_head
        self._tied = tied
        self.hidden_size = int(getattr(args, "hidden_size", 0) or 0)
        self.hidden_dtype: mx.Dtype | None = None
        self.vocab_size = 0
        self.logits_dtype: mx.Dtype | None = None
        if model_type not in VERIFIED_MODEL_TYPES:
            logger.warning("cluster stage wrapper: model_type %r is not in the verified families %s; "
                           "check its greedy output against a single node", model_type, sorted(VERIFIED_MODEL_TYPES))

    # ---- setup ------------------------------------------------------------------------

    def local_facts(self) -> dict[str, Any]:
        """What this rank knows that the others need: embedding dtype (rank 0), head shape (last)."""
        facts: dict[str, Any] = {"rank": self.rank, "start": self.layer_range.start, "end": self.layer_range.end,
                                 "weight_bytes": stage_weight_bytes(self)}
        if self.first:
            facts["hidden_dtype"] = str(self.embed_tokens(mx.array([[0]])).dtype).removeprefix("mlx.core.")
            facts["hidden_size"] = int(self.embed_tokens(mx.array([[0]])).shape[-1])
        if self.last:
            probe = self._head(mx.zeros((1, 1, self.hidden_size or facts.get("hidden_size", 0)),
                                        dtype=self._norm_dtype()))
            facts["vocab_size"] = int(probe.shape[-1])
            facts["logits_dtype"] = str(probe.dtype).removeprefix("mlx.core.")
        return facts

    def _norm_dtype(self) -> mx.Dtype:
        w = getattr(self.norm, "weight", None)
        return w.dtype if w is not None else mx.float32

    def configure(self, facts: list[dict[str, Any]]) -> None:
        """Take every rank's ``local_facts`` (rank order) and fix the shapes the ranks exchange.

        Raises:
            ModelImportError: the ranks' layer ranges do not tile the model in rank order.
        """
        for r, f in enumerate(facts):
            if f["rank"] != r:
                raise ModelImportError(f"rank {r} reported itself as rank {f['rank']}")
        first, last = facts[0], facts[-1]
        self.hidden_dtype = getattr(mx, first["hidden_dtype"])
        self.hidden_size = int(first["hidden_size"])
        self.vocab_size = int(last["vocab_size"])
        self.logits_dtype = getattr(mx, last["logits_dtype"])

    def make_cache(self) -> list[Any]:
        """Fresh per-layer KV caches for this rank's layers (what mlx-lm's ``make_prompt_cache`` calls)."""
        if self._cache_template is not None:
            return [copy.deepcopy(c) for c in self._cache_template]
        return [KVCache() for _ in self.layers]

    # ---- forward ----------------------------------------------------------------------

    def _head(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        return self.head_embed.as_linear(h) if self._tied else self.lm_head(h)

    def forward_layers(self, h: mx.array, cache: list[Any] | None) -> mx.array:
        """Run this rank's layers on ``h`` (B, L, D), updating ``cache``; no communication."""
        if cache is None:
            cache = [None] * len(self.layers)
        masks: dict[int | None, Any] = {}
        for layer, c, window in zip(self.layers, cache, self._windows):
            if window not in masks:
                masks[window] = create_attention_mask(h, c, window_size=window) if window else create_attention_mask(h, c)
            h = layer(h, masks[window], cache=c)
        return h

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """One pipeline forward; every rank calls it with the same ``inputs`` shape.

        Args:
            inputs: token ids (B, L) int; only rank 0 reads their values.
            cache: this rank's per-layer caches (``make_cache``), or None.

        Returns:
            Logits of the last position (B, 1, V), identical on every rank.
        """
        if self.hidden_dtype is None:
            raise RuntimeError("StageModel.configure() was not called")
        B, L = inputs.shape
        g = self.group
        if self.first:
            h = self.embed_tokens(inputs)
        else:
            h = mx.distributed.recv((B, L, self.hidden_size), self.hidden_dtype, self.rank - 1, group=g)
        h = self.forward_layers(h, cache)
        if not self.last:
            sent = mx.distributed.send(h, self.rank + 1, group=g)
            # The send must run whether the caller evaluates the cache (prefill) or the logits
            # (decode): tie it to both (as mlx-lm's pipeline ties it to the cache).
            if cache and getattr(cache[-1], "keys", None) is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, sent)
            logits = mx.depends(mx.zeros((B, 1, self.vocab_size), dtype=self.logits_dtype), sent)
        else:
            logits = self._head(h[:, -1:, :])
        if self.size > 1:
            # Broadcast from the last rank: the others add zeros, which is exact.
            logits = mx.distributed.all_sum(logits, group=g)
        return logits


def load_stage(path: str | Path, layer_range: LayerRange, group: Any) -> tuple[StageModel, dict[str, Any]]:
    """Load one rank's stage from an mlx-lm folder, reading only its own weights.

    mlx-lm's ``load_model(lazy=True)`` maps every tensor without reading it; the stage keeps
    references to its own modules only, and evaluating them reads just those tensors from the
    safetensors files. The rest are dropped unread.

    Returns:
        (stage, config.json as a dict).

    Raises:
        ModelImportError: the folder cannot be loaded, the range is outside the model, or the
            model has no ``layers``/``embed_tokens``.
    """
    from mlx_lm.utils import load_model

    path = Path(path)
    try:
        model, config = load_model(path, lazy=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelImportError(f"cannot load model from {path}: {e}") from e
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    num_layers = int(text.get("num_hidden_layers") or config["num_hidden_layers"])
    if not 0 <= layer_range.start < layer_range.end <= num_layers:
        raise ModelImportError(f"layer range [{layer_range.start}, {layer_range.end}) is outside the model's {num_layers} layers")
    stage = StageModel(model, layer_range, num_layers, group, str(config.get("model_type", "")))
    del model
    mx.eval(stage.parameters())
    return stage, config


def stage_weight_bytes(stage: StageModel) -> int:
    """Bytes of the parameters this stage holds (its layers + embeddings/norm/head if any)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(stage.parameters()))

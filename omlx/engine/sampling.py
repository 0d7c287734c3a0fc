"""Per-request samplers and logits processors, built from mlx-lm's pieces.

Greedy requests share one sampler object so omlx's BatchRunner samples them in one
batched call; a request with temperature > 0 gets its own sampler. A ``seed`` gives the
request its own PRNG key chain (``mx.random.split``), so its samples do not depend on what
else is in the batch. `guard_sampler` and `guard_processor` wrap a request's own ones so their
exception is recorded on its `RequestState` and fails that request alone.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    greedy_sampler,
    make_logits_processors,
)

from omlx.request import SEED_MAX, SEED_MIN, SamplingParams

if TYPE_CHECKING:
    from omlx.engine.request_state import RequestState

Sampler = Callable[[mx.array], mx.array]

logger = logging.getLogger(__name__)


def repair_random_state() -> bool:
    """Reseed MLX's global PRNG when its state can no longer be evaluated; True if it was.

    mlx-lm's samplers are compiled with ``mx.random.state`` as input and output; one that raises
    inside leaves a state array without a primitive, and every later sampled request of the process
    would fail evaluating it. Called on a failed step or start only (it evaluates the state).
    """
    try:
        mx.eval(mx.random.state[0])
        return False
    except Exception:  # the exact error is MLX's "eval an array without a primitive"
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        logger.warning("MLX's random state was left unusable by a failed sampler; reseeded it")
        return True


def make_sampler(params: SamplingParams) -> Sampler:
    """A sampler for one request.

    Args:
        params: the request's sampling settings.

    Returns:
        A callable taking log-probabilities (B, V) float32 and returning token ids (B,) uint32.
        Greedy requests get mlx-lm's shared ``greedy_sampler``; others a `RequestSampler`.
    """
    if params.greedy:
        return greedy_sampler
    return RequestSampler(params)


class RequestSampler:
    """One request's sampler (temperature > 0): mlx-lm's filters, then a categorical draw.

    The filters are mlx-lm's ``apply_top_p``, ``apply_min_p``, ``apply_top_k`` in the order
    ``mlx_lm.sample_utils.make_sampler`` applies them, then a draw from
    ``softmax(filtered / temperature)`` (``categorical_sampling``). A ``seed`` gives the request
    its own key chain: call ``n`` draws with the ``n``-th key split off it.

    Besides the call, `draw` and `keep` serve speculative decoding (`omlx.engine.speculate`):
    `draw` samples each of a sequence's next positions exactly as the next calls would, and
    `keep` consumes the keys of the positions actually used, so a seeded request draws the same
    tokens whether or not its positions were verified together.
    """

    __slots__ = ("_filters", "_temp", "_key", "_pending")

    def __init__(self, params: SamplingParams):
        filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0:
            # k at or past the vocabulary keeps every token: no filter. mlx-lm's apply_top_k raises
            # there, inside a function compiled over mx.random.state, which leaves that state
            # unusable for every later sampled request of the process.
            filters.append(lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x)
        self._filters = filters
        self._temp = params.temperature
        seed = params.seed
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:  # the API refuses these (a 400)
            raise ValueError(f"seed {seed} is outside [{SEED_MIN}, {SEED_MAX}]")
        # MLX keys take 0..2**64-1: a signed 64-bit seed folds into that range one-to-one.
        self._key = mx.random.key(seed % 2**64) if seed is not None else None
        self._pending: list[mx.array] = []  # key chain states after each position of the last draw

    def _filter(self, logprobs: mx.array) -> mx.array:
        for f in self._filters:
            logprobs = f(logprobs)
        return logprobs

    def __call__(self, logprobs: mx.array) -> mx.array:
        """Tokens (B,) uint32 drawn from ``logprobs`` (B, V) float32 (one key for the call)."""
        logprobs = self._filter(logprobs)
        if self._key is None:
            return categorical_sampling(logprobs, self._temp)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self._temp), key=sub)

    def draw(self, logprobs: mx.array) -> mx.array:
        """Tokens (N,) uint32 for ``logprobs`` (N, V) float32, the distributions at one
        sequence's next N positions: position ``j`` is drawn as the ``j``-th call from now would
        draw it (its own key of the chain; unseeded, an independent draw). Consumes nothing
        until `keep`."""
        logprobs = self._filter(logprobs)
        if self._key is None:
            return categorical_sampling(logprobs, self._temp)
        key, out, self._pending = self._key, [], []
        for j in range(logprobs.shape[0]):
            key, sub = mx.random.split(key)
            self._pending.append(key)
            out.append(mx.random.categorical(logprobs[j : j + 1] * (1.0 / self._temp), key=sub))
        return mx.concatenate(out)

    def keep(self, n: int) -> None:
        """The first ``n`` positions of the last `draw` were used: advance the key chain past them."""
        if self._key is not None and n > 0:
            self._key = self._pending[n - 1]
        self._pending = []


def make_processors(params: SamplingParams) -> list[Callable[[mx.array, mx.array], mx.array]]:
    """Logits processors (penalties, logit bias) for one request; empty when none apply.

    Penalties look back over the whole generated text (context = max_tokens), as OpenAI's do.
    """
    if not params.needs_processors:
        return []
    ctx = max(params.max_tokens, 20)
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=ctx,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=ctx,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=ctx,
    )


# ---- fault isolation: a request's own sampler and processors, guarded ---------------------------


def guard_processor(st: RequestState, proc: Any, faulted: list[RequestState]) -> Any:
    """A logits processor whose exception is recorded on ``st`` (logits pass through), so only
    that request fails, after the step."""

    def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return proc(tokens, logits)
        except Exception as e:  # attributed: only this request fails, after the step
            st.record_fault(e, faulted)
            return logits

    return guarded


def guard_sampler(st: RequestState, sampler: Any, faulted: list[RequestState]) -> Any:
    """A per-request sampler whose exception is recorded on ``st`` (argmax stands in)."""
    if sampler is greedy_sampler:  # shared by greedy requests so they sample in one batched call
        return sampler
    return _GuardedSampler(st, sampler, faulted)


class _GuardedSampler:
    """`guard_sampler`'s wrapper; passes a `RequestSampler`'s ``draw``/``keep`` (speculation) on."""

    __slots__ = ("_st", "_sampler", "_faulted", "draw", "keep")

    def __init__(self, st: RequestState, sampler: Any, faulted: list[RequestState]):
        self._st, self._sampler, self._faulted = st, sampler, faulted
        if hasattr(sampler, "draw"):
            self.draw = lambda lp: self._guarded(sampler.draw, lp)
            self.keep = sampler.keep

    def _guarded(self, fn: Any, logprobs: mx.array) -> mx.array:
        try:
            return fn(logprobs)
        except Exception as e:
            self._st.record_fault(e, self._faulted)
            return mx.argmax(logprobs, axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._guarded(self._sampler, logprobs)

"""How long a prefill takes: the engine's prefill rate estimate and its per-request progress rows.

The engine asks `prefill_rate` at admission (to warn when a prompt will outlast the client's
known request timeout) and builds `PrefillStatus` rows for `/v1/admin/recent` while a prompt is
prefilled. Pure arithmetic over figures the engine already has (the restore cost model's
measured rate, the measured chunk times); must not touch mlx, requests' state or HTTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Claude Code gives up on a request after 300 s: its fetch timeout (``API_TIMEOUT_MS``, default
#: 300000 ms) and its stream idle watchdog (``CLAUDE_STREAM_IDLE_TIMEOUT_MS``), seen in
#: Claude Code 2.1.197 against omlx (issue 27: SSE keep-alive pings did not reset it). A
#: prefill estimated longer than this is logged at admission as a WARNING.
CLIENT_REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """A prefill rate and where it comes from.

    Attributes:
        tokens_per_s: prompt tokens per second of one sequence prefilling alone.
        source: "observed" (served prefills, the restore cost model), "measured" (the cost
            model's start-up measurement, or the engine's chunk timings) or "assumed".
    """

    tokens_per_s: float
    source: str


@dataclass(frozen=True, slots=True)
class PrefillStatus:
    """One request whose prompt is being prefilled (a row of ``/v1/admin/recent``'s "prefilling").

    Attributes:
        num_prefilled_tokens: prompt tokens run through the model so far (cached ones excluded).
        num_to_prefill: prompt tokens the cache did not hold (what prefill must compute).
        elapsed_s: since the request joined the batch.
        tokens_per_s: this request's own rate so far (None before its first chunk), else the
            engine's estimate.
        eta_s: seconds left at ``tokens_per_s`` (None without a rate).
    """

    request_id: str
    model: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_prefilled_tokens: int
    num_to_prefill: int
    elapsed_s: float
    tokens_per_s: float | None
    eta_s: float | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON row: token counts, ``progress`` in [0, 1], ``elapsed_s``, ``tokens_per_s``, ``eta_s``."""
        done = self.num_cached_tokens + self.num_prefilled_tokens
        return {
            "request_id": self.request_id, "model": self.model, "outcome": "prefilling",
            "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
            "num_prefilled_tokens": self.num_prefilled_tokens, "num_to_prefill": self.num_to_prefill,
            "num_done_tokens": done,
            "progress": round(done / self.num_prompt_tokens, 4) if self.num_prompt_tokens else 1.0,
            "elapsed_s": round(self.elapsed_s, 2),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
        }


def prefill_rate(cost: Any | None, chunk_ms: dict[int, float] | None, chunk_tokens: int) -> PrefillRate | None:
    """The best prefill rate known: served prefills the cost model observed, else the engine's
    measured time of a ``chunk_tokens`` chunk (or the nearest measured size), else the cost
    model's start-up measurement or assumption; None when there is neither.

    Args:
        cost: the prefix cache's `omlx.cache.tiered.RestoreCostModel` (``prefill_tokens_per_s``,
            ``prefill_measured``, ``num_prefill_samples``), or None.
        chunk_ms: `omlx.engine.step_sizes.StepSizes.chunk_ms` (ms per chunk, by chunk size), or None.
        chunk_tokens: the prefill chunk size the engine runs alone.
    """
    if cost is not None and getattr(cost, "num_prefill_samples", 0) > 0:
        return PrefillRate(float(cost.prefill_tokens_per_s), "observed")
    if chunk_ms:
        n = min(chunk_ms, key=lambda k: (abs(k - chunk_tokens), -k))
        if chunk_ms[n] > 0:
            return PrefillRate(n / (chunk_ms[n] / 1e3), "measured")
    if cost is not None and getattr(cost, "prefill_tokens_per_s", 0) > 0:
        return PrefillRate(float(cost.prefill_tokens_per_s),
                           "measured" if getattr(cost, "prefill_measured", False) else "assumed")
    return None


def warn_if_slow(request_id: str, num_to_prefill: int, num_prompt_tokens: int, rate: PrefillRate | None) -> bool:
    """Log a WARNING (with the estimate and the request id) when prefilling ``num_to_prefill``
    uncached prompt tokens at ``rate`` will take longer than `CLIENT_REQUEST_TIMEOUT_S`.

    Returns:
        True when it warned.
    """
    if rate is None or num_to_prefill <= 0 or rate.tokens_per_s <= 0:
        return False
    est_s = num_to_prefill / rate.tokens_per_s
    if est_s <= CLIENT_REQUEST_TIMEOUT_S:
        return False
    logger.warning("request %s: prefilling %d uncached prompt tokens of %d will take about %.0f s at %.0f tok/s "
                   "(%s), longer than Claude Code's %.0f s request timeout; its blocks are cached as they are "
                   "computed, so a retry resumes where this attempt stops", request_id, num_to_prefill,
                   num_prompt_tokens, est_s, rate.tokens_per_s, rate.source, CLIENT_REQUEST_TIMEOUT_S)
    return True

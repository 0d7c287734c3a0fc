"""Prometheus metrics (``GET /metrics``) and the ring buffer of recent requests (the dashboard).

Two sources: histograms and counters observed when a generation request ends (`observe`, called
from `EventStream`'s sink on the engine thread), and a custom collector that reads the live
pool, scheduler, cache and memory figures at scrape time, so nothing is copied in between.
prometheus-client lives only here (DESIGN.md: api/ is the HTTP edge).
Must not: change any engine, cache or pool state; it only reads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from omlx.engine.content import DroppedContent
from omlx.pool import EnginePool
from omlx.request import Failed, Finished, GenerationEvent, Request

logger = logging.getLogger(__name__)

#: generate_latest writes text format 0.0.4 (what every Prometheus version reads).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: TTFT buckets (s): a cached prompt on a fast machine to a cold 32k prefill on a slow one.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: TPOT buckets (s/token): 1000 tok/s down to 1 tok/s.
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished generation request, as the dashboard lists it.

    Attributes:
        finished_at: wall clock (Unix seconds) when it ended.
        outcome: "stop", "length", "abort" or "error".
        num_prefilled_tokens: prompt tokens this request ran through the model (cached ones
            excluded), aborted and failed requests included.
        ttft_ms: time to first token (None when no token came).
        tpot_ms: mean time per output token after the first (None with fewer than 2 tokens).
        decode_tps: tokens after the first / decode seconds.
        num_draft_tokens, num_accepted_draft_tokens, speculation_off: prompt-lookup drafting
            (`omlx.request.Usage`); 0, 0, False when it did not run.
    """

    request_id: str
    model: str
    finished_at: float
    outcome: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    num_cached_tokens_cold: int
    num_prefilled_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    decode_tps: float | None
    total_ms: float | None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    speculation_off: bool = False


class Metrics:
    """The server's metrics registry and recent-request ring buffer.

    Args:
        pool: read at scrape time (engines, schedulers, caches, memory enforcer).
        num_recent: how many finished requests `recent()` keeps.
    """

    def __init__(self, pool: EnginePool, num_recent: int = 200):
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=True)
        self._recent: collections.deque[RequestRecord] = collections.deque(maxlen=num_recent)
        self._lock = threading.Lock()
        r = self.registry
        self.requests = Counter("omlx_requests", "Generation requests that ended, by outcome "
                                "(stop, length, abort, error).", ["model", "outcome"], registry=r)
        self.prompt_tokens = Counter("omlx_prompt_tokens", "Prompt tokens of ended requests.", ["model"], registry=r)
        self.completion_tokens = Counter("omlx_completion_tokens", "Generated tokens.", ["model"], registry=r)
        self.cached_tokens = Counter("omlx_cached_prompt_tokens", "Prompt tokens served from the KV cache, "
                                     "by tier (hot: RAM, cold: SSD).", ["model", "tier"], registry=r)
        self.ttft = Histogram("omlx_ttft_seconds", "Time to first token (arrival to first token).", ["model"],
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("omlx_tpot_seconds", "Mean time per output token after the first.", ["model"],
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.draft_tokens = Counter("omlx_draft_tokens", "Prompt-lookup draft tokens checked in verify steps.",
                                    ["model"], registry=r)
        self.accepted_draft_tokens = Counter("omlx_accepted_draft_tokens", "Draft tokens the model agreed with "
                                             "(emitted without a step of their own).", ["model"], registry=r)
        self.speculation_off = Counter("omlx_speculation_switched_off", "Requests whose drafting was switched "
                                       "off for low acceptance.", ["model"], registry=r)
        self.dropped = Counter("omlx_dropped_content", "Content blocks and parts a text model cannot read "
                               "(kind: image, document, audio, file), served as a placeholder, by API "
                               "(anthropic, openai, responses).", ["kind", "api"], registry=r)
        r.register(_LiveCollector(pool))

    def observe(self, model: str, request: Request, event: GenerationEvent) -> None:
        """Record a request's last event (Finished or Failed; others are ignored). Any thread."""
        if isinstance(event, Failed):
            self.requests.labels(model, "error").inc()
            self._push(RequestRecord(request.request_id, model, time.time(), "error", request.num_prompt_tokens,
                                     0, 0, 0, request.num_prefilled_tokens, None, None, None, None))
            return
        if not isinstance(event, Finished):
            return
        u = event.usage
        self.requests.labels(model, event.finish_reason).inc()
        self.prompt_tokens.labels(model).inc(u.num_prompt_tokens)
        self.completion_tokens.labels(model).inc(u.num_completion_tokens)
        self.cached_tokens.labels(model, "hot").inc(max(0, u.num_cached_tokens - u.num_cached_tokens_cold))
        self.cached_tokens.labels(model, "cold").inc(u.num_cached_tokens_cold)
        if u.num_draft_tokens:
            self.draft_tokens.labels(model).inc(u.num_draft_tokens)
            self.accepted_draft_tokens.labels(model).inc(u.num_accepted_draft_tokens)
        if u.speculation_off:
            self.speculation_off.labels(model).inc()
        tpot_s = None
        if u.ttft_s is not None:
            self.ttft.labels(model).observe(u.ttft_s)
            if u.total_s is not None and u.num_completion_tokens >= 2:
                tpot_s = max(0.0, u.total_s - u.ttft_s) / (u.num_completion_tokens - 1)
                self.tpot.labels(model).observe(tpot_s)
        self._push(RequestRecord(
            request.request_id, model, time.time(), event.finish_reason, u.num_prompt_tokens,
            u.num_completion_tokens, u.num_cached_tokens, u.num_cached_tokens_cold, request.num_prefilled_tokens,
            _ms(u.ttft_s), _ms(tpot_s), round(1.0 / tpot_s, 2) if tpot_s else None, _ms(u.total_s),
            u.num_draft_tokens, u.num_accepted_draft_tokens, u.speculation_off))

    def dropped_content(self, api: str, request_id: str, dropped: DroppedContent) -> None:
        """Log (one INFO line) and count what one generation request's mapping served as
        placeholders (`omlx.engine.content`); nothing when it dropped nothing.

        Args:
            api: "anthropic", "openai" or "responses" (the ``api`` label).
        """
        if not dropped.counts:
            return
        logger.info("request %s (%s): served %s as placeholders: this model reads text only",
                    request_id, api, dropped.summary())
        for kind, n in dropped.counts.items():
            self.dropped.labels(kind, api).inc(n)

    def _push(self, rec: RequestRecord) -> None:
        with self._lock:
            self._recent.append(rec)

    def recent(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` finished requests, newest first."""
        with self._lock:
            rows = list(self._recent)[-limit:]
        return [asdict(r) for r in reversed(rows)]

    def prefilling(self) -> list[dict[str, Any]]:
        """Requests whose prompt is being prefilled now, on every loaded model, oldest first:
        `omlx.engine.progress.PrefillStatus.as_dict` rows (tokens done / total, tok/s, ETA s)."""
        rows: list[dict[str, Any]] = []
        if self.pool is None:
            return rows
        for e in self.pool.entries():
            snapshot = getattr(e.engine, "prefilling", None)
            if snapshot is not None:
                rows.extend(r.as_dict() for r in snapshot())
        return rows

    def exposition(self) -> bytes:
        """The Prometheus text format (version 0.0.4) of every metric."""
        return generate_latest(self.registry)


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 2)


class _LiveCollector(Collector):
    """Reads pool, scheduler, cache and memory figures at scrape time."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        pool = self.pool
        if pool is None:  # an app built only to list its routes (openapi tests) has no pool
            return
        lim = pool.enforcer.limits
        snap = pool.enforcer.snapshot()
        mem = GaugeMetricFamily("omlx_memory_bytes", "Process memory figures against the ceiling "
                                "(kind: used, process, mlx_active, mlx_cache, ceiling, soft, hard).", labels=["kind"])
        for kind, value in {**snap.as_dict(), **lim.as_dict()}.items():
            mem.add_metric([kind.removesuffix("_bytes")], float(value))
        yield mem
        loaded = GaugeMetricFamily("omlx_model_loaded", "1 for each loaded model (pinned: never evicted).",
                                   labels=["model", "pinned"])
        running = GaugeMetricFamily("omlx_requests_running", "Requests decoding or prefilling now.", labels=["model"])
        waiting = GaugeMetricFamily("omlx_queue_depth", "Requests waiting for a place in the batch.", labels=["model"])
        lookups = CounterMetricFamily("omlx_cache_lookups", "Prefix cache lookups by tier.", labels=["model", "tier"])
        hits = CounterMetricFamily("omlx_cache_hits", "Prefix cache lookups that found blocks.", labels=["model", "tier"])
        misses = CounterMetricFamily("omlx_cache_misses", "Prefix cache lookups that found none.",
                                     labels=["model", "tier"])
        cached_tokens = CounterMetricFamily("omlx_cache_cached_tokens", "Prompt tokens found in the cache.",
                                         labels=["model", "tier"])
        nbytes = GaugeMetricFamily("omlx_cache_bytes", "Bytes held by each cache tier.", labels=["model", "tier"])
        max_bytes = GaugeMetricFamily("omlx_cache_max_bytes", "Budget of each cache tier.", labels=["model", "tier"])
        rows = _rows(pool)
        pinned = {r["id"]: r["pinned"] for r in rows}
        expired = CounterMetricFamily("omlx_leases_expired", "Model leases dropped by the pool's 120 s expiry "
                                      "because their request never released them (each one is a bug, logged as "
                                      "an ERROR with the request id).", labels=["model"])
        for r in rows:
            expired.add_metric([r["id"]], float(r.get("num_expired_leases", 0)))
        yield expired
        for e in pool.entries():
            mid = e.loaded.model_id
            loaded.add_metric([mid, str(pinned.get(mid, False)).lower()], 1.0)
            st = e.engine.scheduler.stats()
            running.add_metric([mid], float(st.num_running))
            waiting.add_metric([mid], float(st.num_waiting))
            pc = e.engine.prefix_cache
            if pc is None:
                continue
            hot = pc.stats()
            tiers = [("hot", hot["num_lookups"], hot["num_hits"], hot["num_cached_tokens"], hot["num_bytes"],
                      hot["max_bytes"])]
            cold = pc.cold_stats() if hasattr(pc, "cold_stats") else None
            if cold:
                tiers.append(("cold", cold["num_lookups"], cold["num_hits"], cold["num_cached_tokens"],
                              cold["num_bytes"], cold["max_bytes"]))
            for tier, n_look, n_hit, n_tok, n_bytes, n_max in tiers:
                lookups.add_metric([mid, tier], float(n_look))
                hits.add_metric([mid, tier], float(n_hit))
                misses.add_metric([mid, tier], float(n_look - n_hit))
                cached_tokens.add_metric([mid, tier], float(n_tok))
                nbytes.add_metric([mid, tier], float(n_bytes))
                max_bytes.add_metric([mid, tier], float(n_max or 0))
        yield from (loaded, running, waiting, lookups, hits, misses, cached_tokens, nbytes, max_bytes)


def _rows(pool: EnginePool) -> list[dict[str, Any]]:
    try:
        return pool.status()["models"]
    except Exception:  # a scrape must not fail because one status row could not be built
        return []

"""Cluster mode's prefix cache: every rank keeps the hot and SSD tiers of its OWN layers.

Owns: building one rank's tiers (the namespace carries the stage's layer range, so each range
has its own SSD folder and ranks sharing a machine never clash), the agreement on how many
prompt tokens come from the cache (`agree_num_cached`, pure), rank 0's `ClusterPrefixCache`
(the engine's ``PrefixCache`` whose lookups, releases and stores are replayed on every rank)
and the followers' `FollowerPrefixCache`. Must not: speak HTTP, choose layer ranges, or run the
generator (``omlx.cluster.worker`` does).

Why the ranks must agree. The ranks replay one BatchRunner call sequence, so every rank must
insert a request with the same number of cached tokens (the segments, hence the forward
passes and collectives, follow from it). Each rank's tiers hold a different history (a rank's
hot budget, evictions or SSD restores differ), so at admission rank 0 broadcasts a lookup (the
prompt), every rank looks up its own tiers, the ranks exchange counts and all use the minimum;
a rank that has more cuts its hit to that count (exact: the KV of position i depends only on
tokens <= i). The insert names the lease and the count; a follower whose count differs stops
the pipeline (EngineError), never produces wrong text.

Whole-prompt hits (the first token drawn from stored log-probabilities, no forward pass) need
every rank to hold the whole prompt; they are used only for greedy requests: a seeded sampler
is a key chain that rank 0 would advance alone.

No ``cache_blocks`` here (the engine checks ``getattr(pc, "cache_blocks", None)``): registering a
running request's blocks chunk by chunk would have to be replayed on every follower at the same
point of its replayed generator, which hands a follower a sequence's caches only when it finishes
(`FollowerPrefixCache.finished`). Rank 0 alone registering them would be harmless (the agreed
count is the minimum) but useless; so in cluster mode blocks are registered at finish (`store`).

Control messages (``omlx.cluster.worker`` lists the others)::

    {"op": "lookup", "lease": id, "tokens": [...], "whole": bool, "prefill_tokens_per_s": r | null}
                                             then every rank gathers {"n", "stats"}
    {"op": "release", "lease": id}
    {"op": "store", "lease": id}             right after the release of the same lease
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from omlx.cache.tiered import PrefixHit
from omlx.cluster.group import ClusterGroup
from omlx.engine.kv_cache import PrefixCacheTiers, PrefixLease
from omlx.errors import ClusterUnavailableError, EngineError

logger = logging.getLogger(__name__)

#: What `/health` says about whole-prompt hits in cluster mode.
WHOLE_HITS_NOTE = "whole-prompt hits (first token without a forward pass) for greedy requests only"


def agree_num_cached(counts: list[int], num_prompt_tokens: int, whole: bool) -> int:
    """The prompt tokens every rank takes from its cache: the fewest any rank holds.

    Args:
        counts: each rank's cached-prefix length for the prompt, rank order.
        num_prompt_tokens: the prompt's length.
        whole: rank 0 holds the log-probabilities after the whole prompt, so a hit may cover
            every token; otherwise at least one token must be prefilled (its logits start
            decoding).

    Returns:
        ``min(counts)``, at most ``num_prompt_tokens - 1`` unless ``whole`` and every rank
        holds the whole prompt; 0 for an empty list.

    Raises:
        ValueError: a count is negative or longer than the prompt.
    """
    if not counts:
        return 0
    if any(not 0 <= n <= num_prompt_tokens for n in counts):
        raise ValueError(f"cached-token counts {counts} outside [0, {num_prompt_tokens}]")
    n = min(counts)
    if whole and n == num_prompt_tokens:
        return n
    return max(0, min(n, num_prompt_tokens - 1))


def _rank_stats(tiers: PrefixCacheTiers | None) -> dict[str, Any]:
    """A rank's few counters, sent with each lookup (a 4 KiB gather region holds them)."""
    if tiers is None:
        return {"enabled": False}
    hot = tiers.stats()
    cold = tiers.cold_stats() or {}
    return {"enabled": True,
            "hot": {k: hot[k] for k in ("num_blocks", "num_bytes", "num_lookups", "num_hits", "num_cached_tokens")},
            "cold": {k: cold[k] for k in ("num_files", "num_bytes", "num_hits", "num_cached_tokens") if k in cold}}


def _lookup(tiers: PrefixCacheTiers | None, group: ClusterGroup, lease_id: int, tokens: list[int],
            whole: bool) -> tuple[PrefixLease | None, list[dict[str, Any]]]:
    """One rank's side of a lookup: look up, exchange counts, cut to the agreed count.

    Every rank calls it for the same message; a failing local lookup counts as 0 (the gather
    must still happen, or the others wait for this rank).

    Returns:
        This rank's lease cut to the agreed count (not materialized; None without tiers), and
        every rank's stats (`_rank_stats`).
    """
    lease = None
    if tiers is not None:
        try:
            lease = tiers.acquire(tokens, whole=whole, materialize=False)
        except Exception:
            logger.exception("rank %d: prefix cache lookup failed; taking nothing from the cache", group.rank)
    mine = lease.num_cached_tokens if lease is not None else 0
    try:
        msgs = group.gather_messages({"n": mine, "stats": _rank_stats(tiers)})
    except BaseException:
        if lease is not None:
            tiers.release(lease)  # type: ignore[union-attr]
        raise
    agreed = agree_num_cached([int(m["n"]) for m in msgs], len(tokens), whole)
    if lease is not None:
        tiers.truncate(lease, agreed)  # type: ignore[union-attr]
        lease.lease_id = lease_id
    return lease, [m["stats"] for m in msgs]


class ClusterPrefixCache:
    """Rank 0's prefix cache: its own tiers, with every lookup, release and store replayed.

    Called on the engine thread, except `stats`, `cold_stats`, `clear` and `close` (any thread;
    they touch rank 0's tiers only: a rank holding less just lowers the agreed count).

    Args:
        tiers: rank 0's tiers (its layers).
        group: the process group.
        control: ``(what, message, fn) -> fn()`` after broadcasting ``message``, under the
            step watchdog (``ClusterPipeline.control``); raises ClusterUnavailableError.
        layer_ranges: every rank's ``[start, end)``, for the per-rank stats.
    """

    def __init__(self, tiers: PrefixCacheTiers, group: ClusterGroup,
                 control: Callable[[str, dict[str, Any], Callable[[], Any]], Any],
                 layer_ranges: list[tuple[int, int]]):
        self.tiers = tiers
        self.group = group
        self._control = control
        self._layer_ranges = layer_ranges
        self._next_id = 0
        self._last: PrefixLease | None = None
        self.allow_whole = False  # set per request by ClusterPipeline.before_insert (greedy only)
        self._rank_stats: list[dict[str, Any]] = []
        self._rank_stats_at: float | None = None

    # ---- engine thread ----------------------------------------------------------------

    def acquire(self, token_ids: list[int], *, whole: bool = False, materialize: bool = True) -> PrefixLease:
        """Look up on every rank and agree on the count (see the module docstring).

        Raises:
            ClusterUnavailableError: a peer was lost.
        """
        lease_id = self._next_id
        self._next_id += 1
        tokens = [int(t) for t in token_ids]
        cost = self.tiers.tiers.cost
        # The pipeline's prefill rate as rank 0 observes it: every rank's restore-or-recompute
        # weighs its own read time against it (a skipped restore makes the pipeline prefill).
        rate = round(cost.prefill_tokens_per_s, 1) if cost.num_prefill_samples else None
        msg = {"op": "lookup", "lease": lease_id, "tokens": tokens, "whole": whole, "prefill_tokens_per_s": rate}
        lease, self._rank_stats = self._control(
            "prefix lookup", msg, lambda: _lookup(self.tiers, self.group, lease_id, tokens, whole))
        self._rank_stats_at = time.time()
        if lease is None:  # rank 0's own lookup failed (logged): a miss, released like any lease
            lease = PrefixLease(PrefixHit(), 0, lease_id=lease_id)
        self._last = lease
        if materialize:
            self.tiers.materialize(lease)
        return lease

    def take_pending(self, caches: Any) -> int | None:
        """The id of the lease an insert starts (the last acquired, not yet inserted), or None
        (a retried request's insert has no lease). Every insert calls it once.

        Args:
            caches: the per-layer caches the insert carries, or None.

        Raises:
            EngineError: the insert carries caches that are not that lease's.
        """
        last, self._last = self._last, None
        if caches is not None and (last is None or caches is not last.caches):
            raise EngineError("cluster prefix cache: an insert carries caches of no pending lease")
        return last.lease_id if last is not None else None

    def materialize(self, lease: PrefixLease, *, room: int = 1) -> None:
        self.tiers.materialize(lease, room=room)

    def next_logprobs(self, token_ids: list[int]) -> Any | None:
        return self.tiers.next_logprobs(token_ids) if self.allow_whole else None

    def put_next_logprobs(self, token_ids: list[int], logprobs: Any) -> None:
        self.tiers.put_next_logprobs(token_ids, logprobs)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.tiers.observe_prefill(num_tokens, seconds)

    def release(self, lease: PrefixLease) -> None:
        """Release on every rank (locally even when the pipeline is lost)."""
        if lease.released:
            return
        self.tiers.release(lease)
        if lease is self._last:
            self._last = None
        self._broadcast("prefix release", {"op": "release", "lease": lease.lease_id})

    def store(self, lease: PrefixLease, prompt_cache: list[Any], token_ids: list[int]) -> None:
        """Store the finished sequence on every rank (each from its own replayed generator)."""
        self.tiers.store(lease, prompt_cache, token_ids)
        self._broadcast("prefix store", {"op": "store", "lease": lease.lease_id})

    def _broadcast(self, what: str, msg: dict[str, Any]) -> None:
        try:
            self._control(what, msg, lambda: None)
        except ClusterUnavailableError:
            pass  # the pipeline is over; the followers' leases die with them

    # ---- any thread -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.tiers.stats()

    def cold_stats(self) -> dict[str, Any] | None:
        return self.tiers.cold_stats()

    def rank_stats(self) -> dict[str, Any]:
        """Every rank's counters as of the last lookup (the followers' own logs have more)."""
        return {"as_of": self._rank_stats_at, "ranks": [
            {"rank": r, "layers": list(self._layer_ranges[r]), **s} for r, s in enumerate(self._rank_stats)]}

    def clear(self, *, cold: bool = False) -> None:
        """Clear rank 0's tiers only (safe: the agreed count drops to what rank 0 holds)."""
        self.tiers.clear(cold=cold)

    def close(self, timeout_s: float | None = 60.0) -> bool:
        return self.tiers.close(timeout_s)


class FollowerPrefixCache:
    """A follower's side of the cluster prefix cache: its tiers and the leases rank 0 named.

    Lease ``id`` -> this rank's lease (from `lookup`) -> the uid its insert got -> the finished
    sequence's caches (from the replayed ``next``/``remove``) -> stored when rank 0 stores.

    Args:
        tiers: this rank's tiers, or None when its cache is off (it then always reports 0).
        group: the process group.
    """

    def __init__(self, tiers: PrefixCacheTiers | None, group: ClusterGroup):
        self.tiers = tiers
        self.group = group
        self._leases: dict[int, tuple[PrefixLease | None, list[int]]] = {}
        self._uid_of: dict[int, int] = {}   # lease id -> uid
        self._lease_of: dict[int, int] = {}  # uid -> lease id
        self._finished: dict[int, tuple[list[Any], list[int]]] = {}  # uid -> (prompt cache, tokens)
        self._to_store: dict[int, tuple[PrefixLease, tuple[list[Any], list[int]]]] = {}

    def lookup(self, msg: dict[str, Any]) -> None:
        lease_id, tokens = int(msg["lease"]), [int(t) for t in msg["tokens"]]
        rate = msg.get("prefill_tokens_per_s")
        if rate and self.tiers is not None:
            self.tiers.tiers.cost.adopt_prefill_rate(float(rate))
        lease, _ = _lookup(self.tiers, self.group, lease_id, tokens, bool(msg["whole"]))
        self._leases[lease_id] = (lease, tokens)

    def insert_caches(self, msg: dict[str, Any]) -> tuple[list[Any] | None, list[list[int]] | None]:
        """``(caches, all_tokens)`` for an insert message (both None when it takes nothing from
        the cache).

        Raises:
            EngineError: rank 0's cached count differs from this rank's (out of step).
        """
        lease_id = msg.get("lease")
        if lease_id is None:
            return None, None
        lease, tokens = self._leases[int(lease_id)]
        n = lease.num_cached_tokens if lease is not None else 0
        if n != int(msg["num_cached"]):
            raise EngineError(f"rank {self.group.rank}: lease {lease_id} holds {n} cached tokens where "
                              f"rank 0 inserts {msg['num_cached']}: the ranks disagree; stopping the pipeline")
        rest = [int(t) for seg in msg["segments"][0] for t in seg]
        if n < len(tokens) and rest != tokens[n:]:  # (a whole hit inserts its first output token)
            raise EngineError(f"rank {self.group.rank}: the insert of lease {lease_id} is not the rest of "
                              "the prompt it looked up: the ranks disagree; stopping the pipeline")
        if n == 0 or lease is None or self.tiers is None:
            return None, None
        self.tiers.materialize(lease, room=len(rest))
        return [lease.caches], [tokens[:n]]

    def inserted(self, msg: dict[str, Any], uid: int) -> None:
        lease_id = msg.get("lease")
        if lease_id is not None:
            self._uid_of[int(lease_id)] = uid
            self._lease_of[uid] = int(lease_id)

    def finished(self, uid: int, prompt_cache: Any, all_tokens: Any) -> None:
        """A replayed ``next``/``remove`` returned a leased sequence's caches: keep them for `store`."""
        if uid in self._lease_of and prompt_cache is not None and all_tokens is not None:
            self._finished[uid] = (prompt_cache, list(all_tokens))

    def release(self, msg: dict[str, Any]) -> None:
        lease_id = msg.get("lease")
        if lease_id is None:
            return
        lease, _ = self._leases.pop(int(lease_id), (None, []))
        uid = self._uid_of.pop(int(lease_id), None)
        done = None
        if uid is not None:
            self._lease_of.pop(uid, None)
            done = self._finished.pop(uid, None)
        if lease is not None and self.tiers is not None:
            self.tiers.release(lease)
            if done is not None:
                self._to_store[int(lease_id)] = (lease, done)

    def store(self, msg: dict[str, Any]) -> None:
        item = self._to_store.pop(int(msg["lease"]), None) if msg.get("lease") is not None else None
        if item is None or self.tiers is None:
            return  # nothing to store here (no tiers, or a miss of this rank's): the count agreement copes
        lease, (prompt_cache, tokens) = item
        try:
            self.tiers.store(lease, prompt_cache, tokens)
        except Exception:
            logger.exception("rank %d: could not store KV blocks of lease %s", self.group.rank, msg["lease"])

    def forget_unstored(self) -> None:
        """Drop released sequences rank 0 did not store (called before every other op)."""
        self._to_store.clear()

    def close(self) -> None:
        """Write the hot tier back to the SSD tier (clean stop)."""
        if self.tiers is not None:
            self.tiers.close()


def stage_prefill_rate(stage: Any, num_tokens: int) -> float:
    """Tokens/s of prefilling ``num_tokens`` through this stage's own layers (best of two).

    No collective (every rank measures alone, whenever it starts): hidden states stand in for
    the previous rank's. Only this rank's share of the pipeline's prefill, so the restore cost
    model starts optimistic about prefill (it restores less eagerly) until rank 0 observes real
    prefills.
    """
    D = stage.hidden_size
    h = ((mx.arange(num_tokens * D) % 97).astype(mx.float32) / 97.0 - 0.5).reshape(1, num_tokens, D)
    h = h.astype(stage.hidden_dtype)
    best = float("inf")
    for _ in range(2):
        cache = stage.make_cache()
        t0 = time.perf_counter()
        out = stage.forward_layers(h, cache)
        mx.eval(out, [c.state for c in cache])
        best = min(best, time.perf_counter() - t0)
    return num_tokens / best


def build_stage_prefix_cache(cfg: Any, path: Path, model_config: dict[str, Any], stage: Any,
                             tokenizer: Any, *, enabled: bool) -> tuple[PrefixCacheTiers | None, str]:
    """This rank's tiers for its stage's layers, and a one-line description for ``/health``.

    Returns:
        (tiers or None, note): the note names the rank, its layer range and the SSD folder, or
        why the cache is off.
    """
    from omlx.engine.kv_cache import make_prefix_cache
    from omlx.engine.loader import LoadedModel

    r = stage.layer_range
    where = f"rank {stage.rank} layers [{r.start}, {r.end})"
    if not enabled:
        return None, f"{where}: off (disabled by configuration)"
    from omlx.engine.cache_spec import CacheSpec, UnsupportedCacheError, layer_specs

    caches = stage.make_cache()
    classes = tuple(type(c).__name__ for c in caches)
    loaded = LoadedModel(path.name, path, stage, tokenizer, model_config, 0, classes)
    try:
        spec = CacheSpec(layer_specs(caches))
    except UnsupportedCacheError as e:
        note = f"{where}: off: {e}"
        logger.warning("prefix cache %s", note)
        return None, note
    tiers = make_prefix_cache(loaded, cfg, layer_range=(r.start, r.end), prefill_rate=stage_prefill_rate, spec=spec)
    cold = tiers.cold_stats()
    note = f"{where}: on (hot tier" + (f", SSD tier {cold['dir']})" if cold else ", no SSD tier)")
    logger.info("prefix cache %s", note)
    return tiers, note

"""Hot <-> cold policy of one model's KV cache: what goes to disk when, and when to restore.

This module owns the policy between the hot tier (``omlx.cache.paged.BlockPool``, RAM) and
the cold tier (``omlx.cache.ssd.SSDStore``, disk):

* **Write-back**: a full block evicted from RAM is queued for disk at high priority.
* **Write-through**: every newly registered full block and tail that holds a prompt token is
  queued at low priority (so a kill -9 loses only what was still in the queue), and a block hit
  ``write_through_hits`` times is queued at high priority (in case its low-priority write was
  dropped). A block or tail that holds generated tokens (``defer_generated``) is held back
  instead and queued when the engine is idle (`write_deferred`: no request running or
  waiting), at its first hit (a next turn that repeats the answer), or written back when
  evicted or at close, whichever comes first: 32 streams of one-off answers wrote ~700 MB of
  tails per wave on an H100 while the next requests decoded; a kill -9 under a load that never
  idles loses them (a follow-up turn then recomputes its previous answer's KV). A tail that a longer sibling on disk covers is not written, and is deleted from
  disk when such a sibling is written (``SSDStore``): bytes stay linear in unique tokens.
* **Restore-on-lookup**: after the hot lookup stops, the chain continues on disk (key of the
  next block under the last parent found; the index says whether its file exists), then the
  longest common prefix with one file under the last block found (a tail or a full block,
  as the hot tier reuses a partial block; beaten by the hot tier's own partial if longer). The
  blocks are restored, read ahead by reader threads while earlier ones are converted and
  registered, only when ``bytes / read bandwidth < tokens / prefill rate``
  (:class:`RestoreCostModel`); the decision is logged.
* **Flush** on close: the hot tier's registered blocks and tails are written back so a clean
  restart restores everything.
* **Window parts** (sliding-window models): the cold tier keeps whole blocks. The write-through
  copy is queued when a block is registered, before the hot tier can drop its window part, and a
  file is never rewritten to drop one: the disk budget is many times the hot one, and a rewrite
  would cost a write and an fsync to save disk the budget already manages. A block written back
  after its window part was dropped (write-through off, or its low-priority write lost) is
  written without it; a hit restored from such a file is cut back like a hot one
  (``CacheSpec.hit_end``).

Pure Python: payloads are opaque, a :class:`PayloadCodec` from the engine turns them into
numpy :class:`HostBlock` and back, always on the calling (engine) thread. It must not import
mlx. Not thread-safe: the engine serializes calls (``omlx.engine.kv_cache``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from omlx.cache.blockfile import HostBlock
from omlx.cache.hashing import BlockHashes, Namespace, hash_block
from omlx.cache.paged import BlockPool, KVBlock
from omlx.cache.ssd import SSDStore
from omlx.units import format_bytes, format_rate

__all__ = [
    "PayloadCodec",
    "RestoreCostModel",
    "RestoreDecision",
    "TierPolicy",
    "TieredCache",
    "PrefixHit",
]

logger = logging.getLogger(__name__)

#: Most held-back writes kept before those of blocks no longer registered are forgotten.
_MAX_DEFERRED = 4096


class PayloadCodec(Protocol):
    """Converts the engine's block payloads to host arrays and back (engine thread only)."""

    def to_host(self, payload: object) -> HostBlock:
        """Host view of a payload; must not copy more than needed, must stay valid while queued."""
        ...

    def from_host(self, host: HostBlock) -> tuple[object, int]:
        """A payload built from host arrays, and its size in bytes."""
        ...


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """Knobs of the hot <-> cold policy.

    Attributes:
        write_through_hits: queue a hot block for disk (high priority) once it was hit this
            many times; 0 turns this off.
        write_new_blocks: queue every newly registered full block and tail (low priority)
            so that a crash loses only the write queue.
        assumed_read_bytes_per_s: read bandwidth assumed before any read was measured
            (conservative: a slow SATA disk).
        assumed_prefill_tokens_per_s: prefill rate assumed when the engine measured none
            (conservative: fast, so restores must clearly win).
        prefetch_blocks: blocks read ahead of the one being converted.
        reader_threads: threads reading block files.
        whole_partials_only: a hit's last block or tail is reused only whole, never a prefix
            of it (models with recurrent state: their snapshot stands at a block's end).
        defer_generated: with ``write_new_blocks``, a new block or tail that holds generated
            tokens (past the sequence's prompt) is queued (low priority) when the engine idles
            or at its first hit, not when registered; eviction and close write it back as any
            other.
    """

    write_through_hits: int = 2
    write_new_blocks: bool = True
    assumed_read_bytes_per_s: float = 200e6
    assumed_prefill_tokens_per_s: float = 20_000.0
    prefetch_blocks: int = 4
    reader_threads: int = 2
    whole_partials_only: bool = False
    defer_generated: bool = True


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    """Whether restoring blocks from disk beats prefilling their tokens.

    Attributes:
        restore: True when ``est_restore_s < est_prefill_s``.
        num_bytes: bytes to read.
        num_tokens: tokens the restore saves from prefill.
        est_restore_s: ``num_bytes / read_bytes_per_s``.
        est_prefill_s: ``num_tokens / prefill_tokens_per_s``.
        read_bytes_per_s, prefill_tokens_per_s: the rates used.
    """

    restore: bool
    num_bytes: int
    num_tokens: int
    est_restore_s: float
    est_prefill_s: float
    read_bytes_per_s: float
    prefill_tokens_per_s: float


class RestoreCostModel:
    """Restore when ``bytes / read bandwidth < tokens / prefill rate``.

    Both rates start from a measurement or a conservative assumption and follow measured
    restores and prefills (exponentially weighted, weight 0.3 for the newest sample).

    Args:
        prefill_tokens_per_s: measured prefill rate (e.g. at warm-up), or ``None``.
        read_bytes_per_s: measured read bandwidth of the cache disk, or ``None``.
        policy: supplies the assumptions used for ``None``.
    """

    _WEIGHT = 0.3

    def __init__(
        self,
        prefill_tokens_per_s: float | None = None,
        read_bytes_per_s: float | None = None,
        policy: TierPolicy | None = None,
    ) -> None:
        policy = policy or TierPolicy()
        self.prefill_tokens_per_s = prefill_tokens_per_s or policy.assumed_prefill_tokens_per_s
        self.read_bytes_per_s = read_bytes_per_s or policy.assumed_read_bytes_per_s
        self.prefill_measured = prefill_tokens_per_s is not None
        self.read_measured = read_bytes_per_s is not None
        self.num_prefill_samples = 0  # served prefills observed (not the start-up measurement)
        self.num_read_samples = 0

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        """Record a restore of ``num_bytes`` that took ``seconds`` end to end."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        if self.read_measured:
            rate = (1 - self._WEIGHT) * self.read_bytes_per_s + self._WEIGHT * rate
        self.read_bytes_per_s = rate
        self.read_measured = True
        self.num_read_samples += 1

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Record a prefill of ``num_tokens`` that took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        if self.prefill_measured:
            rate = (1 - self._WEIGHT) * self.prefill_tokens_per_s + self._WEIGHT * rate
        self.prefill_tokens_per_s = rate
        self.prefill_measured = True
        self.num_prefill_samples += 1

    def adopt_prefill_rate(self, tokens_per_s: float) -> None:
        """Take another process's measured prefill rate as this one's (cluster mode: a follower
        takes the pipeline's rate that rank 0 observes; its own start-up measurement covers
        only its layers, and skipping a restore makes the whole pipeline prefill)."""
        if tokens_per_s > 0:
            self.prefill_tokens_per_s = tokens_per_s
            self.prefill_measured = True

    def decide(self, num_bytes: int, num_tokens: int) -> RestoreDecision:
        """Compare reading ``num_bytes`` with prefilling ``num_tokens``."""
        est_restore = num_bytes / self.read_bytes_per_s
        est_prefill = num_tokens / self.prefill_tokens_per_s
        return RestoreDecision(
            restore=num_tokens > 0 and est_restore < est_prefill,
            num_bytes=num_bytes,
            num_tokens=num_tokens,
            est_restore_s=est_restore,
            est_prefill_s=est_prefill,
            read_bytes_per_s=self.read_bytes_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )


@dataclass(slots=True)
class PrefixHit:
    """The cached prefix of one request, from either tier.

    The request's cached KV is the concatenation, along the token axis, of the first
    ``num_tokens`` tokens of each payload in ``parts``.

    Attributes:
        parts: ``(payload, num_tokens)`` in sequence order.
        held: hot blocks held for the request (release with :meth:`TieredCache.release`).
        num_cached_tokens: tokens covered by ``parts``.
        num_cached_tokens_cold: the part of those restored from disk.
        num_full_blocks: leading full blocks of the request's own chain that are registered in
            the hot tier and held in ``held`` (hot hits and registered restores; a block used
            only in part is not counted). Registering the request's next blocks starts here.
    """

    parts: list[tuple[object, int]] = field(default_factory=list)
    held: list[KVBlock] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_cached_tokens_cold: int = 0
    num_full_blocks: int = 0

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` cached tokens (cluster ranks agree on a count).

        Exact: the KV of position i depends only on tokens ``<= i``, so a prefix of a cached
        prefix is the cached KV of that shorter prefix. Restored (cold) parts come after the
        hot ones, so the tokens dropped are counted off the cold part first. Held blocks stay
        held until release (they remain cached either way), so ``num_full_blocks`` stays.

        Raises:
            ValueError: ``num_tokens`` is negative or more than the hit covers.
        """
        if not 0 <= num_tokens <= self.num_cached_tokens:
            raise ValueError(f"cannot truncate a hit of {self.num_cached_tokens} tokens to {num_tokens}")
        dropped = self.num_cached_tokens - num_tokens
        kept: list[tuple[object, int]] = []
        remaining = num_tokens
        for payload, n in self.parts:
            if remaining <= 0:
                break
            kept.append((payload, min(n, remaining)))
            remaining -= n
        self.parts = kept
        self.num_cached_tokens = num_tokens
        self.num_cached_tokens_cold = max(0, self.num_cached_tokens_cold - dropped)


@dataclass(slots=True)
class _Planned:
    block_hash: bytes
    parent_hash: bytes
    token_ids: list[int]
    num_use: int
    num_bytes: int
    partial: bool = False  # the last item: a file of which only ``num_use`` leading tokens match


class TieredCache:
    """The KV cache of one model across RAM and disk.

    Args:
        pool: the hot tier; its ``on_evict`` hook is taken over for write-back.
        namespace: the model's namespace.
        codec: payload <-> host conversion.
        store: the cold tier, or ``None`` for a RAM-only cache.
        policy: write and restore knobs.
        cost: the restore cost model (default: assumptions of ``policy``).
    """

    def __init__(
        self,
        pool: BlockPool,
        namespace: Namespace,
        codec: PayloadCodec,
        store: SSDStore | None = None,
        policy: TierPolicy | None = None,
        cost: RestoreCostModel | None = None,
    ) -> None:
        self.pool = pool
        self.namespace = namespace
        self.codec = codec
        self.store = store
        self.policy = policy or TierPolicy()
        self.cost = cost or RestoreCostModel(policy=self.policy)
        self._flushing = False
        self._deferred: dict[int, KVBlock] = {}  # block_id -> block whose write waits (defer_generated)
        self._readers: ThreadPoolExecutor | None = None
        self._warned_dtype = False
        self.num_cold_lookups = 0
        self.num_cold_hits = 0
        self.num_cold_cached_tokens = 0
        self.num_restored_blocks = 0
        self.num_restored_bytes = 0
        self.num_restores_skipped = 0
        self.num_restore_failures = 0
        self.restore_s = 0.0
        if store is not None:
            pool.on_evict = self._on_evict

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # ---- lookup ----------------------------------------------------------------------

    def acquire(
        self, token_ids: Sequence[int], *, whole: bool = False, block_hashes: Sequence[bytes] | None = None
    ) -> PrefixHit:
        """Find and hold the longest cached prefix of ``token_ids`` (at most ``len - 1``).

        Hot blocks first; then the chain continues on disk and is restored into the hot tier
        when the cost model says it is cheaper than prefilling. Blocks restored but not fitting
        the hot budget are still used for this request (unregistered).

        Args:
            token_ids: the request's prompt.
            whole: allow the hit to cover every token (the caller holds the logits of the
                last position, so the model need not run on any prompt token).
            block_hashes: the keys of the prompt's full blocks (``BlockHashes.hashes``), so
                neither tier hashes them again; ``None``: hashed here.

        Returns:
            The hit; release it with :meth:`release`.
        """
        bs = self.block_size
        limit = len(token_ids) if whole else max(0, len(token_ids) - 1)
        hit = self.pool.lookup(token_ids, self.namespace, max_cached_tokens=limit, block_hashes=block_hashes,
                               whole_partial_only=self.policy.whole_partials_only)
        self.pool.acquire(hit.all_blocks)
        out = PrefixHit(parts=[(b.payload, bs) for b in hit.blocks], held=list(hit.blocks),
                        num_full_blocks=len(hit.blocks))
        self._write_through_hits(hit.blocks, hit.partial)
        pos = len(hit.blocks) * bs
        num_partial = hit.num_partial_tokens if hit.partial is not None else 0
        cold = self._restore(token_ids, limit, hit.parent_hash or self.namespace.key(), pos, num_partial, out,
                             block_hashes)
        if cold:
            if hit.partial is not None:
                self.pool.release([hit.partial])
        elif hit.partial is not None:
            out.parts.append((hit.partial.payload, num_partial))
            out.held.append(hit.partial)
        out.num_cached_tokens = sum(n for _, n in out.parts)
        out.num_cached_tokens_cold = cold
        return out

    def release(self, hit: PrefixHit) -> None:
        """Drop the request's hold on its hot blocks (they stay cached)."""
        held, hit.held = hit.held, []
        self.pool.release(held)
        hit.parts = []

    def _plan(
        self, token_ids: Sequence[int], limit: int, parent: bytes, pos: int, known: Sequence[bytes] | None = None
    ) -> list[_Planned]:
        """The blocks after ``pos`` found on disk (or in the write queue), in chain order."""
        assert self.store is not None
        bs = self.block_size
        known = known if known is not None else ()
        plan: list[_Planned] = []
        while pos < limit and pos + bs <= len(token_ids):
            tokens = list(token_ids[pos : pos + bs])
            i = pos // bs
            block_hash = known[i] if i < len(known) else hash_block(parent, tokens)
            size = self.store.file_bytes(block_hash)
            if size is None:
                queued = self.store.pending(block_hash)
                if queued is None:
                    break
                size = queued.num_bytes
            plan.append(_Planned(block_hash, parent, tokens, min(bs, limit - pos), size))
            parent = block_hash
            pos += bs
        rest = token_ids[pos : min(limit, pos + bs)]
        child = self.store.best_child(parent, rest, whole_only=self.policy.whole_partials_only) if rest else None
        if child is not None:
            plan.append(_Planned(child.block_hash, parent, list(child.token_ids), child.num_common,
                                 child.num_bytes, partial=True))
        return plan

    def _restore(
        self, token_ids: Sequence[int], limit: int, parent: bytes, pos: int, num_partial: int, out: PrefixHit,
        known: Sequence[bytes] | None = None,
    ) -> int:
        """Restore the disk continuation into ``out``; returns the tokens restored (0: none)."""
        if self.store is None or pos >= limit:
            return 0
        self.num_cold_lookups += 1
        plan = self._plan(token_ids, limit, parent, pos, known)
        num_tokens = sum(p.num_use for p in plan) - num_partial
        if not plan or num_tokens <= 0:
            return 0
        decision = self.cost.decide(sum(p.num_bytes for p in plan), num_tokens)
        verb = "restoring" if decision.restore else "recomputing instead of restoring"
        logger.info(
            "cold KV cache: %s %d block(s) (%s) for %d tokens: est. %.3f s read at %s "
            "vs %.3f s prefill at %.0f tok/s",
            verb, len(plan), format_bytes(decision.num_bytes), decision.num_tokens, decision.est_restore_s,
            format_rate(decision.read_bytes_per_s), decision.est_prefill_s, decision.prefill_tokens_per_s,
        )
        if not decision.restore:
            self.num_restores_skipped += 1
            return 0
        t0 = time.monotonic()
        restored_tokens = restored_bytes = restored_blocks = 0
        hashes = [p.block_hash for p in plan]
        self.store.pin(hashes)
        futures: deque[Future[HostBlock | None]] = deque()
        next_read = 0
        registering = True
        chain = True  # every item so far was a whole full block registered in the hot tier
        try:
            for item in plan:
                while next_read < len(plan) and len(futures) < max(1, self.policy.prefetch_blocks):
                    futures.append(self._submit_read(plan[next_read].block_hash, plan[next_read].parent_hash,
                                                     plan[next_read].token_ids))
                    next_read += 1
                host = futures.popleft().result()
                if host is None or host.num_tokens != len(item.token_ids):
                    self.num_restore_failures += 1
                    break
                payload, num_bytes = self.codec.from_host(host)
                if registering:
                    block = self._register(item, payload, num_bytes)
                    if block is None:
                        registering = False  # hot tier full: use the rest for this request only
                    else:
                        out.held.append(block)
                        payload = block.payload
                chain = chain and registering and not item.partial and len(item.token_ids) == self.block_size
                if chain:
                    out.num_full_blocks += 1
                out.parts.append((payload, item.num_use))
                restored_tokens += item.num_use
                restored_bytes += item.num_bytes
                restored_blocks += 1
        finally:
            for f in futures:
                f.cancel()
            self.store.unpin(hashes)
        elapsed = time.monotonic() - t0
        self.restore_s += elapsed
        if restored_tokens:
            self.cost.observe_read(restored_bytes, elapsed)
            self.num_cold_hits += 1
            self.num_cold_cached_tokens += restored_tokens
            self.num_restored_blocks += restored_blocks
            self.num_restored_bytes += restored_bytes
        return restored_tokens

    def _register(self, item: _Planned, payload: object, num_bytes: int) -> KVBlock | None:
        """Register a restored block (or tail) in the hot tier, held once; ``None`` if it does not fit."""
        if len(item.token_ids) < self.block_size:
            return self.pool.register_tail(self.namespace, item.parent_hash, item.token_ids, payload, num_bytes)
        return self.pool.register(self.namespace, item.parent_hash, item.token_ids, payload, num_bytes,
                                  block_hash=item.block_hash)

    def read_cold(self, block: KVBlock) -> tuple[object, int] | None:
        """A registered block's payload as the cold tier holds it (its write queue, else its
        file, validated), converted by the codec; None when it has none or the read fails.
        Counted as a restore (bytes, time, read bandwidth)."""
        store, h = self.store, block.block_hash
        if store is None or h is None:
            return None
        if not (store.is_pending(h) or store.contains(h)):
            return None
        t0 = time.monotonic()
        host = self._submit_read(h, block.parent_hash, block.token_ids).result()
        if host is None:
            self.num_restore_failures += 1
            return None
        payload, num_bytes = self.codec.from_host(host)
        elapsed = time.monotonic() - t0
        self.restore_s += elapsed
        self.cost.observe_read(host.num_bytes, elapsed)
        self.num_restored_bytes += host.num_bytes
        return payload, num_bytes

    def cold_bytes(self, block: KVBlock) -> int | None:
        """Bytes the cold tier holds for a registered block (queued or on disk), or None."""
        store, h = self.store, block.block_hash
        if store is None or h is None:
            return None
        queued = store.pending(h)
        return queued.num_bytes if queued is not None else store.file_bytes(h)

    def _submit_read(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> Future[HostBlock | None]:
        """A block's host copy from the cold tier: the write queue's, at once, else its file, read
        and validated (`SSDStore.read`: None when that fails) on a reader thread."""
        assert self.store is not None
        queued = self.store.pending(block_hash)
        if queued is not None:
            done: Future[HostBlock | None] = Future()
            done.set_result(queued)
            return done
        if self._readers is None:
            self._readers = ThreadPoolExecutor(
                max_workers=max(1, self.policy.reader_threads), thread_name_prefix="omlx-ssd-reader"
            )
        return self._readers.submit(self.store.read, block_hash, parent_hash, token_ids)

    # ---- writes ----------------------------------------------------------------------

    def register_blocks(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        make_payload: Callable[[int, int], tuple[object, int]],
        held: list[KVBlock],
        num_prompt_tokens: int | None = None,
    ) -> tuple[int, int]:
        """Register full blocks ``start .. end - 1`` of a sequence in the hot tier, in chain order.

        Blocks already cached are held, not copied; new ones are built with ``make_payload`` and
        queued for disk (low priority) when ``write_new_blocks``. Every block this registers or
        finds is appended to ``held`` (one reference each; the caller releases them), so the
        chain cannot be evicted under the caller. Block ``start - 1`` must be cached (held).

        Args:
            token_ids: the sequence's tokens from position 0 (at least ``end * block_size``).
            block_hashes: the keys of its full blocks (at least ``end``), from ``BlockHashes``.
            start, end: the block range; nothing happens when ``start >= end``.
            make_payload: ``(first token, end token) -> (payload, num_bytes)``.
            held: the caller's list of held blocks (extended in place).
            num_prompt_tokens: the sequence's prompt length, when known: a block starting at or
                after it holds generated tokens only and its write is deferred
                (``defer_generated``).

        Returns:
            ``(num_chained, num_new)``: the index of the first block that could not be
            registered (``end`` when all were: the hot budget is full or the parent is gone,
            and later blocks would be useless without it), and how many blocks were new.
        """
        bs = self.block_size
        num_new = 0
        for i in range(start, end):
            block_hash = block_hashes[i]
            existing = self.pool.get(block_hash)
            if existing is not None and not existing.is_tail:
                self.pool.acquire([existing])
                held.append(existing)
                continue
            payload, num_bytes = make_payload(i * bs, (i + 1) * bs)
            parent = block_hashes[i - 1] if i > 0 else self.namespace.key()
            block = self.pool.register(self.namespace, parent, token_ids[i * bs : (i + 1) * bs], payload, num_bytes,
                                       block_hash=block_hash)
            if block is None:
                return i, num_new
            held.append(block)
            num_new += 1
            self._write_new(block, (i + 1) * bs, num_prompt_tokens)
        return max(start, end), num_new

    def _write_new(self, block: KVBlock, end: int, num_prompt_tokens: int | None) -> None:
        """Queue a newly registered block or tail ending at token ``end`` for disk now, or hold
        it back when it holds generated tokens (``defer_generated``, see `write_deferred`)."""
        if not self.policy.write_new_blocks or self.store is None:
            return
        if self.policy.defer_generated and num_prompt_tokens is not None and end > num_prompt_tokens:
            self._deferred[block.block_id] = block
            if len(self._deferred) > _MAX_DEFERRED:
                # Under a load that never idles: forget blocks no longer registered (evicted,
                # superseded tails), so the payloads they hold are freed.
                self._deferred = {k: b for k, b in self._deferred.items() if self.pool.get(b.block_hash or b"") is b}
            return
        self._write(block, high=False)

    def write_deferred(self) -> int:
        """Queue (low priority) the blocks and tails whose write was held back
        (``defer_generated``) and that are still registered; call it while the engine is idle.

        Returns:
            How many were still held back and queued now.
        """
        deferred, self._deferred = self._deferred, {}
        n = 0
        for block in deferred.values():
            if block.block_hash is not None and self.pool.get(block.block_hash) is block:
                self._write(block, high=False)
                n += 1
        return n

    def register_tail(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        parent_hash: bytes,
        make_payload: Callable[[int, int], tuple[object, int]],
        num_prompt_tokens: int | None = None,
    ) -> bool:
        """Register the tail ``token_ids[num_full * block_size : num_tokens]`` under its last full
        block ``parent_hash`` (cached) and queue it for disk (deferred when it holds generated
        tokens only, see `register_blocks`); the pool holds no reference after.

        Returns:
            False when it did not fit (or there is no tail), True otherwise.
        """
        bs = self.block_size
        first = (num_tokens // bs) * bs
        tail = token_ids[first:num_tokens]
        if not tail:
            return False
        payload, num_bytes = make_payload(first, num_tokens)
        block = self.pool.register_tail(self.namespace, parent_hash, tail, payload, num_bytes)
        if block is None:
            return False
        try:
            self._write_new(block, num_tokens, num_prompt_tokens)
        finally:
            self.pool.release([block])
        return True

    def store_sequence(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        make_payload: Callable[[int, int], tuple[object, int]],
        *,
        block_hashes: BlockHashes | None = None,
        num_registered: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Register a finished sequence's new full blocks and its tail in the hot tier.

        Blocks already cached are not copied again; when the hot budget is exhausted the
        rest of the chain is skipped (a chain is only useful from its start). New full blocks
        and the tail are queued for disk at low priority when ``write_new_blocks``.

        Args:
            token_ids: the sequence's tokens (prompt and generated).
            num_tokens: how many of them have KV (``<= len(token_ids)``).
            make_payload: ``(start, end) -> (payload, num_bytes)`` for tokens ``[start, end)``.
            block_hashes: the sequence's keys so far (extended here to ``num_tokens``, so its
                owner never hashes a block twice); ``None``: hashed here.
            num_registered: leading full blocks the caller knows are cached and held (e.g.
                registered as they were computed): skipped without a lookup.
            num_prompt_tokens: the prompt's length, when known (see `register_blocks`).
        """
        total = min(len(token_ids), num_tokens)
        if block_hashes is None:
            block_hashes = BlockHashes(self.namespace.key(), self.block_size)
        block_hashes.extend(token_ids, total)
        num_full = total // self.block_size
        held: list[KVBlock] = []
        try:
            chained, _ = self.register_blocks(token_ids, block_hashes.hashes, num_registered, num_full,
                                              make_payload, held, num_prompt_tokens)
            if chained == num_full:
                self.register_tail(token_ids, total, block_hashes.parent_of(num_full), make_payload,
                                   num_prompt_tokens)
        finally:
            self.pool.release(held)

    def _write_through_hits(self, blocks: list[KVBlock], partial: KVBlock | None = None) -> None:
        """Queue hit full ``blocks`` for disk at high priority once hit ``write_through_hits``
        times; and any hit block or ``partial`` (a tail) whose write was deferred
        (``defer_generated``) at low priority (one on disk or queued already is skipped)."""
        n = self.policy.write_through_hits
        first = self.policy.write_new_blocks and self.policy.defer_generated
        if self.store is None or (n <= 0 and not first):
            return
        for block in blocks:
            if 0 < n <= block.num_hits:
                self._write(block, high=True)
            elif first:
                self._write(block, high=False)
        if first and partial is not None:
            self._write(partial, high=False)

    def _on_evict(self, block: KVBlock) -> None:
        self._deferred.pop(block.block_id, None)  # (another namespace's block: never held back here)
        if block.namespace.key() == self.namespace.key():
            self._write(block, high=True, wait=self._flushing)

    def _write(self, block: KVBlock, *, high: bool, wait: bool = False) -> None:
        self._deferred.pop(block.block_id, None)  # queued now (or on disk): no longer held back
        store = self.store
        h = block.block_hash
        if store is None or h is None or block.payload is None:
            return
        if store.contains(h) or store.is_pending(h):
            return
        try:
            host = self.codec.to_host(block.payload)
        except Exception:
            logger.exception("cold KV cache: cannot convert block %d for disk", block.block_id)
            return
        if not host.tensors:  # a window-only model's block whose window part was dropped: nothing to keep
            return
        if host.dtype != store.dtype:
            if not self._warned_dtype:
                self._warned_dtype = True
                logger.warning("cold KV cache: KV dtype %s differs from the namespace's %s; "
                               "not writing", host.dtype, store.dtype)
            return
        store.put(h, block.parent_hash, block.token_ids, host, high=high, wait=wait)

    # ---- lifecycle -------------------------------------------------------------------

    def clear(self, *, cold: bool = False) -> None:
        """Drop the hot tier's blocks (and with ``cold``, the disk files of this namespace)."""
        self.pool.clear(self.namespace)
        self._deferred.clear()
        if cold and self.store is not None:
            self.store.clear()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is on disk; True if done within ``timeout_s``."""
        return True if self.store is None else self.store.flush(timeout_s)

    def close(self, timeout_s: float | None = 60.0) -> bool:
        """Write the hot tier's registered blocks back to disk, then stop the cold tier.

        Drops the hot tier's blocks. Returns True when every block reached the disk in time.
        """
        if self.store is None:
            return True
        self._flushing = True
        self._deferred.clear()  # the write-back below writes every registered block
        try:
            self.pool.clear(self.namespace, write_back=True)
        finally:
            self._flushing = False
        done = self.store.close(timeout_s)
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        return done

    def cold_stats(self) -> dict[str, Any] | None:
        """The cold section of ``/v1/cache/stats``, or ``None`` without a cold tier."""
        if self.store is None:
            return None
        s = self.store.stats()
        return {
            "enabled": True,
            "dir": str(self.store.dir),
            "num_files": s.num_files,
            "num_bytes": s.num_bytes,
            "max_bytes": s.max_bytes,
            "num_lookups": self.num_cold_lookups,
            "num_hits": self.num_cold_hits,
            "num_cached_tokens": self.num_cold_cached_tokens,
            "num_restored_blocks": self.num_restored_blocks,
            "num_restored_bytes": self.num_restored_bytes,
            "num_restores_skipped": self.num_restores_skipped,
            "num_restore_failures": self.num_restore_failures,
            "restore_s": round(self.restore_s, 6),
            "num_bad_files": s.num_bad_files,
            "num_old_format_files": s.num_old_format_files,
            "num_missing_files": s.num_missing,
            "num_writes": s.num_writes,
            "num_written_bytes": s.num_written_bytes,
            "num_write_errors": s.num_write_errors,
            "num_disk_full": s.num_disk_full,
            "num_queue_drops": s.num_queue_drops,
            "num_budget_drops": s.num_budget_drops,
            "num_queued": s.num_queued,
            "num_queued_bytes": s.num_queued_bytes,
            "num_evictions": s.num_evictions,
            "num_evicted_bytes": s.num_evicted_bytes,
            "num_superseded_files": s.num_superseded,
            "num_scanned_files": s.num_scanned_files,
            "scan_s": round(s.scan_s, 3),
            "read_bytes_per_s": round(self.cost.read_bytes_per_s),
            "read_bandwidth_measured": self.cost.read_measured,
            "prefill_tokens_per_s": round(self.cost.prefill_tokens_per_s, 1),
            "prefill_rate_measured": self.cost.prefill_measured,
            "num_prefill_samples": self.cost.num_prefill_samples,
        }

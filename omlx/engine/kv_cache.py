"""The engine's side of the KV cache: mlx arrays in and out of the hot and cold tiers.

`PrefixCacheTiers` implements the engine's `PrefixCache` protocol on top of the pure
`omlx.cache.tiered.TieredCache` (hot `BlockPool` + SSD store): at admission it looks up the
longest cached prefix (restoring blocks from disk when cheaper than prefill) and turns its
blocks into an mlx-lm ``KVCache`` per layer; as prefill chunks (and decode) complete blocks,
`cache_blocks` registers them at once, and when a request finishes `store` registers the rest
and the tail. A request's block keys are computed once (`Lease.block_hashes`). `MlxPayloadCodec`
converts block payloads to numpy at this boundary, so nothing under ``omlx/cache`` sees mlx.

A block's payload is ONE array, block-major: ``(num_layers, 2, n_kv_heads, num_tokens,
head_dim)`` in the model's KV dtype, keys at ``[:, 0]`` and values at ``[:, 1]`` (the SSD file
holds the same tensor). Storing a block is one stack of the layers' slices; materializing a
request is one concatenate along the token axis, then per-layer views ``kv[l, 0]`` /
``kv[l, 1]`` set as each ``KVCache.state`` (offset = tokens). Those views have no free room, so
mlx-lm's next ``update_and_fetch`` concatenates into a fresh per-layer buffer: the hot tier's
arrays are never written through.

Only models whose every layer uses mlx-lm's plain ``KVCache`` get here (`LoadedModel.blockable`);
others run without a cache, said loudly. A model whose layers differ in KV heads or head dim,
or whose keys and values differ in head dim (the block-major array cannot hold it), also runs
without a prefix cache: the first block it tries to store logs an error and turns the cache
off for that model (`PrefixCacheTiers.disabled_reason`, in ``stats()``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import psutil
from mlx_lm.models.cache import KVCache

from omlx.cache.blockfile import DTYPES, HostBlock
from omlx.cache.hashing import BlockHashes, Namespace, make_kv_format, model_fingerprint, tokenizer_hash
from omlx.cache.paged import BlockPool
from omlx.cache.ssd import SSDStore, default_ssd_cache_bytes
from omlx.cache.tiered import RestoreCostModel, TieredCache, TieredHit, TierPolicy
from omlx.config import ServerConfig
from omlx.engine.loader import LoadedModel

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FINGERPRINT_FILE = ".omlx-fingerprint.json"
# A measured prefill rate is reused this long (it is a property of the model and the machine).
_PREFILL_NOTE_MAX_AGE_S = 7 * 24 * 3600

Payload = mx.array  # (num_layers, 2, n_kv_heads, num_tokens, head_dim)


@dataclass(slots=True)
class Lease:
    """A request's hold on cached blocks (the engine's `PrefixLease`).

    Attributes:
        hit: the blocks reused, from either tier (hot blocks held until release).
        num_cached_tokens: prompt tokens whose KV comes from the cache.
        num_cached_tokens_cold: the part of those restored from the SSD tier.
        caches: one mlx-lm KVCache per layer holding that prefix, or None on a miss.
        lease_id: cluster mode: the id every rank knows this lookup by (None on one node).
        whole: the hit covers every prompt token (counted in ``num_whole_prompt_hits``).
        block_hashes: the request's chained block keys, computed once: the prompt's at
            `PrefixCacheTiers.acquire`, extended by `cache_blocks` and `store` as tokens get KV
            (None for a lease made without a lookup; `store` then hashes).
        num_registered_blocks: leading full blocks of the request that are in the hot tier and
            held by this lease (hits, then blocks `cache_blocks` registered); `store` and
            `cache_blocks` start after them.
        hot_full: a registration found the hot budget full; the lease registers no more blocks
            (a chain is useful only from its start).
    """

    hit: TieredHit
    num_cached_tokens: int
    num_cached_tokens_cold: int = 0
    caches: list[Any] | None = None
    released: bool = False
    lease_id: int | None = None
    whole: bool = False  # counted as a whole-prompt hit
    block_hashes: BlockHashes | None = None
    num_registered_blocks: int = 0
    hot_full: bool = False


def weight_shas(path: Path) -> list[str]:
    """sha256 of each weight file, cached beside the weights keyed by (size, mtime)."""
    files = sorted(path.glob("*.safetensors"))
    sig = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    side = path / _FINGERPRINT_FILE
    try:
        saved = json.loads(side.read_text())
        if saved.get("files") == sig:
            return list(saved["shas"])
    except (OSError, ValueError, KeyError):
        pass
    shas = []
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        shas.append(h.hexdigest())
    try:
        side.write_text(json.dumps({"files": sig, "shas": shas}))
    except OSError:
        logger.debug("cannot write %s; the fingerprint is recomputed at each start", side)
    return shas


def model_namespace(loaded: LoadedModel, kv_dtype: str, layer_range: tuple[int, int] | None = None) -> Namespace:
    """The cache namespace of a loaded model: weights, tokenizer + template, KV format, layers."""
    path = loaded.path
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    fp = model_fingerprint(loaded.config, index, weight_shas(path), loaded.config.get("quantization"))
    tok_file = path / "tokenizer.json"
    tok_bytes = tok_file.read_bytes() if tok_file.exists() else b""
    template = getattr(loaded.tokenizer, "chat_template", None)
    th = tokenizer_hash(tok_bytes, template if isinstance(template, str) else None)
    n_layers = len(loaded.cache_classes)
    start, end = layer_range or (0, n_layers)
    kv_format = make_kv_format(kv_dtype, None, None, "KVCache")
    return Namespace(model_fingerprint=fp, tokenizer_hash=th, kv_format=kv_format,
                     layer_start=start, layer_end=end, format_version=FORMAT_VERSION)


def default_hot_cache_bytes() -> int:
    """A quarter of physical RAM, at most 16 GB: leaves room for weights and activations."""
    return int(min(psutil.virtual_memory().total * 0.25, 16 * 10**9))


def _payload_bytes(payload: Payload) -> int:
    return int(payload.nbytes)


class NonUniformKVError(ValueError):
    """The layers' KV differ in heads or head dim: no block-major array can hold them."""


def check_uniform(caches: list[Any]) -> None:
    """Raise `NonUniformKVError` unless every layer's keys and values share ``(H, D)``."""
    k0 = caches[0].keys
    shape = (k0.shape[1], k0.shape[3])
    for c in caches:
        if (c.keys.shape[1], c.keys.shape[3]) != shape or (c.values.shape[1], c.values.shape[3]) != shape:
            raise NonUniformKVError(
                f"layer KV shapes differ (keys {tuple(c.keys.shape)}, values {tuple(c.values.shape)}, "
                f"layer 0 keys {tuple(k0.shape)})")


def stack_block(caches: list[Any], a: int, b: int) -> Payload:
    """Tokens ``[a, b)`` of per-layer caches as one block-major array (one copy; lazy).

    Args:
        caches: one mlx-lm ``KVCache`` per layer (batch 1), keys/values ``(1, H, >= b, D)``.

    Returns:
        ``(num_layers, 2, H, b - a, D)``.

    Raises:
        NonUniformKVError: the layers differ in heads or head dim, or keys and values do.
    """
    check_uniform(caches)
    flat = mx.stack([x for c in caches for x in (c.keys[0, :, a:b], c.values[0, :, a:b])])
    return flat.reshape(len(caches), 2, *flat.shape[1:])


class MlxPayloadCodec:
    """Block payloads (one mlx array ``(layers, 2, H, T, D)``) to numpy host blocks and back.

    Runs on the engine thread. ``to_host`` does not copy: the numpy array is a view of the
    (evaluated, never mutated) mlx buffer, which it keeps alive until written. bfloat16 travels
    as its uint16 bit pattern.

    Args:
        dtype: the KV dtype name (a key of ``omlx.cache.blockfile.DTYPES``).
    """

    def __init__(self, dtype: str):
        self.dtype = dtype
        self._storage = DTYPES[dtype][1]

    def to_host(self, payload: object) -> HostBlock:
        a: mx.array = payload  # type: ignore[assignment]
        dtype = str(a.dtype).removeprefix("mlx.core.")
        if dtype != self.dtype:
            raise ValueError(f"block KV is {dtype}, the namespace says {self.dtype}")
        m = memoryview(a)
        if not m.c_contiguous:
            a = mx.contiguous(a)
            mx.eval(a)
            m = memoryview(a)
        return HostBlock(dtype, np.frombuffer(m.cast("B"), dtype=self._storage).reshape(a.shape))

    def from_host(self, host: HostBlock) -> tuple[Payload, int]:
        kv = mx.array(host.kv)
        if host.dtype == "bfloat16":
            kv = mx.view(kv, mx.bfloat16)
        mx.eval(kv)
        return kv, _payload_bytes(kv)


def measure_prefill_rate(model: Any, num_tokens: int) -> float:
    """Tokens/s of prefilling one block of ``num_tokens`` into an empty cache (best of two).

    The engine prefills prompts block by block, so this is the cost a restore competes with;
    a deeper context only makes prefill slower (the estimate is conservative for restores).
    """
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[10 + (i * 7919) % 997 for i in range(num_tokens)]])
    best = float("inf")
    for _ in range(2):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(logits, [c.state for c in cache])
        best = min(best, time.perf_counter() - t0)
    return num_tokens / best


@dataclass(slots=True)
class PrefixCacheTiers:
    """The prefix cache of one model, hot and cold (thread-safe; the engine thread does the work).

    Args:
        tiers: the hot <-> cold policy over the block pool and the SSD store.
        num_layers: layers per payload.
    """

    tiers: TieredCache
    num_layers: int
    max_logprobs_bytes: int = 64 * 2**20
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_logprobs: OrderedDict[bytes, mx.array] = field(default_factory=OrderedDict)
    _num_logprobs_bytes: int = 0
    num_whole_hits: int = 0
    disabled_reason: str | None = None

    @property
    def pool(self) -> BlockPool:
        return self.tiers.pool

    @property
    def namespace(self) -> Namespace:
        return self.tiers.namespace

    @property
    def block_size(self) -> int:
        return self.tiers.block_size

    def acquire(self, token_ids: list[int], *, whole: bool = False, materialize: bool = True) -> Lease:
        """Look up and hold the longest cached prefix of ``token_ids``, restoring blocks from disk
        when that is cheaper than prefilling them.

        Args:
            token_ids: the prompt.
            whole: the caller holds the last position's log-probabilities (`next_logprobs`), so
                the hit may cover every prompt token; otherwise at most ``len - 1``.
            materialize: build ``lease.caches`` now; with False, call `materialize` later (a
                whole hit emits its first token before paying for the copy).
        """
        hashes = BlockHashes(self.namespace.key(), self.block_size)
        if self.disabled_reason is not None:
            return Lease(TieredHit(), 0, block_hashes=hashes)
        hashes.extend(token_ids)
        with self._lock:
            hit = self.tiers.acquire(token_ids, whole=whole, block_hashes=hashes.hashes)
            n = hit.num_cached_tokens
            is_whole = whole and n == len(token_ids)
            if is_whole:
                self.num_whole_hits += 1
            try:
                caches = self._materialize(hit.parts) if n and materialize else None
            except Exception:
                self.tiers.release(hit)
                raise
        return Lease(hit, n, hit.num_cached_tokens_cold, caches, whole=is_whole, block_hashes=hashes,
                     num_registered_blocks=hit.num_full_blocks)

    def truncate(self, lease: Lease, num_tokens: int) -> None:
        """Cut an unmaterialized lease to its first ``num_tokens`` tokens (exact; see
        `TieredHit.truncate`). A whole-prompt hit cut short no longer counts as one.

        Raises:
            ValueError: the lease is already materialized, or ``num_tokens`` is out of range.
        """
        if num_tokens == lease.num_cached_tokens:
            return
        if lease.caches is not None:
            raise ValueError("truncate a lease before materializing it")
        with self._lock:
            if lease.whole:
                self.num_whole_hits -= 1
                lease.whole = False
            lease.hit.truncate(num_tokens)
            lease.num_cached_tokens = num_tokens
            lease.num_cached_tokens_cold = lease.hit.num_cached_tokens_cold

    def materialize(self, lease: Lease) -> None:
        """Fill ``lease.caches`` from its held blocks (after ``acquire(..., materialize=False)``)."""
        with self._lock:
            if lease.caches is None and lease.num_cached_tokens:
                lease.caches = self._materialize(lease.hit.parts)

    # ---- log-probabilities after a whole prompt -------------------------------------------

    def _prompt_key(self, token_ids: list[int]) -> bytes:
        h = hashlib.sha256(self.namespace.key())
        h.update(np.asarray(token_ids, dtype="<u4").tobytes())
        return h.digest()

    def next_logprobs(self, token_ids: list[int]) -> mx.array | None:
        """The log-probabilities ``(vocab,)`` the model gave after exactly ``token_ids``, when a
        finished request left them (see `put_next_logprobs`), else None.

        With these and the whole prompt's KV cached, a repeated prompt needs no forward pass for
        its first token: the request's own sampler draws it from the very array a run without
        cache computes (the engine prefills at the same block boundaries either way).
        """
        key = self._prompt_key(token_ids)
        with self._lock:
            lp = self._next_logprobs.get(key)
            if lp is not None:
                self._next_logprobs.move_to_end(key)
            return lp

    def put_next_logprobs(self, token_ids: list[int], logprobs: mx.array) -> None:
        """Keep the unprocessed log-probabilities ``(vocab,)`` after ``token_ids`` (LRU, at most
        ``max_logprobs_bytes`` in all). Only arrays no request-specific processor touched
        (penalties, bias) may be stored: every later request reuses them."""
        key = self._prompt_key(token_ids)
        with self._lock:
            old = self._next_logprobs.pop(key, None)
            if old is not None:
                self._num_logprobs_bytes -= old.nbytes
            if logprobs.nbytes > self.max_logprobs_bytes:
                return
            self._next_logprobs[key] = logprobs
            self._num_logprobs_bytes += logprobs.nbytes
            while self._num_logprobs_bytes > self.max_logprobs_bytes:
                _, lp = self._next_logprobs.popitem(last=False)
                self._num_logprobs_bytes -= lp.nbytes

    def _materialize(self, parts: list[tuple[object, int]]) -> list[KVCache]:
        arrays = []
        for payload, n in parts:
            kv: Payload = payload  # type: ignore[assignment]
            arrays.append(kv if n == kv.shape[3] else kv[:, :, :, :n])
        # (layers, 2, H, num_cached_tokens, D): one copy for the whole request
        kv = mx.concatenate(arrays, axis=3) if len(arrays) > 1 else arrays[0]
        if kv.shape[0] != self.num_layers:
            raise ValueError(f"cached blocks hold {kv.shape[0]} layers, the model has {self.num_layers}")
        num_tokens = kv.shape[3]
        # (2 * layers, H, T, D): layer l's keys are row 2l, its values row 2l + 1 (views)
        rows = kv.reshape(2 * self.num_layers, *kv.shape[2:])
        caches = []
        for layer in range(self.num_layers):
            c = KVCache()
            c.state = (rows[2 * layer : 2 * layer + 1], rows[2 * layer + 1 : 2 * layer + 2], num_tokens)
            caches.append(c)
        mx.eval([c.keys for c in caches], [c.values for c in caches])
        return caches

    def cache_blocks(self, lease: Lease, caches: list[Any], token_ids: list[int], num_tokens: int) -> int:
        """Register the request's full blocks among its first ``num_tokens`` tokens as soon as their
        KV is computed (after each prefill chunk, or when decode fills a block).

        The blocks become hits for any later lookup at once, while the request still runs; they
        are held by the lease until `release`, and queued for the SSD tier (low priority) like
        `store` does. Blocks the lease already registered (or hit) are skipped without hashing
        or copying; `store` at finish does only the rest and the tail.

        Args:
            lease: the request's lease (from `acquire`; not released).
            caches: one mlx-lm ``KVCache`` per layer, batch 1, holding KV for at least
                ``num_tokens`` tokens from position 0.
            token_ids: the request's tokens from position 0 (prompt, then generated).
            num_tokens: how many leading tokens have KV in ``caches``.

        Returns:
            The number of blocks newly registered by this call (0 when none completed, all
            were cached already, or the hot budget is full).
        """
        if lease.released or lease.hot_full or self.disabled_reason or not caches or caches[0].keys is None:
            return 0
        num_tokens = min(num_tokens, len(token_ids), caches[0].offset)
        with self._lock:
            hashes = self._hashes_of(lease)
            hashes.extend(token_ids, num_tokens)
            end = num_tokens // self.block_size
            start = lease.num_registered_blocks
            if start >= end:
                return 0
            try:
                payload = self._payload_fn(caches)
            except NonUniformKVError as exc:
                self._disable(exc)
                return 0
            chained, num_new = self.tiers.register_blocks(token_ids, hashes.hashes, start, end, payload,
                                                          lease.hit.held)
            lease.num_registered_blocks = chained
            lease.hot_full = chained < end
            return num_new

    def store(self, lease: Lease, prompt_cache: list[Any], token_ids: list[int]) -> None:
        """Register the request's new full blocks and its tail (prompt + generated tokens).

        Blocks already cached (by `cache_blocks`, or by anyone) are not copied again and the
        lease's keys are extended rather than recomputed; when the budget is exhausted the rest
        of the chain is skipped (a chain is only useful from its start). New full blocks are
        queued for the SSD tier (low priority) off the request path. Call it after `release`
        or before; the blocks the lease holds stay cached either way, and a chain `cache_blocks`
        stopped for a full budget is tried again from where it stopped.
        """
        if not prompt_cache or prompt_cache[0].keys is None or self.disabled_reason:
            return
        num_tokens = min(len(token_ids), prompt_cache[0].offset)
        with self._lock:
            hashes = self._hashes_of(lease)
            hashes.extend(token_ids, num_tokens)
            try:
                payload = self._payload_fn(prompt_cache)
            except NonUniformKVError as exc:
                self._disable(exc)
                return
            self.tiers.store_sequence(token_ids, num_tokens, payload, block_hashes=hashes,
                                      num_registered=lease.num_registered_blocks)

    def _hashes_of(self, lease: Lease) -> BlockHashes:
        if lease.block_hashes is None:
            lease.block_hashes = BlockHashes(self.namespace.key(), self.block_size)
        return lease.block_hashes

    def _payload_fn(self, caches: list[Any]) -> Callable[[int, int], tuple[Payload, int]]:
        """``(a, b) -> (payload, num_bytes)``: tokens ``[a, b)`` of ``caches`` as one block array,
        evaluated at once (before the next forward pass can update the caches in place; per
        block: measured 2-3x faster on CPU than one eval of a chunk's blocks together).

        Raises:
            NonUniformKVError: as `stack_block` (checked here, before anything is registered).
        """
        check_uniform(caches)

        def payload(a: int, b: int) -> tuple[Payload, int]:
            flat = mx.stack([x for c in caches for x in (c.keys[0, :, a:b], c.values[0, :, a:b])])
            p = flat.reshape(len(caches), 2, *flat.shape[1:])
            mx.eval(p)
            return p, _payload_bytes(p)

        return payload

    def _disable(self, exc: Exception) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = f"block-major KV blocks cannot hold this model's KV: {exc}"
            logger.error("prefix cache OFF for this model (no hits, no stores, no SSD writes): %s; the "
                         "model still serves, prefilling every prompt in full", self.disabled_reason)
            self.tiers.clear()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Feed a measured prefill (``num_tokens`` computed in ``seconds``, the request alone in
        the batch) to the restore cost model, so restore-or-recompute follows the real rate."""
        with self._lock:
            self.tiers.cost.observe_prefill(num_tokens, seconds)

    def release(self, lease: Lease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                self.tiers.release(lease.hit)
                lease.caches = None

    def clear(self, *, cold: bool = False) -> None:
        """Drop the hot tier (and with ``cold``, this model's SSD files)."""
        with self._lock:
            self.tiers.clear(cold=cold)
            self._next_logprobs.clear()
            self._num_logprobs_bytes = 0

    def close(self, timeout_s: float | None = 60.0) -> bool:
        """Write the hot tier back to the SSD tier and stop it (clean shutdown; engine stopped).

        Returns:
            True when every block reached the disk within ``timeout_s``.
        """
        with self._lock:
            t0 = time.monotonic()
            done = self.tiers.close(timeout_s)
            cold = self.tiers.cold_stats()
        if cold is not None:
            logger.info("cold KV cache flushed in %.2f s: %d files, %.1f MB%s", time.monotonic() - t0,
                        cold["num_files"], cold["num_bytes"] / 1e6, "" if done else " (timed out)")
        return done

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.pool.stats()
        return {
            "block_size": self.block_size,
            "num_blocks": s.num_blocks,
            "num_full_blocks": s.num_full_blocks,
            "num_tails": s.num_tails,
            "num_bytes": s.num_bytes,
            "max_bytes": s.max_bytes,
            "num_lookups": s.num_lookups,
            "num_hits": s.num_hits,
            "num_misses": s.num_misses,
            "num_query_tokens": s.num_query_tokens,
            "num_hit_tokens": s.num_hit_tokens,
            "num_evictions": s.num_evictions,
            "num_evicted_bytes": s.num_evicted_bytes,
            "num_whole_prompt_hits": self.num_whole_hits,
            "disabled_reason": self.disabled_reason,
            "num_next_logprobs": len(self._next_logprobs),
            "num_next_logprobs_bytes": self._num_logprobs_bytes,
        }

    def cold_stats(self) -> dict[str, Any] | None:
        """The SSD tier's counters (``/v1/cache/stats`` "cold"), or None when it is off."""
        with self._lock:
            return self.tiers.cold_stats()


def make_prefix_cache(loaded: LoadedModel, config: ServerConfig, *, layer_range: tuple[int, int] | None = None,
                      prefill_rate: Callable[[Any, int], float] = measure_prefill_rate) -> PrefixCacheTiers:
    """Build the cache tiers for a model from the server config (budgets printed at startup).

    Args:
        loaded: the model (in cluster mode: one rank's stage, ``cache_classes`` its layers').
        config: budgets, block size, SSD folder.
        layer_range: the layers ``[start, end)`` whose KV the tiers hold (cluster mode: the
            rank's stage), part of the namespace so each range has its own SSD folder; None =
            every layer.
        prefill_rate: ``(model, num_tokens) -> tokens/s`` measured at start for the restore
            cost model (cluster mode: a stage's own layers, with no collective).
    """
    max_bytes = config.cache.hot_cache_max_bytes or default_hot_cache_bytes()
    kv_dtype = _kv_dtype(loaded)
    ns = model_namespace(loaded, kv_dtype, layer_range)
    bs = config.cache.block_size
    pool = BlockPool(max_bytes=max_bytes, block_size=bs)
    logger.info("hot KV cache for %s: %.2f GB budget, %d-token blocks, namespace %s",
                loaded.model_id, max_bytes / 1e9, bs, ns.digest())
    policy = TierPolicy(write_through_hits=config.cache.ssd_write_through_hits,
                        write_new_blocks=config.cache.ssd_write_new_blocks)
    store, cost = _make_cold_tier(loaded, config, ns, kv_dtype, policy, prefill_rate)
    tiers = TieredCache(pool, ns, MlxPayloadCodec(kv_dtype) if kv_dtype in DTYPES else _NoCodec(),
                        store, policy, cost)
    return PrefixCacheTiers(tiers, len(loaded.cache_classes))


class _NoCodec:
    """Codec of a RAM-only cache (never called: without a store nothing goes to disk)."""

    def to_host(self, payload: object) -> HostBlock:
        raise ValueError("no cold tier")

    def from_host(self, host: HostBlock) -> tuple[object, int]:
        raise ValueError("no cold tier")


def _make_cold_tier(
    loaded: LoadedModel, config: ServerConfig, ns: Namespace, kv_dtype: str, policy: TierPolicy,
    prefill_rate: Callable[[Any, int], float] = measure_prefill_rate,
) -> tuple[SSDStore | None, RestoreCostModel | None]:
    """Open the SSD tier (index rebuilt, budget printed) and measure the restore cost model."""
    if not config.cache.ssd_enabled:
        logger.info("SSD KV cache for %s: off (disabled by configuration)", loaded.model_id)
        return None, None
    if kv_dtype not in DTYPES:
        logger.warning("SSD KV cache for %s: off: KV dtype %s cannot be stored", loaded.model_id, kv_dtype)
        return None, None
    root = config.ssd_cache_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
        budget = config.cache.ssd_cache_max_bytes
        how = "configured"
        if budget is None:
            budget, how = default_ssd_cache_bytes(root), "default: 10% of free disk, at most 50 GB"
        store = SSDStore(root, ns, dtype=kv_dtype, max_bytes=budget, model_id=loaded.model_id,
                         progress=sys.stderr.isatty())
    except OSError as e:
        logger.warning("SSD KV cache for %s: off: cannot use %s: %s", loaded.model_id, root, e)
        return None, None
    st = store.stats()
    logger.info("SSD KV cache for %s: %s, budget %.2f GB (%s); %d block files (%.1f MB) indexed in "
                "%.2f s, %d bad deleted", loaded.model_id, store.dir, budget / 1e9, how, st.num_files,
                st.num_bytes / 1e6, st.scan_s, st.num_bad_files)
    num_tokens = max(1, min(config.cache.block_size, 512))
    note = store.load_note("prefill")
    if note and note.get("num_tokens") == num_tokens and time.time() - note.get("at", 0) < _PREFILL_NOTE_MAX_AGE_S:
        prefill, when = float(note["tokens_per_s"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(note["at"]))
    else:
        prefill, when = prefill_rate(loaded.model, num_tokens), "now"
        store.save_note("prefill", {"num_tokens": num_tokens, "tokens_per_s": prefill, "at": time.time()})
    read_bw = store.measure_read_bandwidth() if st.num_files else None
    logger.info("restore cost model: prefill %.0f tok/s (measured %s, %d-token block); read %s",
                prefill, when, num_tokens,
                f"{read_bw / 1e6:.0f} MB/s (measured)" if read_bw else
                f"{policy.assumed_read_bytes_per_s / 1e6:.0f} MB/s (assumed until measured)")
    return store, RestoreCostModel(prefill, read_bw, policy)


def _kv_dtype(loaded: LoadedModel) -> str:
    """The dtype the model's KV will have (that of its first floating-point weight)."""
    from mlx.utils import tree_flatten

    for _, w in tree_flatten(loaded.model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            return str(w.dtype).removeprefix("mlx.core.")
    return "float32"


__all__ = ["Lease", "MlxPayloadCodec", "PrefixCacheTiers", "make_prefix_cache", "measure_prefill_rate", "model_namespace"]

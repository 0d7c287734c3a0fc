"""The engine's side of the KV cache: mlx arrays in and out of the hot and cold tiers.

`PrefixCacheTiers` implements the engine's `PrefixCache` protocol on top of the pure
`omlx.cache.tiered.TieredCache` (hot `BlockPool` + SSD store): at admission it looks up the
longest cached prefix (restoring blocks from disk when cheaper than prefill) and turns its
blocks into the model's mlx-lm caches; as prefill chunks (and decode) complete blocks,
`cache_blocks` registers them at once, and when a request finishes `store` registers the rest
and the tail. A request's block keys are computed once (`PrefixLease.block_hashes`). `MlxPayloadCodec`
converts block payloads to numpy at this boundary, so nothing under ``omlx/cache`` sees mlx.

A block's payload is a dict of mlx arrays (`omlx.engine.cache_spec`): for a plain model ONE
array ``"kv"``, block-major, ``(num_layers, 2, n_kv_heads, num_tokens, head_dim)`` in the
model's KV dtype, keys at ``[:, 0]`` and values at ``[:, 1]`` (the SSD file holds the same
tensor). Storing a block is one stack of the layers' slices; materializing a request copies
the blocks once, per layer, into buffers with free room for the prompt's uncached rest, set as
each cache's state: the next updates write in place, and the hot tier's arrays are never
written through. Sliding-window layers store every token like attention layers, in a window
part of the payload that the hot tier drops first under pressure where no chain end's window
reads it (`window_parts`, ``BlockPool.window_droppable``), and restore the tokens their window
covers (a hit is cut back to where those are all present); recurrent-state layers (SSM, gated
delta-net) attach a snapshot to the block ending where it was taken, and a hit on such a model
is cut back to the last block that carries one (`CacheSpec.hit_end`).

Models whose cache classes `omlx.engine.cache_spec` does not know (quantized KV, chunked,
``CacheList``) run without a prefix cache, said loudly (`omlx.engine.factory.build_prefix_cache`).
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

from omlx.cache.blockfile import DTYPES, PACKED_DTYPE, STATE_PREFIX, HostBlock
from omlx.cache.hashing import BlockHashes, Namespace, make_kv_format, model_fingerprint, tokenizer_hash
from omlx.cache.paged import TAIL_SLACK_TOKENS, BlockPool, WindowParts
from omlx.cache.ssd import SSDStore, default_ssd_cache_bytes
from omlx.cache.tiered import PrefixHit, RestoreCostModel, TieredCache, TierPolicy
from omlx.config import ServerConfig
from omlx.engine.cache_spec import (ATTENTION, CacheSpec, Payload, has_snapshot, overlaps, payload_bytes, spec_of_model,
                                    window_reads)
from omlx.engine.loader import LoadedModel
from omlx.units import format_bytes, format_rate

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FINGERPRINT_FILE = ".omlx-fingerprint.json"
# A measured prefill rate is reused this long (it is a property of the model and the machine).
_PREFILL_NOTE_MAX_AGE_S = 7 * 24 * 3600



@dataclass(slots=True)
class PrefixLease:
    """A request's hold on cached blocks: its prefix hit, and the caches built from it.

    Attributes:
        hit: the blocks reused, from either tier (hot blocks held until release).
        num_cached_tokens: prompt tokens whose KV comes from the cache.
        num_cached_tokens_cold: the part of those restored from the SSD tier.
        caches: the model's per-layer mlx-lm caches holding that prefix, or None on a miss.
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
        num_prompt_tokens: the prompt's length (the tokens looked up); blocks past it hold
            generated tokens only and their SSD write waits for a hit (`TierPolicy.defer_generated`).
            None for a lease made without a lookup.
    """

    hit: PrefixHit
    num_cached_tokens: int
    num_cached_tokens_cold: int = 0
    caches: list[Any] | None = None
    released: bool = False
    lease_id: int | None = None
    whole: bool = False  # counted as a whole-prompt hit
    block_hashes: BlockHashes | None = None
    num_registered_blocks: int = 0
    hot_full: bool = False
    num_prompt_tokens: int | None = None


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


def model_namespace(loaded: LoadedModel, kv_dtype: str, layer_range: tuple[int, int] | None = None,
                    layout: str = "KVCache", kv_quantization: tuple[int, int] | None = None,
                    block_size: int = 256) -> Namespace:
    """The cache namespace of a loaded model: weights, tokenizer + template, KV format (dtype,
    ``(bits, group size)`` of a quantized KV cache) and cache layout (``"KVCache"`` when every
    layer is plain attention, else `CacheSpec.describe`), layers, block size."""
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
    bits, group = kv_quantization or (None, None)
    kv_format = make_kv_format(kv_dtype, bits, group, layout)
    return Namespace(model_fingerprint=fp, tokenizer_hash=th, kv_format=kv_format,
                     layer_start=start, layer_end=end, format_version=FORMAT_VERSION, block_size=block_size)


def default_hot_cache_bytes() -> int:
    """A quarter of physical RAM, at most 16 GB: leaves room for weights and activations."""
    return int(min(psutil.virtual_memory().total * 0.25, 16 * 10**9))


class MlxPayloadCodec:
    """Block payloads (dicts of mlx arrays, `omlx.engine.cache_spec`) to numpy host blocks and back.

    Runs on the engine thread. ``to_host`` does not copy: each numpy array is a view of the
    (evaluated, never mutated) mlx buffer, which it keeps alive until written. bfloat16 travels
    as its uint16 bit pattern.

    Args:
        dtype: the KV dtype name (a key of ``omlx.cache.blockfile.DTYPES``); per-token tensors
            must have it, state snapshots may have any dtype of ``DTYPES``.
    """

    def __init__(self, dtype: str):
        self.dtype = dtype

    def to_host(self, payload: object) -> HostBlock:
        # Payloads are queued for evaluation, not waited for (`PrefixCacheTiers._payload_fn`):
        # wait here, where the host reads them.
        mx.eval(list(payload.values()))  # type: ignore[attr-defined]
        tensors: dict[str, tuple[str, np.ndarray]] = {}
        for name, a in payload.items():  # type: ignore[attr-defined]
            dtype = str(a.dtype).removeprefix("mlx.core.")
            if dtype not in DTYPES or (dtype != self.dtype and not name.startswith(STATE_PREFIX)
                                       and not (dtype == PACKED_DTYPE and name.endswith(".q"))):
                raise ValueError(f"block tensor {name} is {dtype}, the namespace says {self.dtype}")
            m = memoryview(a)
            if not m.c_contiguous:
                a = mx.contiguous(a)
                mx.eval(a)
                m = memoryview(a)
            tensors[name] = (dtype, np.frombuffer(m.cast("B"), dtype=DTYPES[dtype][1]).reshape(a.shape))
        return HostBlock(tensors=tensors)

    def from_host(self, host: HostBlock) -> tuple[Payload, int]:
        out: Payload = {}
        for name, (dtype, a) in host.tensors.items():
            x = mx.array(a)
            if dtype == "bfloat16":
                x = mx.view(x, mx.bfloat16)
            out[name] = x
        mx.eval(list(out.values()))
        return out, payload_bytes(out)


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
        spec: the model's cache layout (which layers are attention, window or state).
    """

    tiers: TieredCache
    spec: CacheSpec
    max_logprobs_bytes: int = 64 * 2**20
    prefill_note_tokens: int = 0  # the start-up measurement's block (the SSD tier's "prefill" note)
    prefill_rate_observed: bool = False  # the cost model's rate came from served prefills (a note)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_logprobs: OrderedDict[bytes, mx.array] = field(default_factory=OrderedDict)
    _num_logprobs_bytes: int = 0
    num_whole_prompt_hits: int = 0
    num_snapshots: int = 0
    num_hits_cut_to_snapshot: int = 0
    num_hits_cut_to_window: int = 0
    num_window_parts_refilled: int = 0

    def __post_init__(self) -> None:
        tiers = self.tiers
        if self.spec.has_state and (tiers.pool.tail_slack_tokens >= 0 or not tiers.policy.whole_partials_only
                                    or (tiers.store is not None and tiers.store.tail_slack_tokens >= 0)):
            raise ValueError("a model with recurrent-state layers needs tails kept as their own "
                             "(tail_slack_tokens=-1 in the pool and the SSD store) and whole last parts "
                             "(TierPolicy.whole_partials_only): its snapshots stand at their ends")

    @property
    def pool(self) -> BlockPool:
        return self.tiers.pool

    @property
    def namespace(self) -> Namespace:
        return self.tiers.namespace

    @property
    def block_size(self) -> int:
        return self.tiers.block_size

    def acquire(self, token_ids: list[int], *, whole: bool = False, materialize: bool = True) -> PrefixLease:
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
        hashes.extend(token_ids)
        with self._lock:
            hit = self.tiers.acquire(token_ids, whole=whole, block_hashes=hashes.hashes)
            usable = self.spec.hit_end(hit.parts)
            if usable < hit.num_cached_tokens and self.spec.window_layers:
                usable = self._refill_window_parts(hit, usable)
            if usable < hit.num_cached_tokens:  # a state model resumes only from a snapshot
                if all(self.spec.has_window_part(p) for p, _ in hit.parts):  # type: ignore[arg-type]
                    self.num_hits_cut_to_snapshot += 1
                else:  # a block the window layers read lost its window part
                    self.num_hits_cut_to_window += 1
                hit.truncate(usable)
            n = hit.num_cached_tokens
            is_whole = whole and n == len(token_ids)
            if is_whole:
                self.num_whole_prompt_hits += 1
            try:
                caches = self._materialize(hit.parts, len(token_ids) - n) if n and materialize else None
            except Exception:
                self.tiers.release(hit)
                raise
        return PrefixLease(hit, n, hit.num_cached_tokens_cold, caches, whole=is_whole, block_hashes=hashes,
                     num_registered_blocks=hit.num_full_blocks, num_prompt_tokens=len(token_ids))

    def _refill_window_parts(self, hit: PrefixHit, usable: int) -> int:
        """Read back from the cold tier the window parts a hit's window reads that the hot tier
        dropped, when that is cheaper than prefilling the tokens it would lose
        (`RestoreCostModel`); returns the hit's usable end after (`CacheSpec.hit_end`).

        Only hot blocks the hit holds are refilled (their cold copy has the part: written
        through before it was dropped); the refilled payload replaces the part in ``hit.parts``.
        """
        n = hit.num_cached_tokens
        reads = window_reads(n, *self.spec.window_reach)
        wanted: list[tuple[int, Any]] = []  # (index in parts, held block)
        pos = 0
        for i, (payload, used) in enumerate(hit.parts):
            a, pos = pos, pos + used
            if overlaps(a, pos, reads) and not self.spec.has_window_part(payload):  # type: ignore[arg-type]
                block = next((b for b in hit.held if b.payload is payload), None)
                if block is None:
                    return usable
                wanted.append((i, block))
        sizes = [self.tiers.cold_bytes(b) for _, b in wanted]
        if not wanted or any(x is None for x in sizes):
            return usable
        if not self.tiers.cost.decide(sum(sizes), n - usable).restore:  # type: ignore[arg-type]
            return usable
        for i, block in wanted:
            got = self.tiers.read_cold(block)
            if got is None:
                break
            names = self.spec.window_names(got[0])  # type: ignore[arg-type]
            if not names:
                break  # written after its window part was dropped
            merged = {**block.payload, **{k: got[0][k] for k in names}}  # type: ignore[index, dict-item]
            if not self.pool.restore_window_part(block, merged):
                break
            hit.parts[i] = (merged, hit.parts[i][1])
            self.num_window_parts_refilled += 1
        return self.spec.hit_end(hit.parts)  # type: ignore[arg-type]

    def truncate(self, lease: PrefixLease, num_tokens: int) -> None:
        """Cut an unmaterialized lease to its first ``num_tokens`` tokens (exact; see
        `PrefixHit.truncate`). A whole-prompt hit cut short no longer counts as one.

        Raises:
            ValueError: the lease is already materialized, or ``num_tokens`` is out of range.
        """
        if num_tokens == lease.num_cached_tokens:
            return
        if lease.caches is not None:
            raise ValueError("truncate a lease before materializing it")
        with self._lock:
            if lease.whole:
                self.num_whole_prompt_hits -= 1
                lease.whole = False
            lease.hit.truncate(num_tokens)
            lease.num_cached_tokens = num_tokens
            lease.num_cached_tokens_cold = lease.hit.num_cached_tokens_cold
            if self.spec.window_layers and self.spec.hit_end(lease.hit.parts) < num_tokens:  # type: ignore[arg-type]
                # The shorter hit's window reads parts the hot tier dropped: read them back.
                if self._refill_window_parts(lease.hit, 0) < num_tokens:
                    logger.warning("a prefix hit cut to %d tokens reads window parts that are gone; "
                                   "materializing it will fail", num_tokens)

    def materialize(self, lease: PrefixLease, *, room: int = 1) -> None:
        """Fill ``lease.caches`` from its held blocks (after ``acquire(..., materialize=False)``),
        with free room for ``room`` more tokens (the prompt's uncached rest; `CacheSpec.materialize`)."""
        with self._lock:
            if lease.caches is None and lease.num_cached_tokens:
                lease.caches = self._materialize(lease.hit.parts, room)

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

    def _materialize(self, parts: list[tuple[object, int]], room: int = 1) -> list[Any]:
        """Fresh per-layer caches holding the hit (`CacheSpec.materialize`): attention layers
        get buffers of their own, the blocks copied once with free room for ``room`` more tokens
        (the next updates write in place; the hot tier's arrays are never written through),
        window layers their last ``W`` tokens, state layers the last block's snapshot."""
        return self.spec.materialize(parts, room=room)  # type: ignore[arg-type]

    def cache_blocks(self, lease: PrefixLease, caches: list[Any], token_ids: list[int], num_tokens: int, *,
                     state_at: int | None = None, prompt_end: bool = False) -> int:
        """Register the request's full blocks among its first ``num_tokens`` tokens as soon as their
        KV is computed (after each prefill chunk, or when decode fills a block).

        The blocks become hits for any later lookup at once, while the request still runs; they
        are held by the lease until `release`, and queued for the SSD tier (low priority) like
        `store` does. Blocks the lease already registered (or hit) are skipped without hashing
        or copying; `store` at finish does only the rest and the tail.

        Args:
            lease: the request's lease (from `acquire`; not released).
            caches: the model's per-layer caches, batch 1, holding KV for at least
                ``num_tokens`` tokens from position 0 (window layers: the newest of them;
                blocks that fell out of a window end the chain).
            token_ids: the request's tokens from position 0 (prompt, then generated).
            num_tokens: how many leading tokens have KV in ``caches``.
            state_at: the position the caches' state layers stand at, when known exactly (a
                prefill chunk's end): the block ending there carries their snapshot.
            prompt_end: ``num_tokens`` is the end of the prompt. A model with state layers then
                also registers the partial last block with the snapshot there (the next turn
                of a chat resumes from it when the answer is not repeated token for token).

        Returns:
            The number of blocks newly registered by this call (0 when none completed, all
            were cached already, or the hot budget is full).
        """
        if lease.released or lease.hot_full or not caches:
            return 0
        seen = self.spec.num_tokens(caches)
        num_tokens = min(num_tokens, len(token_ids), seen if seen is not None else num_tokens)
        with self._lock:
            hashes = self._hashes_of(lease)
            hashes.extend(token_ids, num_tokens)
            end = num_tokens // self.block_size
            start = lease.num_registered_blocks
            tail = (prompt_end and self.spec.has_state and state_at == num_tokens
                    and num_tokens % self.block_size != 0)
            if (start >= end and not tail) or start * self.block_size < self.spec.held_from(caches):
                return 0
            payload = self._payload_fn(caches, state_at)
            chained, num_new = self.tiers.register_blocks(token_ids, hashes.hashes, start, end, payload,
                                                          lease.hit.held, lease.num_prompt_tokens)
            lease.num_registered_blocks = chained
            lease.hot_full = chained < end
            if tail and chained >= end:
                self.tiers.register_tail(token_ids, num_tokens, hashes.parent_of(end), payload,
                                         lease.num_prompt_tokens)
            return num_new

    def store(self, lease: PrefixLease, prompt_cache: list[Any], token_ids: list[int]) -> None:
        """Register the request's new full blocks and its tail (prompt + generated tokens).

        Blocks already cached (by `cache_blocks`, or by anyone) are not copied again and the
        lease's keys are extended rather than recomputed; when the budget is exhausted the rest
        of the chain is skipped (a chain is only useful from its start). New full blocks are
        queued for the SSD tier (low priority) off the request path. Call it after `release`
        or before; the blocks the lease holds stay cached either way, and a chain `cache_blocks`
        stopped for a full budget is tried again from where it stopped.
        """
        if not prompt_cache:
            return
        seen = self.spec.num_tokens(prompt_cache)
        if seen == 0:
            return
        # The caches at finish (or removal) stand exactly at their own offset: the block or
        # tail ending there (when the tokens reach it) carries the state layers' snapshot.
        num_tokens = len(token_ids) if seen is None else min(len(token_ids), seen)
        if lease.num_registered_blocks * self.block_size < self.spec.held_from(prompt_cache):
            return  # the next block fell out of a window layer's cache: the chain ends here
        with self._lock:
            hashes = self._hashes_of(lease)
            hashes.extend(token_ids, num_tokens)
            payload = self._payload_fn(prompt_cache, seen)
            self.tiers.store_sequence(token_ids, num_tokens, payload, block_hashes=hashes,
                                      num_registered=lease.num_registered_blocks,
                                      num_prompt_tokens=lease.num_prompt_tokens)

    def _hashes_of(self, lease: PrefixLease) -> BlockHashes:
        if lease.block_hashes is None:
            lease.block_hashes = BlockHashes(self.namespace.key(), self.block_size)
        return lease.block_hashes

    def _payload_fn(self, caches: list[Any], state_at: int | None) -> Callable[[int, int], tuple[Payload, int]]:
        """``(a, b) -> (payload, num_bytes)``: tokens ``[a, b)`` of ``caches`` as one block
        payload (`CacheSpec.payload_fn`), queued for evaluation at once (per block: measured 2-3x
        faster on CPU than one eval of a chunk's blocks together), not waited for: the engine
        thread syncs only where the SSD tier reads a payload (`MlxPayloadCodec.to_host`), so a
        block whose write is deferred (generated tokens, a finished request's tail) costs no
        stall of the step in flight. (Until the copy has run, the next update of the caches it
        reads writes a fresh buffer instead of updating in place: a device copy, not a stall.)"""
        make = self.spec.payload_fn(caches, state_at)

        def payload(a: int, b: int) -> tuple[Payload, int]:
            p = make(a, b)
            mx.async_eval(list(p.values()))
            if has_snapshot(p):
                self.num_snapshots += 1
            return p, payload_bytes(p)

        return payload

    def adopt_chunk_prefill_rate(self, tokens_per_s: float) -> None:
        """Take the engine's measured rate at its own prefill chunk size (`StepSizes`) when it
        is higher than the start-up block measurement and no served prefill was observed yet:
        the engine prefills whole chunks, and on an accelerator one short block is mostly fixed
        cost (H200, 1B model: restoring from disk looked cheaper than a prefill that was not)."""
        with self._lock:
            cost = self.tiers.cost
            if self.prefill_rate_observed or cost.num_prefill_samples or tokens_per_s <= cost.prefill_tokens_per_s:
                return
            logger.info("restore cost model: prefill %.0f tok/s (measured at the prefill chunk size; was %.0f)",
                        tokens_per_s, cost.prefill_tokens_per_s)
            cost.adopt_prefill_rate(tokens_per_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Feed a measured prefill (``num_tokens`` computed in ``seconds``, the request alone in
        the batch) to the restore cost model, so restore-or-recompute follows the real rate."""
        with self._lock:
            self.tiers.cost.observe_prefill(num_tokens, seconds)

    def write_deferred(self) -> int:
        """Queue for the SSD tier the blocks and tails of generated tokens held back while
        requests ran (`TieredCache.write_deferred`); the engine calls it when idle."""
        with self._lock:
            return self.tiers.write_deferred()

    def release(self, lease: PrefixLease) -> None:
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
            cost, store = self.tiers.cost, self.tiers.store
            if store is not None and cost.num_prefill_samples and self.prefill_note_tokens:
                # The next start takes the rate served prefills showed, not a fresh block measurement.
                store.save_note("prefill", {"num_tokens": self.prefill_note_tokens, "at": time.time(),
                                            "tokens_per_s": cost.prefill_tokens_per_s, "source": "observed"})
            done = self.tiers.close(timeout_s)
            cold = self.tiers.cold_stats()
        if cold is not None:
            logger.info("cold KV cache flushed in %.2f s: %d files, %s%s", time.monotonic() - t0,
                        cold["num_files"], format_bytes(cold["num_bytes"]), "" if done else " (timed out)")
        return done

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.pool.stats()
        return {
            "block_size": self.block_size,
            "num_blocks": s.num_blocks,
            "num_full_blocks": s.num_full_blocks,
            "num_tails": s.num_tails,
            "num_held_blocks": s.num_blocks - s.num_free_blocks,  # held by running requests (private ones included)
            "num_bytes": s.num_bytes,
            "max_bytes": s.max_bytes,
            "num_lookups": s.num_lookups,
            "num_hits": s.num_hits,
            "num_misses": s.num_misses,
            "num_query_tokens": s.num_query_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_evictions": s.num_evictions,
            "num_evicted_bytes": s.num_evicted_bytes,
            "num_whole_prompt_hits": self.num_whole_prompt_hits,
            "cache_layout": self.spec.describe(),
            "num_snapshots": self.num_snapshots,
            "num_hits_cut_to_snapshot": self.num_hits_cut_to_snapshot,
            "num_window_bytes": s.num_window_bytes,
            "num_window_parts_dropped": s.num_window_parts_dropped,
            "num_window_bytes_dropped": s.num_window_bytes_dropped,
            "num_hits_cut_to_window": self.num_hits_cut_to_window,
            "num_window_parts_refilled": self.num_window_parts_refilled,
            "num_next_logprobs": len(self._next_logprobs),
            "num_next_logprobs_bytes": self._num_logprobs_bytes,
        }

    def cold_stats(self) -> dict[str, Any] | None:
        """The SSD tier's counters (``/v1/cache/stats`` "cold"), or None when it is off."""
        with self._lock:
            return self.tiers.cold_stats()


def make_prefix_cache(loaded: LoadedModel, config: ServerConfig, *, layer_range: tuple[int, int] | None = None,
                      prefill_rate: Callable[[Any, int], float] = measure_prefill_rate,
                      spec: CacheSpec | None = None) -> PrefixCacheTiers:
    """Build the cache tiers for a model from the server config (budgets printed at startup).

    Args:
        loaded: the model (in cluster mode: one rank's stage, ``cache_classes`` its layers').
        config: budgets, block size, SSD folder.
        layer_range: the layers ``[start, end)`` whose KV the tiers hold (cluster mode: the
            rank's stage), part of the namespace so each range has its own SSD folder; None =
            every layer.
        prefill_rate: ``(model, num_tokens) -> tokens/s`` measured at start for the restore
            cost model (cluster mode: a stage's own layers, with no collective).
        spec: the cache layout (default: `spec_of_model` of ``loaded.model``).

    Raises:
        UnsupportedCacheError: a layer's cache class is not one `omlx.engine.cache_spec` knows.
    """
    spec = spec or spec_of_model(loaded.model)
    max_bytes = config.cache.hot_cache_max_bytes or default_hot_cache_bytes()
    kv_dtype = _kv_dtype(loaded)
    plain = all(layer.kind == ATTENTION for layer in spec.layers)
    bs = config.cache.block_size
    ns = model_namespace(loaded, kv_dtype, layer_range, "KVCache" if plain else spec.describe(),
                         spec.kv_quantization, bs)
    # A recurrent model resumes only at a snapshot, which stands at a block's or tail's end:
    # tails are never dropped for a longer sibling, and a hit's last part is used whole.
    stateful = spec.has_state
    pool = BlockPool(max_bytes=max_bytes, block_size=bs, tail_slack_tokens=-1 if stateful else TAIL_SLACK_TOKENS,
                     window_parts=window_parts(spec))
    logger.info("hot KV cache for %s: %s budget, %d-token blocks, namespace %s, cache layout %s",
                loaded.model_id, format_bytes(max_bytes), bs, ns.digest(), spec.describe())
    if spec.has_state:
        logger.info("%s has recurrent-state layers: a prefix hit resumes from the last block whose state "
                    "was snapshotted (prefill chunk ends, finished requests)", loaded.model_id)
    policy = TierPolicy(write_through_hits=config.cache.ssd_write_through_hits,
                        write_new_blocks=config.cache.ssd_write_new_blocks, whole_partials_only=stateful)
    store, cost, observed = _make_cold_tier(loaded, config, ns, kv_dtype, policy, prefill_rate,
                                            tail_slack_tokens=-1 if stateful else TAIL_SLACK_TOKENS)
    tiers = TieredCache(pool, ns, MlxPayloadCodec(kv_dtype) if kv_dtype in DTYPES else _NoCodec(),
                        store, policy, cost)
    return PrefixCacheTiers(tiers, spec, prefill_note_tokens=_prefill_note_tokens(config), prefill_rate_observed=observed)


def window_parts(spec: CacheSpec) -> WindowParts | None:
    """How the hot tier measures and drops the window part of this layout's payloads
    (`CacheSpec.window_part_bytes`, `CacheSpec.drop_window_part`), or None without window layers."""
    if not spec.window_layers:
        return None
    reach, keep = spec.window_reach
    return WindowParts(reach_tokens=reach, keep_tokens=keep,
                       num_bytes=spec.window_part_bytes,  # type: ignore[arg-type]
                       drop=spec.drop_window_part)  # type: ignore[arg-type]


def _prefill_note_tokens(config: ServerConfig) -> int:
    """Tokens of the start-up prefill measurement (one block, at most 512)."""
    return max(1, min(config.cache.block_size, 512))


class _NoCodec:
    """Codec of a RAM-only cache (never called: without a store nothing goes to disk)."""

    def to_host(self, payload: object) -> HostBlock:
        raise ValueError("no cold tier")

    def from_host(self, host: HostBlock) -> tuple[object, int]:
        raise ValueError("no cold tier")


def _make_cold_tier(
    loaded: LoadedModel, config: ServerConfig, ns: Namespace, kv_dtype: str, policy: TierPolicy,
    prefill_rate: Callable[[Any, int], float] = measure_prefill_rate, tail_slack_tokens: int = TAIL_SLACK_TOKENS,
) -> tuple[SSDStore | None, RestoreCostModel | None, bool]:
    """Open the SSD tier (index rebuilt, budget printed) and measure the restore cost model;
    the flag says its prefill rate is one served prefills showed (the last run's note)."""
    if not config.cache.ssd_enabled:
        logger.info("SSD KV cache for %s: off (disabled by configuration)", loaded.model_id)
        return None, None, False
    if kv_dtype not in DTYPES:
        logger.warning("SSD KV cache for %s: off: KV dtype %s cannot be stored", loaded.model_id, kv_dtype)
        return None, None, False
    root = config.ssd_cache_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
        budget = config.cache.ssd_cache_max_bytes
        how = "configured"
        if budget is None:
            budget, how = default_ssd_cache_bytes(root), "default: 10% of free disk, at most 50 GB"
        store = SSDStore(root, ns, dtype=kv_dtype, max_bytes=budget, model_id=loaded.model_id,
                         tail_slack_tokens=tail_slack_tokens,
                         progress=sys.stderr.isatty())
    except OSError as e:
        logger.warning("SSD KV cache for %s: off: cannot use %s: %s", loaded.model_id, root, e)
        return None, None, False
    st = store.stats()
    logger.info("SSD KV cache for %s: %s, budget %s (%s); %d block files (%s) indexed in "
                "%.2f s, %d bad deleted", loaded.model_id, store.dir, format_bytes(budget), how, st.num_files,
                format_bytes(st.num_bytes), st.scan_s, st.num_bad_files)
    num_tokens = _prefill_note_tokens(config)
    note = store.load_note("prefill")
    observed = False
    if note and note.get("num_tokens") == num_tokens and time.time() - note.get("at", 0) < _PREFILL_NOTE_MAX_AGE_S:
        prefill, when = float(note["tokens_per_s"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(note["at"]))
        observed = note.get("source") == "observed"
        if observed:
            when += ", served prefills"
    else:
        prefill, when = prefill_rate(loaded.model, num_tokens), "now"
        store.save_note("prefill", {"num_tokens": num_tokens, "tokens_per_s": prefill, "at": time.time()})
    read_bw = store.measure_read_bandwidth() if st.num_files else None
    logger.info("restore cost model: prefill %.0f tok/s (measured %s, %d-token block); read %s",
                prefill, when, num_tokens,
                f"{format_rate(read_bw)} (measured)" if read_bw else
                f"{format_rate(policy.assumed_read_bytes_per_s)} (assumed until measured)")
    return store, RestoreCostModel(prefill, read_bw, policy), observed


def _kv_dtype(loaded: LoadedModel) -> str:
    """The dtype the model's KV will have (that of its first floating-point weight)."""
    from mlx.utils import tree_flatten

    for _, w in tree_flatten(loaded.model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            return str(w.dtype).removeprefix("mlx.core.")
    return "float32"


__all__ = ["MlxPayloadCodec", "PrefixCacheTiers", "PrefixLease", "make_prefix_cache", "measure_prefill_rate", "model_namespace",
           "window_parts"]

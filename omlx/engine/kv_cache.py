"""The engine's side of the KV cache: mlx arrays in and out of the block pool.

`PrefixCacheTiers` implements the engine's `PrefixCache` protocol on top of the pure
`omlx.cache.paged.BlockPool`: at admission it looks up the longest cached prefix and
concatenates its blocks into an mlx-lm ``KVCache`` per layer; when a request finishes it cuts
the request's KV (prompt and generated tokens) into blocks and registers the new ones.

A block's payload is a tuple over layers of ``(keys, values)``, each ``(1, n_kv_heads,
num_tokens, head_dim)`` in the model's KV dtype. Only models whose every layer uses mlx-lm's
plain ``KVCache`` get here (`LoadedModel.blockable`); others run without a cache, said loudly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
from mlx_lm.models.cache import KVCache

from omlx.cache.hashing import Namespace, hash_block, make_kv_format, model_fingerprint, tokenizer_hash
from omlx.cache.paged import BlockPool, PrefixHit
from omlx.config import ServerConfig
from omlx.engine.loader import LoadedModel

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FINGERPRINT_FILE = ".omlx-fingerprint.json"

Payload = tuple[tuple[mx.array, mx.array], ...]


@dataclass(slots=True)
class Lease:
    """A request's hold on cached blocks (the engine's `PrefixLease`).

    Attributes:
        hit: the blocks reused (held until release).
        num_cached_tokens: prompt tokens whose KV comes from the cache.
        num_cached_tokens_cold: the part of those restored from the SSD tier.
        caches: one mlx-lm KVCache per layer holding that prefix, or None on a miss.
    """

    hit: PrefixHit
    num_cached_tokens: int
    num_cached_tokens_cold: int = 0
    caches: list[Any] | None = None
    released: bool = False


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
    return sum(k.nbytes + v.nbytes for k, v in payload)


@dataclass(slots=True)
class PrefixCacheTiers:
    """Hot-tier prefix cache of one model (thread-safe; the engine thread does the work).

    Args:
        pool: the block pool (owns the byte budget and eviction).
        namespace: this model's namespace.
        num_layers: layers per payload.
    """

    pool: BlockPool
    namespace: Namespace
    num_layers: int
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def acquire(self, token_ids: list[int]) -> Lease:
        """Look up and hold the longest cached prefix of ``token_ids`` (at most len - 1 tokens)."""
        with self._lock:
            hit = self.pool.lookup(token_ids, self.namespace, max_cached_tokens=max(0, len(token_ids) - 1))
            self.pool.acquire(hit.all_blocks)
            n = hit.num_cached_tokens
            caches = self._materialize(hit) if n else None
        return Lease(hit, n, 0, caches)

    def _materialize(self, hit: PrefixHit) -> list[KVCache]:
        parts: list[Payload] = [b.payload for b in hit.blocks]  # type: ignore[misc]
        if hit.partial is not None and hit.num_partial_tokens:
            k = hit.num_partial_tokens
            parts.append(tuple((kk[:, :, :k], vv[:, :, :k]) for kk, vv in hit.partial.payload))  # type: ignore[union-attr]
        caches = []
        for layer in range(self.num_layers):
            keys = mx.concatenate([p[layer][0] for p in parts], axis=2) if len(parts) > 1 else parts[0][layer][0]
            values = mx.concatenate([p[layer][1] for p in parts], axis=2) if len(parts) > 1 else parts[0][layer][1]
            c = KVCache()
            c.state = (keys, values, keys.shape[2])
            caches.append(c)
        mx.eval([c.keys for c in caches], [c.values for c in caches])
        return caches

    def store(self, lease: Lease, prompt_cache: list[Any], token_ids: list[int]) -> None:
        """Register the request's new full blocks and its tail (prompt + generated tokens).

        Blocks already cached are not copied again; when the budget is exhausted the rest of
        the chain is skipped (a chain is only useful from its start).
        """
        if not prompt_cache or prompt_cache[0].keys is None:
            return
        total = min(len(token_ids), prompt_cache[0].offset)
        bs = self.block_size
        keys = [c.keys for c in prompt_cache]
        values = [c.values for c in prompt_cache]

        def payload(a: int, b: int) -> Payload:
            p = tuple((mx.contiguous(k[:, :, a:b]), mx.contiguous(v[:, :, a:b])) for k, v in zip(keys, values))
            mx.eval(p)
            return p

        held = []
        with self._lock:
            try:
                parent = self.namespace.key()
                num_full = total // bs
                complete = True
                for i in range(num_full):
                    toks = token_ids[i * bs:(i + 1) * bs]
                    h = hash_block(parent, toks)
                    existing = self.pool.get(h)
                    if existing is not None and not existing.is_tail:
                        parent = h
                        continue
                    p = payload(i * bs, (i + 1) * bs)
                    blk = self.pool.register(self.namespace, parent, toks, p, _payload_bytes(p))
                    if blk is None:
                        complete = False
                        break
                    held.append(blk)
                    parent = h
                tail = token_ids[num_full * bs:total]
                if complete and tail:
                    p = payload(num_full * bs, total)
                    blk = self.pool.register_tail(self.namespace, parent, tail, p, _payload_bytes(p))
                    if blk is not None:
                        held.append(blk)
            finally:
                self.pool.release(held)

    def release(self, lease: Lease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                self.pool.release(lease.hit.all_blocks)
                lease.caches = None

    def clear(self) -> None:
        with self._lock:
            self.pool.clear(self.namespace)

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
        }


def make_prefix_cache(loaded: LoadedModel, config: ServerConfig) -> PrefixCacheTiers:
    """Build the cache tiers for a model from the server config (budget printed at startup)."""
    max_bytes = config.cache.hot_cache_max_bytes or default_hot_cache_bytes()
    kv_dtype = _kv_dtype(loaded)
    ns = model_namespace(loaded, kv_dtype)
    pool = BlockPool(max_bytes=max_bytes, block_size=config.cache.block_size)
    logger.info("hot KV cache for %s: %.2f GB budget, %d-token blocks, namespace %s",
                loaded.model_id, max_bytes / 1e9, config.cache.block_size, ns.digest())
    return PrefixCacheTiers(pool, ns, len(loaded.cache_classes))


def _kv_dtype(loaded: LoadedModel) -> str:
    """The dtype the model's KV will have (that of its first floating-point weight)."""
    from mlx.utils import tree_flatten

    for _, w in tree_flatten(loaded.model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            return str(w.dtype).removeprefix("mlx.core.")
    return "float32"


__all__ = ["Lease", "PrefixCacheTiers", "make_prefix_cache", "model_namespace"]

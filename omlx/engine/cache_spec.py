"""What a model's per-layer caches hold, and how they become blocks and come back (exactly).

mlx-lm makes one cache object per layer (``make_prompt_cache``). omlx's prefix cache knows
three kinds, in the way vLLM v1's hybrid KV cache manager and SGLang's Mamba radix cache
split a hybrid model into layer groups:

- **attention** (``KVCache``): per-token keys and values; every token's KV is kept.
- **window** (``RotatingKVCache``, window ``W``, ``keep`` sink tokens): per-token as well, but
  the cache holds only the last ``W`` tokens (plus the first ``keep``); a prefill leaves up to
  ``W - 1 + chunk`` in temporal order. Blocks store every token's KV like attention layers,
  as a *window part* of their own that the hot tier may drop (``omlx.cache.paged.WindowParts``):
  restoring a hit that ends at ``e`` reads only the window parts of tokens ``[0, keep)`` and
  ``[e - (W - keep), e)`` (all of ``[0, e)`` when ``e <= W``); `CacheSpec.hit_end` cuts a hit
  back to where every window part it reads is present.
- **quantized** (``QuantizedKVCache``, omlx's `omlx.engine.quant_cache.QuantKVCache`, from
  ``--kv-bits``): attention whose per-token keys and values are kept quantized (``bits``,
  ``group_size``); blocks hold the packed arrays with their scales and biases.
- **state** (``ArraysCache``: gated delta-net, Mamba/SSM and conv state): one
  fixed-size state per sequence, not per token. It is *snapshotted* at a position (the end of a
  block-aligned prefill chunk, or the end of a finished sequence) and attached to the block
  that ends there; a prefix hit on such a model may end only at a block that carries one.

A block's payload is a dict of mlx arrays. Per-token tensors have the token axis second to
last: ``"kv"`` is ``(num_attention_layers, 2, n_kv_heads, num_tokens, head_dim)`` and ``"win"``
the same of the window layers (the window part, absent once dropped) when every
attention/window layer shares keys' and values' ``(heads, head_dim)`` (keys at ``[:, 0]``), each
in layer order; otherwise (MLA: keys and values differ in head dim) ``"k.{layer}"`` /
``"v.{layer}"``, each ``(heads, num_tokens, dim)`` (the window part: those of window layers). Snapshot tensors are ``"state.{layer}.{i}"`` (the i-th array
of that layer's ``ArraysCache``, batch axis kept, any shape and dtype). Quantized layers replace
each per-token tensor ``X`` by three, ``X.q`` (packed ``uint32``, ``(…, num_tokens, dim * bits
/ 32)``), ``X.scales`` and ``X.biases`` (``(…, num_tokens, dim / group_size)``, the model's
dtype); a model mixes quantized with unquantized per-token layers only in the per-layer form.

Other cache classes (``ChunkedKVCache``, ``CacheList``,
``ConcatenateKVCache``) are not known here: `layer_specs` raises `UnsupportedCacheError`
and the model serves without a prefix cache, said loudly.

Must not: know about requests, tiers or files (``omlx.engine.kv_cache`` and ``omlx.cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from omlx.engine.quant_cache import QuantKVCache
from omlx.errors import OmlxError

ATTENTION, WINDOW, QUANTIZED, STATE = "attention", "window", "quantized", "state"
STATE_PREFIX = "state."
WINDOW_TENSOR = "win"
QUANT_PARTS = ("q", "scales", "biases")

Payload = dict[str, mx.array]


class UnsupportedCacheError(OmlxError, ValueError):
    """A layer's cache class cannot be cut into exact blocks or snapshots."""


class NotHeldError(OmlxError, ValueError):
    """Tokens asked for are no longer in a window layer's cache (they fell out of its window)."""


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's cache kind.

    Attributes:
        kind: ``"attention"``, ``"window"``, ``"quantized"`` or ``"state"``.
        window: the window ``W`` of a window layer (``RotatingKVCache.max_size``), else 0.
        keep: sink tokens a window layer always keeps (``RotatingKVCache.keep``), else 0.
        num_arrays: arrays of a state layer (``len(ArraysCache.cache)``), else 0.
        bits, group_size: a quantized layer's KV quantization, else 0.
    """

    kind: str
    window: int = 0
    keep: int = 0
    num_arrays: int = 0
    bits: int = 0
    group_size: int = 0

    def tag(self) -> str:
        """Short text for the namespace: ``A``, ``W512k0``, ``Q8g64``, ``S2``."""
        if self.kind == ATTENTION:
            return "A"
        if self.kind == WINDOW:
            return f"W{self.window}k{self.keep}"
        if self.kind == QUANTIZED:
            return f"Q{self.bits}g{self.group_size}"
        return f"S{self.num_arrays}"


def layer_specs(caches: Sequence[Any]) -> tuple[LayerSpec, ...]:
    """The kind of each layer's cache (fresh caches from ``make_prompt_cache``).

    Raises:
        UnsupportedCacheError: a class this module does not know (named in the message), or
            only state layers (a pure Mamba/RWKV model: no per-token KV to key blocks by).
    """
    out = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            out.append(LayerSpec(ATTENTION))
        elif type(c) is RotatingKVCache:
            out.append(LayerSpec(WINDOW, window=int(c.max_size), keep=int(c.keep)))
        elif type(c) in (QuantizedKVCache, QuantKVCache):
            out.append(LayerSpec(QUANTIZED, bits=int(c.bits), group_size=int(c.group_size)))
        elif type(c) is ArraysCache:  # a subclass might need more than its size to be rebuilt
            out.append(LayerSpec(STATE, num_arrays=len(c.cache)))
        else:
            raise UnsupportedCacheError(f"layer {i} uses {type(c).__name__}, which the prefix cache cannot "
                                        "cut into exact blocks yet")
    if out and all(s.kind == STATE for s in out):
        # Blocks are keyed and sized by their per-token KV; a model without any has none.
        raise UnsupportedCacheError("every layer is recurrent state (no attention layer): a state-only model "
                                    "is not cached yet")
    return tuple(out)


def describe(layers: Sequence[LayerSpec]) -> str:
    """Run-length text of the layer kinds, e.g. ``"A*2,W512k0*10"`` (names a cache layout)."""
    runs: list[list[Any]] = []
    for spec in layers:
        t = spec.tag()
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return ",".join(t if n == 1 else f"{t}*{n}" for t, n in runs)


def freeze(caches: Sequence[Any]) -> list[Any]:
    """A view of ``caches`` as they stand now, for reading after later steps updated them.

    ``KVCache`` objects are returned as they are (later tokens only write at later positions);
    a window or state layer gets a new cache object whose arrays are new graph nodes of the
    current ones (``mx.stop_gradient``: no copy; a later in-place update of the live cache
    then copies instead of writing through).
    """
    out: list[Any] = []
    for c in caches:
        if type(c) is RotatingKVCache and c.keys is not None:
            f = RotatingKVCache(c.max_size, c.keep)
            f.state = (mx.stop_gradient(c.keys), mx.stop_gradient(c.values), c.offset, c.keep, c.max_size, c._idx)
            out.append(f)
        elif isinstance(c, ArraysCache):
            f = ArraysCache(len(c.cache))
            f.cache = [None if a is None else mx.stop_gradient(a) for a in c.cache]
            out.append(f)
        else:
            out.append(c)
    return out


def _window_first(c: RotatingKVCache) -> int:
    """The first position after its ``keep`` sink tokens that a window cache still holds (0
    when it never trimmed), from its indices alone: ``_temporal_order`` would keep
    ``keys.shape[2]`` tokens (rotated or full) or the first ``_idx`` (still growing)."""
    size = c.keys.shape[2]
    held = size if c._idx == size or c._idx < c.offset else c._idx
    first = c.offset - held if c.offset <= held or c.keep == 0 else c.offset - (held - c.keep)
    return max(first, 0)


def _window_order(c: RotatingKVCache) -> tuple[mx.array, mx.array, int]:
    """(keys, values, first position) of a window cache in temporal order; positions ``[0,
    keep)`` are at the front when the cache trimmed, then ``[first, offset)``."""
    return c._temporal_order(c.keys), c._temporal_order(c.values), _window_first(c)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The cache layout of one model (or one cluster stage's layers).

    Holds no reference to the model (an unloaded model's memory must come back even while
    its prefix cache is still being flushed or referenced).

    Args:
        layers: one `LayerSpec` per layer, in layer order.
    """

    layers: tuple[LayerSpec, ...]

    @classmethod
    def plain(cls, num_layers: int) -> CacheSpec:
        """``num_layers`` plain attention layers (mlx-lm's default cache: one ``KVCache`` each)."""
        return cls(tuple(LayerSpec(ATTENTION) for _ in range(num_layers)))

    def with_kv_bits(self, bits: int, group_size: int) -> CacheSpec:
        """This layout with every full-attention layer's KV quantized (``--kv-bits``); window
        and state layers stay as they are (mlx-lm has no quantized rotating cache)."""
        return CacheSpec(tuple(LayerSpec(QUANTIZED, bits=bits, group_size=group_size) if s.kind == ATTENTION else s
                               for s in self.layers))

    @property
    def kv_quantization(self) -> tuple[int, int] | None:
        """(bits, group size) of the quantized layers, or None when none is."""
        for s in self.layers:
            if s.kind == QUANTIZED:
                return s.bits, s.group_size
        return None

    def make_cache(self) -> list[Any]:
        """Fresh per-layer caches of these kinds, as ``make_prompt_cache`` makes them."""
        out: list[Any] = []
        for spec in self.layers:
            if spec.kind == ATTENTION:
                out.append(KVCache())
            elif spec.kind == QUANTIZED:
                out.append(QuantKVCache(spec.group_size, spec.bits))
            elif spec.kind == WINDOW:
                out.append(RotatingKVCache(spec.window, spec.keep))
            else:
                out.append(ArraysCache(spec.num_arrays))
        return out

    @property
    def token_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.kind != STATE]

    @property
    def window_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.kind == WINDOW]

    @property
    def window_reach(self) -> tuple[int, int]:
        """(``max(W - keep)``, ``max(keep)``) over the window layers ((0, 0) without any): a hit
        ending at ``e`` reads the window parts of tokens ``[0, keep)`` and ``[e - reach, e)``."""
        win = [self.layers[i] for i in self.window_layers]
        return max((s.window - s.keep for s in win), default=0), max((s.keep for s in win), default=0)

    def window_names(self, payload: Payload) -> list[str]:
        """Names of ``payload``'s window part (empty when dropped or the model has none)."""
        if not self.window_layers:
            return []
        if WINDOW_TENSOR in payload:
            return [WINDOW_TENSOR]
        return [n for i in self.window_layers for n in (f"k.{i}", f"v.{i}") if n in payload]

    def has_window_part(self, payload: Payload) -> bool:
        """Whether ``payload`` holds its window layers' KV (always True without window layers)."""
        return not self.window_layers or bool(self.window_names(payload))

    def window_part_bytes(self, payload: Payload) -> int:
        """Bytes of ``payload``'s window part (0 when dropped or the model has none)."""
        return int(sum(payload[n].nbytes for n in self.window_names(payload)))

    def drop_window_part(self, payload: Payload) -> Payload:
        """A new payload without the window part (``payload`` itself is not changed: a lease
        may still read it)."""
        names = set(self.window_names(payload))
        return {k: v for k, v in payload.items() if k not in names}

    @property
    def state_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.kind == STATE]

    @property
    def has_state(self) -> bool:
        return any(s.kind == STATE for s in self.layers)

    def describe(self) -> str:
        return describe(self.layers)

    def num_tokens(self, caches: Sequence[Any]) -> int | None:
        """Tokens the caches have seen (the first per-token layer's ``offset``); None for a
        model with state layers only."""
        for i in self.token_layers:
            return int(caches[i].offset)
        return None

    def held_from(self, caches: Sequence[Any]) -> int:
        """The first position every window layer still holds (0 when all do): blocks before it
        cannot be cut from these caches."""
        first = 0
        for i in self.token_layers:
            c = caches[i]
            if type(c) is RotatingKVCache and c.keys is not None:
                f = _window_first(c)
                if f > c.keep:
                    first = max(first, f)
        return first

    # ---- caches -> block payloads --------------------------------------------------------

    def payload_fn(self, caches: Sequence[Any], state_at: int | None) -> Callable[[int, int], Payload]:
        """``(a, b) -> payload`` of tokens ``[a, b)`` of batch-1 ``caches`` (lazy arrays).

        Args:
            caches: per layer, batch 1, holding every token up to ``b`` (window layers: at
                least those in ``[a, b)``).
            state_at: the position the state layers' arrays stand at (their snapshot goes into
                the block ending there), or None when unknown (no snapshot is taken).

        Raises:
            NotHeldError: (from the function) a window layer no longer holds ``[a, b)``.
        """
        tok = self.token_layers
        windows = {i: _window_order(caches[i]) for i in tok if type(caches[i]) is RotatingKVCache}

        def kv(i: int, a: int, b: int) -> tuple[Any, Any]:
            c = caches[i]
            if isinstance(c, QuantizedKVCache):
                return tuple(x[0, :, a:b] for x in c.keys), tuple(x[0, :, a:b] for x in c.values)
            if i not in windows:
                return c.keys[0, :, a:b], c.values[0, :, a:b]
            keys, values, first = windows[i]
            if b <= c.keep or first <= c.keep:
                lo = a
            elif a >= first:
                lo = a - first + c.keep
            else:
                raise NotHeldError(f"layer {i} holds positions from {first}, block starts at {a}")
            return keys[0, :, lo : lo + b - a], values[0, :, lo : lo + b - a]

        uniform = self._uniform(caches)
        # Indices into ``tok`` of the attention layers and of the window layers (the window part).
        attn = [j for j, i in enumerate(tok) if self.layers[i].kind != WINDOW]
        win = [j for j, i in enumerate(tok) if self.layers[i].kind == WINDOW]

        def payload(a: int, b: int) -> Payload:
            out: Payload = {}
            if tok:
                pairs = [kv(i, a, b) for i in tok]
                if uniform:
                    if isinstance(pairs[0][0], tuple):
                        for j, part in enumerate(QUANT_PARTS):
                            flat = mx.stack([side[j] for pair in pairs for side in pair])
                            out[f"kv.{part}"] = flat.reshape(len(tok), 2, *flat.shape[1:])
                    else:
                        for name, group in (("kv", attn), (WINDOW_TENSOR, win)):
                            if group:
                                flat = mx.stack([x for j in group for x in pairs[j]])
                                out[name] = flat.reshape(len(group), 2, *flat.shape[1:])
                else:
                    for i, (k, v) in zip(tok, pairs):
                        if isinstance(k, tuple):
                            for j, part in enumerate(QUANT_PARTS):
                                out[f"k.{i}.{part}"], out[f"v.{i}.{part}"] = k[j], v[j]
                        else:
                            out[f"k.{i}"], out[f"v.{i}"] = k, v
            if state_at is not None and b == state_at:
                for i in self.state_layers:
                    for j, arr in enumerate(caches[i].cache):
                        if arr is not None:
                            out[f"{STATE_PREFIX}{i}.{j}"] = arr
            return out

        return payload

    def _uniform(self, caches: Sequence[Any]) -> bool:
        """Every per-token layer has one kind (quantized or not) and keys and values of one
        ``(heads, dim)`` and dtype: they stack into one tensor (per quantized part)."""
        def first(x: Any) -> mx.array:
            return x[0] if isinstance(x, tuple) else x

        shapes = {(isinstance(caches[i].keys, tuple), first(caches[i].keys).shape[1], first(caches[i].keys).shape[3],
                   first(caches[i].values).shape[1], first(caches[i].values).shape[3], first(caches[i].keys).dtype)
                  for i in self.token_layers}
        if len(shapes) != 1:
            return False
        _, kh, kd, vh, vd, _ = shapes.pop()
        return (kh, kd) == (vh, vd)

    # ---- block payloads -> caches --------------------------------------------------------

    def materialize(self, parts: Sequence[tuple[Payload, int]], *, room: int = 1) -> list[Any]:
        """Fresh per-layer caches holding the prefix the parts cover, as a prefill of the same
        tokens leaves them for every later token (window layers: the last ``W - keep`` tokens
        and the ``keep`` first, read from the parts that hold them, so the other parts may
        lack their window part; state layers: the snapshot of the last part).

        Attention layers get buffers of their own with free room after the prefix, as a prefill
        leaves them: each layer's keys (values) are the blocks' slices copied once into one
        array of at least ``tokens + room`` positions (a multiple of ``KVCache.step``), so the
        next updates write in place. (An exact-size buffer, or a view of one buffer shared by
        the layers, would be copied whole into a grown one by mlx-lm's first update: a second
        copy of the prefix's KV, ~460 MB for 18.7k tokens of Qwen2.5-0.5B in float32.)

        Args:
            parts: ``(payload, tokens used)`` in sequence order; with state layers the last
                payload must carry a snapshot and be used whole. A part may lack its window
                part only where `hit_end` allows.
            room: tokens the caller will add soon (the prompt's uncached rest, at least its
                first token): the attention layers' free positions.

        Raises:
            ValueError: a state model's last part has no snapshot, or a part the window layers
                read lacks its window part.
        """
        num_tokens = sum(n for _, n in parts)
        window = {WINDOW_TENSOR} | {f"{kv}.{i}" for i in self.window_layers for kv in "kv"}
        attention = {"kv"} | {f"{kv}.{i}" for i, s in enumerate(self.layers) if s.kind == ATTENTION for kv in "kv"}
        capacity = -(-(num_tokens + max(room, 1)) // KVCache.step) * KVCache.step
        joined: dict[str, mx.array] = {}
        names = [k for k in parts[0][0] if not k.startswith(STATE_PREFIX) and k not in window | attention]
        for name in names:
            pieces = []
            for payload, n in parts:
                x = payload[name]
                pieces.append(x if n == x.shape[-2] else x[..., :n, :])
            joined[name] = mx.concatenate(pieces, axis=-2) if len(pieces) > 1 else pieces[0]
        caches = self.make_cache()
        qkvs = [joined[f"kv.{p}"] for p in QUANT_PARTS] if "kv.q" in joined else None
        reach, keep = self.window_reach
        wins = _gather(parts, WINDOW_TENSOR, num_tokens, reach, keep) if self.window_layers and \
            WINDOW_TENSOR in parts[-1][0] else None
        j_attn = j_win = 0
        for i in self.token_layers:
            c, spec = caches[i], self.layers[i]
            if spec.kind == QUANTIZED:
                if qkvs is not None:
                    qk, qv = tuple(x[j_attn, 0][None] for x in qkvs), tuple(x[j_attn, 1][None] for x in qkvs)
                else:
                    qk = tuple(joined[f"k.{i}.{p}"][None] for p in QUANT_PARTS)
                    qv = tuple(joined[f"v.{i}.{p}"][None] for p in QUANT_PARTS)
                j_attn += 1
                c.state = (qk, qv, num_tokens, spec.group_size, spec.bits)
                continue
            if spec.kind == ATTENTION:
                if "kv" in parts[0][0]:
                    k, v = (_with_room(parts, "kv", (j_attn, kv), capacity) for kv in (0, 1))
                else:
                    k, v = (_with_room(parts, f"{kv}.{i}", (), capacity) for kv in "kv")
                j_attn += 1
                c.state = (k, v, num_tokens)
                continue
            # A window layer: the tokens [0, keep) and [e - (W - keep), e) of the gathered
            # window tensor, whose positions are [0, head) then [first, e).
            if wins is not None:
                x, head, first = wins
                k, v = x[j_win, 0][None], x[j_win, 1][None]
            else:
                kx, head, first = _gather(parts, f"k.{i}", num_tokens, spec.window - spec.keep, spec.keep)
                vx, _, _ = _gather(parts, f"v.{i}", num_tokens, spec.window - spec.keep, spec.keep)
                k, v = kx[None], vx[None]
            j_win += 1
            if num_tokens > spec.window:
                lo = head + (num_tokens - (spec.window - spec.keep)) - first
                k = mx.concatenate([k[:, :, : spec.keep], k[:, :, lo:]], axis=2)
                v = mx.concatenate([v[:, :, : spec.keep], v[:, :, lo:]], axis=2)
            c.state = (k, v, num_tokens, spec.keep, spec.window, k.shape[2])
        last, used = parts[-1]
        for i in self.state_layers:
            arrays = [last.get(f"{STATE_PREFIX}{i}.{j}") for j in range(self.layers[i].num_arrays)]
            if all(a is None for a in arrays) or used != _payload_tokens(last):
                raise ValueError(f"the cached prefix ends at {num_tokens} tokens without a state snapshot "
                                 f"for layer {i}")
            caches[i].cache = list(arrays)
        mx.eval([c.state for c in caches])
        return caches

    def hit_end(self, parts: Sequence[tuple[Payload, int]]) -> int:
        """Tokens of the longest usable prefix of a hit's parts (``(payload, tokens used)`` in
        sequence order): the largest end ``e`` such that

        - with state layers, ``e`` ends a part used whole that carries a snapshot (else any
          ``e`` up to the parts' tokens);
        - with window layers, every part overlapping the positions a window layer reads at
          ``e`` has its window part: ``[0, min(keep, e))`` and ``[max(0, e - (W - keep)), e)``
          (``keep``: the largest over the window layers, ``W - keep`` likewise). Attention
          parts are never dropped, so every part before ``e`` has those.

        0 when no such end is left.
        """
        grand = sum(n for _, n in parts)
        ends: list[int] = [] if self.has_state else [grand]  # candidates
        starts: list[tuple[int, int]] = []  # [start, end) of the parts without their window part
        total = 0
        for payload, n in parts:
            if self.window_layers and not self.has_window_part(payload):
                starts.append((total, total + n))
                if not self.has_state:
                    ends.append(total)
            total += n
            if self.has_state and n == _payload_tokens(payload) and has_snapshot(payload):
                ends.append(total)
        reach, keep = self.window_reach
        for e in sorted(ends, reverse=True):
            reads = window_reads(e, reach, keep)
            if not any(overlaps(a, b, reads) for a, b in starts):
                return e
        return 0


def window_reads(end: int, reach: int, keep: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The token positions a window layer (``reach = W - keep``, ``keep`` sink tokens) reads
    when a prefix of ``end`` tokens is restored: ``[0, head)`` and ``[first, end)``, with
    ``first = max(0, end - reach)`` and ``head = min(keep, first)`` (the two never overlap; all
    of ``[0, end)`` once they meet). The one statement of this rule for `CacheSpec.hit_end`,
    `_gather` and ``PrefixCacheTiers``' refill of dropped window parts."""
    first = max(0, end - reach)
    return (0, min(keep, first)), (first, end)


def overlaps(a: int, b: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether positions ``[a, b)`` meet any of the half-open ``ranges``."""
    return any(max(a, lo) < min(b, hi) for lo, hi in ranges)


def _with_room(parts: Sequence[tuple[Payload, int]], name: str, index: tuple[int, ...], capacity: int) -> mx.array:
    """One attention layer's keys or values of a hit, ``(1, heads, capacity, dim)``: the parts'
    tokens of tensor ``name`` (at ``index``, e.g. ``(layer, 0)`` of a block-major ``"kv"``) copied
    once into a fresh array, zeros after them (as ``KVCache`` grows)."""
    pieces = []
    for payload, n in parts:
        x = (payload[name][index] if index else payload[name])[None]
        pieces.append(x if n == x.shape[-2] else x[..., :n, :])
    num_tokens = sum(n for _, n in parts)
    pad = mx.zeros((*pieces[0].shape[:-2], capacity - num_tokens, pieces[0].shape[-1]), pieces[0].dtype)
    return mx.concatenate([*pieces, pad], axis=-2)


def _gather(parts: Sequence[tuple[Payload, int]], name: str, num_tokens: int, reach: int,
            keep: int) -> tuple[mx.array, int, int]:
    """The tensor ``name`` of the parts at the positions a window layer reads at ``num_tokens``
    (`window_reads`), concatenated on the token axis (-2), and ``(head, first)``: the array
    holds positions ``[0, head)`` then ``[first, num_tokens)``.

    Raises:
        ValueError: a part holding a read position lacks ``name`` (its window part was dropped
            where `CacheSpec.hit_end` would not have allowed).
    """
    reads = window_reads(num_tokens, reach, keep)
    (_, head), (first, _) = reads
    pieces = []
    pos = 0
    for payload, n in parts:
        a, b = pos, pos + n
        pos = b
        for lo, hi in reads:
            lo, hi = max(lo, a), min(hi, b)
            if lo >= hi:
                continue
            x = payload.get(name)
            if x is None:
                raise ValueError(f"the window layers read positions {lo}..{hi - 1}, whose block lost its window part")
            pieces.append(x[..., lo - a : hi - a, :])
    return (mx.concatenate(pieces, axis=-2) if len(pieces) > 1 else pieces[0]), head, first


def has_snapshot(payload: Payload) -> bool:
    return any(k.startswith(STATE_PREFIX) for k in payload)


def _payload_tokens(payload: Payload) -> int:
    """Tokens a payload's per-token tensors hold (0 for a snapshot-only payload)."""
    for k, x in payload.items():
        if not k.startswith(STATE_PREFIX):
            return int(x.shape[-2])
    return 0


def payload_bytes(payload: Payload) -> int:
    return int(sum(x.nbytes for x in payload.values()))


def spec_of_model(model: Any) -> CacheSpec:
    """The `CacheSpec` of an mlx-lm model (``make_prompt_cache``).

    Raises:
        UnsupportedCacheError: as `layer_specs`.
    """
    from mlx_lm.models.cache import make_prompt_cache

    return CacheSpec(layer_specs(make_prompt_cache(model)))


def describe_model_cache(path: Any, kv_bits: int | None = None, kv_group_size: int = 64) -> tuple[str, bool]:
    """(cache layout or the reason it is unsupported, prefix cache possible) of the mlx-lm
    model folder ``path``, without reading its weights (``mlx_lm.utils.load_model(lazy=True)``
    maps the files; nothing is evaluated); with ``kv_bits``, the layout ``--kv-bits`` serves it
    with. For ``omlx doctor``.

    Raises:
        Exception: whatever mlx-lm raises for a folder it cannot load.
    """
    from pathlib import Path

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True)
    caches = make_prompt_cache(model)
    try:
        spec = CacheSpec(layer_specs(caches))
        return (spec.with_kv_bits(kv_bits, kv_group_size) if kv_bits else spec).describe(), True
    except UnsupportedCacheError as e:
        return str(e), False


__all__ = ["ATTENTION", "QUANTIZED", "STATE", "WINDOW", "CacheSpec", "LayerSpec", "NotHeldError", "Payload",
           "UnsupportedCacheError", "describe", "describe_model_cache", "freeze", "has_snapshot", "layer_specs", "payload_bytes",
           "spec_of_model"]

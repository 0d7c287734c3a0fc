"""Quantized KV caches that batch (``--kv-bits``): one sequence's, and the decode batch's.

mlx-lm quantizes a sequence's KV in ``QuantizedKVCache``: each new token's keys and values are
``mx.quantize``-d along the head dim in groups of ``group_size`` (affine, ``bits`` per
element), kept as three arrays per side (packed ``uint32`` ``(B, H, T, D * bits / 32)``,
``scales`` and ``biases`` ``(B, H, T, D / group_size)`` in the model's dtype), and attention
reads them through ``mlx_lm.models.base.quantized_scaled_dot_product_attention`` (chosen by the
cache having ``bits``). mlx-lm 0.32.2 has no batched form: its ``BatchGenerator`` and
``mlx_lm.server`` serve ``kv_bits`` one stream at a time. omlx's step loop merges sequences
into one decode batch, so this module gives the quantized cache the batch surface the runner
uses for ``BatchKVCache`` (``merge``, ``extend``, ``filter``, ``extract``, left padding and its
mask), with the same layout rules (left-padded rows, ``_idx`` the shared write position).

Quantization is per token, so a token's quantized KV does not depend on the others: a block
cut from these arrays and restored later is exactly what a prefill of the same tokens writes.
Unlike mlx-lm's ``generate`` (``quantized_kv_start``, default 5,000 tokens), omlx quantizes from
the first token: one KV format per cache namespace.

Must not: know about requests, blocks or tiers.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache

#: The (bits, group size) pairs ``mx.quantize`` supports (affine mode).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)

QTensors = tuple[mx.array, mx.array, mx.array]  # packed, scales, biases


def _map(fn: Any, t: QTensors) -> QTensors:
    return tuple(fn(x) for x in t)  # type: ignore[return-value]


def _zeros(shape: tuple[int, ...], dim: int, dtype: Any, group_size: int, bits: int) -> QTensors:
    """Empty quantized storage for ``shape + (dim,)`` values."""
    return (mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype=dtype),
            mx.zeros((*shape, dim // group_size), dtype=dtype))


class QuantKVCache(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` for one sequence, able to join a decode batch.

    Adds what the runner needs beside ``KVCache``'s surface: ``size()`` (tokens held) and
    ``merge`` (several of these into one `BatchQuantKVCache`).
    """

    def size(self) -> int:
        return self.offset

    def merge(self, caches: Sequence[QuantKVCache]) -> BatchQuantKVCache:
        return BatchQuantKVCache.merge(caches)


class BatchQuantKVCache(_BaseCache):
    """Quantized KV of a left-padded decode batch (the quantized twin of mlx-lm's ``BatchKVCache``).

    Attributes:
        keys, values: ``(packed, scales, biases)``, each ``(B, H, S, ·)``, or None while empty;
            row ``b`` holds its tokens at ``[left_padding[b], _idx)``.
        left_padding: ``(B,)`` int32, padding positions at the front of each row.
        offset: ``(B,)`` int32, tokens each row has seen (its RoPE position).
        group_size, bits: the quantization (read by mlx-lm's attention to pick the quantized path).

    Args:
        left_padding: per row, padding positions at the front.
        group_size, bits: as ``QuantizedKVCache``.
    """

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: QTensors | None = None
        self.values: QTensors | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QTensors, QTensors]:
        """Quantize and append ``(B, H, n, D)`` keys and values; returns every position's quantized KV."""
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            shape = (B, H, (self.step + n - 1) // self.step * self.step)
            new_k = _zeros(shape, keys.shape[3], keys.dtype, self.group_size, self.bits)
            new_v = _zeros(shape, values.shape[3], values.dtype, self.group_size, self.bits)
            if self.keys is not None:
                old_k, old_v = self.keys, self.values
                if prev % self.step != 0:
                    old_k = _map(lambda x: x[..., :prev, :], old_k)
                    old_v = _map(lambda x: x[..., :prev, :], old_v)  # type: ignore[arg-type]
                new_k = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_k, new_k))  # type: ignore[assignment]
                new_v = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_v, new_v))  # type: ignore[assignment, arg-type]
            self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]  # type: ignore[index]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[QTensors, QTensors]:
        idx = self._idx
        return (_map(lambda x: x[..., :idx, :], self.keys),  # type: ignore[arg-type]
                _map(lambda x: x[..., :idx, :], self.values))  # type: ignore[arg-type]

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """``(B, 1, N, _idx + N)`` bool: causal, padding positions masked (as ``BatchKVCache``)."""
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep only rows ``batch_indices`` (in place), dropping padding every row now has."""
        if self.keys is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)  # type: ignore[arg-type]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)  # type: ignore[arg-type]
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantKVCache) -> None:
        """Append ``other``'s rows (in place), right-aligning both at the larger write position."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)  # type: ignore[index]
        idx = max(self._idx, other._idx)

        def padded(c: BatchQuantKVCache) -> tuple[QTensors, QTensors, mx.array, mx.array]:
            left = idx - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                H = ref.keys[0].shape[1]  # type: ignore[index]
                k = tuple(mx.zeros((rows, H, 0, x.shape[3]), dtype=x.dtype) for x in ref.keys)  # type: ignore[union-attr]
                v = tuple(mx.zeros((rows, H, 0, x.shape[3]), dtype=x.dtype) for x in ref.values)  # type: ignore[union-attr]
            else:
                k, v = c.keys, c.values  # type: ignore[assignment]
            right = size - k[0].shape[2] - left

            def fit(x: mx.array) -> mx.array:
                r = right
                if r < 0:
                    x, r = x[..., :r, :], 0
                return mx.pad(x, [(0, 0), (0, 0), (left, r), (0, 0)]) if left or r else x

            return _map(fit, k), _map(fit, v), c.offset, c.left_padding + left  # type: ignore[arg-type]

        a, b = padded(self), padded(other)
        self.keys = tuple(mx.concatenate([x, y]) for x, y in zip(a[0], b[0]))  # type: ignore[assignment]
        self.values = tuple(mx.concatenate([x, y]) for x, y in zip(a[1], b[1]))  # type: ignore[assignment]
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = idx

    def row_view(self, row: int, pad: int) -> QuantKVCache:
        """Row ``row`` (left padding ``pad``) as a one-sequence cache of slices (no copy)."""
        c = QuantKVCache(self.group_size, self.bits)
        k = _map(lambda x: x[row : row + 1, :, pad : self._idx], self.keys)  # type: ignore[arg-type]
        v = _map(lambda x: x[row : row + 1, :, pad : self._idx], self.values)  # type: ignore[arg-type]
        c.state = (k, v, self._idx - pad, self.group_size, self.bits)
        return c

    def extract(self, idx: int) -> QuantKVCache:
        """Row ``idx`` as its own `QuantKVCache` (a copy)."""
        pad = int(self.left_padding[idx].item())
        c = QuantKVCache(self.group_size, self.bits)
        k = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), self.keys)  # type: ignore[arg-type]
        v = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), self.values)  # type: ignore[arg-type]
        c.state = (k, v, self._idx - pad, self.group_size, self.bits)
        return c

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantKVCache:
        """One batch of one-sequence caches (each row right-aligned, padded on the left)."""
        gs, bits = caches[0].group_size, caches[0].bits
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), gs, bits)
        padding = [longest - n for n in lengths]
        full = next(c for c in caches if c.keys is not None)
        H = full.keys[0].shape[1]
        keys = tuple(mx.zeros((len(caches), H, longest, x.shape[3]), dtype=x.dtype) for x in full.keys)
        values = tuple(mx.zeros((len(caches), H, longest, x.shape[3]), dtype=x.dtype) for x in full.values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None or c.offset == 0:
                continue
            for j in range(3):
                keys[j][i : i + 1, :, p : p + c.offset] = c.keys[j][..., : c.offset, :]
                values[j][i : i + 1, :, p : p + c.offset] = c.values[j][..., : c.offset, :]
        out = cls(padding, gs, bits)
        out.keys, out.values = keys, values  # type: ignore[assignment]
        out.offset = out.offset + longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return int(sum(x.nbytes for x in (*self.keys, *self.values)))  # type: ignore[misc]


__all__ = ["KV_BITS", "KV_GROUP_SIZES", "BatchQuantKVCache", "QuantKVCache"]

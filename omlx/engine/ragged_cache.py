"""A decode batch's KV whose rows end at their own positions, so each row can drop its own tail.

Speculative decoding verifies every speculating row's draft in one forward pass; afterwards each
row keeps a different number of the positions just written (row i keeps ``1 + accepted_i``,
a plain decode row beside them keeps 1). mlx-lm's ``BatchKVCache`` has one write index
``_idx`` for all rows, so ``trim(n)`` drops the same count from every row. `RaggedBatchKVCache`
(our subclass of it) lets row ``i`` end ``slack[i]`` positions before ``_idx``:

    row 0:  pad pad  t0 t1 t2 t3 t4 t5 | _idx          slack 0
    row 1:   t0  t1  t2 t3 t4  x  x  x | _idx          slack 3  (x: dropped, never read)

- **Writes** go to each row's own end (``put_along_axis`` of the ``(B, H, N, D)`` new keys at
  ``end_i .. end_i + N - 1``), so a row's tokens stay contiguous ``[left_padding_i, end_i)``
  and the dropped positions are overwritten by its next tokens. While no row has slack (no
  speculation), writes are the parent's slice update.
- **The mask** (``make_mask``) lets query ``j`` of row ``i`` (at position ``end_i + j``) see
  ``[left_padding_i, end_i + j]``: the dropped positions past a row's end are never read.
- **RoPE** positions are ``offset`` (per row, as in ``BatchKVCache``), which counts only kept
  tokens: `trim_rows` lowers it with the row's end, so ``offset_i + left_padding_i == end_i``.
- The key length of attention is ``_idx = max_i end_i``; a common tail (every row's slack >= m)
  is cut at once. Rows that fall behind the leading row cost the same wasted key positions as the
  left padding of a row that joined later (the batch is a rectangle ``max_i (pad_i + tokens_i)``
  wide either way); `filter` (a row leaving) re-aligns the rows when that lets it cut width.

Options weighed (issue 25): (a) "holes" (write at the shared ``_idx``, mask out each row's
rejected positions) needs a ``(B, S)`` validity array in every mask and grows every row by the
whole draft width on every verify step, plain rows included (K pad positions per step), so it
needs periodic compaction copies; (b) rolling each row that kept fewer tokens right after every
verify step (mlx-lm's ``finalize`` does this for right padding) copies the whole KV of the batch
on almost every verify step. Ragged ends need neither: one scatter of the new positions per
layer per step while rows are ragged (measured on 2 CPU cores, B=4, H=8, 4k x 64 fp16: the
scatter costs about what the slice update does), no copy of old KV, a mask computed from
``(B,)`` arrays.

Relies on mlx-lm 0.32's ``BatchKVCache`` layout (``keys``/``values``/``_idx``, ``offset +
left_padding == _idx`` per row, ``filter`` cutting common left padding, ``extend``
right-justifying at ``_idx``); tests/unit/engine/test_spec_batch.py checks every method against
each row's own ``KVCache``, so an upstream change shows there.

**Repeating attention shapes** (``bucket``, set by the runner for a verify step on CUDA): MLX's
CUDA attention builds a cuDNN graph for every new (query length, key length) pair of a
multi-token forward, ~45-50 ms each on an H100 (`benchmarks/diag_verify_cost.py`: a width-2..7
verify forward of SmolLM2-135M 8-bit took 46-54 ms the first time, 3.9-5 ms once cached), and a
verify step's key length moves with every step. With ``bucket`` = B, the keys returned (and the
mask) span ``_idx`` rounded up to a multiple of B; the positions past each row's end are
masked, so the attention's values are the same while only one key length per B tokens of context
reaches the device. `BucketedKV` does the same for a lone row's plain ``KVCache``.

Must not: know about requests, drafts or sampling; the runner decides what each row keeps.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _with_room(buf: mx.array | None, keep: int, room: int, like: mx.array) -> mx.array:
    """``buf``'s first ``keep`` positions (axis 2) and then ``room`` zero positions; the other
    axes and the dtype are ``like``'s (a new buffer when ``buf`` is None)."""
    zeros = mx.zeros((*like.shape[:2], room, like.shape[3]), like.dtype)
    return zeros if buf is None else mx.concatenate([buf[..., :keep, :], zeros], axis=2)


class RaggedBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` whose rows may end before the shared write index ``_idx``.

    Attributes (beyond ``BatchKVCache``'s ``keys``, ``values`` ``(B, H, S, D)``,
    ``offset``/``left_padding`` ``(B,)`` int32 and ``_idx``):
        slack: per row (host ints), positions between the row's end and ``_idx``; the row's
            tokens are ``[left_padding[i], _idx - slack[i])``. All zero: the parent's layout.
        bucket: 0, or the multiple the key length of the next forward is rounded up to
            (module docstring); the runner sets it around a verify step only.
    """

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.slack = [0] * len(left_padding)
        self.bucket = 0

    @classmethod
    def adopt(cls, c: BatchKVCache) -> RaggedBatchKVCache:
        """``c``'s arrays as a `RaggedBatchKVCache` (no copy; ``c`` must not be used after)."""
        r = cls.__new__(cls)
        r.__dict__.update(c.__dict__)
        r.slack = list(getattr(c, "slack", None) or [0] * c.offset.shape[0])
        r.bucket = getattr(c, "bucket", 0)
        return r

    # ---- the forward pass ----------------------------------------------------------------

    def _ends(self) -> mx.array:
        """``(B,)`` int32: where each row's next token is written (one past its last token)."""
        return self.offset + self.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(B, H, N, D)`` keys/values at each row's end; every position up to the new
        ``_idx`` is returned (rows' dropped positions included: the mask hides them), or up to
        ``_idx`` rounded up to ``bucket`` when that is set (the positions past it masked too)."""
        if not any(self.slack) and not self.bucket:
            return super().update_and_fetch(keys, values)
        prev, n = self._idx, keys.shape[2]
        need = _round_up(prev + n, self.bucket) if self.bucket else prev + n
        if self.keys is None or need > self.keys.shape[2]:  # grow as the parent does (multiples of ``step``)
            size = _round_up(need - prev, self.step)
            self.keys = _with_room(self.keys, prev, size, keys)
            self.values = _with_room(self.values, prev, size, values)
        if any(self.slack):
            ends = mx.array([prev - s for s in self.slack])
            idx = (ends[:, None] + mx.arange(n)[None])[:, None, :, None]  # (B, 1, N, 1)
            self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
            self.values = mx.put_along_axis(self.values, idx, values, axis=2)
        else:
            self.keys[..., prev : prev + n, :] = keys
            self.values[..., prev : prev + n, :] = values
        self.offset = self.offset + n
        self._idx += n
        if self.bucket:
            end = _round_up(self._idx, self.bucket)
            return self.keys[..., :end, :], self.values[..., :end, :]
        return self.keys_and_values()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> mx.array:
        """``(B, 1, N, _idx + N)`` bool (``_idx + N`` rounded up to ``bucket`` when set): query
        ``j`` of row ``i`` sees ``[left_padding_i, end_i + j]`` (and only the last
        ``window_size`` of those, when given). With no slack and no bucket, the parent's mask
        (the same values)."""
        if not any(self.slack) and not self.bucket:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        width = _round_up(self._idx + N, self.bucket) if self.bucket else self._idx + N
        pos = self._ends()[:, None, None, None] + mx.arange(N)[:, None]  # (B, 1, N, 1)
        t = mx.arange(width)
        mask = (t <= pos) & (t >= self.left_padding[:, None, None, None])
        if window_size is not None:
            mask = mask & (t > pos - window_size)
        return mask

    # ---- what the runner does between steps ----------------------------------------------

    def trim_rows(self, n: Sequence[int]) -> None:
        """Drop the last ``n[i]`` tokens of each row ``i`` (their KV is never read again)."""
        if len(n) != len(self.slack):
            raise ValueError(f"trim_rows needs one count per row: {len(self.slack)} rows, got {len(n)}")
        if not any(n):
            return
        self.offset = self.offset - mx.array(list(n))
        self.slack = [s + k for s, k in zip(self.slack, n)]
        self._cut_common_tail()

    def _cut_common_tail(self) -> None:
        m = min(self.slack, default=0)
        if m:
            self._idx -= m
            self.slack = [s - m for s in self.slack]

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows ``batch_indices`` (in place); cut the width no kept row uses, re-aligning
        the rows' ends (one copy) when their slack and padding together allow it."""
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.slack = [self.slack[i] for i in keep]
        super().filter(batch_indices)  # gathers the rows and cuts the padding they all have
        self._cut_common_tail()
        if any(self.slack) and self.keys is not None:
            pads = self.left_padding.tolist()
            cut = min(p + s for p, s in zip(pads, self.slack))
            if cut > 0:  # every row has this much padding once aligned
                self.align()
                self.keys, self.values = self.keys[..., cut:, :], self.values[..., cut:, :]
                self.left_padding = self.left_padding - cut
                self._idx -= cut

    def align(self) -> None:
        """Move every row's tokens right by its slack (its dropped positions become left
        padding): the parent's layout again, one copy of the keys and values."""
        if not any(self.slack) or self.keys is None:
            self.slack = [0] * len(self.slack)
            return
        shift = mx.array(self.slack)
        self.keys = dynamic_roll(self.keys[..., : self._idx, :], shift[:, None], axis=2)
        self.values = dynamic_roll(self.values[..., : self._idx, :], shift[:, None], axis=2)
        self.left_padding = self.left_padding + shift
        self.slack = [0] * len(self.slack)

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows (a ``BatchKVCache`` or another of these); both are
        right-justified at the longer ``_idx`` by the parent, so each row's slack is kept."""
        theirs = list(getattr(other, "slack", None) or [0] * other.offset.shape[0])
        super().extend(other)
        self.slack = self.slack + theirs

    def extract(self, idx: int) -> KVCache:
        """Row ``idx``'s tokens as a batch-1 ``KVCache`` (a copy)."""
        pad = self.left_padding[idx].item()
        end = self._idx - self.slack[idx]
        c = KVCache()
        c.keys = mx.contiguous(self.keys[idx : idx + 1, :, pad:end])
        c.values = mx.contiguous(self.values[idx : idx + 1, :, pad:end])
        c.offset = end - pad
        return c

    def row_view(self, row: int, pad: int) -> KVCache:
        """A batch-1 ``KVCache`` view (no copy) of row ``row``, whose left padding is ``pad``."""
        end = self._idx - self.slack[row]
        v = KVCache()
        v.state = (self.keys[row : row + 1, :, pad:end], self.values[row : row + 1, :, pad:end], end - pad)
        return v

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self.slack = [self._idx - e for e in self._ends().tolist()]  # the ends are in the arrays


class BucketedKV:
    """A lone row's plain ``KVCache`` as one verify step sees it: the keys and the mask span the
    context rounded up to ``bucket`` positions (module docstring), the ones past the row's end
    masked. Writes go to the ``KVCache`` itself (its ``offset`` and buffer are the row's; the
    buffer grows to the rounded length when short), so the view is dropped after the forward.
    Other attributes are the ``KVCache``'s.
    """

    def __init__(self, cache: KVCache, bucket: int):
        self.cache, self.bucket = cache, bucket

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> mx.array:
        """``(N, L)`` bool, ``L`` = ``offset + N`` rounded up to ``bucket``: query ``j`` (at
        position ``offset + j``) sees ``[0, offset + j]`` (the last ``window_size``, when given)."""
        end = self.cache.offset
        pos = end + mx.arange(N)[:, None]
        t = mx.arange(_round_up(end + N, self.bucket))
        mask = t <= pos
        if window_size is not None:
            mask = mask & (t > pos - window_size)
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The ``KVCache``'s own write; returns its keys and values up to its new ``offset``
        rounded up to ``bucket``."""
        c = self.cache
        c.update_and_fetch(keys, values)
        end = _round_up(c.offset, self.bucket)
        if end > c.keys.shape[2]:
            c.keys = _with_room(c.keys, c.offset, end - c.offset, c.keys)
            c.values = _with_room(c.values, c.offset, end - c.offset, c.values)
        return c.keys[..., :end, :], c.values[..., :end, :]

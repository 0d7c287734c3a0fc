"""Which blocks a hit on a sliding-window layout needs (`CacheSpec.hit_end`), and that caches
built from parts that lost their window part equal those built from whole parts (no model:
random payloads of the shape `CacheSpec.payload_fn` gives)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from omlx.engine.cache_spec import ATTENTION, WINDOW, CacheSpec, LayerSpec
from omlx.engine.kv_cache import window_parts

BS = 4


def spec(window: int = 8, keep: int = 0) -> CacheSpec:
    return CacheSpec((LayerSpec(WINDOW, window=window, keep=keep), LayerSpec(ATTENTION),
                      LayerSpec(WINDOW, window=window, keep=keep)))


def blocks(n: int, seed: int = 0) -> list[dict[str, mx.array]]:
    """``n`` whole payloads of 4 tokens: ``kv`` (1 attention layer) and ``win`` (2 window layers)."""
    mx.random.seed(seed)
    return [{"kv": mx.random.normal((1, 2, 2, BS, 3)), "win": mx.random.normal((2, 2, 2, BS, 3))} for _ in range(n)]


def used(payloads: list[dict[str, mx.array]], num_tokens: int) -> list[tuple[dict[str, mx.array], int]]:
    """The parts of a hit of ``num_tokens`` over ``payloads`` (the last one used in part)."""
    out = []
    for p in payloads:
        n = min(BS, num_tokens)
        if n <= 0:
            break
        out.append((p, n))
        num_tokens -= n
    return out


def dropped(s: CacheSpec, payloads: list[dict[str, mx.array]], which: list[int]) -> list[dict[str, mx.array]]:
    return [s.drop_window_part(p) if i in which else p for i, p in enumerate(payloads)]


@pytest.mark.parametrize(("num_tokens", "gone", "keep", "end"), [
    (20, [], 0, 20),                  # whole
    (20, [0, 1, 2], 0, 20),           # window [12, 20): blocks 3, 4 only
    (20, [0, 1, 2, 3], 0, 0),         # block 3 is in [12, 20); every shorter end reads a gone part
    (18, [0, 1], 0, 18),              # a hit ending mid-block: window [10, 18)
    (18, [0, 1, 2], 0, 0),            # block 2 [8, 12) overlaps [10, 18)
    (20, [3], 0, 12),                 # cut to block 3's start: window [4, 12) is whole
    (24, [3], 0, 24),                 # window [16, 24)
    (7, [0], 0, 0),                   # e <= W: every token is read
    (20, [1, 2], 2, 20),              # keep 2: [0, 2) and [14, 20); block 0 kept
    (20, [0], 2, 0),                  # keep 2: block 0 holds the sink tokens
])
def test_hit_end_needs_the_window_parts_of_the_last_reach_tokens_and_the_sinks(num_tokens, gone, keep, end):
    s = spec(keep=keep)
    parts = used(dropped(s, blocks(6), gone), num_tokens)
    assert s.hit_end(parts) == end


def test_window_parts_hook_measures_and_drops_only_the_window_tensor():
    s = spec(keep=1)
    wp = window_parts(s)
    assert wp is not None and (wp.reach_tokens, wp.keep_tokens) == (7, 1)
    p = blocks(1)[0]
    assert wp.num_bytes(p) == p["win"].nbytes
    q = wp.drop(p)
    assert set(q) == {"kv"} and set(p) == {"kv", "win"}  # a new dict; the old one unchanged
    assert wp.num_bytes(q) == 0 and not s.has_window_part(q)
    assert window_parts(CacheSpec.plain(2)) is None


def _state(c):
    keys, values = c.state[0], c.state[1]
    return keys, values, c.offset, getattr(c, "_idx", None)


@pytest.mark.parametrize(("num_tokens", "gone", "keep"), [(20, [0, 1, 2], 0), (18, [0, 1], 0), (23, [1, 2], 2),
                                                          (6, [], 0)])
def test_caches_from_parts_without_window_parts_equal_those_from_whole_parts(num_tokens, gone, keep):
    s = spec(keep=keep)
    whole = used(blocks(6, seed=1), num_tokens)
    part = used(dropped(s, blocks(6, seed=1), gone), num_tokens)
    assert s.hit_end(part) == num_tokens
    made = s.materialize(part)
    for a, b in zip(s.materialize(whole), made):
        ka, va, oa, ia = _state(a)
        kb, vb, ob, ib = _state(b)
        assert (oa, ia) == (ob, ib) and ka.shape == kb.shape
        assert mx.array_equal(ka, kb) and mx.array_equal(va, vb)
    # What a prefill leaves in a window layer: the first ``keep`` tokens and the last ``W - keep``.
    win = mx.concatenate([p["win"][..., :n, :] for p, n in whole], axis=-2)  # (2 layers, 2, heads, T, dim)
    tail = min(num_tokens, 8 - keep) if num_tokens > 8 else num_tokens
    want = win if num_tokens <= 8 else mx.concatenate([win[..., :keep, :], win[..., num_tokens - tail :, :]], axis=-2)
    for j, c in zip((0, 1), (made[0], made[2])):
        assert c.offset == num_tokens and mx.array_equal(c.state[0][0], want[j, 0])
        assert mx.array_equal(c.state[1][0], want[j, 1])


def test_per_layer_tensors_of_window_layers_are_the_window_part():
    """Layers whose keys and values differ in shape store ``k.{i}``/``v.{i}``: the window
    layers' ones are the window part, gathered per layer when materialized."""
    s = CacheSpec((LayerSpec(WINDOW, window=8), LayerSpec(ATTENTION)))
    mx.random.seed(2)
    payloads = [{"k.0": mx.random.normal((2, BS, 3)), "v.0": mx.random.normal((2, BS, 5)),
                 "k.1": mx.random.normal((2, BS, 3)), "v.1": mx.random.normal((2, BS, 5))} for _ in range(5)]
    assert s.window_names(payloads[0]) == ["k.0", "v.0"]
    part = used(dropped(s, payloads, [0, 1]), 19)
    assert set(part[0][0]) == {"k.1", "v.1"} and s.hit_end(part) == 19
    whole = s.materialize(used(payloads, 19))
    cut = s.materialize(part)
    for a, b in zip(whole, cut):
        assert all(mx.array_equal(x, y) for x, y in zip(a.state[:2], b.state[:2]))
    with pytest.raises(ValueError, match="lost its window part"):
        s.materialize(used(dropped(s, payloads, [3]), 19))

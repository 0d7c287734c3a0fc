"""The mlx <-> numpy boundary of the cold tier (omlx.engine.kv_cache.MlxPayloadCodec): bit-exact
round trips of block payloads through a block file for float32, float16 and bfloat16, with no
model: the block-major ``kv`` of a plain model cut from longer per-layer caches, and a hybrid
payload (per-layer keys/values of different head dims, as MLA has, plus a float32 state
snapshot beside bfloat16 KV)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from omlx.cache.blockfile import block_path
from omlx.cache.hashing import Namespace, hash_block, make_kv_format
from omlx.cache.ssd import SSDStore
from omlx.engine.cache_spec import ATTENTION, STATE, CacheSpec, LayerSpec
from omlx.engine.kv_cache import MlxPayloadCodec


def caches_of(dtype, heads=(3, 3), dims=(16, 16), num_tokens: int = 12, vdims=None) -> list[KVCache]:
    out = []
    for h, d, vd in zip(heads, dims, vdims or dims):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, h, num_tokens, d)).astype(dtype),
                           mx.random.normal((1, h, num_tokens, vd)).astype(dtype))
        out.append(c)
    return out


def round_trip(tmp_path: Path, dtype: str, payload: dict, num_layers: int, layout: str = "KVCache") -> dict:
    codec = MlxPayloadCodec(dtype)
    host = codec.to_host(payload)
    ns = Namespace("m", "t", make_kv_format(dtype, None, None, layout), 0, num_layers)
    tokens = [1, 2, 3, 4]
    h = hash_block(ns.key(), tokens)
    store = SSDStore(tmp_path, ns, dtype=dtype, max_bytes=10**9)
    assert store.put(h, ns.key(), tokens, host) and store.flush(10)
    restored, num_bytes = codec.from_host(store.read(h, ns.key(), tokens))
    assert num_bytes == sum(x.nbytes for x in payload.values()) and set(restored) == set(payload)
    for name, x in payload.items():  # bit-exact, not just numerically equal
        assert restored[name].dtype == x.dtype and restored[name].shape == x.shape
        assert mx.array_equal(mx.view(x, mx.uint8), mx.view(restored[name], mx.uint8)).item(), name
    # mlx reads the file as plain safetensors too (bfloat16 included)
    loaded = mx.load(str(block_path(tmp_path, ns, h)))
    assert set(loaded) == set(payload)
    return restored


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_payload_round_trip_through_a_block_file_is_bit_exact(tmp_path: Path, dtype: str):
    mx_dtype = getattr(mx, dtype)
    caches = caches_of(mx_dtype)
    # A block is a slice of longer caches along the token axis (each cache has free room too).
    payload = CacheSpec.plain(2).payload_fn(caches, None)(4, 8)
    mx.eval(payload)
    assert set(payload) == {"kv"} and payload["kv"].shape == (2, 2, 3, 4, 16) and payload["kv"].dtype == mx_dtype
    for layer, c in enumerate(caches):
        assert mx.array_equal(payload["kv"][layer, 0], c.keys[0, :, 4:8]).item()
        assert mx.array_equal(payload["kv"][layer, 1], c.values[0, :, 4:8]).item()
    round_trip(tmp_path, dtype, payload, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hybrid_payload_with_per_layer_tensors_and_a_snapshot_round_trips(tmp_path: Path, dtype: str):
    mx_dtype = getattr(mx, dtype)
    caches: list = caches_of(mx_dtype, heads=(1, 1), dims=(32, 32), vdims=(8, 8))  # MLA-like
    state = ArraysCache(2)
    state[0], state[1] = mx.random.normal((1, 3, 5)).astype(mx_dtype), mx.random.normal((1, 2, 4, 4))
    caches.append(state)
    spec = CacheSpec((LayerSpec(ATTENTION), LayerSpec(ATTENTION), LayerSpec(STATE, num_arrays=2)))
    payload = spec.payload_fn(caches, 8)(4, 8)  # the block ends where the state stands
    mx.eval(payload)
    assert set(payload) == {"k.0", "v.0", "k.1", "v.1", "state.2.0", "state.2.1"}
    assert payload["k.0"].shape == (1, 4, 32) and payload["v.1"].shape == (1, 4, 8)
    assert payload["state.2.1"].dtype == mx.float32
    assert "state.2.0" not in spec.payload_fn(caches, 8)(0, 4)  # a block ending elsewhere: no snapshot
    restored = round_trip(tmp_path, dtype, payload, 3, spec.describe())
    # Two blocks' worth materialize into caches of the right kinds, the snapshot in place.
    first = spec.payload_fn(caches, None)(0, 4)
    got = spec.materialize([(first, 4), (restored, 4)])
    assert got[0].offset == 8 and mx.array_equal(got[1].values[..., :8, :], caches[1].values[..., :8, :]).item()
    assert mx.array_equal(got[2][1], state[1]).item()


def test_codec_refuses_a_payload_of_another_dtype():
    payload = {"kv": mx.zeros((1, 2, 1, 4, 2), dtype=mx.float16)}
    with pytest.raises(ValueError, match="float16"):
        MlxPayloadCodec("bfloat16").to_host(payload)

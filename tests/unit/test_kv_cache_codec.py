"""The mlx <-> numpy boundary of the cold tier (omlx.engine.kv_cache.MlxPayloadCodec): bit-exact
round trips of a block-major payload ``(layers, 2, heads, tokens, head_dim)`` through a block
file for float32, float16 and bfloat16, including a block cut from longer per-layer caches, with
no model; and a model whose layers differ in KV shape is refused loudly, not misstored."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from omlx.cache.hashing import Namespace, hash_block, make_kv_format
from omlx.cache.ssd import SSDStore
from omlx.engine.kv_cache import MlxPayloadCodec, NonUniformKVError, stack_block


def caches_of(dtype, heads=(3, 3), dims=(16, 16), num_tokens: int = 12) -> list[KVCache]:
    out = []
    for h, d in zip(heads, dims):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, h, num_tokens, d)).astype(dtype),
                           mx.random.normal((1, h, num_tokens, d)).astype(dtype))
        out.append(c)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_payload_round_trip_through_a_block_file_is_bit_exact(tmp_path: Path, dtype: str):
    mx_dtype = getattr(mx, dtype)
    caches = caches_of(mx_dtype)
    # A block is a slice of longer caches along the token axis (each cache has free room too).
    payload = stack_block(caches, 4, 8)
    mx.eval(payload)
    assert payload.shape == (2, 2, 3, 4, 16) and payload.dtype == mx_dtype
    for layer, c in enumerate(caches):
        assert mx.array_equal(payload[layer, 0], c.keys[0, :, 4:8]).item()
        assert mx.array_equal(payload[layer, 1], c.values[0, :, 4:8]).item()
    codec = MlxPayloadCodec(dtype)
    host = codec.to_host(payload)
    assert host.dtype == dtype and host.num_tokens == 4 and host.kv.shape == (2, 2, 3, 4, 16)

    ns = Namespace("m", "t", make_kv_format(dtype, None, None, "KVCache"), 0, 2)
    tokens = [1, 2, 3, 4]
    h = hash_block(ns.key(), tokens)
    store = SSDStore(tmp_path, ns, dtype=dtype, max_bytes=10**9)
    assert store.put(h, ns.key(), tokens, host) and store.flush(10)
    restored, num_bytes = codec.from_host(store.read(h, ns.key(), tokens))
    assert num_bytes == payload.nbytes and restored.dtype == mx_dtype and restored.shape == payload.shape
    # bit-exact, not just numerically equal
    assert mx.array_equal(mx.view(payload, mx.uint8), mx.view(restored, mx.uint8)).item()
    # mlx reads the file as plain safetensors too (bfloat16 included)
    from omlx.cache.blockfile import block_path

    loaded = mx.load(str(block_path(tmp_path, ns, h)))
    assert set(loaded) == {"kv"} and mx.array_equal(mx.view(loaded["kv"], mx.uint8), mx.view(payload, mx.uint8)).item()


def test_codec_refuses_a_payload_of_another_dtype():
    payload = mx.zeros((1, 2, 1, 4, 2), dtype=mx.float16)
    with pytest.raises(ValueError, match="float16"):
        MlxPayloadCodec("bfloat16").to_host(payload)


@pytest.mark.parametrize(("heads", "dims"), [((2, 4), (8, 8)), ((2, 2), (8, 16))])
def test_layers_of_different_kv_shapes_cannot_make_a_block(heads, dims):
    with pytest.raises(NonUniformKVError):
        stack_block(caches_of(mx.float32, heads, dims), 0, 4)

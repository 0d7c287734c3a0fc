"""The mlx <-> numpy boundary of the cold tier (omlx.engine.kv_cache.MlxPayloadCodec): bit-exact
round trips through a block file for float32, float16 and bfloat16, including a non-contiguous
slice, with no model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from omlx.cache.hashing import Namespace, hash_block, make_kv_format
from omlx.cache.ssd import SSDStore
from omlx.engine.kv_cache import MlxPayloadCodec


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_payload_round_trip_through_a_block_file_is_bit_exact(tmp_path: Path, dtype: str):
    mx_dtype = getattr(mx, dtype)
    full = [(mx.random.normal((1, 3, 12, 16)).astype(mx_dtype), mx.random.normal((1, 3, 12, 16)).astype(mx_dtype))
            for _ in range(2)]
    # A block is a slice of a longer cache along the token axis; one layer stays non-contiguous.
    payload = ((mx.contiguous(full[0][0][:, :, 4:8]), mx.contiguous(full[0][1][:, :, 4:8])),
               (full[1][0][:, :, 4:8], full[1][1][:, :, 4:8]))
    mx.eval(payload)
    codec = MlxPayloadCodec(dtype)
    host = codec.to_host(payload)
    assert host.dtype == dtype and host.num_tokens == 4

    ns = Namespace("m", "t", make_kv_format(dtype, None, None, "KVCache"), 0, 2)
    tokens = [1, 2, 3, 4]
    h = hash_block(ns.key(), tokens)
    store = SSDStore(tmp_path, ns, dtype=dtype, max_bytes=10**9)
    assert store.put(h, ns.key(), tokens, host) and store.flush(10)
    restored, num_bytes = codec.from_host(store.read(h, ns.key(), tokens))
    assert num_bytes == sum(k.nbytes + v.nbytes for k, v in payload)
    for (k0, v0), (k1, v1) in zip(payload, restored):
        assert k1.dtype == mx_dtype and k1.shape == (1, 3, 4, 16)
        assert mx.array_equal(k0, k1).item() and mx.array_equal(v0, v1).item()
        # bit-exact, not just numerically equal
        assert mx.array_equal(mx.view(k0, mx.uint8), mx.view(k1, mx.uint8)).item()


def test_codec_refuses_a_payload_of_another_dtype():
    payload = ((mx.zeros((1, 1, 4, 2), dtype=mx.float16), mx.zeros((1, 1, 4, 2), dtype=mx.float16)),)
    with pytest.raises(ValueError, match="float16"):
        MlxPayloadCodec("bfloat16").to_host(payload)

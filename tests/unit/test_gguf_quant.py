"""GGUF Q4_0 / Q4_1 / Q8_0 blocks become MLX affine triplets that dequantize to exactly the values
gguf-py's reference dequantizer gives (omlx.engine.gguf_quant)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from omlx.engine.gguf_quant import is_exact, to_mlx_affine


@dataclass
class _Tensor:  # the two fields of gguf.ReaderTensor that the conversion reads
    tensor_type: GGMLQuantizationType
    data: np.ndarray


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_convert_exactly(kind):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    qt = GGMLQuantizationType[kind]
    t = _Tensor(qt, quantize(w, qt))
    assert is_exact(t)
    weight, scales, biases, bits = to_mlx_affine(t)
    assert weight.dtype == np.uint32 and weight.shape == (48, 256 * bits // 32)
    assert scales.shape == biases.shape == (48, 256 // 32) and scales.dtype == np.float32
    ref = dequantize(t.data, qt).astype(np.float32)
    got = np.array(mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
    assert np.array_equal(ref, got)
    assert np.abs(ref - w).max() > 0  # the check is against the quantized values, not the originals


def test_other_types_are_not_kept():
    t = _Tensor(GGMLQuantizationType.Q6_K, np.zeros((4, 210), np.uint8))
    assert not is_exact(t)
    with pytest.raises(ValueError, match="Q6_K"):
        to_mlx_affine(t)

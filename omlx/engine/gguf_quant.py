"""GGUF block quantizations that MLX's affine quantization holds exactly, converted without loss.

Owns: turning a GGUF tensor of type Q4_0, Q4_1 or Q8_0 into MLX's ``(weight, scales, biases)``
triplet (``mx.quantize`` layout, group size 32), bit for bit the values the GGUF stands for.
Must not: read files or pick which tensors to keep quantized (``gguf_import`` does).

Why these are exact (ggml's ``ggml-common.h`` block structs; MLX's affine mode is
``w = scale * q + bias`` per group of ``group_size`` along a row, q unsigned):
  - Q4_1 ``{f16 d, f16 m, u8 qs[16]}``: ``w = d * q + m``         -> scale d, bias m;
  - Q4_0 ``{f16 d, u8 qs[16]}``:        ``w = d * (q - 8)``       -> scale d, bias -8 d;
  - Q8_0 ``{f16 d, i8 qs[32]}``:        ``w = d * q`` (q signed)  -> q + 128, scale d, bias -128 d.
In a 4-bit block byte j holds element j in its low nibble and element j + 16 in its high one.
MLX packs ``32 / bits`` values per uint32, element i of a word in bits ``[i * bits, (i + 1) * bits)``.
Scales and biases are written as float32 (f16 values and their multiples by 8 or 128 are exact
in float32, and so are ``d * q + bias`` for these ranges), so ``mx.dequantize`` of the triplet
equals ``gguf.quants.dequantize`` of the block exactly (a test checks it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: GGUF tensor types kept quantized, with the bits they become.
EXACT_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GROUP_SIZE = 32


def is_exact(tensor: Any) -> bool:
    """True for a 2-D GGUF tensor whose type MLX holds exactly (`EXACT_TYPES`)."""
    return tensor.tensor_type.name in EXACT_TYPES and len(tensor.data.shape) == 2


def to_mlx_affine(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A Q4_0 / Q4_1 / Q8_0 `gguf.ReaderTensor` as MLX affine arrays.

    Returns:
        ``(weight, scales, biases, bits)``: weight ``(rows, cols * bits / 32)`` uint32, scales and
        biases ``(rows, cols / 32)`` float32, rows and cols in HF layout (numpy order).

    Raises:
        ValueError: another tensor type.
    """
    kind = tensor.tensor_type.name
    raw = np.ascontiguousarray(tensor.data)  # (rows, num_blocks * block_bytes) uint8
    rows = raw.shape[0]
    if kind == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint32)  # (rows, nb, 32)
        return _pack(q.reshape(rows, -1), 8), d, -128.0 * d, 8
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, size)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        bias = -8.0 * d if kind == "Q4_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., size - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint32)  # elements 0..15, then 16..31
        return _pack(q.reshape(rows, -1), 4), d, bias, 4
    raise ValueError(f"GGUF type {kind} is not held exactly by MLX's affine quantization")


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """``(rows, cols)`` values < 2**bits -> ``(rows, cols * bits / 32)`` uint32, MLX's packing."""
    per = 32 // bits
    q = q.reshape(q.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)

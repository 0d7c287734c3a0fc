"""KV block gather: joining a request's cached blocks, by native kernel or reference path.

Owns one array operation of the hot tier (DESIGN.md, "Hot tier"): at admission, a request's
cached blocks -> one contiguous KV array per layer and per K/V (`gather_kv_blocks`). The
reference is what ``omlx/engine/kv_cache.py`` does: one ``mx.concatenate`` per layer and per
K/V, i.e. one copy launch per block, per layer, per K/V. The native path does the same copies
in one launch per group of layers through ``mx.fast.metal_kernel`` (macOS) or
``mx.fast.cuda_kernel`` (Linux GPUs), from ``metal/kv_gather.{metal,cu}``.

Which path runs is decided by `omlx.kernels.status.native_kernel_status`; a kernel runs only
where it was measured at >= 2x over the reference (metal/README.md) and passed its probe.
Today none does, so the reference runs everywhere unless a caller names a path (tests,
``metal/bench.py``). A kernel for the finishing side (cutting KV into blocks) was measured
slower than the reference and dropped (metal/README.md). Results are lazy mlx arrays; the
caller evaluates them. This module holds no policy (which blocks, when): that is the cache's.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from omlx.errors import OmlxError
from omlx.kernels.sources import SELECT, load_source, select_code

Payload = tuple[tuple[mx.array, mx.array], ...]
LayerKV = tuple[mx.array, mx.array]

KERNELS = ("kv_gather",)
NATIVE_PATHS = ("metal", "cuda")

# Pointers per launch: Metal binds at most 31 buffers per kernel; CUDA kernel parameters may
# take 32764 bytes (8 per pointer) since CUDA 12.1, so 2048 pointers leave ample room.
_MAX_BUFFERS = {"metal": 31, "cuda": 2048}
_THREADS = 256
_MAX_LANES = 1 << 16
# MLX binds Metal inputs of fewer than 8 elements in the constant address space.
_MIN_METAL_ELEMENTS = 8
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

_lock = threading.Lock()
_compiled: dict[tuple[str, str, int, int], Any] = {}
_active: dict[str, str] = {}


class KernelUnavailable(OmlxError, RuntimeError):
    """A native path was asked for but its source is missing (internal; status reports it)."""


def set_active_paths(paths: dict[str, str]) -> None:
    """Record the path each kernel takes from now on ("metal", "cuda" or "reference")."""
    with _lock:
        _active.clear()
        _active.update(paths)


def active_path(kernel: str) -> str:
    """The path `kernel` takes now; "reference" until `native_kernel_status` chose another."""
    return _active.get(kernel, "reference")


# ---------------------------------------------------------------- gather


def gather_reference(parts: Sequence[Payload], takes: Sequence[int]) -> list[LayerKV]:
    """The generic path of `gather_kv_blocks`: one concatenate per layer and per K/V."""
    out = []
    for layer in range(len(parts[0])):
        kv = []
        for j in (0, 1):
            pieces = [p[layer][j] if t == p[layer][j].shape[2] else p[layer][j][:, :, :t]
                      for p, t in zip(parts, takes)]
            kv.append(mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0])
        out.append((kv[0], kv[1]))
    return out


def gather_kv_blocks(parts: Sequence[Payload], takes: Sequence[int], path: str | None = None) -> list[LayerKV]:
    """Join cached blocks into one KV array per layer (lazy; the caller evaluates).

    Args:
        parts: N block payloads in token order; ``parts[i][layer] = (keys, values)``, each
            ``(1, n_kv_heads, T_i, head_dim)``, same dtype and heads for every block.
        takes: tokens used from each block (``1 <= takes[i] <= T_i``; only a last, partial
            block takes fewer than it holds).
        path: "metal", "cuda" or "reference"; None = the path chosen at start-up.

    Returns:
        Per layer ``(keys, values)``, each ``(1, n_kv_heads, sum(takes), head_dim)``.

    Raises:
        ValueError: no parts, or ``takes`` does not match ``parts``.
    """
    if not parts or len(parts) != len(takes):
        raise ValueError(f"gather_kv_blocks: {len(parts)} parts but {len(takes)} takes")
    path = path or active_path("kv_gather")
    if path in NATIVE_PATHS and _gather_fits(path, parts, takes):
        return _gather_native(path, parts, takes)
    return gather_reference(parts, takes)


def _gather_fits(path: str, parts: Sequence[Payload], takes: Sequence[int]) -> bool:
    # O(layers + blocks) checks, not O(layers * blocks): Python costs ~1 us per array touched,
    # the same order as the copy itself. Every block of one model has one layout per layer.
    num_layers = len(parts[0])
    k0 = parts[0][0][0]
    if k0.dtype not in _DTYPES or k0.ndim != 4 or k0.shape[0] != 1:
        return False
    _, h, t0, d = k0.shape
    for k, v in parts[0]:
        if k.shape != (1, h, t0, d) or v.shape != k.shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
            return False
    for p, t in zip(parts, takes):
        k, v = p[0]
        if len(p) != num_layers or k.shape[1:2] + k.shape[3:] != (h, d) or v.shape != k.shape or not 0 < t <= k.shape[2]:
            return False
        if path == "metal" and k.size < _MIN_METAL_ELEMENTS:
            return False
    return True


def _gather_native(path: str, parts: Sequence[Payload], takes: Sequence[int]) -> list[LayerKV]:
    n = len(parts)
    max_nb = _pow2_floor((_MAX_BUFFERS[path] - 3) // 2)
    if n > max_nb:
        # More blocks than one launch may bind: gather chunks, then join them (few launches).
        chunks = [_gather_native(path, parts[i:i + max_nb], takes[i:i + max_nb]) for i in range(0, n, max_nb)]
        return [(mx.concatenate([c[layer][0] for c in chunks], axis=2),
                 mx.concatenate([c[layer][1] for c in chunks], axis=2)) for layer in range(len(chunks[0]))]
    num_layers = len(parts[0])
    k0 = parts[0][0][0]
    _, h, _, d = k0.shape
    nb = _pow2_ceil(n)
    group = max(1, min(num_layers, (_MAX_BUFFERS[path] - 1) // (2 * nb + 2)))
    total = sum(takes)
    offs = [0]
    for t in takes[:-1]:
        offs.append(offs[-1] + t)
    pad = [0] * (nb - n)
    meta = mx.array([h, d, total, n, nb, *[p[0][0].shape[2] for p in parts], *pad, *offs, *pad, *takes, *pad],
                    dtype=mx.int32)
    lanes = _lanes(max(takes) * d, k0.dtype)
    out: list[LayerKV] = []
    for g0 in range(0, num_layers, group):
        g = min(group, num_layers - g0)
        kernel = _kernel(path, "kv_gather", g, nb)
        inputs = [meta] + [parts[min(i, n - 1)][layer][j]
                           for layer in range(g0, g0 + g) for j in (0, 1) for i in range(nb)]
        outs = kernel(inputs=inputs, template=_template(path, k0.dtype, d), grid=(lanes, h, 2 * g * nb),
                      threadgroup=(_THREADS, 1, 1), output_shapes=[(1, h, total, d)] * (2 * g),
                      output_dtypes=[k0.dtype] * (2 * g))
        out.extend((outs[2 * i], outs[2 * i + 1]) for i in range(g))
    return out


# ---------------------------------------------------------------- kernels


def _kernel(path: str, name: str, group: int, nb: int) -> Any:
    """The compiled kernel for (backend, kernel, layers per launch, blocks per launch), cached."""
    key = (path, name, group, nb)
    with _lock:
        k = _compiled.get(key)
        if k is not None:
            return k
        src = load_source(name, path)
        if src is None:
            raise KernelUnavailable(f"no {path} source for {name}")
        n_in, n_out = 2 * group * nb, 2 * group
        select = select_code(n_in, n_out)
        make = mx.fast.metal_kernel if path == "metal" else mx.fast.cuda_kernel
        k = make(name=f"omlx_{name}_g{group}_n{nb}", input_names=["meta"] + [f"s{i}" for i in range(n_in)],
                 output_names=[f"o{i}" for i in range(n_out)], source=src.body.replace(SELECT, select),
                 header=src.header, ensure_row_contiguous=True)
        _compiled[key] = k
        return k


def _template(path: str, dtype: mx.Dtype, head_dim: int) -> list[tuple[str, Any]]:
    if path == "metal":
        return [("T", dtype), ("VEC", head_dim * dtype.size % 16 == 0)]
    return [("T", dtype)]


def _lanes(num_elements: int, dtype: mx.Dtype) -> int:
    """Copy lanes per (block, head): one 16-byte move each, rounded up to whole threadgroups."""
    per = max(1, 16 // dtype.size)
    lanes = _THREADS * math.ceil(math.ceil(num_elements / per) / _THREADS)
    return max(_THREADS, min(lanes, _MAX_LANES))


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


__all__ = ["KERNELS", "active_path", "gather_kv_blocks", "gather_reference", "set_active_paths"]

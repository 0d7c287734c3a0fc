"""KV block kernels: the reference path against numpy (CPU), the native path against the
reference (GPU, marked ``gpu``), the kernel sources, and `native_kernel_status()`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx.kernels import kv_blocks, sources
from omlx.kernels import status as status_mod
from omlx.kernels.status import KERNEL_INFO, gpu_backend, native_kernel_status, slow_path_messages

REPO = Path(__file__).resolve().parents[2]


def _blocks(n: int, layers: int, heads: int, dim: int, lens: list[int] | None = None, dtype=mx.bfloat16):
    lens = lens or [16] * n
    return [tuple((mx.random.normal((1, heads, t, dim)).astype(dtype), mx.random.normal((1, heads, t, dim)).astype(dtype))
                  for _ in range(layers)) for t in lens]


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _equal(a, b) -> bool:
    fa, fb = tree_flatten(a), tree_flatten(b)
    return len(fa) == len(fb) and all(x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
                                      for (_, x), (_, y) in zip(fa, fb))


# ---------------------------------------------------------------- reference (everywhere)


@pytest.mark.parametrize("takes", [[16], [16, 16, 16], [16, 16, 3], [5]])
def test_gather_reference_matches_numpy(takes):
    parts = _blocks(len(takes), layers=3, heads=2, dim=8)
    out = kv_blocks.gather_reference(parts, takes)
    assert len(out) == 3
    for layer, (k, v) in enumerate(out):
        assert k.shape == (1, 2, sum(takes), 8) and k.dtype == mx.bfloat16
        want_k = np.concatenate([_np(p[layer][0])[:, :, :t] for p, t in zip(parts, takes)], axis=2)
        want_v = np.concatenate([_np(p[layer][1])[:, :, :t] for p, t in zip(parts, takes)], axis=2)
        np.testing.assert_array_equal(_np(k), want_k)
        np.testing.assert_array_equal(_np(v), want_v)


def test_bad_calls_raise():
    with pytest.raises(ValueError):
        kv_blocks.gather_kv_blocks([], [])
    with pytest.raises(ValueError):
        kv_blocks.gather_kv_blocks(_blocks(2, 1, 1, 8), [16])


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize("kernel", kv_blocks.KERNELS)
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_every_kernel_has_both_sources(kernel, backend):
    src = sources.load_source(kernel, backend, REPO / "metal")
    assert src is not None, f"metal/{kernel}.{'metal' if backend == 'metal' else 'cu'} is missing"
    assert sources.SELECT in src.body and "omlx_copy" in src.header


def test_parse_source_rejects_missing_markers(tmp_path):
    with pytest.raises(ValueError, match="@@header"):
        sources.parse_source("int x;", tmp_path / "k.cu")
    with pytest.raises(ValueError, match="select"):
        sources.parse_source("// @@header\n// @@body\nreturn;", tmp_path / "k.cu")


def test_native_build_manifest_is_checked_against_sources(tmp_path):
    (tmp_path / "k.cu").write_text("// @@header\n// @@body\n/*@@select*/\n")
    assert sources.native_build(tmp_path) is None
    (tmp_path / "build").mkdir()
    import json

    (tmp_path / "build" / sources.MANIFEST).write_text(json.dumps({"sources": sources.source_hashes(tmp_path)}))
    assert sources.native_build(tmp_path).current
    (tmp_path / "k.cu").write_text("// @@header\n// @@body\n/*@@select*/ // edited\n")
    assert not sources.native_build(tmp_path).current


# ---------------------------------------------------------------- status


def test_status_on_this_machine_names_every_kernel():
    status = native_kernel_status(refresh=True)
    assert set(status) == set(kv_blocks.KERNELS) == set(KERNEL_INFO)
    for s in status.values():
        assert s.path in ("metal", "cuda", "reference")
        if s.path == "reference":
            assert s.reason, "a kernel that does not run must say why"
        if s.slow:
            assert s.fix and s.warning
        assert set(s.as_dict()) >= {"name", "available", "path", "reason", "slow", "warning", "fix"}
        assert kv_blocks.active_path(s.name) == s.path


def test_no_kernel_ships_below_the_bar():
    # metal/README.md: kv_gather measured 0.81-2.01x on an H200; a kernel ships only at >= 2x.
    for info in KERNEL_INFO.values():
        assert info.measured
    assert KERNEL_INFO["kv_gather"].ships_on == frozenset()


@pytest.mark.skipif(gpu_backend() != "cpu", reason="checks the CPU-only answer")
def test_status_on_cpu_is_reference_and_not_slow():
    status = native_kernel_status(refresh=True)
    for s in status.values():
        assert (s.path, s.available, s.slow, s.warning) == ("reference", False, False, "")
        assert "CPU" in s.reason
    assert slow_path_messages(status) == []
    assert kv_blocks.active_path("kv_gather") == "reference"


def test_disabled_kernels_are_said():
    status = native_kernel_status(("kv_gather",), refresh=True)
    s = status["kv_gather"]
    assert s.path == "reference" and "disabled" in s.reason and "OMLX_DISABLE_KERNELS" in s.fix
    assert any("kv_gather" in m and "disabled" in m for m in slow_path_messages(status))
    assert all(x.warning for x in native_kernel_status(("all",), refresh=True).values())
    native_kernel_status(refresh=True)  # restore this machine's own choice for later tests


def test_a_shipping_kernel_without_source_is_a_slow_path(monkeypatch, tmp_path):
    # What a GPU machine with a broken install sees: the kernel should run, its source is gone.
    monkeypatch.setattr(status_mod, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(status_mod.sources, "source_dirs", lambda: [tmp_path])
    info = KERNEL_INFO["kv_gather"]
    monkeypatch.setitem(KERNEL_INFO, "kv_gather", dataclasses.replace(info, ships_on=frozenset({"cuda"})))
    try:
        s = native_kernel_status(refresh=True)["kv_gather"]
        assert s.slow and s.path == "reference" and not s.available
        assert "no cuda source" in s.reason and "reinstall" in s.fix and "Fix:" in s.warning
    finally:
        monkeypatch.undo()
        native_kernel_status(refresh=True)


# ---------------------------------------------------------------- native path (GPU)


@pytest.fixture(scope="module")
def native_path():
    backend = gpu_backend()
    if backend != "cuda":
        pytest.skip(f"needs MLX with CUDA on an NVIDIA GPU (mlx[cuda13]); this process runs MLX on {backend}")
    return backend


@pytest.mark.gpu
def test_gpu_status_and_probe(native_path):
    s = native_kernel_status(refresh=True)["kv_gather"]
    assert s.available and s.backend == native_path and not s.slow
    assert s.path == ("cuda" if s.ships else "reference")
    assert status_mod._probe("kv_gather", native_path) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("heads,dim,lens,takes", [
    (2, 64, [16, 16, 16], [16, 16, 7]),       # partial last block
    (8, 128, [256] * 5, [256] * 5),           # a real block size, N not a power of two
    (3, 6, [16, 16], [16, 9]),                # rows not a multiple of 16 bytes: scalar copies
    (1, 64, [4] * 600, [4] * 599 + [2]),      # more blocks than one launch binds: chunked
])
def test_gpu_gather_equals_reference(native_path, dtype, heads, dim, lens, takes):
    layers = 2 if len(lens) > 100 else 5
    parts = _blocks(len(lens), layers, heads, dim, lens, dtype)
    got = kv_blocks.gather_kv_blocks(parts, takes, path=native_path)
    assert _equal(got, kv_blocks.gather_reference(parts, takes))


@pytest.mark.gpu
def test_gpu_gather_round_trips_a_cache(native_path):
    # Blocks cut from one buffer, joined again: exactly the first tokens of that buffer.
    keys = [mx.random.normal((1, 4, 1024, 64)).astype(mx.bfloat16) for _ in range(6)]
    values = [mx.random.normal((1, 4, 1024, 64)).astype(mx.bfloat16) for _ in range(6)]
    bounds = [(i * 256, (i + 1) * 256) for i in range(3)] + [(768, 900)]
    parts = [tuple((mx.contiguous(k[:, :, a:b]), mx.contiguous(v[:, :, a:b])) for k, v in zip(keys, values))
             for a, b in bounds]
    got = kv_blocks.gather_kv_blocks(parts, [256, 256, 256, 100], path=native_path)
    for layer, (k, v) in enumerate(got):
        assert mx.array_equal(k, keys[layer][:, :, :868]).item()
        assert mx.array_equal(v, values[layer][:, :, :868]).item()

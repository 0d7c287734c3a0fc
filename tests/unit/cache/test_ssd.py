"""SSD cold tier without a model: file format round trips, validation of every read (bad files
deleted and counted, never returned), budget eviction order, crash-safe writes, a tiny
filesystem that fills up, and the maintenance helpers behind `omlx cache`."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from omlx.cache import blockfile
from omlx.cache.blockfile import (
    SSD_FORMAT_VERSION,
    BadBlockError,
    HostBlock,
    block_path,
    decode_block,
    encode_block,
    write_file_atomic,
)
from omlx.cache.hashing import Namespace, hash_block, make_kv_format
from omlx.cache.ssd import WRITER_NICE, SSDStore, clear_cache_dir, summarize_cache_dir, verify_cache_dir

BS = 4
NS = Namespace("model-a", "tok-a", make_kv_format("bfloat16", None, None, "KVCache"), 0, 2)
NS_F32 = Namespace("model-a", "tok-a", make_kv_format("float32", None, None, "KVCache"), 0, 2)
NS_B = Namespace("model-b", "tok-a", NS.kv_format, 0, 2)


def host_block(dtype: str = "bfloat16", num_tokens: int = BS, seed: int = 0, heads: int = 2, dim: int = 8) -> HostBlock:
    rng = np.random.default_rng(seed)
    storage = blockfile.DTYPES[dtype][1]
    shape = (1, heads, num_tokens, dim)

    def arr() -> np.ndarray:
        if storage is np.uint16:
            return rng.integers(0, 2**16, size=shape, dtype=np.uint16)
        return rng.standard_normal(shape).astype(storage)

    return HostBlock.from_layers(dtype, [(arr(), arr()) for _ in range(2)])


def same(a: HostBlock, b: HostBlock) -> bool:
    return a.dtype == b.dtype and all(
        np.array_equal(x, y) and x.dtype == y.dtype for la, lb in zip(a.layers, b.layers) for x, y in zip(la, lb)
    )


def chain(tokens: list[int], ns: Namespace = NS) -> list[tuple[bytes, bytes, list[int]]]:
    """(hash, parent, tokens) of each full block of ``tokens``."""
    out = []
    parent = ns.key()
    for i in range(0, len(tokens) - BS + 1, BS):
        toks = tokens[i : i + BS]
        h = hash_block(parent, toks)
        out.append((h, parent, toks))
        parent = h
    return out


def make_store(root: Path, ns: Namespace = NS, dtype: str = "bfloat16", max_bytes: int = 10**9, **kw) -> SSDStore:
    return SSDStore(root, ns, dtype=dtype, max_bytes=max_bytes, **kw)


def write_chain(store: SSDStore, tokens: list[int], seed: int = 0) -> list[tuple[bytes, bytes, list[int]]]:
    blocks = chain(tokens, store.namespace)
    for i, (h, parent, toks) in enumerate(blocks):
        assert store.put(h, parent, toks, host_block(store.dtype, seed=seed + i))
        assert store.flush(10)
    return blocks


# ---- format ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "ns"), [("bfloat16", NS), ("float32", NS_F32)])
def test_write_read_roundtrip(tmp_path: Path, dtype: str, ns: Namespace):
    store = make_store(tmp_path, ns, dtype)
    (h, parent, toks), = chain([5, 6, 7, 8], ns)
    block = host_block(dtype)
    assert store.put(h, parent, toks, block)
    assert store.flush(10)
    path = block_path(tmp_path, ns, h)
    assert path.exists() and path.parent.name == h.hex()[:2] and path.parent.parent.name == ns.digest()
    got = store.read(h, parent, toks)
    assert got is not None and same(got, block)
    # A fresh store (a restart) finds the file by scanning and reads the same bytes.
    again = make_store(tmp_path, ns, dtype)
    assert again.contains(h) and again.stats().num_scanned_files == 1
    got2 = again.read(h, parent, toks)
    assert got2 is not None and same(got2, block)
    assert again.stats().num_bad_files == 0


def test_file_is_plain_safetensors_with_the_documented_metadata(tmp_path: Path):
    (h, parent, toks), = chain([1, 2, 3, 4])
    block = host_block("bfloat16")
    got_hash, data = encode_block(NS, parent, toks, block)
    assert got_hash == h
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    # One block-major tensor: (layers, keys|values, heads, tokens, head_dim)
    assert sorted(header) == ["kv"]
    assert header["kv"]["dtype"] == "BF16"  # stored as bfloat16, not uint16
    assert header["kv"]["shape"] == [2, 2, 2, BS, 8]
    assert (8 + n) % 8 == 0  # tensor data starts 8-aligned (header padded with spaces)
    assert meta["format_version"] == str(SSD_FORMAT_VERSION) == "4"
    assert meta["layout"] == "layer,kv,head,token,dim"
    assert json.loads(meta["namespace"]) == json.loads(NS.to_json())
    assert meta["parent_hash"] == parent.hex() and meta["block_hash"] == h.hex()
    assert json.loads(meta["token_ids"]) == toks and meta["num_tokens"] == "4"
    assert (meta["layer_start"], meta["layer_end"], meta["dtype"]) == ("0", "2", "bfloat16")
    assert meta["checksum"].startswith("crc32:")
    host, p, t = decode_block(data, NS, h, parent_hash=parent, token_ids=toks, dtype="bfloat16")
    assert same(host, block) and p == parent and t == toks


def test_bytes_on_disk_grow_linearly_with_unique_tokens(tmp_path: Path):
    store = make_store(tmp_path)
    blocks = write_chain(store, list(range(40)))
    sizes = [block_path(tmp_path, NS, h).stat().st_size for h, _, _ in blocks]
    payload = host_block().num_bytes
    # Every block stores only its own tokens: equal sizes, each the payload plus a small header.
    assert len(set(sizes)) <= 2 and max(sizes) < payload + 2048
    assert store.stats().num_bytes == sum(sizes)


# ---- validation: bad files are deleted and counted, never returned ---------------------


def test_a_block_file_is_read_by_any_safetensors_reader(tmp_path: Path):
    from safetensors import safe_open

    store = make_store(tmp_path, NS_F32, "float32")
    (h, parent, toks), = chain([1, 2, 3, 4], NS_F32)
    block = host_block("float32")
    assert store.put(h, parent, toks, block) and store.flush(10)
    with safe_open(str(block_path(tmp_path, NS_F32, h)), framework="numpy") as f:
        assert list(f.keys()) == ["kv"] and f.metadata()["block_hash"] == h.hex()
        assert np.array_equal(f.get_tensor("kv"), block.kv)


def _write_v2_file(root: Path, ns: Namespace, h: bytes, parent: bytes, toks: list[int]) -> Path:
    """A block file as omlx format version 2 wrote it: per-layer tensors, same metadata keys."""
    from safetensors.numpy import save_file

    enc = blockfile.encode_block_parts(ns, parent, toks, host_block("float32"))
    (n,) = struct.unpack("<Q", enc.header[:8])
    meta = json.loads(enc.header[8 : 8 + n])["__metadata__"]
    meta["format_version"] = "2"
    del meta["layout"]
    tensors = {f"layer.{i}.{kind}": np.zeros((1, 2, len(toks), 8), np.float32)
               for i in range(ns.layer_start, ns.layer_end) for kind in ("keys", "values")}
    path = block_path(root, ns, h)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def test_files_of_an_older_format_are_counted_deleted_and_never_read(tmp_path: Path, caplog):
    blocks = chain(list(range(1, 13)), NS_F32)
    paths = [_write_v2_file(tmp_path, NS_F32, h, p, t) for h, p, t in blocks]
    with caplog.at_level("WARNING", logger="omlx.cache.ssd"):
        store = make_store(tmp_path, NS_F32, "float32")
    s = store.stats()
    assert s.num_files == 0 and s.num_old_format_files == 3 and s.num_bad_files == 3
    assert not any(p.exists() for p in paths)
    old = [r for r in caplog.records if "older format" in r.getMessage()]
    assert len(old) == 1 and "3 block file(s)" in old[0].getMessage() and "2: 3" in old[0].getMessage()
    h, p, t = blocks[0]
    assert store.read(h, p, t) is None
    # decode refuses one too (e.g. a file written by another process after the scan)
    path = _write_v2_file(tmp_path, NS_F32, h, p, t)
    with pytest.raises(blockfile.OldFormatError):
        decode_block(path.read_bytes(), NS_F32, h)


def _one_block(tmp_path: Path) -> tuple[SSDStore, bytes, bytes, list[int], Path]:
    store = make_store(tmp_path)
    (h, parent, toks), = write_chain(store, [9, 8, 7, 6])
    return store, h, parent, toks, block_path(tmp_path, NS, h)


def test_truncated_file_is_deleted_at_scan(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])
    again = make_store(tmp_path)
    assert not again.contains(h) and not path.exists()
    assert again.stats().num_bad_files == 1
    assert again.read(h, parent, toks) is None


def test_truncated_file_is_rejected_on_read(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert store.read(h, parent, toks) is None
    assert not path.exists() and not store.contains(h)
    assert store.stats().num_bad_files == 1


@pytest.mark.parametrize("where", ["tensor data", "last byte", "header"])
def test_flipped_byte_is_rejected_on_read(tmp_path: Path, where: str):
    store, h, parent, toks, path = _one_block(tmp_path)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    pos = {"tensor data": 8 + n + 5, "last byte": len(data) - 1, "header": 8 + n // 2}[where]
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    assert store.read(h, parent, toks) is None
    assert not path.exists()
    assert store.stats().num_bad_files == 1 and store.stats().num_reads == 0


def test_wrong_namespace_file_is_deleted(tmp_path: Path):
    # A block of model B planted where model A's block of the same tokens would live.
    (h_b, parent_b, toks), = chain([1, 2, 3, 4], NS_B)
    _, data = encode_block(NS_B, parent_b, toks, host_block())
    (h_a, parent_a, _), = chain(toks, NS)
    path = block_path(tmp_path, NS, h_a)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    store = make_store(tmp_path)
    assert not store.contains(h_a) and not path.exists()
    assert store.stats().num_bad_files == 1
    assert store.read(h_a, parent_a, toks) is None


def test_other_namespaces_are_never_looked_at(tmp_path: Path):
    b = make_store(tmp_path, NS_B)
    blocks_b = write_chain(b, list(range(8)))
    a = make_store(tmp_path, NS)
    assert a.stats().num_files == 0 and a.stats().num_bad_files == 0
    assert all(block_path(tmp_path, NS_B, h).exists() for h, _, _ in blocks_b)
    # The same tokens in A's namespace have other keys: a miss, never B's KV.
    assert all(not a.contains(h) for h, _, _ in chain(list(range(8)), NS))


def _rewrite_metadata(path: Path, **changes: str) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def test_older_format_version_is_deleted_at_scan(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    _rewrite_metadata(path, format_version=str(SSD_FORMAT_VERSION - 1))
    again = make_store(tmp_path)
    assert not again.contains(h) and not path.exists()
    assert again.stats().num_bad_files == 1


def test_older_format_version_is_rejected_on_read(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    _rewrite_metadata(path, format_version="0")
    assert store.read(h, parent, toks) is None and not path.exists()
    assert store.stats().num_bad_files == 1


def test_parent_mismatch_is_deleted_and_counted(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    assert store.read(h, b"\x01" * 32, toks) is None
    assert not path.exists() and store.stats().num_bad_files == 1


def test_token_mismatch_is_deleted_and_counted(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    assert store.read(h, parent, [9, 8, 7, 5]) is None
    assert not path.exists() and store.stats().num_bad_files == 1


def test_metadata_whose_tokens_do_not_hash_to_the_name_is_bad(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    _rewrite_metadata(path, token_ids="[9,8,7,5]")
    assert store.read(h, parent, None) is None  # type: ignore[arg-type]
    assert store.stats().num_bad_files == 1


def test_wrong_dtype_is_bad(tmp_path: Path):
    store = make_store(tmp_path, NS_F32, "float32")
    (h, parent, toks), = write_chain(store, [1, 2, 3, 4])
    # The same namespace opened with another KV dtype must not read float32 bits as bfloat16.
    other = SSDStore(tmp_path, NS_F32, dtype="bfloat16", max_bytes=10**9)
    assert not other.contains(h) and other.stats().num_bad_files == 1


def test_decode_rejects_garbage():
    (h, parent, toks), = chain([1, 2, 3, 4])
    for data in (b"", b"\x00" * 7, struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 2) + b"[]"):
        with pytest.raises(BadBlockError):
            decode_block(data, NS, h)


def test_missing_file_is_a_miss_not_bad(tmp_path: Path):
    store, h, parent, toks, path = _one_block(tmp_path)
    path.unlink()
    assert store.read(h, parent, toks) is None
    s = store.stats()
    assert s.num_bad_files == 0 and s.num_missing == 1 and s.num_files == 0


# ---- budget ---------------------------------------------------------------------------


def test_budget_evicts_least_recently_used_leaves_first(tmp_path: Path):
    size = len(encode_block(NS, NS.key(), [0, 0, 0, 0], host_block())[1])
    store = make_store(tmp_path, max_bytes=5 * size)
    a = write_chain(store, [1] * 4 + [2] * 4 + [3] * 4, seed=0)  # a0 -> a1 -> a2
    b = write_chain(store, [4] * 4 + [5] * 4, seed=10)  # b0 -> b1
    assert store.stats().num_files == 5
    store.read(*a[2])  # a's leaf is now the most recently used
    c = write_chain(store, [6] * 4, seed=20)  # needs room for one: b1 (LRU leaf) goes
    assert not store.contains(b[1][0]) and store.contains(b[0][0])
    write_chain(store, [7] * 4, seed=30)  # next LRU leaf: b0 (a parent only once b1 left)
    assert not store.contains(b[0][0])
    assert all(store.contains(h) for h, _, _ in a) and store.contains(c[0][0])
    assert store.stats().num_evictions == 2
    assert not block_path(tmp_path, NS, b[0][0]).exists()


def test_pinned_blocks_are_never_evicted(tmp_path: Path):
    size = len(encode_block(NS, NS.key(), [0, 0, 0, 0], host_block())[1])
    store = make_store(tmp_path, max_bytes=2 * size)
    a = write_chain(store, [1] * 4, seed=0)
    b = write_chain(store, [2] * 4, seed=1)
    store.pin([a[0][0], b[0][0]])
    write_chain(store, [3] * 4, seed=2)
    s = store.stats()
    assert s.num_budget_drops == 1 and s.num_files == 2 and store.contains(a[0][0]) and store.contains(b[0][0])
    store.unpin([a[0][0]])
    c = write_chain(store, [4] * 4, seed=3)
    assert not store.contains(a[0][0]) and store.contains(b[0][0]) and store.contains(c[0][0])


def test_a_parent_is_kept_for_its_child(tmp_path: Path):
    size = len(encode_block(NS, NS.key(), [0, 0, 0, 0], host_block())[1])
    store = make_store(tmp_path, max_bytes=1 * size)
    a = write_chain(store, [1] * 8)  # a1 cannot evict its parent a0 (the only leaf), so it is dropped
    assert store.contains(a[0][0]) and not store.contains(a[1][0])
    assert store.stats().num_budget_drops == 1


def test_index_rebuild_keeps_recency_and_shrinks_to_a_smaller_budget(tmp_path: Path):
    store = make_store(tmp_path)
    old = write_chain(store, [1] * 4, seed=0)
    new = write_chain(store, [2] * 4, seed=1)
    t = os.stat(block_path(tmp_path, NS, new[0][0])).st_mtime
    os.utime(block_path(tmp_path, NS, old[0][0]), (t - 100, t - 100))
    size = store.stats().num_bytes // 2
    again = make_store(tmp_path, max_bytes=size)
    assert again.contains(new[0][0]) and not again.contains(old[0][0])


# ---- writes: queue, crash safety, full disk ----------------------------------------------


def test_queue_full_drops_low_and_high_displaces_low(tmp_path: Path):
    store = make_store(tmp_path, max_queue_bytes=3 * host_block().num_bytes)
    gate = threading.Event()
    real_write = store._write
    store._write = lambda job: (gate.wait(10), real_write(job))  # type: ignore[method-assign]
    blocks = chain(list(range(24)))
    try:
        assert all(store.put(h, p, t, host_block(seed=i)) for i, (h, p, t) in enumerate(blocks[:3]))
        assert not store.put(*blocks[3], host_block(seed=3))  # low, queue full: dropped
        assert store.put(*blocks[4], host_block(seed=4), high=True)  # displaces the newest low
        assert store.stats().num_queue_drops == 2
    finally:
        gate.set()
    assert store.flush(10)
    on_disk = [store.contains(h) for h, _, _ in blocks[:5]]
    assert on_disk == [True, True, False, False, True]


def test_put_of_a_block_on_disk_or_queued_is_a_no_op(tmp_path: Path):
    store = make_store(tmp_path)
    (h, p, t), = write_chain(store, [1, 2, 3, 4])
    assert store.put(h, p, t, host_block())
    assert store.flush(10) and store.stats().num_writes == 1


def test_failed_write_leaves_no_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real = os.write
    calls = {"n": 0}

    def flaky(fd: int, data) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        return real(fd, data[:100])

    monkeypatch.setattr(blockfile.os, "write", flaky)
    target = tmp_path / "ab" / "x.safetensors"
    with pytest.raises(OSError):
        write_file_atomic(target, b"y" * 1000)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_stale_temp_files_are_removed_at_start_but_not_a_live_writers(tmp_path: Path):
    store = make_store(tmp_path)
    (h, _, _), = write_chain(store, [1, 2, 3, 4])
    folder = block_path(tmp_path, NS, h).parent
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = folder / f".{h.hex()}.safetensors.{dead.pid}.abcd1234.tmp"
    live = folder / f".{h.hex()}.safetensors.{os.getppid()}.abcd1234.tmp"
    stale.write_bytes(b"half a block")
    live.write_bytes(b"being written")
    again = make_store(tmp_path)
    assert not stale.exists() and live.exists()
    assert again.stats().num_files == 1 and again.stats().num_bad_files == 0


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A real 1 MiB tmpfs (needs root and mount); skipped with the reason otherwise."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"tmpfs-{uuid.uuid4().hex[:6]}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "run as root where mount is permitted")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_tiny_filesystem_fills_up_without_harm(tiny_fs: Path):
    big = host_block(num_tokens=BS, heads=4, dim=1024)  # ~64 KiB per block file
    store = make_store(tiny_fs, max_bytes=100 * 1024 * 1024)  # budget far above the disk
    chains = [chain([c] * 4 + [c + 100] * 4) for c in range(20)]  # 20 chains of 2 blocks
    for blocks in chains:
        for h, p, t in blocks:
            store.put(h, p, t, big)
        store.flush(10)
    s = store.stats()
    assert s.num_disk_full >= 1 and s.num_write_errors >= s.num_disk_full
    assert s.max_bytes < 1024 * 1024  # the budget shrank to what the disk holds
    # It keeps working: newer chains were written by evicting older leaves.
    assert s.num_evictions > 0 and any(store.contains(h) for h, _, _ in chains[-1])
    # Every file on disk is whole and valid; no temp file is left.
    report = verify_cache_dir(tiny_fs, remove=False)
    assert report.bad == [] and report.num_files == s.num_files
    assert not list(tiny_fs.rglob("*.tmp"))
    for blocks in chains:
        for h, p, t in blocks:
            if store.contains(h):
                got = store.read(h, p, t)
                assert got is not None and same(got, big)


# ---- maintenance ------------------------------------------------------------------------


def test_verify_reports_and_removes_bad_files(tmp_path: Path):
    store = make_store(tmp_path)
    blocks = write_chain(store, list(range(16)))
    bad = block_path(tmp_path, NS, blocks[1][0])
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0xFF
    bad.write_bytes(bytes(data))
    dry = verify_cache_dir(tmp_path, remove=False)
    assert dry.num_files == 4 and dry.num_ok == 3 and len(dry.bad) == 1 and bad.exists()
    assert "checksum" in dry.bad[0][1]
    report = verify_cache_dir(tmp_path)
    assert report.num_removed == 1 and not bad.exists()
    assert verify_cache_dir(tmp_path).bad == []


def test_summarize_and_clear_by_model(tmp_path: Path):
    a = make_store(tmp_path, NS, model_id="model-a")
    b = make_store(tmp_path, NS_B, model_id="model-b")
    write_chain(a, list(range(8)))
    write_chain(b, list(range(12)))
    (tmp_path / "not-a-namespace").mkdir()
    (tmp_path / "not-a-namespace" / "keep.txt").write_text("mine")
    rows = {r.model_id: r for r in summarize_cache_dir(tmp_path)}
    assert set(rows) == {"model-a", "model-b"}
    assert rows["model-a"].num_files == 2 and rows["model-b"].num_files == 3
    assert rows["model-b"].namespace == NS_B
    assert clear_cache_dir(tmp_path, "model-b")[0] == 3
    assert {r.model_id for r in summarize_cache_dir(tmp_path)} == {"model-a"}
    assert clear_cache_dir(tmp_path)[0] == 2
    assert summarize_cache_dir(tmp_path) == []
    assert (tmp_path / "not-a-namespace" / "keep.txt").exists()  # never touches foreign files


def test_store_clear_deletes_this_namespace_only(tmp_path: Path):
    a = make_store(tmp_path, NS)
    b = make_store(tmp_path, NS_B)
    write_chain(a, list(range(8)))
    write_chain(b, list(range(8)))
    assert a.clear() == 2 and a.stats().num_files == 0
    assert make_store(tmp_path, NS_B).stats().num_files == 2
    shutil.rmtree(tmp_path / NS.digest())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_the_writer_thread_runs_at_the_lowest_priority(tmp_path):
    """Block writes must not take CPU from a prefill: the writer thread is niced, the caller is not
    (the caller keeps the priority it had, e.g. a suite run under ``nice -n 19``)."""
    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store = make_store(tmp_path)
    write_chain(store, list(range(BS)))
    writer = store._writer
    assert writer is not None and writer.native_id is not None and writer.is_alive()
    assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == WRITER_NICE == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice
    if caller_nice < WRITER_NICE:
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) > caller_nice
    store.close()


def test_with_negative_tail_slack_tails_stay_and_best_child_can_be_whole_only(tmp_path: Path):
    store = make_store(tmp_path, tail_slack_tokens=-1)
    parent = NS.key()
    short, longer = [5, 6], [5, 6, 7]
    for toks in (short, longer):
        assert store.put(hash_block(parent, toks), parent, toks, host_block(store.dtype, num_tokens=len(toks)))
        assert store.flush(10)
    assert store.contains(hash_block(parent, short))  # not superseded by the longer sibling
    m = store.best_child(parent, [5, 6, 9], whole_only=True)
    assert m is not None and m.num_common == 2 and list(m.token_ids) == short
    assert store.best_child(parent, [5, 9], whole_only=True) is None
    m = store.best_child(parent, [5, 6, 7, 1])
    assert m is not None and m.num_common == 3

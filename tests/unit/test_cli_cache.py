"""`omlx cache stats|clear|verify` on a cache folder written by SSDStore (CliRunner, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from omlx.cache.blockfile import SSD_FORMAT_VERSION, HostBlock, block_path
from omlx.cache.hashing import FORMAT_VERSION, Namespace, hash_block, make_kv_format
from omlx.cache.ssd import NAMESPACE_FILE, SSDStore
from omlx.cli.main import app

runner = CliRunner()
KV = make_kv_format("float32", None, None, "KVCache")
NS_A = Namespace("model-a", "tok", KV, 0, 1)
NS_B = Namespace("model-b", "tok", KV, 0, 1, block_size=16)  # served with --block-size 16
# Cluster mode: rank 1 of model-a keeps layer [1, 2) in a namespace of its own.
NS_A_RANK1 = Namespace("model-a", "tok", KV, 1, 2)


def fill(base: Path, ns: Namespace, model_id: str, num_blocks: int) -> list[bytes]:
    store = SSDStore(base / "cache", ns, dtype="float32", max_bytes=10**9, model_id=model_id)
    parent, out = ns.key(), []
    for i in range(num_blocks):
        tokens = [i, i + 1]
        h = hash_block(parent, tokens)
        arr = np.full((1, 1, 2, 4), i, dtype=np.float32)
        store.put(h, parent, tokens, HostBlock.from_layers("float32", [(arr, arr)]))
        parent = h
        out.append(h)
    assert store.flush(10)
    return out


def test_stats_verify_and_clear(tmp_path: Path):
    fill(tmp_path, NS_A, "model-a", 3)
    hashes_b = fill(tmp_path, NS_B, "model-b", 2)
    fill(tmp_path, NS_A_RANK1, "model-a", 1)

    r = runner.invoke(app, ["cache", "stats", "--base-path", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["num_files"] == 6
    assert sorted((n["model_id"], tuple(n["layers"]), n["num_files"]) for n in doc["namespaces"]) == [
        ("model-a", (0, 1), 3), ("model-a", (1, 2), 1), ("model-b", (0, 1), 2)]
    assert sorted((n["model_id"], n["block_size"]) for n in doc["namespaces"]) == [
        ("model-a", 256), ("model-a", 256), ("model-b", 16)]
    r = runner.invoke(app, ["cache", "stats", "--base-path", str(tmp_path)])
    assert r.exit_code == 0 and "6 block files" in r.output and "model-b" in r.output
    line_b = next(line for line in r.output.splitlines() if "model-b" in line)
    assert "16-token blocks" in line_b and "256-token blocks" not in line_b, r.output
    assert "layers [1, 2)" in r.output and "layers [0, 1)" in r.output

    bad = block_path(tmp_path / "cache", NS_B, hashes_b[1])
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x80
    bad.write_bytes(bytes(data))
    r = runner.invoke(app, ["cache", "verify", "--base-path", str(tmp_path), "--dry-run"])
    assert r.exit_code == 1 and "1 bad" in r.output and bad.exists()
    r = runner.invoke(app, ["cache", "verify", "--base-path", str(tmp_path)])
    assert r.exit_code == 1 and "1 removed" in r.output and not bad.exists()
    r = runner.invoke(app, ["cache", "verify", "--base-path", str(tmp_path)])
    assert r.exit_code == 0 and "5 ok, 0 bad" in r.output

    r = runner.invoke(app, ["cache", "clear", "--model", "model-b", "--base-path", str(tmp_path)])
    assert r.exit_code == 0 and "removed 1 block files" in r.output
    r = runner.invoke(app, ["cache", "clear", "--ssd-cache-dir", str(tmp_path / "cache")])
    assert r.exit_code == 0 and "removed 4 block files" in r.output  # model-a's, of both layer ranges
    r = runner.invoke(app, ["cache", "stats", "--base-path", str(tmp_path)])
    assert "empty" in r.output


def test_stats_reports_the_block_file_format_version(tmp_path: Path):
    """``format_version`` was the namespace's key-layout version (1 or 2) where the README and
    the block files say format 4: it is now the block-file format, from the one constant."""
    fill(tmp_path, NS_A, "model-a", 1)
    fill(tmp_path, NS_B, "model-b", 1)
    ns_file = tmp_path / "cache" / NS_B.digest() / NAMESPACE_FILE  # written by an older omlx
    doc = json.loads(ns_file.read_text())
    ns_file.write_text(json.dumps({**doc, "format_version": SSD_FORMAT_VERSION - 1}))

    r = runner.invoke(app, ["cache", "stats", "--base-path", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["format_version"] == SSD_FORMAT_VERSION == 4
    rows = {n["model_id"]: n for n in doc["namespaces"]}
    assert (rows["model-a"]["format_version"], rows["model-a"]["key_format_version"]) == (SSD_FORMAT_VERSION, FORMAT_VERSION)
    assert rows["model-b"]["format_version"] == SSD_FORMAT_VERSION - 1
    r = runner.invoke(app, ["cache", "stats", "--base-path", str(tmp_path)])
    assert r.exit_code == 0 and f"(block-file format {SSD_FORMAT_VERSION})" in r.output, r.output
    line_a, line_b = (next(line for line in r.output.splitlines() if m in line) for m in ("model-a", "model-b"))
    assert "block-file format" not in line_a and f"block-file format {SSD_FORMAT_VERSION - 1} (this omlx reads none" in line_b

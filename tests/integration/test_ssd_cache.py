"""SSD cold tier with the real model and real server processes: a prefix survives a clean stop and
a kill -9, and greedy output with blocks restored from disk equals a `--no-cache` server's, token
for token. Faults (kill -9 in a loop while writing, truncated / flipped / old-format files, files
of another model) never produce a wrong output, a crash or a stuck server, and are counted.

Prompts are token ids (the completions API accepts them), so the test knows every block's key.
Prompt A is not a multiple of the block size: its partial last block (the *tail*, with the
generated tokens after it) goes to disk too, and after a restart its common prefix with the
prompt is reused (`cached_tokens` = every prompt token but the last).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from omlx.cache.blockfile import block_path, read_header
from omlx.cache.hashing import Namespace, block_hashes
from omlx.cache.ssd import verify_cache_dir
from tests.helpers import MODEL_ID, ServerProcess, default_model_dir

BS = 64
ARGS = ["--block-size", str(BS)]
MAX_TOKENS = 8


def _tokenize(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")).encode(text).ids


def _text(seed: int, lines: int) -> str:
    return "\n".join(
        f"Note {seed}.{i}: the warehouse in district {(i * 7 + seed) % 13} shipped {(i * 37 + seed) % 101} crates "
        f"of {['apples', 'copper wire', 'paper', 'tiles', 'glass'][(i + seed) % 5]} on day {i + 1}."
        for i in range(lines)
    ) + "\nQuestion: which district shipped the most crates? Answer:"


@pytest.fixture(scope="module")
def prompt_a() -> list[int]:
    """~620 tokens: 9 full 64-token blocks and a partial one."""
    ids = _tokenize(_text(0, 40))
    assert len(ids) >= 620
    return ids[:600] + _tokenize("\nQuestion: which district shipped the most crates? Answer:")[-20:]


def _complete(s: ServerProcess, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
    r = httpx.post(s.url + "/v1/completions", timeout=300, json={
        "model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]


def _cold(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["models"][MODEL_ID]["cold"]


def _wait_written(s: ServerProcess, num_files: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        cold = _cold(s)
        if cold["num_queued"] == 0 and cold["num_files"] >= num_files:
            return cold
        assert time.monotonic() < deadline, f"blocks not written in {timeout_s}s: {cold}"
        time.sleep(0.2)


def _server(base: Path, *extra: str) -> ServerProcess:
    return ServerProcess([*ARGS, *extra], base_path=base).start()


def _namespace(cache_dir: Path) -> tuple[Path, Namespace]:
    (ns_dir,) = [p for p in cache_dir.iterdir() if (p / "namespace.json").exists()]
    doc = json.loads((ns_dir / "namespace.json").read_text())
    return ns_dir, Namespace.from_json(json.dumps(doc["namespace"]))


@pytest.fixture(scope="module")
def plain():
    """The reference: a server without any cache, same block size (same prefill segments)."""
    s = ServerProcess(["--no-cache", *ARGS]).start()
    refs: dict[tuple[int, ...], str] = {}

    def ref(prompt: list[int]) -> str:
        key = tuple(prompt)
        if key not in refs:
            refs[key] = _complete(s, prompt)[0]
        return refs[key]

    yield ref
    s.stop()


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory, plain, prompt_a):
    """A base path whose SSD tier holds prompt A (served once, then a clean stop), and a copy."""
    base = tmp_path_factory.mktemp("ssd-warm")
    s = _server(base)
    try:
        rate_at_start = _cold(s)["prefill_tokens_per_s"]
        text, usage = _complete(s, prompt_a)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "cached_tokens_cold": 0}
        assert text == plain(prompt_a)
        # The restore-or-recompute rule follows this real prefill (alone in the batch).
        cold = _cold(s)
        assert cold["num_prefill_samples"] == 1 and cold["prefill_tokens_per_s"] != rate_at_start
    finally:
        s.stop()  # SIGTERM: a clean stop flushes the hot tier
    assert "cold KV cache flushed" in s.log()
    ns_dir, ns = _namespace(base / "cache")
    keys = block_hashes(ns, prompt_a, BS)
    assert all(block_path(base / "cache", ns, k).exists() for k in keys)
    # 1 tail after block 8: the prompt's last 44 tokens and the 7 generated ones with KV
    parents = [read_header(p)[0].metadata["parent_hash"] for p in ns_dir.rglob("*.safetensors")]
    assert parents.count(keys[-1].hex()) == 1
    pristine = tmp_path_factory.mktemp("ssd-pristine") / "cache"
    shutil.copytree(base / "cache", pristine)
    return base, pristine


def test_clean_restart_restores_the_prefix_from_disk(warm_cache, plain, prompt_a):
    base, _ = warm_cache
    s = _server(base)
    try:
        cold_at_start = _cold(s)
        assert cold_at_start["num_scanned_files"] >= 9 and cold_at_start["num_bad_files"] == 0
        text, usage = _complete(s, prompt_a)
        assert text == plain(prompt_a)
        n = len(prompt_a) - 1  # 9 blocks + 43 tokens of the tail: all but the last prompt token
        assert usage["prompt_tokens_details"] == {"cached_tokens": n, "cached_tokens_cold": n}
        cold = _cold(s)  # (the start-up warm-up chat may have restored its own tail)
        delta = {k: cold[k] - cold_at_start[k] for k in ("num_hits", "num_cached_tokens", "num_restored_blocks")}
        assert delta == {"num_hits": 1, "num_cached_tokens": n, "num_restored_blocks": 10}
        # Warm again (hot tier now): still the same output, nothing more from disk.
        again, usage = _complete(s, prompt_a)
        assert again == text and usage["prompt_tokens_details"]["cached_tokens"] == len(prompt_a)  # whole-prompt hit
        assert usage["prompt_tokens_details"]["cached_tokens_cold"] == 0
        assert _cold(s)["num_cached_tokens"] == cold["num_cached_tokens"]
    finally:
        s.stop()
    assert "restoring 10 block(s)" in s.log()


def test_a_follow_up_turn_after_a_restart_reuses_the_whole_tail_from_disk(warm_cache, plain, prompt_a, tmp_path):
    """The agent-trace case: turn N+1 extends turn N's prompt and reply. After a restart, its
    prefix up to the end of turn N's KV (full blocks and the tail) comes from disk, exactly."""
    _, pristine = warm_cache
    shutil.copytree(pristine, tmp_path / "cache")
    reply = _tokenize(plain(prompt_a))
    follow_up = prompt_a + reply + _tokenize("\nQuestion: and which shipped the fewest? Answer:")
    s = _server(tmp_path)
    try:
        text, usage = _complete(s, follow_up)
        assert text == plain(follow_up)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # the tail holds the prompt's last 44 tokens and 7 generated ones (when the reply
        # re-tokenizes to the generated ids, all of them match)
        assert len(prompt_a) <= cached <= len(prompt_a) + 7
        assert usage["prompt_tokens_details"]["cached_tokens_cold"] == cached
        assert cached % BS != 0  # not block-aligned: the tail was reused
    finally:
        s.stop()


def test_kill9_restart_restores_written_through_blocks(tmp_path, plain, prompt_a):
    s = _server(tmp_path)
    try:
        text, _ = _complete(s, prompt_a)
        assert text == plain(prompt_a)
        _wait_written(s, 11)  # write-through of new blocks and the tails (+ warm-up's), off the request path
    finally:
        s.stop(signal.SIGKILL)
    s = _server(tmp_path)
    try:
        text, usage = _complete(s, prompt_a)
        assert text == plain(prompt_a)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt_a) - 1
        assert usage["prompt_tokens_details"]["cached_tokens_cold"] == len(prompt_a) - 1
    finally:
        s.stop()


def test_kill9_in_a_loop_while_writing_then_a_clean_start_is_exact(tmp_path, plain):
    prompts = {i: [_tokenize(_text(10 * i + j, 9)) for j in range(3)] for i in range(3)}
    first: dict[int, list[int]] = {}
    for i in range(3):
        s = _server(tmp_path)
        try:
            assert _cold(s)["num_bad_files"] == 0  # a killed writer never leaves a visible partial file
            done = threading.Event()

            def send(p: list[int], i: int = i, done: threading.Event = done) -> None:
                try:
                    _complete(s, p, max_tokens=4)
                except (httpx.HTTPError, AssertionError):
                    return  # killed mid-request
                first.setdefault(i, p)
                done.set()

            threads = [threading.Thread(target=send, args=(p,), daemon=True) for p in prompts[i]]
            for t in threads:
                t.start()
            assert done.wait(300)
            if i == 2:  # let the last round land some files; earlier rounds die mid-write
                deadline = time.monotonic() + 60
                while _cold(s)["num_files"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            s.stop(signal.SIGKILL)  # while the other requests run and blocks are being written
        for t in threads:
            t.join(30)
    report = verify_cache_dir(tmp_path / "cache", remove=False)
    assert report.bad == [] and report.num_files > 0
    s = _server(tmp_path)
    try:
        cold = _cold(s)
        assert cold["num_bad_files"] == 0 and cold["num_scanned_files"] == report.num_files
        for p in (first[2], first[0]):
            assert _complete(s, p)[0] == plain(p)
        assert _cold(s)["num_cached_tokens"] > 0
    finally:
        s.stop()


def _rewrite_metadata(path: Path, **changes: str) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def test_corrupt_and_foreign_files_are_detected_counted_and_recomputed(warm_cache, plain, prompt_a, tmp_path):
    _, pristine = warm_cache
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    ns_dir, ns = _namespace(cache)
    keys = block_hashes(ns, prompt_a, BS)
    files = [block_path(cache, ns, k) for k in keys]
    assert all(f.exists() for f in files)
    # Another model's namespace (same tokens, other digest): must be ignored, not read or deleted.
    foreign = cache / ("f" * 32)
    shutil.copytree(ns_dir, foreign)
    foreign_files = sorted(foreign.rglob("*.safetensors"))
    data = bytearray(files[2].read_bytes())
    data[len(data) // 2] ^= 0x5A  # flipped byte in tensor data: caught by the checksum on read
    files[2].write_bytes(bytes(data))
    with open(files[4], "r+b") as f:  # truncated: caught by the index rebuild
        f.truncate(files[4].stat().st_size - 1000)
    _rewrite_metadata(files[6], format_version="0")  # an older format version

    s = _server(tmp_path)
    try:
        start = _cold(s)
        assert start["num_bad_files"] == 2  # truncated + old version, at the index rebuild
        text, usage = _complete(s, prompt_a)
        assert text == plain(prompt_a)
        cold = _cold(s)
        assert cold["num_bad_files"] == 3  # + the flipped byte, on read
        # blocks 0 and 1; the rest was recomputed (start: the warm-up chat's own tail)
        assert cold["num_cached_tokens"] - start["num_cached_tokens"] == 2 * BS
        assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * BS, "cached_tokens_cold": 2 * BS}
        again, usage = _complete(s, prompt_a)
        assert again == text and usage["prompt_tokens_details"]["cached_tokens"] == len(prompt_a)  # whole-prompt hit
    finally:
        s.stop()
    assert sorted(foreign.rglob("*.safetensors")) == foreign_files
    assert verify_cache_dir(cache, remove=False).bad == []


def test_files_of_another_model_version_are_a_miss(warm_cache, plain, prompt_a, tmp_path):
    """Failure case ssd-cache-key-misses-kv-quant-setting: the weights changed under the same
    model name; the old blocks must be misses, never loaded."""
    _, pristine = warm_cache
    shutil.copytree(pristine, tmp_path / "cache")
    old_ns_dir, _ = _namespace(tmp_path / "cache")
    num_old = len(list(old_ns_dir.rglob("*.safetensors")))
    src = default_model_dir()
    dst = tmp_path / "models" / MODEL_ID
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("."):
            os.symlink(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["omlx_test_revision"] = 2  # a new revision of the model: another fingerprint
    (dst / "config.json").write_text(json.dumps(config))
    prompt_b = prompt_a[: 2 * BS + 12]
    s = _server(tmp_path)
    try:
        assert _cold(s)["num_scanned_files"] == 0
        text, usage = _complete(s, prompt_b)
        assert text == plain(prompt_b)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        cold = _cold(s)
        assert cold["num_cached_tokens"] == 0 and cold["num_bad_files"] == 0
    finally:
        s.stop()
    assert len(list(old_ns_dir.rglob("*.safetensors"))) == num_old  # untouched
    dirs = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(dirs) == 2

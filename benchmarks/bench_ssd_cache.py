"""SSD cold-tier benchmark (issue 4): what a prefix paid for once costs after a restart.

Sections (README.md in this folder explains every figure):

0. Disk: cold sequential read bandwidth of the cache folder's filesystem (a ~1 GiB file
   written, fsynced, dropped from the page cache with ``posix_fadvise(DONTNEED)``, read).
1. Populate: a fresh omlx (its own base path) serves the ~4,000-token prompt(s) of the
   prefix-cache benchmark (cold, then identical again: hot) and the 8-turn agent trace.
   The write queue is waited out, then a clean stop (SIGTERM) flushes the hot tier.
   Bytes on disk (block files of the namespace) against unique tokens in full blocks x KV
   bytes per token.
2. Restart: page cache dropped (``/proc/sys/vm/drop_caches`` when allowed, else fadvise on
   every file of the cache folder; again on the block files once the server is up, because its
   start-up reads some of them), omlx started on the same base path; the same long prompt(s)
   and the trace turns again (same messages): TTFT, restored bytes and restore time
   (``/v1/cache/stats`` cold counters before and after each request).
3. Cold reference: an omlx with ``--no-cache`` gets every trace turn (same messages); the long
   prompt's cold figure is its first request in step 1 (a fresh, empty cache).
4. Restart mid-trace: a fresh omlx and mlx_lm.server run the trace (without its edit turn);
   both are restarted before turn 5 (omlx: queue waited out, clean stop, page cache dropped);
   mlx_lm.server keeps its prompt cache only in RAM, so it pays a cold prefill there.

Usage:
    python benchmarks/bench_ssd_cache.py            # full run (~15 min on a quiet 2-core machine)
    python benchmarks/bench_ssd_cache.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402

BLOCK_SUFFIX = ".safetensors"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--model-dir", type=Path, default=None, help="mlx-lm model folder (default: omlx's embedded SmolLM2)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the base paths (and so the SSD cache) and the bandwidth file go: put it on the disk "
                        "to measure (default: a temp folder, deleted at the end)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (cache files, logs)")
    p.add_argument("--reps", type=int, default=None, help="long prompts, each a new seed (default 2, quick 1)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="long prompt length (default 4000, quick 1000)")
    p.add_argument("--system-tokens", type=int, default=None, help="agent system prompt (default 2000, quick 600)")
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens added per turn (default 300, quick 100)")
    p.add_argument("--turns", type=int, default=None, help="agent-trace turns (default 8, quick 6)")
    p.add_argument("--edit-turn", type=int, default=5,
                   help="the turn (1-based) of the restart-free trace that edits a line in the middle of the history")
    p.add_argument("--restart-turn", type=int, default=5, help="the servers are restarted before this turn (1-based)")
    p.add_argument("--reply-tokens", type=int, default=None, help="max_tokens of each agent reply (default 64, quick 12)")
    p.add_argument("--bw-bytes", type=int, default=None,
                   help="size of the read-bandwidth file (default 1 GiB, quick 256 MiB)")
    p.add_argument("--page-cache", choices=("auto", "drop_caches", "fadvise"), default="auto",
                   help="how the page cache is dropped before a restart: auto tries /proc/sys/vm/drop_caches (the "
                        "whole machine's page cache) and falls back to posix_fadvise(DONTNEED) on every file of the "
                        "cache folder; fadvise touches only those files (kinder to neighbours)")
    p.add_argument("--omlx-arg", action="append", default=[], help="extra argument for omlx serve (repeatable)")
    p.add_argument("--peer-arg", action="append", default=[], help="extra argument for mlx_lm server (repeatable)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS for every server (default: OpenBLAS's own)")
    p.add_argument("--out-dir", type=Path, default=C.RESULTS_DIR)
    a = p.parse_args()
    q = a.quick
    a.reps = a.reps or (1 if q else 2)
    a.prompt_tokens = a.prompt_tokens or (1000 if q else 4000)
    a.system_tokens = a.system_tokens or (600 if q else 2000)
    a.turn_tokens = a.turn_tokens or (100 if q else 300)
    a.turns = a.turns or (6 if q else 8)
    a.reply_tokens = a.reply_tokens or (12 if q else 64)
    a.bw_bytes = a.bw_bytes or ((256 if q else 1024) * 1024 * 1024)
    if not 2 <= a.restart_turn <= a.turns:
        p.error(f"--restart-turn must be between 2 and --turns ({a.turns})")
    return a


# ---------------------------------------------------------------------------------------------
# page cache and disk


def files_under(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()]


def fadvise_dontneed(paths: list[Path]) -> int:
    """fsync then ``posix_fadvise(POSIX_FADV_DONTNEED)`` every file; returns how many were dropped."""
    n = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def drop_page_cache(root: Path, try_global: bool = True, require_global: bool = False) -> dict[str, Any]:
    """Drop ``root``'s files from the page cache.

    Tries ``echo 1 > /proc/sys/vm/drop_caches`` (the whole page cache; needs root and a
    writable /proc/sys) when ``try_global``, and falls back to fadvise on every file under
    ``root``. Returns the method used, the files and how many of their bytes are still
    resident afterwards (``fincore``; None when it is missing).
    """
    files = files_under(root)
    out: dict[str, Any] = {"num_files": len(files)}
    method = None
    if try_global:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "drop_caches"
        except OSError as e:
            out["drop_caches_error"] = f"{type(e).__name__}: {e.strerror or e}"
            if require_global:
                raise RuntimeError(f"--page-cache drop_caches: {out['drop_caches_error']}") from e
    if method is None:
        out["num_fadvised"] = fadvise_dontneed(files)
        method = "fadvise"
    out["method"] = method
    out["resident_bytes_after"] = resident_bytes(files)
    out["total_bytes"] = sum(f.stat().st_size for f in files if f.exists())
    return out


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (util-linux ``fincore``), or None without it."""
    exe = shutil.which("fincore")
    if not exe or not files:
        return None if not exe else 0
    total = 0
    for i in range(0, len(files), 200):
        p = subprocess.run([exe, "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files[i:i + 200])],
                           capture_output=True, text=True)
        if p.returncode not in (0, 1):
            return None
        total += sum(int(x) for x in p.stdout.split() if x.isdigit())
    return total


def cold_read_bandwidth(folder: Path, num_bytes: int) -> dict[str, Any]:
    """Cold sequential read bandwidth of ``folder``'s filesystem, in bytes/s.

    Writes ``num_bytes`` (8 MiB chunks of random bytes), fsyncs, drops the file from the page
    cache with ``posix_fadvise(DONTNEED)``, then times reading it sequentially in 8 MiB chunks.
    The file is deleted afterwards.
    """
    chunk = 8 * 1024 * 1024
    data = os.urandom(chunk)
    path = folder / "omlx-bench-readbw.bin"
    free = shutil.disk_usage(folder).free
    if free < 2 * num_bytes:
        raise RuntimeError(f"{folder}: {free / 1e9:.1f} GB free, need {2 * num_bytes / 1e9:.1f} GB for the bandwidth file")
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < num_bytes:
                n = f.write(data[: min(chunk, num_bytes - written)])
                written += n
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        fadvise_dontneed([path])
        resident = resident_bytes([path])
        buf = bytearray(chunk)
        read = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            while True:
                n = os.readv(fd, [buf])
                if n <= 0:
                    break
                read += n
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"num_bytes": read, "read_s": read_s, "read_bytes_per_s": read / read_s, "write_s": write_s,
            "write_bytes_per_s": num_bytes / write_s, "resident_bytes_before_read": resident, "path": str(path)}


def namespace_dirs(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.iterdir() if (p / "namespace.json").exists()] if cache_dir.exists() else []


def block_files(cache_dir: Path) -> list[Path]:
    return [f for ns in namespace_dirs(cache_dir) for f in ns.rglob("*" + BLOCK_SUFFIX)]


# ---------------------------------------------------------------------------------------------
# requests


class Seen:
    """The token sequences one omlx cache saw: unique tokens, and unique tokens in full blocks."""

    def __init__(self, prompts: C.Prompts):
        self.prompts = prompts
        self.trie = C.Trie()
        self.blocks: set[int] = set()

    def add(self, ids: list[int], res: C.StreamResult, block_size: int) -> None:
        if not res.ok:
            return
        seq = C.served_tokens(self.prompts, ids, res)
        # The KV of the last generated token is never computed (it was sampled, not fed).
        seq = seq[: len(ids) + max(0, res.num_tokens - 1)]
        self.trie.add(seq)
        for k in range(len(seq) // block_size):
            self.blocks.add(hash(tuple(seq[: (k + 1) * block_size])))


def file_num_tokens(path: Path) -> int:
    """``num_tokens`` from a block file's safetensors metadata (0 when unreadable)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return int(json.loads(f.read(n))["__metadata__"]["num_tokens"])
    except (OSError, ValueError, KeyError):
        return 0


def cache_stats(server: C.Server) -> dict[str, Any]:
    """``/v1/cache/stats`` of the served model: ``{"hot": ..., "cold": ...}``."""
    return server.get_json("/v1/cache/stats")["models"][server.model_name]


def send(server: C.Server, ids: list[int], *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
         max_tokens: int = 1, seen: Seen | None = None, block_size: int = 256, rep: C.Report | None = None,
         task: str = "") -> dict[str, Any]:
    """One streamed request; omlx's cold counters are read before and after it (deltas in the result)."""
    before = cache_stats(server)["cold"] if server.kind == "omlx" else None
    res = C.stream_chat(server, messages, max_tokens) if messages is not None else \
        C.stream_completion(server, prompt, max_tokens)
    if not res.ok and rep is not None:
        rep.note(f"{server.label} {task} failed: {res.error}")
    d = res.summary()
    d["id"] = task
    d["local_prompt_tokens"] = len(ids)
    d["text"] = res.text
    if before is not None and before.get("enabled"):
        after = cache_stats(server)["cold"]
        for k in ("num_cached_tokens", "num_restored_blocks", "num_restored_bytes", "num_restores_skipped",
                  "num_restore_failures", "restore_s"):
            if k in after:
                d["cold_" + k] = after[k] - before.get(k, 0)
        d["cold_read_bytes_per_s_model"] = after.get("read_bytes_per_s")
    if seen is not None:
        seen.add(ids, res, block_size)
    return d


def wait_written(server: C.Server, timeout_s: float = 300) -> dict[str, Any]:
    """Wait until omlx's SSD write queue is empty; returns the cold stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        cold = cache_stats(server)["cold"]
        if not cold.get("enabled") or cold.get("num_queued", 0) == 0 or time.monotonic() > deadline:
            return cold
        time.sleep(0.2)


def warm_up(server: C.Server) -> None:
    """A tiny request unrelated to the benchmark's prompts (the peer loads lazily)."""
    C.stream_chat(server, [{"role": "user", "content": "Say hello."}], 1)


# ---------------------------------------------------------------------------------------------


def main() -> int:
    a = parse_args()
    C.set_blas_threads(a.blas_threads)
    model_dir = C.ensure_model_dir(a.model_dir)
    rep = C.Report("ssd_cache", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()})
    rep.data["model_dir"] = str(model_dir)
    made_work = a.work_dir is None
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="omlx-bench-ssd-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "logs"
    log_dir.mkdir(exist_ok=True)
    rep.log(f"model {model_dir}; work folder {work}")
    prompts = C.Prompts(model_dir)
    bpt, kv_shape = C.kv_bytes_per_token(model_dir)
    raw: dict[str, Any] = {}
    fig: dict[str, Any] = {"kv_bytes_per_token": bpt, **kv_shape}
    servers: list[C.Server] = []

    def start(kind: str, label: str, extra: list[str], base: Path | None = None) -> C.Server:
        srv = C.Server(kind, model_dir, extra, log_dir, label, base_path=base)
        rep.log(f"starting {label}")
        srv.start()
        srv.wait_idle()
        servers.append(srv)
        if srv.blas() != "openblas":
            rep.note(f"{label} does not run on OpenBLAS ({srv.blas()})")
        return srv

    def stop(srv: C.Server) -> dict[str, Any]:
        srv.stop(timeout_s=300)
        servers.remove(srv)
        log = srv.log_path.read_text() if srv.log_path else ""
        flushed = [" ".join(ln.split("] ", 1)[-1].split()).removeprefix("INFO ")
                   for ln in log.splitlines() if "cold KV cache flushed" in ln]
        return {"stopped_clean": srv.stopped_clean, "flush_log": flushed[-1] if flushed else None}

    try:
        # ---- 0. disk bandwidth
        base_a = work / "base-a"
        cache_a = base_a / "cache"
        cache_a.mkdir(parents=True, exist_ok=True)
        rep.log(f"cold sequential read bandwidth of {cache_a} ({a.bw_bytes / 2**20:.0f} MiB file)")
        bw = cold_read_bandwidth(cache_a, a.bw_bytes)
        fig["disk"] = bw
        rep.log(f"read {bw['read_bytes_per_s'] / 1e6:.0f} MB/s cold (write {bw['write_bytes_per_s'] / 1e6:.0f} MB/s, "
                f"resident before read: {bw['resident_bytes_before_read']})")
        if bw["resident_bytes_before_read"]:
            rep.note(f"{bw['resident_bytes_before_read']} bytes of the bandwidth file stayed in the page cache")

        long_texts = [C.long_case(prompts, r, a.prompt_tokens)["cold"] for r in range(a.reps)]
        long_ids = [prompts.encode(t) for t in long_texts]
        trace = C.AgentTrace.build(prompts, 0, a.system_tokens, a.turn_tokens, a.turns, a.edit_turn)

        # ---- 1. populate
        srv = start("omlx", "omlx", a.omlx_arg, base_a)
        block_size = int(cache_stats(srv)["hot"]["block_size"])
        fig["block_size"] = block_size
        seen = Seen(prompts)
        pop: dict[str, Any] = {"long": [], "trace": []}
        for r, (text, ids) in enumerate(zip(long_texts, long_ids)):
            cold = send(srv, ids, prompt=text, seen=seen, block_size=block_size, rep=rep, task=f"long-{r}-cold")
            hot = send(srv, ids, prompt=text, seen=seen, block_size=block_size, rep=rep, task=f"long-{r}-hot")
            pop["long"].append({"cold": cold, "hot": hot})
            rep.log(f"long {r}: cold {C.ms(cold['ttft_s'])}, hot {C.ms(hot['ttft_s'])}")
        histories: list[list[dict[str, Any]]] = []
        msgs = trace.start()
        for k in range(a.turns):
            trace.next_turn(msgs, k)
            histories.append(copy.deepcopy(msgs))
            d = send(srv, prompts.chat_ids(msgs), messages=msgs, max_tokens=a.reply_tokens, seen=seen,
                     block_size=block_size, rep=rep, task=f"trace-turn-{k + 1}")
            pop["trace"].append(d)
            msgs.append({"role": "assistant", "content": d["text"]})
        rep.log("populate trace TTFT " + " ".join(C.fmt((t["ttft_s"] or 0) * 1e3, "", 0) for t in pop["trace"]) + " ms")
        t0 = time.perf_counter()
        cold_before_stop = wait_written(srv)
        pop["queue_wait_s"] = time.perf_counter() - t0
        pop["cold_before_stop"] = cold_before_stop
        pop["hot_before_stop"] = cache_stats(srv)["hot"]
        pop["stop"] = stop(srv)
        if not pop["stop"]["stopped_clean"] or not pop["stop"]["flush_log"]:
            rep.note(f"omlx did not stop cleanly or logged no flush: {pop['stop']}")
        raw["populate"] = pop

        # ---- bytes on disk
        files = block_files(cache_a)
        disk_bytes = sum(f.stat().st_size for f in files)
        file_tokens = [file_num_tokens(f) for f in files]
        expected_blocks = len(seen.blocks)
        num_full = sum(1 for n in file_tokens if n == block_size)
        # Full blocks and tails (partial last blocks) both go to disk: the ideal is every unique
        # token with KV that omlx saw (the start-up warm-up chat's tail is not in it: ~50 tokens).
        fig["disk_bytes"] = {
            "num_files": len(files), "num_full_block_files": num_full, "num_tail_files": len(files) - num_full,
            "num_bytes": disk_bytes, "num_file_tokens": sum(file_tokens), "expected_blocks": expected_blocks,
            "unique_tokens_full_blocks": expected_blocks * block_size, "unique_tokens_all": seen.trie.size,
            "ideal_bytes": seen.trie.size * bpt,
            "ratio": C.ratio(disk_bytes, seen.trie.size * bpt),
            "bytes_per_file_token": C.ratio(disk_bytes, sum(file_tokens)),
        }
        if num_full != expected_blocks:
            rep.note(f"{num_full} full-block files on disk, {expected_blocks} unique full blocks expected "
                     "(counted from re-tokenized replies, so off by a block or two is possible)")

        # ---- 2. restart with the page cache dropped
        drop1 = drop_page_cache(base_a / "cache", a.page_cache != "fadvise", a.page_cache == "drop_caches")
        rep.log(f"page cache dropped ({drop1['method']}): {drop1.get('resident_bytes_after')} of "
                f"{drop1['total_bytes']} bytes still resident")
        srv = start("omlx", "omlx (restarted)", a.omlx_arg, base_a)
        start_cold = cache_stats(srv)["cold"]
        drop2 = drop_page_cache(base_a / "cache", try_global=False)  # start-up read some block files
        rep.log(f"after start: fadvise again, {drop2.get('resident_bytes_after')} bytes resident")
        rst: dict[str, Any] = {"drop_before_start": drop1, "drop_after_start": drop2, "cold_at_start": start_cold,
                               "long": [], "trace": []}
        for r, (text, ids) in enumerate(zip(long_texts, long_ids)):
            d = send(srv, ids, prompt=text, rep=rep, task=f"long-{r}-restart")
            rst["long"].append(d)
            rep.log(f"long {r} after restart: {C.ms(d['ttft_s'])}, cached {d['cached_tokens']}, restored "
                    f"{(d.get('cold_num_restored_bytes') or 0) / 1e6:.1f} MB in {C.ms(d.get('cold_restore_s'))}")
        for k, h in enumerate(histories):
            d = send(srv, prompts.chat_ids(h), messages=h, rep=rep, task=f"trace-turn-{k + 1}-restart")
            rst["trace"].append(d)
        rep.log("trace after restart TTFT " + " ".join(C.fmt((t["ttft_s"] or 0) * 1e3, "", 0) for t in rst["trace"])
                + " ms")
        rst["cold_end"] = cache_stats(srv)["cold"]
        rst["stop"] = stop(srv)
        raw["restart"] = rst

        # ---- 3. cold reference: no cache at all
        srv = start("omlx", "omlx --no-cache", ["--no-cache", *a.omlx_arg])
        nc: dict[str, Any] = {"trace": []}
        for k, h in enumerate(histories):
            nc["trace"].append(send(srv, prompts.chat_ids(h), messages=h, rep=rep, task=f"trace-turn-{k + 1}-nocache"))
        rep.log("trace without cache TTFT " + " ".join(C.fmt((t["ttft_s"] or 0) * 1e3, "", 0) for t in nc["trace"])
                + " ms")
        stop(srv)
        raw["nocache"] = nc

        # ---- 4. restart before turn R, omlx and mlx_lm.server
        base_b = work / "base-b"
        trace_b = C.AgentTrace.build(prompts, 1, a.system_tokens, a.turn_tokens, a.turns, 0)  # no edit
        labels = ("omlx", "mlx_lm.server")
        kinds = {"omlx": "omlx", "mlx_lm.server": "mlx_lm"}
        extra = {"omlx": a.omlx_arg, "mlx_lm.server": a.peer_arg}
        bases = {"omlx": base_b, "mlx_lm.server": None}
        live = {lb: start(kinds[lb], lb, extra[lb], bases[lb]) for lb in labels}
        for s in live.values():
            warm_up(s)
        mid: dict[str, Any] = {lb: [] for lb in labels}
        hist = {lb: trace_b.start() for lb in labels}
        for k in range(a.turns):
            if k + 1 == a.restart_turn:
                for lb in labels:
                    s = live[lb]
                    info: dict[str, Any] = {}
                    if s.kind == "omlx":
                        info["cold_before_stop"] = wait_written(s)
                    info.update(stop(s))
                    if s.kind == "omlx":
                        info["drop_before_start"] = drop_page_cache(base_b / "cache", a.page_cache != "fadvise",
                                                                    a.page_cache == "drop_caches")
                    live[lb] = start(kinds[lb], f"{lb} (restarted)", extra[lb], bases[lb])
                    if s.kind == "omlx":
                        info["drop_after_start"] = drop_page_cache(base_b / "cache", try_global=False)
                    warm_up(live[lb])
                    mid.setdefault("restarts", {})[lb] = info
            for lb in labels:
                m = trace_b.next_turn(hist[lb], k)
                d = send(live[lb], prompts.chat_ids(m), messages=m, max_tokens=a.reply_tokens, rep=rep,
                         task=f"midtrace-turn-{k + 1}")
                d["after_restart"] = k + 1 == a.restart_turn
                mid[lb].append(d)
                m.append({"role": "assistant", "content": d["text"]})
        for lb in labels:
            rep.log(f"trace restarted before turn {a.restart_turn}, {lb}: TTFT " +
                    " ".join(C.fmt((t["ttft_s"] or 0) * 1e3, "", 0) for t in mid[lb]) + " ms")
        for lb in labels:
            stop(live[lb])
        raw["midtrace"] = mid
    except BaseException:
        rep.log(f"failed; the work folder {work} is kept (server logs under logs/)")
        raise
    finally:
        for srv in list(servers):
            srv.stop()

    for group in (raw["populate"]["trace"], raw["restart"]["trace"], raw["nocache"]["trace"],
                  raw["midtrace"]["omlx"], raw["midtrace"]["mlx_lm.server"]):
        for d in group:
            d["text"] = d["text"][:80]

    # ---- figures
    pop, rst, nc, mid = raw["populate"], raw["restart"], raw["nocache"], raw["midtrace"]
    cold_bw = fig["disk"]["read_bytes_per_s"]
    long_rows = []
    for r in range(a.reps):
        c, h, x = pop["long"][r]["cold"], pop["long"][r]["hot"], rst["long"][r]
        nbytes, rs = x.get("cold_num_restored_bytes") or 0, x.get("cold_restore_s")
        bound = 2 * nbytes / cold_bw + 0.050
        long_rows.append({"prompt_tokens": c["prompt_tokens"], "cold_ttft_s": c["ttft_s"],
                          "hot_ttft_s": h["ttft_s"], "restart_ttft_s": x["ttft_s"], "restart_cached": x["cached_tokens"],
                          "restored_tokens": x.get("cold_num_cached_tokens"), "restored_bytes": nbytes,
                          "restore_s": rs, "restore_bytes_per_s": C.ratio(nbytes, rs), "restore_bound_s": bound,
                          "restore_over_bound": C.ratio(rs, bound) if nbytes else None,
                          "speedup": C.ratio(c["ttft_s"], x["ttft_s"])})
    fig["long"] = long_rows
    turn_rows = []
    for k in range(a.turns):
        p_, x, n = pop["trace"][k], rst["trace"][k], nc["trace"][k]
        turn_rows.append({"prompt_tokens": x["prompt_tokens"], "populate_ttft_s": p_["ttft_s"], "nocache_ttft_s": n["ttft_s"],
                          "restart_ttft_s": x["ttft_s"], "restart_cached": x["cached_tokens"],
                          "restored_tokens": x.get("cold_num_cached_tokens"), "restored_bytes": x.get("cold_num_restored_bytes"),
                          "restore_s": x.get("cold_restore_s"), "speedup": C.ratio(n["ttft_s"], x["ttft_s"])})
    fig["trace"] = turn_rows
    restores = [(d.get("cold_num_restored_bytes") or 0, d.get("cold_restore_s") or 0.0) for d in rst["long"] + rst["trace"]]
    tot_b, tot_s = sum(b for b, _ in restores), sum(s for b, s in restores if b)
    fig["restore"] = {"num_bytes": tot_b, "restore_s": tot_s, "bytes_per_s": C.ratio(tot_b, tot_s),
                      "over_cold_read_bw": C.ratio(C.ratio(tot_b, tot_s), cold_bw),
                      "worst_over_bound": max((C.ratio(s, 2 * b / cold_bw + 0.05) or 0 for b, s in restores if b),
                                              default=None)}
    rt = a.restart_turn - 1
    fig["midtrace"] = {lb: {"ttft_s": [d["ttft_s"] for d in mid[lb]], "cached": [d["cached_tokens"] for d in mid[lb]],
                            "restart_over_previous": C.ratio(mid[lb][rt]["ttft_s"], mid[lb][rt - 1]["ttft_s"]),
                            "total_ttft_s": sum(d["ttft_s"] or 0 for d in mid[lb])}
                       for lb in ("omlx", "mlx_lm.server")}
    fig["page_cache"] = {"before_start": rst["drop_before_start"]["method"],
                         "after_start": rst["drop_after_start"]["method"],
                         "drop_caches_error": rst["drop_before_start"].get("drop_caches_error")}
    rep.data["figures"] = fig
    rep.data["raw"] = raw

    # ---- tables
    rows = []
    for r, x in enumerate(long_rows):
        rows.append([f"long #{r + 1} ({x['prompt_tokens']} tok)", C.ms(x["cold_ttft_s"]),
                     C.ms(x["hot_ttft_s"]), C.ms(x["restart_ttft_s"]), f"{x['restart_cached']} / {x['restored_tokens']}",
                     f"{x['restored_bytes'] / 1e6:.1f} MB", C.ms(x["restore_s"]), C.ms(x["restore_bound_s"]),
                     C.fmt(x["speedup"], "x")])
    rep.table(f"Long prompt: cold (fresh cache) vs after a restart with the page cache dropped "
              f"({fig['page_cache']['before_start']}); restore bound = 2 x bytes / cold read bw + 50 ms",
              ["prompt", "cold", "hot", "after restart", "cached / from disk", "restored",
               "restore time", "bound", "cold/restart"], rows)
    trows = []
    for k, x in enumerate(turn_rows):
        trows.append([f"turn {k + 1}{' (edit)' if k + 1 == a.edit_turn else ''}", str(x["prompt_tokens"]),
                      C.ms(x["nocache_ttft_s"]), C.ms(x["populate_ttft_s"]), C.ms(x["restart_ttft_s"]),
                      f"{x['restart_cached']} / {x['restored_tokens']}",
                      f"{(x['restored_bytes'] or 0) / 1e6:.1f} MB", C.ms(x["restore_s"]), C.fmt(x["speedup"], "x")])
    rep.table("Agent trace after the restart (same messages; cold = omlx --no-cache, first run = the populating run)",
              ["turn", "prompt", "cold", "first run", "after restart", "cached / from disk", "restored",
               "restore time", "cold/restart"], trows)
    mrows = []
    for k in range(a.turns):
        o, p_ = mid["omlx"][k], mid["mlx_lm.server"][k]
        mrows.append([f"turn {k + 1}{' (after restart)' if k == rt else ''}", str(o["prompt_tokens"]),
                      C.ms(o["ttft_s"]), f"{o['cached_tokens']} / {o.get('cold_num_cached_tokens')}", C.ms(p_["ttft_s"]),
                      str(p_["cached_tokens"])])
    mrows.append(["total", "", C.ms(fig["midtrace"]["omlx"]["total_ttft_s"]), "",
                  C.ms(fig["midtrace"]["mlx_lm.server"]["total_ttft_s"]), ""])
    rep.table(f"Agent trace (no edit) with both servers restarted before turn {a.restart_turn}",
              ["turn", "prompt", "omlx TTFT", "omlx cached / from disk", "mlx_lm.server TTFT", "peer cached"], mrows)
    db = fig["disk_bytes"]
    rep.table("Disk and bytes", ["figure", "value"], [
        ["cold sequential read (file, fsync, fadvise DONTNEED, read)",
         f"{cold_bw / 1e6:.0f} MB/s ({fig['disk']['num_bytes'] / 2**20:.0f} MiB in {fig['disk']['read_s']:.2f} s)"],
        ["restore throughput (all restores after the restart)",
         f"{(fig['restore']['bytes_per_s'] or 0) / 1e6:.0f} MB/s ({tot_b / 1e6:.1f} MB in {tot_s * 1e3:.0f} ms)"],
        ["page cache drop", f"before start: {fig['page_cache']['before_start']}; after start: fadvise on block files"
                            + (f" ({fig['page_cache']['drop_caches_error']})" if fig['page_cache']['drop_caches_error'] else "")],
        ["block files (full blocks + tails) / bytes on disk",
         f"{db['num_files']} ({db['num_full_block_files']} + {db['num_tail_files']}) / {db['num_bytes'] / 1e6:.1f} MB"],
        ["all unique tokens (in full blocks) / tokens in files",
         f"{db['unique_tokens_all']} ({db['unique_tokens_full_blocks']}) / {db['num_file_tokens']}"],
        [f"KV bytes per token (2*{kv_shape['layers']}*{kv_shape['kv_heads']}*{kv_shape['head_dim']}*"
         f"{kv_shape['dtype_bytes']})", str(bpt)],
        ["bytes on disk per stored token", C.fmt(db["bytes_per_file_token"], " B", 0)],
    ])

    # ---- targets
    best = min((x for x in long_rows), key=lambda x: x["speedup"] or 0)
    rep.target(f"TTFT after restart vs cold prefill, ~{a.prompt_tokens} tokens (worst prompt)",
               best["speedup"], ">=", 10, "cold TTFT / TTFT after restart, how many times faster")
    rep.target(f"turn {a.restart_turn} TTFT after the restart vs turn {a.restart_turn - 1}'s (omlx)",
               fig["midtrace"]["omlx"]["restart_over_previous"], "<=", 1.5,
               f"mlx_lm.server: {C.fmt(fig['midtrace']['mlx_lm.server']['restart_over_previous'], 'x')}")
    rep.target("restore time vs 2 x (bytes / cold read bandwidth) + 50 ms (worst restore)",
               fig["restore"]["worst_over_bound"], "<=", 1.0, f"server-side restore_s, {len([b for b, _ in restores if b])} restores")
    rep.target("disk bytes vs unique tokens x KV bytes per token", db["ratio"], "<=", 1.05,
               f"{db['unique_tokens_all']} unique tokens x {bpt} B")
    rep.print()
    rep.write(a.out_dir, "quick" if a.quick else "")
    if made_work and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        rep.log(f"kept {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cold tier storage of one namespace: the index, the disk budget, the writer, validated reads.

This module owns what is on disk under ``<cache-dir>/<namespace digest>/``: the in-memory
index rebuilt from the files at start (a block's parent, size and recency), the byte budget
(least recently used leaves first, pinned blocks never), the bounded write queue and its
writer thread, reads that delete and count a bad file instead of serving it, and the
maintenance helpers behind ``omlx cache stats|clear|verify``.

Files are indexed by key and by parent: after the last full block of a prompt found on disk,
:meth:`SSDStore.best_child` finds the file under it (a tail, or a full block) sharing the
longest common prefix with the rest of the prompt, as the hot tier does. A file that a longer
sibling (same parent) *supersedes* holds (almost) nothing the sibling does not: it is deleted
when the sibling is written (or found at start), and never written after it. Supersedes: the
sibling agrees with all but at most ``tail_slack_tokens`` of the file's last tokens, and on at
least 4/5 of them (the hot tier's rule for tails: a finished request's tail ends in generated
tokens that the next prompt may not repeat exactly; lookup recomputes those few instead of
storing the shared tokens twice). The file format itself is
``omlx.cache.blockfile``. It uses numpy only through that module: it must not import mlx,
and it does not decide *when* a block is written or restored (``omlx.cache.tiered``).
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import shutil
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omlx.cache.blockfile import (
    BLOCK_SUFFIX,
    DTYPES,
    SSD_FORMAT_VERSION,
    TMP_SUFFIX,
    BadBlockError,
    HostBlock,
    OldFormatError,
    check_metadata,
    decode_block,
    encode_block_parts,
    iter_block_files,
    parse_header,
    read_header,
    remove_stale_temp,
    write_file_atomic,
)
from omlx.cache.hashing import HASH_NUM_BYTES, Namespace
from omlx.cache.paged import TAIL_SLACK_TOKENS, common_prefix_len, tail_superseded
from omlx.units import format_bytes

__all__ = [
    "ChildMatch",
    "ColdStats",
    "NamespaceSummary",
    "SSDStore",
    "VerifyReport",
    "clear_cache_dir",
    "default_ssd_cache_bytes",
    "summarize_cache_dir",
    "verify_cache_dir",
]

NAMESPACE_FILE = "namespace.json"
NOTES_FILE = "notes.json"
_NS_DIR_CHARS = 32

logger = logging.getLogger(__name__)


def _progress(total: int, label: str, enabled: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """A rich progress bar on a TTY (advance, close); no-ops otherwise."""
    if not enabled or total < 1 or not sys.stderr.isatty():
        return (lambda: None), (lambda: None)
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task(label, total=total)
    bar.start()
    return (lambda: bar.advance(task)), bar.stop


def default_ssd_cache_bytes(path: Path) -> int:
    """Default disk budget: 10% of the free space where ``path`` lives, at most 50 GB."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return int(min(free * 0.10, 50 * 10**9))


WRITER_NICE = 19
"""Nice value of the writer thread (Linux: per thread). Writing a block (serialize, CRC-32, write,
fsync) takes CPU that a prefill's BLAS threads would otherwise have; at nice 19 it runs when the
cores are free, so a turn after a long one is not slowed by the previous turn's writes."""


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's CPU priority; True when it took effect.

    Linux: ``setpriority`` on the thread's own id (a thread is a task there); macOS: the thread's
    background QoS (``PRIO_DARWIN_BG``, Python >= 3.12). Elsewhere, or without permission, nothing
    changes (logged at debug): the writer then runs at the process's priority.
    """
    if nice <= 0:
        return False
    try:
        if sys.platform.startswith("linux"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            return True
        if sys.platform == "darwin" and hasattr(os, "PRIO_DARWIN_THREAD"):
            os.setpriority(os.PRIO_DARWIN_THREAD, 0, os.PRIO_DARWIN_BG)  # type: ignore[attr-defined]
            return True
    except OSError as exc:
        logger.debug("cannot lower the SSD writer's priority: %s", exc)
    return False


@dataclass(slots=True)
class _Entry:
    parent_hash: bytes
    num_bytes: int
    tick: int
    tokens: array  # the file's token ids, uint32 (4 bytes a token: the index stays small)
    num_children: int = 0
    num_pins: int = 0


@dataclass(frozen=True, slots=True)
class ChildMatch:
    """A file under a parent whose first tokens match a prompt's (see :meth:`SSDStore.best_child`).

    Attributes:
        block_hash: the file's key.
        token_ids: all of the file's tokens (read and validate with these).
        num_common: leading tokens shared with the prompt (``>= 1``); the KV of exactly these
            is reusable (causal attention).
        num_bytes: the file's size.
    """

    block_hash: bytes
    token_ids: tuple[int, ...]
    num_common: int
    num_bytes: int


@dataclass(slots=True)
class _WriteJob:
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    host: HostBlock
    num_bytes: int
    high: bool


@dataclass(frozen=True, slots=True)
class ColdStats:
    """Counters of one namespace's cold tier since the store was opened.

    Attributes:
        num_files, num_bytes, max_bytes: blocks on disk, their bytes, the budget.
        num_scanned_files, scan_s: files found by the index rebuild at start and its time.
        num_writes, num_written_bytes: blocks written.
        num_write_errors: writes that failed (any OSError), ``num_disk_full`` of them ENOSPC.
        num_queue_drops: blocks not written because the write queue was full.
        num_budget_drops: blocks not written because every file was pinned or a parent.
        num_queued, num_queued_bytes: blocks waiting in the write queue now.
        num_reads, num_read_bytes, read_s: validated reads and their total time.
        num_bad_files: files found invalid (at start or on read) and deleted, including
            ``num_old_format_files``.
        num_old_format_files: files of another format version (an older omlx) deleted.
        num_missing: index entries whose file had vanished (deleted by someone else).
        num_evictions, num_evicted_bytes: files deleted for the budget.
        num_superseded: files deleted (or not written) because a sibling under the same
            parent holds the same tokens and more (a tail that a longer tail or block covers).
    """

    num_files: int
    num_bytes: int
    max_bytes: int
    num_scanned_files: int
    scan_s: float
    num_writes: int
    num_written_bytes: int
    num_write_errors: int
    num_disk_full: int
    num_queue_drops: int
    num_budget_drops: int
    num_queued: int
    num_queued_bytes: int
    num_reads: int
    num_read_bytes: int
    read_s: float
    num_bad_files: int
    num_missing: int
    num_evictions: int
    num_evicted_bytes: int
    num_superseded: int = 0
    num_old_format_files: int = 0


class SSDStore:
    """The cold tier of one namespace: index, budget, writer thread, validated reads.

    Thread-safe: the engine thread queues writes and pins, reader threads read, the writer
    thread writes and evicts; one lock guards the index.

    Args:
        root: the cache folder (``--ssd-cache-dir``).
        namespace: blocks of this namespace only; files of others are never looked at.
        dtype: the KV dtype (a key of :data:`DTYPES`); files of another dtype are bad.
        max_bytes: disk budget for this namespace's block files, in bytes.
        max_queue_bytes: most bytes of blocks waiting to be written; more are dropped.
        model_id: recorded in ``namespace.json`` for ``omlx cache stats|clear --model``.
        progress: show a progress bar while rebuilding the index (only on a TTY).
        tail_slack_tokens: a file whose last tokens differ from a longer sibling's in at most
            this many (and in at most 1/5 of them) is superseded by it; 0: only exact prefixes;
            negative: never (recurrent-state models: each tail's snapshot is its own).

    The index is rebuilt from the namespace's folder in the constructor: headers are parsed,
    files of another format version, namespace or dtype, or truncated ones, are deleted and
    counted as bad; stale temp files of dead writers are deleted; files superseded by a
    sibling are deleted.
    """

    def __init__(
        self,
        root: Path,
        namespace: Namespace,
        *,
        dtype: str,
        max_bytes: int,
        max_queue_bytes: int = 256 * 1024 * 1024,
        model_id: str = "",
        progress: bool = False,
        tail_slack_tokens: int = TAIL_SLACK_TOKENS,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        self.root = Path(root)
        self.namespace = namespace
        self.dtype = dtype
        self.tail_slack_tokens = int(tail_slack_tokens)  # negative: never superseded
        self.dir = self.root / namespace.digest()
        self._max_bytes = self._configured_max_bytes = max(0, int(max_bytes))
        self._disk_full_at: float | None = None
        self._max_queue_bytes = max_queue_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[bytes, _Entry] = {}
        self._by_parent: dict[bytes, set[bytes]] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._clock = 0
        self._num_bytes = 0
        self._high: deque[_WriteJob] = deque()
        self._low: deque[_WriteJob] = deque()
        self._pending: dict[bytes, _WriteJob] = {}
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self._warned_full = False
        self._c = dict.fromkeys(
            ("writes", "written_bytes", "write_errors", "disk_full", "queue_drops", "budget_drops",
             "reads", "read_bytes", "bad_files", "missing", "evictions", "evicted_bytes", "superseded", "old_format"), 0)
        self._read_s = 0.0
        self._write_s = 0.0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_namespace_file(model_id)
        t0 = time.monotonic()
        self._rebuild_index(progress)
        self.scan_s = time.monotonic() - t0
        self.num_scanned_files = len(self._index)
        with self._lock:
            self._make_room(0, protect=None)

    # ---- index ---------------------------------------------------------------------

    def _write_namespace_file(self, model_id: str) -> None:
        doc = {"namespace": json.loads(self.namespace.to_json()), "model_id": model_id,
               "format_version": SSD_FORMAT_VERSION}
        path = self.dir / NAMESPACE_FILE
        try:
            if json.loads(path.read_text()) == doc:
                return
        except (OSError, ValueError):
            pass
        try:
            write_file_atomic(path, json.dumps(doc, indent=1, sort_keys=True).encode())
        except OSError as exc:
            logger.warning("cannot write %s: %s", path, exc)

    def _rebuild_index(self, progress: bool) -> None:
        files = list(iter_block_files(self.dir))
        advance, close = _progress(len(files), "indexing SSD KV cache", progress)
        found: list[tuple[float, bytes, _Entry]] = []
        old: dict[str, int] = {}
        try:
            for path in files:
                advance()
                if path.name.endswith(TMP_SUFFIX):
                    remove_stale_temp(path)
                    continue
                try:
                    block_hash = bytes.fromhex(path.name[: -len(BLOCK_SUFFIX)])
                    if len(block_hash) != HASH_NUM_BYTES or path.parent.name != block_hash.hex()[:2]:
                        raise BadBlockError("file name is not <hh>/<64 hex>.safetensors")
                    header, size, mtime = read_header(path)
                    parent, tokens = check_metadata(header.metadata, self.namespace, block_hash, None, None,
                                                    self.dtype)
                except FileNotFoundError:
                    continue
                except OldFormatError as exc:
                    # Another layout (an older omlx): never misread; one summary line below.
                    old[str(exc.version)] = old.get(str(exc.version), 0) + 1
                    self._delete_bad(path, str(exc), log=False)
                    continue
                except (BadBlockError, ValueError, OSError) as exc:
                    self._delete_bad(path, str(exc))
                    continue
                found.append((mtime, block_hash, _Entry(parent, size, 0, array("I", tokens))))
        finally:
            close()
        if old:
            num_old = sum(old.values())
            with self._lock:
                self._c["old_format"] += num_old
            logger.warning("cold KV cache: deleted %d block file(s) of an older format (version %s; this omlx "
                           "writes version %d) in %s; their prompts are prefilled again once", num_old,
                           ", ".join(f"{v}: {n}" for v, n in sorted(old.items())), SSD_FORMAT_VERSION, self.dir)
        found.sort(key=lambda x: x[0])  # oldest first: least recently used
        for _, block_hash, entry in found:
            self._clock += 1
            entry.tick = self._clock
            self._index[block_hash] = entry
            self._by_parent.setdefault(entry.parent_hash, set()).add(block_hash)
            self._num_bytes += entry.num_bytes
        for block_hash, entry in self._index.items():
            parent = self._index.get(entry.parent_hash)
            if parent is not None:
                parent.num_children += 1
        for block_hash, entry in self._index.items():
            if entry.num_children == 0:
                self._heap.append((entry.tick, block_hash))
        heapq.heapify(self._heap)
        with self._lock:
            for block_hash in list(self._index):
                if block_hash in self._index:
                    self._drop_superseded_by(block_hash)

    def _delete_bad(self, path: Path, reason: str, *, log: bool = True) -> None:
        if log:
            logger.warning("cold KV cache: deleting bad block file %s (%s)", path.name, reason)
        with self._lock:
            self._c["bad_files"] += 1
        try:
            path.unlink()
        except OSError:
            pass

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is on disk (as far as the index knows)."""
        with self._lock:
            return block_hash in self._index

    def file_bytes(self, block_hash: bytes) -> int | None:
        """Size of the block's file in bytes, or ``None`` if not on disk."""
        with self._lock:
            entry = self._index.get(block_hash)
            return None if entry is None else entry.num_bytes

    def is_pending(self, block_hash: bytes) -> bool:
        """Whether the block waits in the write queue (or is being written)."""
        with self._lock:
            return block_hash in self._pending

    def pending(self, block_hash: bytes) -> HostBlock | None:
        """The KV of a block still in the write queue, or ``None``."""
        with self._lock:
            job = self._pending.get(block_hash)
            return None if job is None else job.host

    def pin(self, hashes: Sequence[bytes]) -> None:
        """Protect blocks from eviction (e.g. while they are being restored)."""
        with self._lock:
            for h in hashes:
                entry = self._index.get(h)
                if entry is not None:
                    entry.num_pins += 1

    def unpin(self, hashes: Sequence[bytes]) -> None:
        """Undo :meth:`pin`; unpinned leaves become evictable again."""
        with self._lock:
            for h in hashes:
                entry = self._index.get(h)
                if entry is not None and entry.num_pins > 0:
                    entry.num_pins -= 1
                    if entry.num_pins == 0 and entry.num_children == 0:
                        heapq.heappush(self._heap, (entry.tick, h))

    def _touch(self, block_hash: bytes) -> None:
        entry = self._index.get(block_hash)
        if entry is not None:
            self._clock += 1
            entry.tick = self._clock
            if entry.num_children == 0:
                heapq.heappush(self._heap, (entry.tick, block_hash))

    def _add(self, block_hash: bytes, parent_hash: bytes, num_bytes: int, tokens: Sequence[int]) -> None:
        self._clock += 1
        entry = _Entry(parent_hash, num_bytes, self._clock, array("I", tokens))
        self._index[block_hash] = entry
        self._by_parent.setdefault(parent_hash, set()).add(block_hash)
        self._num_bytes += num_bytes
        parent = self._index.get(parent_hash)
        if parent is not None:
            parent.num_children += 1
        heapq.heappush(self._heap, (entry.tick, block_hash))

    def _forget(self, block_hash: bytes) -> _Entry | None:
        """Drop an entry from the index (not the file)."""
        entry = self._index.pop(block_hash, None)
        if entry is None:
            return None
        siblings = self._by_parent.get(entry.parent_hash)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._by_parent[entry.parent_hash]
        self._num_bytes -= entry.num_bytes
        parent = self._index.get(entry.parent_hash)
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and parent.num_pins == 0:
                heapq.heappush(self._heap, (parent.tick, entry.parent_hash))
        return entry

    def _path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}{BLOCK_SUFFIX}"

    def _covered(self, parent_hash: bytes, tokens: array) -> bool:
        """Whether a file under ``parent_hash`` supersedes a file of ``tokens`` (lock held)."""
        slack = self.tail_slack_tokens
        return any(
            tail_superseded(self._index[h].tokens, tokens, slack) for h in self._by_parent.get(parent_hash, ())
        )

    def _drop_superseded_by(self, block_hash: bytes) -> None:
        """Delete the unpinned leaf siblings that this file supersedes (lock held)."""
        entry = self._index[block_hash]
        for h in list(self._by_parent.get(entry.parent_hash, ())):
            sib = self._index[h]
            if sib.num_children or sib.num_pins or not tail_superseded(entry.tokens, sib.tokens, self.tail_slack_tokens):
                continue
            self._forget(h)
            self._c["superseded"] += 1
            try:
                self._path(h).unlink()
            except OSError:
                pass

    def best_child(self, parent_hash: bytes, token_ids: Sequence[int], *, whole_only: bool = False) -> ChildMatch | None:
        """The file under ``parent_hash`` sharing the longest common prefix with ``token_ids``.

        Mirrors the hot tier's partial reuse (``BlockPool.lookup``): the first ``num_common``
        tokens of a file chained from the same parent are exactly the KV a prompt starting with
        them computes. Ties go to the most recently used file.

        Args:
            parent_hash: key of the last block matched (``namespace.key()`` at the start).
            token_ids: the prompt's tokens after that block (at most ``block_size``).

        Returns:
            The best match, or ``None`` when no file under the parent shares a first token.
        """
        if not token_ids:
            return None
        first = token_ids[0]
        best: tuple[int, int] = (0, 0)
        found: tuple[bytes, _Entry] | None = None
        with self._lock:
            for h in self._by_parent.get(parent_hash, ()):
                e = self._index[h]
                if not e.tokens or e.tokens[0] != first:
                    continue
                score = (common_prefix_len(e.tokens, token_ids), e.tick)
                if whole_only and score[0] < len(e.tokens):
                    continue
                if score > best:
                    best, found = score, (h, e)
            if found is None:
                return None
            return ChildMatch(found[0], tuple(found[1].tokens), best[0], found[1].num_bytes)

    def _make_room(self, num_bytes: int, *, protect: bytes | None) -> bool:
        """Evict least recently used unpinned leaves until ``num_bytes`` more fit."""
        skipped = []
        ok = True
        while self._num_bytes + num_bytes > self._max_bytes:
            if not self._heap:
                ok = False
                break
            tick, h = heapq.heappop(self._heap)
            entry = self._index.get(h)
            if entry is None or entry.tick != tick or entry.num_children or entry.num_pins:
                continue  # stale, not a leaf, or pinned (re-pushed when that changes)
            if h == protect:
                skipped.append((tick, h))
                continue
            self._forget(h)
            self._c["evictions"] += 1
            self._c["evicted_bytes"] += entry.num_bytes
            try:
                (self.dir / h.hex()[:2] / f"{h.hex()}{BLOCK_SUFFIX}").unlink()
            except OSError:
                pass
        for item in skipped:
            heapq.heappush(self._heap, item)
        return ok

    # ---- writes --------------------------------------------------------------------

    def put(
        self,
        block_hash: bytes,
        parent_hash: bytes,
        token_ids: Sequence[int],
        host: HostBlock,
        *,
        high: bool = False,
        wait: bool = False,
    ) -> bool:
        """Queue a block for writing; never blocks unless ``wait``.

        When the queue's bytes are full, a low-priority block is dropped; a high-priority one
        displaces the newest queued low-priority blocks, else it is dropped. Drops are counted.

        Args:
            block_hash: the block's key, ``hash_block(parent_hash, token_ids)`` as the caller
                computed it (a request's ``BlockHashes``; trusted, not hashed again); a block
                already on disk or queued is skipped.
            parent_hash: previous block's key (``namespace.key()`` for block 0).
            token_ids: the block's tokens.
            host: its KV; the arrays must stay unchanged until written.
            high: high priority (write-back of an evicted block, a block hit often).
            wait: block until there is room instead of dropping (clean shutdown flush).

        Returns:
            True when queued (or already on disk / queued), False when dropped.
        """
        job = _WriteJob(block_hash, parent_hash, tuple(int(t) for t in token_ids), host,
                        host.num_bytes, high)
        with self._cond:
            if self._closed:
                return False
            if block_hash in self._index or block_hash in self._pending:
                return True
            if self._covered(parent_hash, array("I", job.token_ids)):
                self._c["superseded"] += 1
                return True
            while self._queued_bytes + job.num_bytes > self._max_queue_bytes and self._pending:
                if wait:
                    self._cond.wait(1.0)
                    if self._closed:
                        return False
                    continue
                if high and self._low:
                    victim = self._low.pop()
                    self._pending.pop(victim.block_hash, None)
                    self._queued_bytes -= victim.num_bytes
                    self._c["queue_drops"] += 1
                    continue
                self._c["queue_drops"] += 1
                return False
            (self._high if high else self._low).append(job)
            self._pending[block_hash] = job
            self._queued_bytes += job.num_bytes
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="omlx-ssd-writer", daemon=True)
                self._writer.start()
            self._cond.notify_all()
            return True

    def _write_loop(self) -> None:
        lower_thread_priority(WRITER_NICE)
        while True:
            with self._cond:
                while not self._high and not self._low and not self._closed:
                    self._cond.wait()
                if not self._high and not self._low:
                    return
                job = (self._high or self._low).popleft()
                self._busy = True
            try:
                self._write(job)
            except Exception:  # the writer must survive anything; a lost write is only a miss
                logger.exception("cold KV cache: writing block %s failed", job.block_hash.hex()[:16])
                with self._lock:
                    self._c["write_errors"] += 1
            finally:
                with self._cond:
                    self._pending.pop(job.block_hash, None)
                    self._queued_bytes -= job.num_bytes
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: _WriteJob) -> None:
        t0 = time.monotonic()
        # The key was computed once by the request (BlockHashes); put's callers vouch for it. The
        # tensor bytes go from the host array to the file: only the small header holds the GIL.
        enc = encode_block_parts(self.namespace, job.parent_hash, job.token_ids, job.host,
                                 block_hash=job.block_hash)
        block_hash, num_bytes = enc.block_hash, enc.num_bytes
        with self._lock:
            if block_hash in self._index:
                return
            if self._covered(job.parent_hash, array("I", job.token_ids)):
                self._c["superseded"] += 1
                return
            self._maybe_regrow_budget()
            if not self._make_room(num_bytes, protect=job.parent_hash):
                self._c["budget_drops"] += 1
                return
            self._pin_parent(job.parent_hash, +1)
        path = self.dir / block_hash.hex()[:2] / f"{block_hash.hex()}{BLOCK_SUFFIX}"
        try:
            write_file_atomic(path, enc.header, *enc.buffers)
        except OSError as exc:
            with self._lock:
                self._pin_parent(job.parent_hash, -1)
                self._c["write_errors"] += 1
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._c["disk_full"] += 1
                    # The disk holds less than the budget: shrink it to what we hold now, so
                    # later writes evict older blocks instead of failing.
                    self._max_bytes = self._num_bytes
                    self._disk_full_at = time.monotonic()
                    if not self._warned_full:
                        self._warned_full = True
                        logger.warning("cold KV cache: disk full at %s; budget lowered to %s",
                                       self.dir, format_bytes(self._max_bytes))
                else:
                    logger.warning("cold KV cache: cannot write %s: %s", path, exc)
            return
        with self._lock:
            self._pin_parent(job.parent_hash, -1)
            self._add(block_hash, job.parent_hash, num_bytes, job.token_ids)
            self._drop_superseded_by(block_hash)
            self._c["writes"] += 1
            self._c["written_bytes"] += num_bytes
            self._write_s += time.monotonic() - t0

    def _maybe_regrow_budget(self) -> None:
        """A minute after the disk was found full, let the budget grow into freed space."""
        if self._disk_full_at is None or time.monotonic() - self._disk_full_at < 60.0:
            return
        self._disk_full_at = None
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return
        self._max_bytes = min(self._configured_max_bytes, self._num_bytes + int(free * 0.9))

    def _pin_parent(self, parent_hash: bytes, delta: int) -> None:
        entry = self._index.get(parent_hash)
        if entry is not None:
            entry.num_pins = max(0, entry.num_pins + delta)
            if entry.num_pins == 0 and entry.num_children == 0:
                heapq.heappush(self._heap, (entry.tick, parent_hash))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the write queue is empty; True if it emptied within ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._high or self._low or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self, timeout_s: float | None = 60.0) -> bool:
        """Write what is queued, then stop the writer; True if everything was written."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(1.0 if done else 0.1)
        return done

    # ---- reads ---------------------------------------------------------------------

    def read(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> HostBlock | None:
        """Read and validate one block; a bad file is deleted and counted, never returned.

        Args:
            block_hash: the block's key.
            parent_hash: the key it must chain from.
            token_ids: the tokens it must hold.

        Returns:
            The block's KV (arrays are read-only views of the file's bytes), or ``None`` when
            the file is missing or invalid.
        """
        path = self.dir / block_hash.hex()[:2] / f"{block_hash.hex()}{BLOCK_SUFFIX}"
        t0 = time.monotonic()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                if self._forget(block_hash) is not None:
                    self._c["missing"] += 1
            return None
        except OSError as exc:
            logger.warning("cold KV cache: cannot read %s: %s", path, exc)
            return None
        try:
            host, _, _ = decode_block(data, self.namespace, block_hash, parent_hash=parent_hash,
                                      token_ids=token_ids, dtype=self.dtype)
        except BadBlockError as exc:
            with self._lock:
                self._forget(block_hash)
            self._delete_bad(path, str(exc))
            return None
        elapsed = time.monotonic() - t0
        with self._lock:
            self._c["reads"] += 1
            self._c["read_bytes"] += len(data)
            self._read_s += elapsed
            self._touch(block_hash)
        try:
            os.utime(path)  # recency survives a restart (the index is ordered by mtime)
        except OSError:
            pass
        return host

    def measure_read_bandwidth(self, max_bytes: int = 16 * 1024 * 1024) -> float | None:
        """Bytes/s of plain reads of the most recently used files (up to ``max_bytes``).

        Returns:
            The measured bandwidth, or ``None`` when no file could be read.
        """
        with self._lock:
            recent = sorted(self._index.items(), key=lambda kv: -kv[1].tick)
        total = 0
        t0 = time.monotonic()
        for h, _ in recent:
            if total >= max_bytes:
                break
            try:
                with open(self.dir / h.hex()[:2] / f"{h.hex()}{BLOCK_SUFFIX}", "rb") as f:
                    total += len(f.read())
            except OSError:
                continue
        elapsed = time.monotonic() - t0
        return total / elapsed if total and elapsed > 0 else None

    def clear(self) -> int:
        """Delete every block file of this namespace and the queue; returns files deleted."""
        with self._cond:
            hashes = list(self._index)
            for job in list(self._high) + list(self._low):
                self._pending.pop(job.block_hash, None)
                self._queued_bytes -= job.num_bytes
            self._high.clear()
            self._low.clear()
            self._index.clear()
            self._by_parent.clear()
            self._heap.clear()
            self._num_bytes = 0
        for h in hashes:
            try:
                (self.dir / h.hex()[:2] / f"{h.hex()}{BLOCK_SUFFIX}").unlink()
            except OSError:
                pass
        return len(hashes)

    def load_note(self, name: str) -> dict | None:
        """A small JSON note saved beside this namespace's blocks (e.g. a measured rate)."""
        try:
            value = json.loads((self.dir / NOTES_FILE).read_text()).get(name)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, dict) else None

    def save_note(self, name: str, value: dict) -> None:
        """Save a note for :meth:`load_note` (best effort, atomic)."""
        path = self.dir / NOTES_FILE
        try:
            notes = json.loads(path.read_text())
            if not isinstance(notes, dict):
                notes = {}
        except (OSError, ValueError):
            notes = {}
        notes[name] = value
        try:
            write_file_atomic(path, json.dumps(notes, indent=1, sort_keys=True).encode())
        except OSError as exc:
            logger.debug("cannot save %s: %s", path, exc)

    @property
    def max_bytes(self) -> int:
        """The disk budget in bytes (lowered when the disk was found full)."""
        return self._max_bytes

    def stats(self) -> ColdStats:
        """A snapshot of occupancy and counters."""
        with self._lock:
            c = self._c
            return ColdStats(
                num_files=len(self._index), num_bytes=self._num_bytes, max_bytes=self._max_bytes,
                num_scanned_files=self.num_scanned_files, scan_s=self.scan_s,
                num_writes=c["writes"], num_written_bytes=c["written_bytes"],
                num_write_errors=c["write_errors"], num_disk_full=c["disk_full"],
                num_queue_drops=c["queue_drops"], num_budget_drops=c["budget_drops"],
                num_queued=len(self._pending), num_queued_bytes=self._queued_bytes,
                num_reads=c["reads"], num_read_bytes=c["read_bytes"], read_s=self._read_s,
                num_bad_files=c["bad_files"], num_missing=c["missing"],
                num_evictions=c["evictions"], num_evicted_bytes=c["evicted_bytes"],
                num_superseded=c["superseded"], num_old_format_files=c["old_format"],
            )

    def write_bytes_per_s(self) -> float | None:
        """Measured bytes/s of completed writes (encode + fsync), or ``None``."""
        with self._lock:
            return self._c["written_bytes"] / self._write_s if self._write_s > 0 else None


# ---- maintenance (omlx cache stats|clear|verify) -------------------------------------


@dataclass(slots=True)
class NamespaceSummary:
    """One namespace folder of a cache folder.

    Attributes:
        digest: the folder name.
        model_id: the served id recorded when it was written ('' if unknown).
        namespace: its Namespace, or ``None`` when ``namespace.json`` is missing or unreadable.
        format_version: the block-file format (`SSD_FORMAT_VERSION`) of the omlx that last wrote
            ``namespace.json``; ``None`` when it records none. Not the namespace's own
            ``format_version``, which versions the key layout (`omlx.cache.hashing.FORMAT_VERSION`).
        num_files, num_bytes: block files and their bytes.
        num_temp_files: leftover temp files.
    """

    digest: str
    model_id: str
    namespace: Namespace | None
    format_version: int | None = None
    num_files: int = 0
    num_bytes: int = 0
    num_temp_files: int = 0


def _is_namespace_dir(path: Path) -> bool:
    name = path.name
    return path.is_dir() and len(name) == _NS_DIR_CHARS and all(c in "0123456789abcdef" for c in name)


def _load_namespace_doc(ns_dir: Path) -> dict | None:
    """A folder's namespace file as written by `SSDStore` (None when missing or not a JSON object)."""
    try:
        doc = json.loads((ns_dir / NAMESPACE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _read_namespace_file(ns_dir: Path, doc: dict | None = None) -> tuple[str, Namespace | None]:
    """(model id, namespace) a folder's namespace file (or its ``doc``, already loaded) records;
    the namespace is None when it cannot be read as this version's (an older layout), the model
    id "" when nothing can."""
    doc = _load_namespace_doc(ns_dir) if doc is None else doc
    if doc is None:
        return "", None
    model_id = str(doc.get("model_id", ""))
    try:
        return model_id, Namespace.from_json(json.dumps(doc["namespace"]))
    except (ValueError, KeyError, TypeError):
        return model_id, None


def summarize_cache_dir(root: Path) -> list[NamespaceSummary]:
    """Every namespace folder under ``root`` with its file count and bytes (stat only)."""
    out = []
    if not root.is_dir():
        return out
    for ns_dir in sorted(p for p in root.iterdir() if _is_namespace_dir(p)):
        doc = _load_namespace_doc(ns_dir)
        model_id, ns = _read_namespace_file(ns_dir, doc)
        version = doc.get("format_version") if doc is not None else None
        s = NamespaceSummary(ns_dir.name, model_id, ns,
                             version if isinstance(version, int) and not isinstance(version, bool) else None)
        for path in iter_block_files(ns_dir):
            if path.name.endswith(TMP_SUFFIX):
                s.num_temp_files += 1
                continue
            try:
                s.num_bytes += path.stat().st_size
                s.num_files += 1
            except OSError:
                pass
        out.append(s)
    return out


@dataclass(slots=True)
class VerifyReport:
    """Result of :func:`verify_cache_dir`.

    Attributes:
        num_files: block files checked.
        num_ok: files that passed every check.
        bad: ``(path, reason)`` of each file that failed.
        num_removed: bad files deleted (0 on a dry run).
        num_temp_removed: stale temp files deleted.
    """

    num_files: int = 0
    num_ok: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    num_removed: int = 0
    num_temp_removed: int = 0


def verify_cache_dir(root: Path, *, remove: bool = True, progress: bool = False) -> VerifyReport:
    """Fully validate every block file under ``root`` (as a read would) and remove bad ones.

    A file must belong to the namespace of its folder (from ``namespace.json``, else from its
    own header when the folder name is that namespace's digest), carry its own hash as its
    name, chain from its parent hash, and match its checksum.
    """
    report = VerifyReport()
    if not root.is_dir():
        return report
    files = [(d, p) for d in sorted(root.iterdir()) if _is_namespace_dir(d) for p in iter_block_files(d)]
    advance, close = _progress(len(files), "verifying SSD KV cache", progress)
    try:
        for ns_dir, path in files:
            advance()
            if path.name.endswith(TMP_SUFFIX):
                if remove and remove_stale_temp(path):
                    report.num_temp_removed += 1
                continue
            report.num_files += 1
            reason = _verify_file(ns_dir, path)
            if reason is None:
                report.num_ok += 1
                continue
            report.bad.append((str(path), reason))
            if remove:
                try:
                    path.unlink()
                    report.num_removed += 1
                except OSError:
                    pass
    finally:
        close()
    return report


def _verify_file(ns_dir: Path, path: Path) -> str | None:
    """Why a block file is bad, or ``None`` when it is good."""
    _, ns = _read_namespace_file(ns_dir)
    try:
        block_hash = bytes.fromhex(path.name[: -len(BLOCK_SUFFIX)])
        if len(block_hash) != HASH_NUM_BYTES:
            return "file name is not a 64-hex block hash"
        data = path.read_bytes()
        if ns is None:
            header = parse_header(data, len(data))
            ns = Namespace.from_json(header.metadata.get("namespace", ""))
            if ns.digest() != ns_dir.name:
                return "namespace differs from its folder"
        decode_block(data, ns, block_hash)
    except (BadBlockError, ValueError, OSError) as exc:
        return str(exc)
    return None


def clear_cache_dir(root: Path, model_id: str | None = None) -> tuple[int, int]:
    """Delete the block files of every namespace (or only those recorded for ``model_id``).

    Only namespace folders (32 hex chars) and the files omlx writes in them are deleted.

    Returns:
        ``(files deleted, bytes freed)``.
    """
    num_files = num_bytes = 0
    if not root.is_dir():
        return 0, 0
    for ns_dir in sorted(p for p in root.iterdir() if _is_namespace_dir(p)):
        if model_id is not None and _read_namespace_file(ns_dir)[0] != model_id:
            continue
        for path in list(iter_block_files(ns_dir)):
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:
                continue
            if path.name.endswith(BLOCK_SUFFIX):
                num_files += 1
                num_bytes += size
        for sub in ns_dir.iterdir():
            if sub.is_dir():
                try:
                    sub.rmdir()
                except OSError:
                    pass
        for name in (NAMESPACE_FILE, NOTES_FILE):
            try:
                (ns_dir / name).unlink()
            except OSError:
                pass
        try:
            ns_dir.rmdir()
        except OSError:
            pass
    return num_files, num_bytes

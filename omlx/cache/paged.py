"""Hot tier bookkeeping: a ref-counted pool of KV blocks with prefix lookup, LRU and CoW.

This module owns which blocks are cached in RAM, who holds them, and which one goes next. It
is pure Python: a block's KV arrays are an opaque ``payload`` with a byte size that the engine
supplies (its per-layer mlx KV slices); nothing here imports mlx, reads arrays or touches the
disk. Write-back to the SSD tier happens through the ``on_evict`` hook.

Model (compare vLLM ``v1/core/block_pool.py`` and SGLang ``radix_cache.py``):

* A *full block* holds ``block_size`` tokens and is found by its chained hash
  (:func:`omlx.cache.hashing.hash_block`). Blocks form a tree: each block's parent is the
  previous block of the sequence, or the namespace key for block 0.
* A *tail* holds the ``1 .. block_size - 1`` tokens after the last full block of a finished
  sequence, keyed by (parent hash, its tokens), so prompts shorter than a block hit too.
* Lookup walks full blocks by hash, then reuses the longest common prefix of one child of the
  last matched block (full block or tail). KV at position ``i`` depends only on tokens
  ``0..i`` (causal attention), so the first ``k`` tokens of any cached block whose parent
  chain and first ``k`` tokens match are exactly the KV the request would compute.
* A tail that a newer sibling supersedes (agrees with all but its last few tokens, see
  ``TAIL_SLACK_TOKENS``) is dropped as soon as nobody holds it, so the shared tokens are not
  stored twice.
* A block with ``ref_count == 0`` stays cached and is evictable once it is a leaf (no cached
  child). Leaves go in LRU order; at equal recency tails go first, then deeper blocks.
* On a model with sliding-window layers a block's payload has a separately droppable *window
  part* (those layers' KV, :class:`WindowParts`). Under pressure the pool drops the window
  parts that no hit at the end of a cached chain can read before it evicts any leaf (the rule:
  :meth:`BlockPool.window_droppable`).

Not thread-safe: one engine thread owns a pool.
"""

from __future__ import annotations

import copy
import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from omlx.cache.hashing import HASH_NUM_BYTES, Namespace, hash_block

__all__ = ["BlockPool", "KVBlock", "PoolStats", "HotHit", "WindowParts"]

logger = logging.getLogger(__name__)

PayloadCopier = Callable[[object], object]
EvictCallback = Callable[["KVBlock"], None]

# (last_access, 0 for a tail / 1 for a full block, -block_index, block_id); see _evict_key.
_HeapEntry = tuple[int, int, int, int]


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of KV held by the pool. Compared by identity.

    Attributes:
        block_id: Pool-unique id, assigned in creation order from 0; never reused.
        block_hash: Chained key (32 bytes) while the block is registered (findable by
            lookup); ``None`` for a private block (a copy-on-write copy, or a held block
            that :meth:`BlockPool.clear` dropped from the index).
        parent_hash: Key of the previous block, or ``namespace.key()`` for block 0.
        token_ids: The block's tokens: ``block_size`` for a full block, fewer for a tail.
        namespace: The namespace the block's KV belongs to.
        block_index: Position in the sequence: the block covers tokens
            ``[block_index * block_size, block_index * block_size + len(token_ids))``.
        is_tail: ``True`` for a partial last block (``len(token_ids) < block_size``).
        ref_count: Number of holders (requests); 0 means cached and evictable as a leaf.
        num_bytes: Size of the payload in bytes, as the caller reported it.
        payload: Opaque KV data (the engine's per-layer arrays), or ``None``.
        last_access: Pool clock value of the last lookup hit, acquire or release (a
            monotonic counter, not wall time).
        num_hits: Number of lookups that reused this block.
        window_bytes: Bytes of the payload's window part (included in ``num_bytes``); 0 when
            the pool has no :class:`WindowParts`, or the part was dropped or never there
            (a block restored from a file written without it).
    """

    block_id: int
    block_hash: bytes | None
    parent_hash: bytes
    token_ids: tuple[int, ...]
    namespace: Namespace
    block_index: int
    is_tail: bool
    ref_count: int = 0
    num_bytes: int = 0
    payload: object | None = None
    last_access: int = 0
    num_hits: int = 0
    window_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the block."""
        return len(self.token_ids)

    @property
    def is_registered(self) -> bool:
        """Whether lookups can find (and therefore share) this block."""
        return self.block_hash is not None


@dataclass(slots=True)
class HotHit:
    """Result of :meth:`BlockPool.lookup`: the cached prefix of a token sequence in the hot tier
    (the tiered cache extends it from the cold tier into a `omlx.cache.tiered.PrefixHit`).

    The request's cached KV is the concatenation, along the token axis, of every block in
    ``blocks`` followed by the first ``num_partial_tokens`` tokens of ``partial``.

    Attributes:
        blocks: Full blocks reused whole, in sequence order (block ``i`` = tokens
            ``[i * block_size, (i + 1) * block_size)``).
        partial: A full block or tail, child of the last block in ``blocks`` (or of the
            namespace), of which only a prefix is reused; ``None`` when there is none.
        num_partial_tokens: Tokens reused from ``partial`` (0 when ``partial`` is ``None``);
            slice its payload to this many tokens.
    """

    blocks: list[KVBlock]
    partial: KVBlock | None = None
    num_partial_tokens: int = 0

    @property
    def num_cached_tokens(self) -> int:
        """Number of leading tokens whose KV is cached (the prefix hit)."""
        return sum(len(b.token_ids) for b in self.blocks) + self.num_partial_tokens

    @property
    def all_blocks(self) -> list[KVBlock]:
        """``blocks`` plus ``partial``: what to :meth:`BlockPool.acquire` and later release."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    @property
    def parent_hash(self) -> bytes | None:
        """Parent to :meth:`BlockPool.register` the next full block under (``None`` = root)."""
        return self.blocks[-1].block_hash if self.blocks else None


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of pool occupancy and counters since creation.

    Attributes:
        num_blocks: Live blocks of any kind (full, tail, private).
        num_full_blocks: Registered full blocks.
        num_tails: Registered tails.
        num_private_blocks: Unregistered blocks (CoW copies, cleared while held).
        num_free_blocks: Registered blocks with ``ref_count == 0``.
        num_bytes: Bytes of all live blocks.
        num_free_bytes: Bytes of registered blocks with ``ref_count == 0``.
        max_bytes: Byte budget.
        num_lookups: Calls to :meth:`BlockPool.lookup`.
        num_hits: Lookups that reused at least one token.
        num_misses: Lookups that reused none.
        num_query_tokens: Tokens passed to lookups (after ``max_cached_tokens``).
        num_cached_tokens: Tokens reused by lookups.
        num_evictions: Blocks evicted (``on_evict`` was called for each).
        num_evicted_bytes: Bytes of evicted blocks.
        num_rejected: Registrations refused for lack of room or of a cached parent.
        num_cow_copies: Copies made by :meth:`BlockPool.writable`.
        num_dropped_tails: Tails dropped because a longer sibling made them redundant (at once
            when unheld, else when their last holder releases them).
        num_window_bytes: Bytes of live blocks' window parts (part of ``num_bytes``).
        num_window_parts_dropped: Window parts dropped under pressure (see
            :meth:`BlockPool.window_droppable`).
        num_window_bytes_dropped: Bytes those parts held.
        num_window_parts_restored: Window parts put back into held blocks
            (:meth:`BlockPool.restore_window_part`, from the cold tier).
    """

    num_blocks: int
    num_full_blocks: int
    num_tails: int
    num_private_blocks: int
    num_free_blocks: int
    num_bytes: int
    num_free_bytes: int
    max_bytes: int
    num_lookups: int
    num_hits: int
    num_misses: int
    num_query_tokens: int
    num_cached_tokens: int
    num_evictions: int
    num_evicted_bytes: int
    num_rejected: int
    num_cow_copies: int
    num_dropped_tails: int
    num_window_bytes: int = 0
    num_window_parts_dropped: int = 0
    num_window_bytes_dropped: int = 0
    num_window_parts_restored: int = 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Return the number of leading elements ``a`` and ``b`` share (any int sequences)."""
    n = min(len(a), len(b))
    if type(a) is type(b) and a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


TAIL_SLACK_TOKENS = 16
"""A tail is redundant once a longer sibling agrees with all but at most this many of its last
tokens (and on at least 4/5 of them): lookup then reuses that sibling's shared prefix and
recomputes at most this many tokens, while keeping the tail would store the shared tokens twice
(a finished request's tail ends in generated tokens, which the next prompt may not repeat)."""


def tail_superseded(longer: Sequence[int], shorter: Sequence[int], slack: int = TAIL_SLACK_TOKENS) -> bool:
    """Whether a sibling with tokens ``longer`` makes a tail with tokens ``shorter`` redundant.

    Shared by the hot tier (tails dropped) and the SSD tier (tail files deleted or never written).
    A negative ``slack`` means never: each tail is kept (a model with recurrent state has a
    snapshot at each tail's own end, which no sibling can stand in for).
    """
    if slack < 0:
        return False
    n = len(shorter)
    if len(longer) <= n:
        return False
    unique = n - common_prefix_len(longer, shorter)
    return unique <= slack and n - unique >= 4 * unique


def _supersedes(sibling: KVBlock, tail: KVBlock, slack: int = TAIL_SLACK_TOKENS) -> bool:
    """Whether ``sibling`` (a full block or a longer tail) makes ``tail`` redundant."""
    return sibling is not tail and tail_superseded(sibling.token_ids, tail.token_ids, slack)


@dataclass(frozen=True, slots=True)
class WindowParts:
    """How a pool sees the window part of its payloads (a model with sliding-window layers).

    The pool stays payload-agnostic: the engine says how many bytes a payload's window part
    holds and how to drop it (``omlx.engine.cache_spec``).

    Attributes:
        reach_tokens: ``W - keep`` (the largest over the window layers): a hit ending at
            position ``e > W`` reads the window parts of tokens ``[e - reach_tokens, e)``.
        keep_tokens: ``keep`` sink tokens (the largest): every hit reads tokens ``[0, keep)``,
            so a block holding any of them never drops its window part.
        num_bytes: payload -> bytes of its window part (0 when it has none).
        drop: payload -> the payload without its window part (a new object; the old one may
            still be read by a holder's parts, it is never changed in place).
    """

    reach_tokens: int
    keep_tokens: int
    num_bytes: Callable[[object], int]
    drop: Callable[[object], object]


def _evict_key(block: KVBlock) -> _HeapEntry:
    """Eviction order: least recent first; at equal recency tails, then deeper blocks."""
    return (block.last_access, 0 if block.is_tail else 1, -block.block_index, block.block_id)


def _check_num_bytes(num_bytes: int) -> None:
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise ValueError(f"num_bytes must be an int >= 0, got {num_bytes!r}")


class BlockPool:
    """Ref-counted, byte-budgeted pool of KV blocks for one engine (one model).

    Several namespaces may share a pool; blocks of different namespaces never match.

    Args:
        max_bytes: Byte budget for all blocks' payloads; registrations that cannot fit
            after evicting every evictable block return ``None``.
        block_size: Tokens per full block.
        on_evict: Called with each evicted block after it left the pool (payload still
            attached), e.g. to queue an SSD write-back. Must not call into the pool and
            should be quick: it runs inside :meth:`register`. Exceptions are logged.
        copy_payload: Deep-copies a payload for copy-on-write; defaults to
            :func:`copy.deepcopy`.
        tail_slack_tokens: A tail is dropped once a longer sibling agrees with all but this
            many of its last tokens (`tail_superseded`); negative: tails are never dropped so.
        window_parts: How payloads' window parts are measured and dropped (a model with
            sliding-window layers), or ``None``: payloads are whole or gone.

    Raises:
        ValueError: ``max_bytes < 0`` or ``block_size < 1``.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        block_size: int = 256,
        on_evict: EvictCallback | None = None,
        copy_payload: PayloadCopier | None = None,
        tail_slack_tokens: int = TAIL_SLACK_TOKENS,
        window_parts: WindowParts | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        _check_num_bytes(max_bytes)
        self.on_evict = on_evict
        self._block_size = block_size
        self._max_bytes = max_bytes
        self._copy_payload: PayloadCopier = copy_payload or copy.deepcopy
        self._tail_slack = int(tail_slack_tokens)
        self._window_parts = window_parts
        self._num_window_bytes = 0
        self._num_window_parts_dropped = 0
        self._num_window_bytes_dropped = 0
        self._num_window_parts_restored = 0
        self._blocks: dict[int, KVBlock] = {}
        self._full: dict[bytes, KVBlock] = {}
        self._tails: dict[bytes, KVBlock] = {}
        # parent hash -> registered children (full blocks and tails) by block id
        self._children: dict[bytes, dict[int, KVBlock]] = {}
        # Evictable leaves; stale entries are skipped on pop and purged by _compact_heap.
        self._heap: list[_HeapEntry] = []
        self._num_bytes = 0
        self._num_free_bytes = 0
        self._clock = 0
        self._next_block_id = 0
        self._num_lookups = 0
        self._num_hits = 0
        self._num_query_tokens = 0
        self._num_cached_tokens = 0
        self._num_evictions = 0
        self._num_evicted_bytes = 0
        self._num_rejected = 0
        self._num_cow_copies = 0
        self._num_dropped_tails = 0

    @property
    def block_size(self) -> int:
        """Tokens per full block."""
        return self._block_size

    @property
    def max_bytes(self) -> int:
        """Byte budget."""
        return self._max_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes of all live blocks (always ``<= max_bytes``)."""
        return self._num_bytes

    @property
    def tail_slack_tokens(self) -> int:
        """See the constructor; negative: tails are never dropped for a longer sibling."""
        return self._tail_slack

    @property
    def window_parts(self) -> WindowParts | None:
        """See the constructor."""
        return self._window_parts

    def lookup(
        self,
        token_ids: Sequence[int],
        namespace: Namespace,
        *,
        max_cached_tokens: int | None = None,
        block_hashes: Sequence[bytes] | None = None,
        whole_partial_only: bool = False,
    ) -> HotHit:
        """Find the longest cached prefix of ``token_ids``.

        Walks full blocks by chained hash and stops at the first miss; then reuses the
        longest common prefix with one child (full block or tail) of the last match.
        Reference counts do not change: :meth:`acquire` ``hit.all_blocks`` before
        anything else runs on the pool, or the blocks may be evicted. Counts the lookup in
        :meth:`stats` and marks the reused blocks as recently used.

        Args:
            token_ids: The request's tokens (prompt, or prompt plus earlier output).
            namespace: Only blocks of this namespace match.
            max_cached_tokens: Cap on ``num_cached_tokens``. Pass ``len(prompt) - 1``: the
                model must run at least one token to produce logits.
            block_hashes: The chained keys of ``token_ids``' leading full blocks, already
                computed by the caller (``omlx.cache.hashing.BlockHashes``); blocks past them
                are hashed here.
            whole_partial_only: Reuse a last child only whole (all its tokens match), never a
                prefix of it: a recurrent model's state snapshot stands at a block's end.

        Returns:
            The hit; ``num_cached_tokens == 0`` when nothing matches.

        Raises:
            ValueError: ``max_cached_tokens < 0`` or a token id is invalid.
        """
        limit = len(token_ids)
        if max_cached_tokens is not None:
            if max_cached_tokens < 0:
                raise ValueError(f"max_cached_tokens must be >= 0, got {max_cached_tokens}")
            limit = min(limit, max_cached_tokens)
        bs = self._block_size
        parent = namespace.key()
        hit = HotHit(blocks=[])
        pos = 0
        known = block_hashes if block_hashes is not None else ()
        while pos + bs <= limit:
            i = pos // bs
            block_hash = known[i] if i < len(known) else hash_block(parent, token_ids[pos : pos + bs])
            block = self._full.get(block_hash)
            if block is None:
                break
            hit.blocks.append(block)
            parent = block_hash
            pos += bs
        rest = tuple(token_ids[pos : min(limit, pos + bs)])
        if rest:
            best: tuple[int, int, int] = (0, 0, 0)
            for child in self._children.get(parent, {}).values():
                if child.token_ids[0] != rest[0]:
                    continue
                num_common = common_prefix_len(child.token_ids, rest)
                if whole_partial_only and num_common < len(child.token_ids):
                    continue
                # Ties go to the most recently used, then the newest block: deterministic.
                score = (num_common, child.last_access, child.block_id)
                if num_common > 0 and score > best:
                    best, hit.partial = score, child
            hit.num_partial_tokens = best[0]
        num_cached = hit.num_cached_tokens
        self._num_lookups += 1
        self._num_query_tokens += limit
        self._num_cached_tokens += num_cached
        if num_cached:
            self._num_hits += 1
            tick = self._tick()
            for block in hit.all_blocks:
                block.num_hits += 1
                block.last_access = tick
                self._push_if_evictable(block)
        return hit

    def get(self, block_hash: bytes) -> KVBlock | None:
        """Return the registered full block or tail with this key, or ``None``."""
        return self._full.get(block_hash) or self._tails.get(block_hash)

    def blocks(self) -> list[KVBlock]:
        """Return every live block (registered or private), by ascending ``block_id``."""
        return [self._blocks[i] for i in sorted(self._blocks)]

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference per occurrence; held blocks are never evicted.

        Raises:
            ValueError: A block is not live in this pool (evicted, released to 0 while
                private, or from another pool). Nothing changes then.
        """
        blocks = list(blocks)
        for block in blocks:
            self._check_live(block)
        tick = self._tick()
        for block in blocks:
            if block.ref_count == 0 and block.is_registered:
                self._num_free_bytes -= block.num_bytes
            block.ref_count += 1
            block.last_access = tick

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per occurrence.

        A registered block reaching 0 stays cached (evictable once it is a leaf); a private
        block reaching 0 is freed. All blocks released in one call share one recency, so
        their chain is evicted tail first.

        Raises:
            ValueError: A block is not live, or is released more times than it is held.
                Nothing changes then.
        """
        blocks = list(blocks)
        for block, count in Counter(blocks).items():
            self._check_live(block)
            if count > block.ref_count:
                raise ValueError(
                    f"block {block.block_id} released {count} time(s) but held "
                    f"{block.ref_count} time(s); release only what you acquired"
                )
        tick = self._tick()
        for block in blocks:
            block.ref_count -= 1
            block.last_access = tick
            if block.ref_count == 0:
                if not block.is_registered:
                    self._remove(block)
                elif block.is_tail and self._is_covered(block):
                    # Superseded while held (the request that extended it held it): a
                    # prefix of a sibling now, so lookup reuses the sibling instead.
                    self._num_free_bytes += block.num_bytes
                    self._remove(block)
                    self._num_dropped_tails += 1
                else:
                    self._num_free_bytes += block.num_bytes
                    self._push_if_evictable(block)

    def register(
        self,
        namespace: Namespace,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        payload: object,
        num_bytes: int,
        *,
        block_hash: bytes | None = None,
    ) -> KVBlock | None:
        """Cache a full block, held once by the caller (release it when done).

        Args:
            namespace: The block's namespace.
            parent_hash: ``block_hash`` of the previous full block (it must be cached), or
                ``None`` (or ``namespace.key()``) for block 0.
            token_ids: Exactly ``block_size`` token ids.
            payload: The block's KV (opaque); dropped if the block is already cached.
            num_bytes: Payload size in bytes.
            block_hash: The block's key when the caller already computed it
                (``hash_block(parent, token_ids)``, e.g. from ``BlockHashes``); not re-checked.

        Returns:
            The new block, or the already-cached block with the same key (dedup), with
            ``ref_count`` raised by one; ``None`` (nothing changed but possibly evictions)
            when the block cannot fit the byte budget even after evicting every evictable
            block, or its parent is no longer cached.

        Raises:
            ValueError: Wrong token count, invalid token id, negative ``num_bytes``, a
                ``parent_hash`` of another namespace, of a tail, or not 32 bytes.
        """
        tokens = tuple(token_ids)
        if len(tokens) != self._block_size:
            raise ValueError(
                f"a full block holds block_size={self._block_size} tokens, got {len(tokens)}; "
                "use register_tail for a partial last block"
            )
        _check_num_bytes(num_bytes)
        resolved = self._resolve_parent(namespace, parent_hash)
        if resolved is None:
            self._num_rejected += 1
            return None
        parent_key, parent = resolved
        if block_hash is None:
            block_hash = hash_block(parent_key, tokens)
        elif len(block_hash) != HASH_NUM_BYTES:
            raise ValueError(f"block_hash must be {HASH_NUM_BYTES} bytes, got {len(block_hash)}")
        existing = self._full.get(block_hash)
        if existing is not None:
            self.acquire([existing])
            return existing
        block = self._insert(
            namespace, parent_key, parent, block_hash, tokens, payload, num_bytes, is_tail=False
        )
        if block is not None:
            self._drop_tails_covered_by(block)
        return block

    def register_tail(
        self,
        namespace: Namespace,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        payload: object,
        num_bytes: int,
    ) -> KVBlock | None:
        """Cache the partial last block of a sequence, held once by the caller.

        Unheld tails under the same parent whose tokens are a prefix of ``token_ids`` are
        dropped (lookup reuses a prefix of the new tail instead).

        Args:
            namespace: The tail's namespace.
            parent_hash: ``block_hash`` of the last full block before it (cached), or
                ``None`` (or ``namespace.key()``) when the sequence is shorter than a block.
            token_ids: ``1 .. block_size - 1`` token ids.
            payload: The tail's KV (opaque); dropped if a cached block already covers it.
            num_bytes: Payload size in bytes.

        Returns:
            The new tail, or an already-cached block under the same parent whose tokens
            start with ``token_ids`` (it may be longer, even a full block; not when
            ``tail_slack_tokens`` is negative: then only the same tail), with
            ``ref_count`` raised by one; ``None`` when it cannot fit or the parent is no
            longer cached.

        Raises:
            ValueError: As :meth:`register`, for a token count outside
                ``1 .. block_size - 1``.
        """
        tokens = tuple(token_ids)
        if not 1 <= len(tokens) < self._block_size:
            raise ValueError(
                f"a tail holds 1..{self._block_size - 1} tokens, got {len(tokens)}; "
                "use register for a full block"
            )
        _check_num_bytes(num_bytes)
        resolved = self._resolve_parent(namespace, parent_hash)
        if resolved is None:
            self._num_rejected += 1
            return None
        parent_key, parent = resolved
        block_hash = hash_block(parent_key, tokens)
        covering = self._tails.get(block_hash)
        if covering is None and self._tail_slack >= 0:  # with tails kept as their own, only itself covers
            n = len(tokens)
            covering = next(
                (
                    child
                    for child in self._children.get(parent_key, {}).values()
                    if child.token_ids[:n] == tokens
                ),
                None,
            )
        if covering is not None:
            self.acquire([covering])
            return covering
        block = self._insert(
            namespace, parent_key, parent, block_hash, tokens, payload, num_bytes, is_tail=True
        )
        if block is not None:
            self._drop_tails_covered_by(block)
        return block

    def writable(self, block: KVBlock) -> KVBlock | None:
        """Return a block the caller may modify in place, moving the caller's reference.

        The caller must hold ``block``. It gets ``block`` itself when it is the only holder
        and the block is private (unregistered); otherwise a new private copy (payload via
        ``copy_payload``, ``ref_count == 1``) and its reference on ``block`` is released.
        A registered block is always copied: a later lookup could share it.

        Returns:
            The writable block, or ``None`` (the caller still holds ``block``) when the
            copy cannot fit the byte budget.

        Raises:
            ValueError: ``block`` is not live or not held.
        """
        self._check_live(block)
        if block.ref_count < 1:
            raise ValueError(f"block {block.block_id} is not held; acquire it before writing")
        if block.ref_count == 1 and not block.is_registered:
            return block
        if not self._make_room(block.num_bytes, protect=None):
            self._num_rejected += 1
            return None
        payload = None if block.payload is None else self._copy_payload(block.payload)
        clone = KVBlock(
            block_id=self._new_block_id(),
            block_hash=None,
            parent_hash=block.parent_hash,
            token_ids=block.token_ids,
            namespace=block.namespace,
            block_index=block.block_index,
            is_tail=block.is_tail,
            ref_count=1,
            num_bytes=block.num_bytes,
            payload=payload,
            last_access=self._tick(),
            window_bytes=block.window_bytes,
        )
        self._blocks[clone.block_id] = clone
        self._num_bytes += clone.num_bytes
        self._num_window_bytes += clone.window_bytes
        self._num_cow_copies += 1
        self.release([block])
        return clone

    def evict(self, num_bytes: int) -> int:
        """Free at least ``num_bytes``: drop droppable window parts (:meth:`window_droppable`),
        then evict leaves in LRU order, until enough is freed or nothing is left.

        Use it under memory pressure; registration makes room the same way by itself.

        Returns:
            Bytes freed (may be less than asked, or more by up to one block).
        """
        _check_num_bytes(num_bytes)
        freed = self._drop_window_parts(num_bytes)
        while freed < num_bytes:
            block = self._evict_one(protect=None)
            if block is None:
                break
            freed += block.num_bytes
        return freed

    def clear(self, namespace: Namespace | None = None, *, write_back: bool = False) -> int:
        """Drop every block (of ``namespace``, or of all namespaces) from the cache.

        Unheld blocks are freed; held blocks become private (no longer found by lookup) and
        are freed when released. Counts no evictions.

        Args:
            namespace: Only this namespace, or ``None`` for all.
            write_back: Also pass each freed registered block to ``on_evict``, deepest
                first (e.g. flush to SSD before unloading a model).

        Returns:
            Number of blocks dropped from the index (freed or made private).
        """
        key = None if namespace is None else namespace.key()
        doomed = [
            b
            for b in self._blocks.values()
            if b.is_registered and (key is None or b.namespace.key() == key)
        ]
        doomed.sort(key=lambda b: (-b.block_index, b.block_id))
        for block in doomed:
            if block.ref_count == 0:
                self._remove(block)
                if write_back:
                    self._notify_evict(block)
            else:
                self._unindex(block)
                block.block_hash = None
        self._compact_heap()
        return len(doomed)

    def stats(self) -> PoolStats:
        """Return occupancy and counters; O(number of blocks)."""
        num_private = sum(1 for b in self._blocks.values() if not b.is_registered)
        num_free = sum(1 for b in self._blocks.values() if b.is_registered and b.ref_count == 0)
        return PoolStats(
            num_blocks=len(self._blocks),
            num_full_blocks=len(self._full),
            num_tails=len(self._tails),
            num_private_blocks=num_private,
            num_free_blocks=num_free,
            num_bytes=self._num_bytes,
            num_free_bytes=self._num_free_bytes,
            max_bytes=self._max_bytes,
            num_lookups=self._num_lookups,
            num_hits=self._num_hits,
            num_misses=self._num_lookups - self._num_hits,
            num_query_tokens=self._num_query_tokens,
            num_cached_tokens=self._num_cached_tokens,
            num_evictions=self._num_evictions,
            num_evicted_bytes=self._num_evicted_bytes,
            num_rejected=self._num_rejected,
            num_cow_copies=self._num_cow_copies,
            num_dropped_tails=self._num_dropped_tails,
            num_window_bytes=self._num_window_bytes,
            num_window_parts_dropped=self._num_window_parts_dropped,
            num_window_bytes_dropped=self._num_window_bytes_dropped,
            num_window_parts_restored=self._num_window_parts_restored,
        )

    def window_droppable(self) -> list[KVBlock]:
        """The blocks whose window part may be dropped now, in the order they go.

        Only with :class:`WindowParts`. A block's window part is droppable when all of these hold
        (``end(b) = b.block_index * block_size + b.num_tokens``, one past its last position):

        1. it is a registered full block with its window part, held or not: a holder reads a
           block's payload only through the payload object its lookup captured, and dropping
           makes a new object without ever changing the old one (a lease not yet materialized
           keeps the bytes alive until it is); a running request holds its whole chain, and
           its own next hit is at its chain's end;
        2. it holds no sink token: ``block_index * block_size >= keep_tokens``;
        3. every cached chain through it goes on for at least ``reach_tokens`` tokens past it:
           it has a registered child, and every registered leaf ``L`` below it (a full block or
           tail without registered children) has ``end(L) - end(block) >= reach_tokens``.

        So a hit ending where any cached chain ends (a conversation's next turn) never needs a
        dropped part: its window reads ``[end(L) - reach_tokens, end(L))``, after the block. A
        hit ending inside a chain less than ``reach_tokens`` tokens after a dropped part is
        cut back to where every part its window reads is present (``CacheSpec.hit_end``).

        Order: least recently used first; then the block nearer the start; then block id.
        O(number of blocks).
        """
        wp = self._window_parts
        if wp is None or self._num_window_bytes == 0:
            return []
        bs = self._block_size
        registered = sorted((b for b in self._blocks.values() if b.is_registered), key=lambda b: -b.block_index)
        min_end: dict[int, int] = {}  # block id -> smallest end of a registered leaf below it (or itself)
        out: list[KVBlock] = []
        for b in registered:  # children (index + 1) before their parent
            end = b.block_index * bs + b.num_tokens
            kids = None if b.is_tail else self._children.get(b.block_hash)  # type: ignore[arg-type]
            if not kids:
                min_end[b.block_id] = end
                continue
            m = min(min_end[c.block_id] for c in kids.values())
            min_end[b.block_id] = m
            if b.window_bytes > 0 and b.block_index * bs >= wp.keep_tokens and m - end >= wp.reach_tokens:
                out.append(b)
        out.sort(key=lambda b: (b.last_access, b.block_index, b.block_id))
        return out

    def restore_window_part(self, block: KVBlock, payload: object) -> bool:
        """Give a held block whose window part was dropped a payload that has it again (read
        back from the cold tier), making room as registration does.

        Returns:
            False (nothing changed) when the part does not fit the budget.

        Raises:
            ValueError: no :class:`WindowParts`, the block is not live or not held, it still has
                its window part, or ``payload`` has none.
        """
        wp = self._window_parts
        self._check_live(block)
        if wp is None or block.ref_count < 1 or block.window_bytes:
            raise ValueError(f"block {block.block_id}: restore a window part only into a held block without one")
        n = int(wp.num_bytes(payload))
        if n <= 0:
            raise ValueError("the payload has no window part")
        if not self._make_room(n, protect=None):
            self._num_rejected += 1
            return False
        block.payload = payload
        block.num_bytes += n
        block.window_bytes = n
        self._num_bytes += n
        self._num_window_bytes += n
        self._num_window_parts_restored += 1
        return True

    def _drop_window_parts(self, num_bytes: int) -> int:
        """Drop droppable window parts (:meth:`window_droppable` order) until ``num_bytes``
        are freed or none is left; returns the bytes freed."""
        freed = 0
        if num_bytes <= 0:
            return 0
        for block in self.window_droppable():
            if freed >= num_bytes:
                break
            freed += self._drop_window_part(block)
        return freed

    def _drop_window_part(self, block: KVBlock) -> int:
        wp = self._window_parts
        assert wp is not None
        n = block.window_bytes
        block.payload = wp.drop(block.payload)
        block.num_bytes -= n
        block.window_bytes = 0
        self._num_bytes -= n
        self._num_window_bytes -= n
        if block.is_registered and block.ref_count == 0:
            self._num_free_bytes -= n
        self._num_window_parts_dropped += 1
        self._num_window_bytes_dropped += n
        return n

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_block_id(self) -> int:
        block_id = self._next_block_id
        self._next_block_id += 1
        return block_id

    def _check_live(self, block: KVBlock) -> None:
        if self._blocks.get(block.block_id) is not block:
            raise ValueError(
                f"block {block.block_id} is not live in this pool (evicted or freed); "
                "acquire blocks right after lookup, before anything else runs on the pool"
            )

    def _resolve_parent(
        self, namespace: Namespace, parent_hash: bytes | None
    ) -> tuple[bytes, KVBlock | None] | None:
        """Return (parent key, parent block or None for the root), or None if not cached."""
        root = namespace.key()
        if parent_hash is None or parent_hash == root:
            return root, None
        if len(parent_hash) != HASH_NUM_BYTES:
            raise ValueError(f"parent_hash must be {HASH_NUM_BYTES} bytes, got {len(parent_hash)}")
        if parent_hash in self._tails:
            raise ValueError("parent_hash names a tail; only a full block can have children")
        parent = self._full.get(parent_hash)
        if parent is None:
            return None
        if parent.namespace.key() != root:
            raise ValueError(
                f"parent block {parent.block_id} belongs to namespace "
                f"{parent.namespace.digest()}, not {namespace.digest()}"
            )
        return parent_hash, parent

    def _insert(
        self,
        namespace: Namespace,
        parent_key: bytes,
        parent: KVBlock | None,
        block_hash: bytes,
        tokens: tuple[int, ...],
        payload: object,
        num_bytes: int,
        *,
        is_tail: bool,
    ) -> KVBlock | None:
        window_bytes = 0
        if self._window_parts is not None and payload is not None:
            window_bytes = int(self._window_parts.num_bytes(payload))
            if not 0 <= window_bytes <= num_bytes:
                raise ValueError(f"window part of {window_bytes} bytes in a payload of {num_bytes}")
        if not self._make_room(num_bytes, protect=parent):
            self._num_rejected += 1
            return None
        block = KVBlock(
            block_id=self._new_block_id(),
            block_hash=block_hash,
            parent_hash=parent_key,
            token_ids=tokens,
            namespace=namespace,
            block_index=0 if parent is None else parent.block_index + 1,
            is_tail=is_tail,
            ref_count=1,
            num_bytes=num_bytes,
            payload=payload,
            last_access=self._tick(),
            window_bytes=window_bytes,
        )
        self._blocks[block.block_id] = block
        (self._tails if is_tail else self._full)[block_hash] = block
        self._children.setdefault(parent_key, {})[block.block_id] = block
        self._num_bytes += num_bytes
        self._num_window_bytes += window_bytes
        return block

    def _drop_tails_covered_by(self, block: KVBlock) -> None:
        """Drop unheld tails under ``block``'s parent that it supersedes (``_supersedes``).

        A held tail is dropped later, when its last holder releases it (see ``release``).
        """
        siblings = self._children.get(block.parent_hash, {})
        for sibling in list(siblings.values()):
            if sibling.is_tail and sibling.ref_count == 0 and _supersedes(block, sibling, self._tail_slack):
                self._remove(sibling)
                self._num_dropped_tails += 1

    def _is_covered(self, tail: KVBlock) -> bool:
        """Whether a sibling (full block or longer tail) supersedes ``tail`` (``_supersedes``)."""
        siblings = self._children.get(tail.parent_hash, {})
        return any(_supersedes(s, tail, self._tail_slack) for s in siblings.values())

    def _make_room(self, num_bytes: int, *, protect: KVBlock | None) -> bool:
        """Drop droppable window parts, then evict leaves, until ``num_bytes`` more fit; False
        (evicting no leaf if foreseeable) if not."""
        if self._num_bytes + num_bytes <= self._max_bytes:
            return True
        # Window parts no chain end reads go before any leaf (window_droppable), held ones too.
        self._drop_window_parts(self._num_bytes + num_bytes - self._max_bytes)
        if self._num_bytes + num_bytes <= self._max_bytes:
            return True
        reclaimable = self._num_free_bytes
        if protect is not None and protect.ref_count == 0:
            reclaimable -= protect.num_bytes
        # Held blocks cannot go: give up before evicting anything in vain.
        if self._num_bytes - reclaimable + num_bytes > self._max_bytes:
            return False
        while self._num_bytes + num_bytes > self._max_bytes:
            # Can still fail when an unheld block has a held descendant (it is no leaf).
            if self._evict_one(protect=protect) is None:
                return False
        return True

    def _is_evictable(self, block: KVBlock) -> bool:
        return (
            block.ref_count == 0
            and block.block_hash is not None
            and not self._children.get(block.block_hash)
        )

    def _push_if_evictable(self, block: KVBlock) -> None:
        if self._is_evictable(block):
            heapq.heappush(self._heap, _evict_key(block))
            if len(self._heap) > 2 * len(self._blocks) + 64:
                self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [_evict_key(b) for b in self._blocks.values() if self._is_evictable(b)]
        heapq.heapify(self._heap)

    def _evict_one(self, *, protect: KVBlock | None) -> KVBlock | None:
        """Evict the least recently used evictable leaf other than ``protect``."""
        skipped: list[_HeapEntry] = []
        victim: KVBlock | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            block = self._blocks.get(entry[3])
            if block is None or not self._is_evictable(block) or block.last_access != entry[0]:
                continue  # stale entry
            if block is protect:
                skipped.append(entry)
                continue
            victim = block
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if victim is None:
            return None
        self._remove(victim)
        self._num_evictions += 1
        self._num_evicted_bytes += victim.num_bytes
        self._notify_evict(victim)
        return victim

    def _notify_evict(self, block: KVBlock) -> None:
        if self.on_evict is None:
            return
        try:
            self.on_evict(block)
        except Exception:
            # A failed write-back loses a cold copy, never correctness: keep serving.
            logger.exception("on_evict failed for block %d", block.block_id)

    def _unindex(self, block: KVBlock) -> None:
        """Remove a registered block from the hash index and its parent's children."""
        assert block.block_hash is not None
        if block.ref_count == 0:
            self._num_free_bytes -= block.num_bytes
        (self._tails if block.is_tail else self._full).pop(block.block_hash, None)
        siblings = self._children.get(block.parent_hash)
        if siblings is not None:
            siblings.pop(block.block_id, None)
            if not siblings:
                del self._children[block.parent_hash]
                parent = self._full.get(block.parent_hash)
                if parent is not None:
                    self._push_if_evictable(parent)

    def _remove(self, block: KVBlock) -> None:
        """Free a block: drop it from the index (if registered) and from the pool."""
        if block.is_registered:
            self._unindex(block)
        del self._blocks[block.block_id]
        self._num_bytes -= block.num_bytes
        self._num_window_bytes -= block.window_bytes

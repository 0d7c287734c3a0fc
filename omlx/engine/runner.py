"""The model runner: omlx's own step loop over an mlx-lm model (batched decode, chunked prefill).

One `BatchRunner` per engine, driven by the engine thread (MLX belongs to that thread). It owns
the sequences' KV caches (mlx-lm's cache classes) and turns a call of `next()` into at most one
batched decode step plus at most one prefill chunk:

- **Prefill** runs one sequence at a time in chunks into that sequence's own batch-1 caches
  (``make_prompt_cache``), in arrival order except that a sequence whose rest fits one chunk
  goes ahead of a longer one (a long head still runs a chunk in every round, `_short_first`),
  and except that fresh short prompts queued together (no cached
  prefix, every layer a plain ``KVCache``, each whole prompt within one chunk) are prefilled
  in one left-padded forward pass over ``BatchKVCache`` (as mlx-lm's ``BatchGenerator``
  prefills), which joins the decode batch as it is. The last chunk includes the prompt's last token, so its
  logits give the first output token directly, as ``mlx_lm.generate_step`` does. Chunks end at
  absolute multiples of the chunk size (itself a multiple of the KV block size; a first piece
  under half a chunk, after a prefix hit, joins the next chunk), so a prompt prefilled after a
  prefix hit is cut at the same later positions as without it, and
  ``on_prefill_chunk`` can hand full blocks to the prefix cache as soon as they are computed.
  While other sequences decode, chunks are ``mixed_step_size`` tokens (about one decode step
  of work, measured), so running streams keep flowing; alone, ``prefill_step_size``.
- **Shape padding** (``pad_shapes``, on for a CUDA device): MLX's CUDA attention builds a
  cuDNN graph for every new (query length, key length) pair, 50-70 ms each on an H200
  (`benchmarks/diag_interference.py`: a 1,024-token chunk beside a decoding stream took
  90-99 ms the first time and 15-26 ms once its shapes were cached), so a prompt's ragged last
  chunk would pay one on every request. Such a chunk is padded at its end to `padded_length`
  (query lengths that repeat), its logits are read at its last real token, and the pad is
  trimmed off the cache: causal attention never lets a real token see the pad after it, so
  the KV and logits are the unpadded ones. Only over plain ``KVCache`` layers (trimmed
  exactly); a left-padded prefill batch is padded to the same lengths. (End to end, the
  H200 bench's cold 4k TTFT did not measurably change with it, 217 ms median against 234,
  within that figure's run-to-run spread; what it bounds is the set of shapes.)
- **Decode** runs every sequence past its prefill in one forward pass. A batch of one keeps its
  own plain ``KVCache`` objects (mlx-lm's fast causal path, exactly ``generate_step``'s work per
  token); two or more are merged into ``BatchKVCache`` (left-padded), which is filtered when a
  sequence leaves and extracted back to a plain cache when one is left. A sequence that finishes
  leaves a *dead row* behind (fed, never emitted); the batch is filtered only when dead rows
  reach a share of it (`omlx.engine.compaction`), not at every finish.
- **Pipelining**: the step that feeds token t builds and queues its graph (``mx.async_eval``)
  before the host reads t, so the host's work of a step (reading tokens, stop checks, the
  engine's detokenizing) overlaps the accelerator's next forward: one host sync per step.
- **Speculation** (``num_draft_tokens``, `_spec_step`): a verify step feeds every speculating
  row its prompt-lookup draft, beside plain rows, in one forward pass, and keeps per row what
  its own sampler would have drawn (`omlx.engine.speculate`: greedy and sampled rows alike); in
  a merged batch the KV is `omlx.engine.ragged_cache.RaggedBatchKVCache`, whose rows each drop
  their own rejected positions.

The call surface (``insert_segments``, ``next``, ``remove``) and response fields follow
mlx-lm's ``BatchGenerator``, so the engine and the cluster's replication layer drive either.
Must not: know about requests, HTTP, or the prefix cache's internals (it reports chunks only).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from omlx.engine.cache_spec import freeze
from omlx.engine.compaction import Compaction
from omlx.engine.grammar import GrammarMatcher, Grammars, mask_logits
from omlx.engine.lookup import PromptLookup
from omlx.engine.pacing import PrefillPacer
from omlx.engine.ragged_cache import BucketedKV, RaggedBatchKVCache
from omlx.engine.speculate import Drafting, can_draft, verify

logger = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]
#: ``(state, caches, num_tokens)``: a prefill chunk of the sequence inserted with ``state`` (None
#: when it was inserted without one) finished; ``caches`` are its batch-1 caches as they stood right after it (`omlx.engine.cache_spec.freeze`): KV for its
#: first ``num_tokens`` tokens (cached prefix included), state layers at ``num_tokens``.
ChunkHook = Callable[[Any, list[Any], int], None]

#: Release MLX's buffer cache every this many decode steps (as ``generate_step`` does).
_CLEAR_CACHE_EVERY = 256


def drafting_blocker(caches: Sequence[Any]) -> str | None:
    """Why a model whose fresh caches are ``caches`` never speculates, or None when it can: a
    verify step drops rejected KV only from plain ``KVCache`` layers (merged: their
    `RaggedBatchKVCache`), so a sliding-window, recurrent or quantized layer keeps every
    sequence of that model on plain decode steps (`BatchRunner._trims_rows`)."""
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    return f"its cache has {', '.join(kinds)} layers (only plain KVCache layers can drop a rejected draft)" \
        if kinds else None


def padded_length(n: int, quantum: int = KVCache.step) -> int:
    """The query length a chunk of ``n`` tokens is padded to with ``pad_shapes``: the next
    power of two (at least 16) up to ``quantum``, else the next multiple of ``quantum``
    (mlx-lm's ``KVCache.step``, 256: the cache's buffer then grows to the same capacities).
    Wastes under half of a short chunk and under ``quantum`` tokens of a long one."""
    if n <= quantum:
        return min(quantum, max(16, 1 << (n - 1).bit_length()))
    return -(-n // quantum) * quantum


@dataclass(slots=True)
class PromptResponse:
    """Progress of one sequence's prefill (one per chunk).

    Attributes:
        progress: (tokens prefilled, tokens to prefill) of what was inserted, cached prefix
            excluded.
        end_of_prompt: the last chunk ran; the first output token follows.
        state: what the sequence was inserted with (``insert_segments``'s ``states``), or None.
    """

    uid: int
    progress: tuple[int, int]
    end_of_prompt: bool
    state: Any = None


class TokenResponse:
    """One generated token of one sequence.

    Attributes:
        token: the token id.
        logprobs: ``(vocab,)`` log-probabilities it was sampled from (after the sequence's
            logits processors), a lazy view of the step's batch array.
        finish_reason: "stop" (a stop token), "length" (``max_tokens``), or None.
        prompt_cache: on finish, the sequence's caches (one batch-1 ``KVCache`` per layer)
            holding KV for ``all_tokens`` (its own copy, already queued for evaluation); else
            None, and None on every finish of a runner made with ``finished_caches=False``.
        all_tokens: on finish, every token whose KV is in ``prompt_cache``.
        draft: on the first token of a verify step (prompt lookup), ``(drafted, accepted,
            switched_off)``: draft tokens checked in that step, how many of them matched (they
            follow this token in the same step), and whether speculation was switched off for
            the sequence after it for low acceptance; else None.
        state: what the sequence was inserted with (``insert_segments``'s ``states``), or None.
    """

    __slots__ = ("uid", "state", "token", "finish_reason", "prompt_cache", "all_tokens", "draft", "_lp", "_row")

    def __init__(self, seq: _Seq, token: int, lp: mx.array, row: int, finish_reason: str | None = None,
                 prompt_cache: list[Any] | None = None, all_tokens: list[int] | None = None):
        self.uid, self.state, self.token, self._lp, self._row = seq.uid, seq.state, token, lp, row
        self.finish_reason, self.prompt_cache, self.all_tokens = finish_reason, prompt_cache, all_tokens
        self.draft: tuple[int, int, bool] | None = None

    @property
    def logprobs(self) -> mx.array:
        return self._lp[self._row]


@dataclass(slots=True, eq=False)
class _Seq:
    """The runner's record of one sequence (its caches, prefill and decode progress)."""

    uid: int
    cache: list[Any]  # batch-1 caches while prefilling or alone; [] while in a merged batch
    tokens: list[int]  # tokens whose KV is (or is being) written, cached prefix included
    pending: list[int]  # prompt tokens still to prefill
    num_prompt: int  # tokens inserted (progress denominator)
    max_tokens: int
    sampler: Sampler
    processors: tuple[Processor, ...]
    matcher: Any  # mlx-lm StopSequences.Matcher
    context: TokenBuffer | None = None  # tokens seen by the processors
    grammar: GrammarMatcher | None = None  # constrained decoding (structured outputs)
    num_generated: int = 0
    # Speculative decoding (prompt lookup):
    drafting: Drafting | None = None  # set at its first chance to speculate
    spec_off: bool = False  # not eligible, or switched off for low acceptance
    y_known: int | None = None  # the token to feed next, already read by a verify step
    # The caller's record of this sequence (the engine's `RequestState`), opaque here: handed
    # back on its responses and chunk reports, so the caller never looks a uid up.
    state: Any = None


@dataclass(slots=True, eq=False)
class _Joining:
    """Sequences whose prefill finished, waiting to join the decode batch at the next step:
    one sequence with its batch-1 caches, or a batch prefilled together (``BatchKVCache``
    layers, rows in ``seqs`` order)."""

    seqs: list[_Seq]
    cache: list[Any]
    y: mx.array  # (n,) first tokens
    lp: mx.array  # (n, V) their log-probabilities
    batched: bool


def _sample(seqs: Sequence[_Seq], logits: mx.array, inputs: mx.array | None,
            grammars: Grammars | None = None) -> tuple[mx.array, mx.array]:
    """Grammar masks, processors, log-softmax and sampling for rows ``seqs`` of ``logits`` (B, V).

    ``inputs`` (B,) are the tokens just fed (added to each processor context and consumed by
    each grammar); None for a prompt's last chunk, whose context already holds the prompt.
    Returns (tokens (B,), logprobs (B, V)).
    """
    if grammars is not None and any(s.grammar is not None for s in seqs):
        mx.async_eval(logits)  # the forward runs while the host reads inputs and builds the masks
        fed = inputs.tolist() if inputs is not None else None  # waits for the previous step
        t0 = time.perf_counter()
        for s, t in zip(seqs, fed or ()):
            if s.grammar is not None:
                s.grammar.consume(t)
        logits = mask_logits(logits, [s.grammar for s in seqs], grammars)
        grammars.num_masked_steps += 1
        grammars.mask_host_s += time.perf_counter() - t0
    if any(s.processors for s in seqs):
        rows = []
        for i, s in enumerate(seqs):
            row = logits[i : i + 1]
            if s.processors:
                assert s.context is not None
                ctx = s.context.update_and_fetch(inputs[i : i + 1]) if inputs is not None else s.context.tokens
                for proc in s.processors:
                    row = proc(ctx, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    first = seqs[0].sampler
    if all(s.sampler is first for s in seqs):
        return first(logprobs), logprobs
    return mx.concatenate([s.sampler(logprobs[i : i + 1]) for i, s in enumerate(seqs)], axis=0), logprobs


class BatchRunner:
    """Continuous batching over one mlx-lm model (engine thread only).

    Args:
        model: an mlx-lm model (``nn.Module``), or a stage of one (cluster mode).
        stop_tokens: token sequences that end a sequence (the tokenizer's EOS ids).
        prefill_step_size: most tokens of one prefill chunk while nothing decodes; a multiple
            of ``block_size``.
        mixed_step_size: most tokens of one prefill chunk while sequences decode.
        block_size: the KV block size chunks align to.
        on_prefill_chunk: called after each prefill chunk (see `ChunkHook`).
        stream: the MLX stream the forward passes run on (default: mlx-lm's generation stream).
        hold_last_token: prefill a prompt up to its last token, then that token alone (as
            ``mlx_lm.generate_step`` does): the chunk hook then sees the caches at
            ``len(prompt) - 1``, where a model with recurrent state is snapshotted (a chat's
            next turn usually re-tokenizes the prompt's last token, "\\n" after "assistant",
            together with the answer, so the state after it would not be reused).
        make_cache: fresh per-layer batch-1 caches for a new sequence (default mlx-lm's
            ``make_prompt_cache(model)``; ``--kv-bits`` passes `CacheSpec.make_cache`, whose
            attention layers are `omlx.engine.quant_cache.QuantKVCache`).
        grammars: the model's `Grammars`, needed for sequences inserted with a grammar matcher
            (constrained decoding); None when none will be.
        num_draft_tokens: most tokens prompt lookup drafts per verify step (0: speculation
            off). Used for a sequence without processors or grammar, greedy or sampled
            (`omlx.engine.speculate`), alone over plain ``KVCache`` layers or in a merged batch
            whose layers are all ``BatchKVCache`` (made `RaggedBatchKVCache`, so each row
            drops its own rejected tokens); see `_spec_step`.
        max_tpot_slowdown: a prefill chunk joins a step beside decoding sequences only while
            their mean step time stays within this many decode-only steps (`PrefillPacer`,
            ``self.pacer``); <= 1 = off, a chunk in every step.
        pad_shapes: pad ragged prefill chunks to `padded_length` (see the module docstring;
            the engine turns it on for a CUDA device). Needs a model that returns every
            position's logits, so never for a cluster stage (its logits are the last position's).
        finished_caches: give a finishing sequence's caches on its response (``prompt_cache``);
            False when nobody stores them (no prefix cache), saving a copy of its KV.
        compaction: when a merged decode batch drops its finished rows (default
            `Compaction()`).
    """

    def __init__(self, model: Any, *, stop_tokens: Sequence[Sequence[int]], prefill_step_size: int = 2048,
                 mixed_step_size: int | None = None, block_size: int = 256,
                 on_prefill_chunk: ChunkHook | None = None, stream: Any = None, hold_last_token: bool = False,
                 make_cache: Callable[[], list[Any]] | None = None, grammars: Grammars | None = None,
                 num_draft_tokens: int = 0, max_tpot_slowdown: float = 0.0, pad_shapes: bool = False,
                 finished_caches: bool = True, compaction: Compaction | None = None):
        from mlx_lm.generate import StopSequences

        self.model = model
        self.block_size = block_size
        self.prefill_step_size = max(block_size, prefill_step_size // block_size * block_size)
        self.mixed_step_size = max(1, min(mixed_step_size or self.prefill_step_size, self.prefill_step_size))
        self.on_prefill_chunk = on_prefill_chunk
        self.hold_last_token = hold_last_token
        self._make_cache = make_cache or (lambda: make_prompt_cache(model))
        self.grammars = grammars
        self._stream = stream or generation_stream
        self._default_stops = StopSequences(list(stop_tokens) or None)
        self._next_uid = 0
        self._prefill: deque[_Seq] = deque()
        # A long prompt that short ones were just moved ahead of: it runs the next chunk after
        # theirs before any other short one may pass it again (see `_short_first`).
        self._passed: _Seq | None = None
        self._joining: list[_Joining] = []
        self._rows: list[_Seq] = []  # the decode batch, in row order; _DEAD for a finished row
        self._num_dead = 0  # rows of self._rows that are _DEAD (only in a merged batch)
        self.finished_caches = finished_caches
        self.compaction = compaction or Compaction()
        self.num_compactions = 0  # filters of the merged batch, all time
        self._cache: list[Any] = []  # its caches: the one row's own, or merged (BatchKVCache...)
        self._merged = False  # self._cache holds batched caches (two or more rows)
        self._y: mx.array | None = None  # (B,) tokens to feed next, sampled, not yet read
        self._emitted = False  # self._y was read and emitted already (`_emit_first`): feed it only
        self._lp: mx.array | None = None  # (B, V) their log-probabilities
        self._num_steps = 0
        self._reports: list[tuple[Any, list[Any], int]] = []  # chunk hooks due after the next step
        self.num_prefill_tokens = 0  # tokens prefilled (cached prefixes excluded), all time
        self.num_draft_tokens = max(0, num_draft_tokens)
        self.num_spec_steps = 0  # drafts checked (one per speculating row of a verify step), all time
        self.num_drafted_tokens = 0  # draft tokens proposed, all time
        self.num_accepted_tokens = 0  # of them accepted, all time
        self.pacer = PrefillPacer(max_tpot_slowdown)
        self.pad_shapes = pad_shapes
        self.num_pad_tokens = 0  # tokens of padding run by shape padding, all time

    # ---- the BatchGenerator-shaped surface ----------------------------------------------

    @property
    def num_prefilling(self) -> int:
        """Sequences still prefilling (not yet decoding)."""
        return len(self._prefill)

    def __len__(self) -> int:
        return len(self._prefill) + sum(len(j.seqs) for j in self._joining) + len(self._rows) - self._num_dead

    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any]] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Sampler | None] | None = None,
        logits_processors: list[list[Processor]] | None = None,
        stop_sequences: list[Any] | None = None,
        grammars: list[GrammarMatcher | None] | None = None,
        states: list[Any] | None = None,
    ) -> list[int]:
        """Queue sequences for prefill.

        Args:
            segments: per sequence, its prompt tokens (the concatenation of its segments; how
                they are cut does not matter: the runner chunks by its own rule).
            max_tokens: per sequence, most tokens to generate (> 0).
            caches: per sequence, batch-1 caches already holding ``all_tokens`` (a prefix hit),
                or None for fresh ones.
            all_tokens: per sequence, the tokens those caches hold.
            samplers, logits_processors, stop_sequences: per sequence (mlx-lm's kinds).
            grammars: per sequence, its grammar matcher (constrained decoding) or None; the
                runner must have been given ``grammars``.
            states: per sequence, the caller's record of it (opaque), handed back as the
                ``state`` of its responses and chunk reports; None when not given.

        Returns:
            The new sequences' uids.

        Raises:
            ValueError: an empty prompt, ``max_tokens <= 0``, option lists of the wrong length, or
                a grammar matcher without the runner's ``grammars``.
        """
        n = len(segments)
        opts = {"max_tokens": max_tokens, "caches": caches, "all_tokens": all_tokens, "samplers": samplers,
                "logits_processors": logits_processors, "stop_sequences": stop_sequences, "grammars": grammars,
                "states": states}
        if grammars and any(g is not None for g in grammars) and self.grammars is None:
            raise ValueError("a sequence has a grammar matcher, but this runner was made without grammars")
        for k, v in opts.items():
            if v is not None and len(v) != n:
                raise ValueError(f"option {k} must have one entry per sequence: expected {n}, got {len(v)}")
        new: list[_Seq] = []
        for i, segs in enumerate(segments):
            prompt = [t for seg in segs for t in seg]
            m = max_tokens[i] if max_tokens else 256
            if not prompt:
                raise ValueError("a sequence has an empty prompt")
            if m <= 0:
                raise ValueError("max_tokens must be > 0")
            cache = caches[i] if caches and caches[i] is not None else self._make_cache()
            prefix = list(all_tokens[i]) if all_tokens and caches and caches[i] is not None else []
            procs = tuple(logits_processors[i] or ()) if logits_processors else ()
            sampler = (samplers[i] if samplers else None) or greedy_sampler
            stops = (stop_sequences[i] if stop_sequences else None) or self._default_stops
            new.append(_Seq(uid=self._next_uid + i, cache=cache, tokens=prefix, pending=prompt,
                            num_prompt=len(prompt), max_tokens=m, sampler=sampler, processors=procs,
                            matcher=stops.matcher(), grammar=grammars[i] if grammars else None,
                            state=states[i] if states else None))
        self._next_uid += n
        self._prefill.extend(new)
        return [s.uid for s in new]

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, tuple[list[Any], list[int]]]:
        """Drop sequences wherever they are.

        Returns:
            With ``return_prompt_caches``, uid -> (batch-1 caches, the tokens they hold) for
            each removed sequence that had any KV; else an empty dict.
        """
        want = set(uids)
        out: dict[int, tuple[list[Any], list[int]]] = {}
        for s in [s for s in self._prefill if s.uid in want]:
            self._prefill.remove(s)
            if return_prompt_caches and s.tokens:
                out[s.uid] = (s.cache, list(s.tokens))
        for j in list(self._joining):
            rows = [i for i, s in enumerate(j.seqs) if s.uid in want]
            if not rows:
                continue
            for i in rows:
                if return_prompt_caches:
                    out[j.seqs[i].uid] = (([c.extract(i) for c in j.cache] if j.batched else j.cache),
                                          list(j.seqs[i].tokens))
            keep = [i for i in range(len(j.seqs)) if i not in rows]
            if not keep:
                self._joining.remove(j)
                continue
            idx = mx.array(keep)
            j.seqs, j.y, j.lp = [j.seqs[i] for i in keep], j.y[idx], j.lp[idx]
            for c in j.cache:
                c.filter(keep)
        rows = [i for i, s in enumerate(self._rows) if s.uid in want]
        if rows:
            if return_prompt_caches:
                for i in rows:
                    out[self._rows[i].uid] = (self._extract(i), list(self._rows[i].tokens))
            self._drop_rows(rows)
        return out

    def decode_caches(self, uid: int) -> list[Any] | None:
        """Batch-1 caches of decoding sequence ``uid``: its own caches when it decodes alone;
        of a merged batch, per-layer ``KVCache`` views of its row of each ``BatchKVCache`` (no
        copy) and ``extract`` copies of its row of window (``BatchRotatingKVCache``, no sink
        tokens) and state (``ArraysCache``) layers. None when it is not decoding or a layer is
        of another class. The caches may already hold the step in flight (one token more)."""
        from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

        from omlx.engine.quant_cache import BatchQuantKVCache

        row = next((i for i, s in enumerate(self._rows) if s.uid == uid), None)
        if row is None:
            return None
        if not self._merged:
            return self._cache
        views: list[Any] = []
        pad: int | None = None  # the row's left padding, the same in every BatchKVCache layer
        for c in self._cache:
            if isinstance(c, RaggedBatchKVCache):
                if pad is None:
                    pad = c.left_padding[row].item()
                views.append(c.row_view(row, pad))
            elif isinstance(c, BatchKVCache):
                if pad is None:
                    pad = c.left_padding[row].item()  # one host sync, not one per layer
                views.append(_row_view(c, row, pad, c._idx))
            elif isinstance(c, BatchQuantKVCache):
                if pad is None:
                    pad = c.left_padding[row].item()
                views.append(c.row_view(row, pad))
            elif (isinstance(c, BatchRotatingKVCache) and not getattr(c, "keep", 0)) or isinstance(c, ArraysCache):
                views.append(c.extract(row))
            else:
                return None
        return views

    def next(self) -> tuple[list[PromptResponse], list[TokenResponse]]:
        """One step: a decode step of every decoding sequence and at most one prefill chunk.

        Returns:
            (prefill progress, generated tokens), like ``BatchGenerator.next``. Sequences that
            finished are removed (their response carries their caches).
        """
        reports, self._reports = self._reports, []
        fed_only, self._emitted = self._emitted, False  # self._y went out last step: feed it only
        with mx.stream(self._stream):
            joins = bool(self._joining) and not fed_only
            alone = joins and not self._rows and not self._prefill  # the joiners are all the work there is
            if joins:
                self._join()
            y_in, lp_in, rows = self._y, self._lp, list(self._rows)
            if alone and y_in is not None:
                return self._emit_first(rows, y_in, lp_in, reports)
            # A fed-only step feeds tokens `_emit_first` already emitted: never a verify step.
            speculate = y_in is not None and self.num_draft_tokens and not fed_only
            gen_resps = self._spec_step(y_in, lp_in) if speculate else None
            if gen_resps is None and y_in is not None:
                for s in rows:
                    s.y_known = None  # a plain step feeds (and later reads) y_in itself
                # Queue the step that feeds y_in before the host reads it (pipelining).
                logits = self.model(y_in[:, None], cache=self._cache)[:, -1, :]
                self._y, self._lp = _sample(self._rows, logits, y_in, self.grammars)
                mx.async_eval(self._y, self._lp)
            whole = False
            if self._prefill:
                step = self._chunk_size()
                self._short_first(step)
                head = self._prefill[0]  # its next chunk is all of its prompt (a short one):
                whole = (len(head.pending) == head.num_prompt
                         and self._chunk_end(head, step) == len(head.tokens) + len(head.pending))
            paced = self.pacer.allow(decoding=y_in is not None, waiting=bool(self._prefill), whole_prompt=whole)
            prompt_resps = self._prefill_chunk(step) if self._prefill and paced else []
            if gen_resps is None:
                gen_resps = self._emit(rows, y_in, lp_in) if y_in is not None and not fed_only else []
            self._run_reports(reports)
        self._num_steps += 1
        if self._num_steps % _CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return prompt_resps, gen_resps

    def _emit_first(self, rows: list[_Seq], y_in: mx.array, lp_in: mx.array,
                    reports: list[tuple[Any, list[Any], int]]) -> tuple[list[PromptResponse], list[TokenResponse]]:
        """A step in which sequences joined an empty decode batch with no prompt left to
        prefill: emit ``y_in`` (their first tokens) before queuing the decode step that feeds
        it, which the next step queues without emitting again (``self._emitted``). With other
        work in flight the pipelined order stays (its steps would lose their overlap).

        On a CPU, ``mx.async_eval`` of a whole forward pass returns only once most of it has run
        (MLX bounds the tasks in flight), so the pipelined order (queue, then read) put a full
        decode step into every time to first token: over an 18.7k-token prefix hit on
        Qwen2.5-Coder-0.5B that step took 2.0-3.2 s of an 7-9.6 s TTFT on the 2-core VM
        (`benchmarks/bench_long_prefix_restore.py`). A row that finishes here is fed its last
        token all the same, so the caches it returns hold every one of its tokens.
        """
        for s in rows:
            s.y_known = None  # y_in is read here; a lone row's verify-step guess is stale now
        gen_resps = self._emit(rows, y_in, lp_in)
        for r in gen_resps:
            if r.finish_reason is not None:  # its caches hold its last token too, as after a pipelined step
                # Queued whole, as that step's was: a pipeline stage's sends are in the logits' graph.
                mx.async_eval(self.model(mx.array([[r.token]], dtype=mx.uint32), cache=r.prompt_cache))
        self._emitted = self._y is not None
        self._run_reports(reports)
        self._num_steps += 1
        return [], gen_resps

    # ---- prefill -------------------------------------------------------------------------

    def _chunk_size(self) -> int:
        return self.mixed_step_size if (self._rows or self._joining) else self.prefill_step_size

    @staticmethod
    def _plain_kv(s: _Seq) -> bool:
        """Every layer of ``s`` is a plain ``KVCache`` (trimmed exactly, batched by padding)."""
        return all(type(c) is KVCache for c in s.cache)

    @classmethod
    def _batchable(cls, s: _Seq) -> bool:
        """A fresh sequence (no cached prefix) over plain ``KVCache`` layers only."""
        return not s.tokens and cls._plain_kv(s)

    def _prefill_group(self, step: int) -> list[_Seq]:
        """The head of the prefill queue and the batchable sequences right behind it whose
        whole prompts fit one left-padded forward pass of at most ``step`` tokens (padding
        counted); a group of one is prefilled the usual way."""
        group: list[_Seq] = []
        longest = 0
        for s in self._prefill:
            if self.hold_last_token or not self._batchable(s):
                break
            longest = max(longest, len(s.pending))
            if (len(group) + 1) * longest > step:
                break
            group.append(s)
        return group

    def _prefill_batch(self, group: list[_Seq]) -> list[PromptResponse]:
        """Prefill ``group``'s whole prompts in one forward pass (left-padded, ``BatchKVCache``)
        and sample their first tokens; the group then joins the decode batch as one piece."""
        from mlx_lm.models.cache import BatchKVCache

        longest = max(len(s.pending) for s in group)
        if self.pad_shapes:
            longest = padded_length(longest)
        pads = [longest - len(s.pending) for s in group]
        self.num_pad_tokens += sum(pads)
        x = mx.array([[0] * p + s.pending for p, s in zip(pads, group)], dtype=mx.uint32)
        cache = [BatchKVCache(pads) for _ in group[0].cache]
        logits = self.model(x, cache=cache)[:, -1, :]
        out: list[PromptResponse] = []
        for s in group:
            s.tokens.extend(s.pending)
            self.num_prefill_tokens += len(s.pending)
            s.pending = []
            if s.processors:
                s.context = TokenBuffer(s.tokens)
        y, lp = _sample(group, logits, None, self.grammars)
        mx.async_eval(y, lp)
        for row, (p, s) in enumerate(zip(pads, group)):
            self._prefill.popleft()
            s.cache = []
            if self.on_prefill_chunk is not None:
                self._reports.append((s.state, [_row_view(c, row, p, longest) for c in cache], len(s.tokens)))
            out.append(PromptResponse(s.uid, (s.num_prompt, s.num_prompt), True, s.state))
        self._joining.append(_Joining(group, cache, y, lp, batched=True))
        return out

    def _short_first(self, step: int) -> None:
        """Order the prefill queue: sequences whose rest fits one chunk of ``step`` tokens go
        ahead of a longer head (in their arrival order, the long ones keep theirs), so a
        short prompt (a new turn on a cached conversation) waits at most one chunk instead of
        a whole long prefill. A long head that was passed runs its next chunk before any
        sequence may pass it again: with short prompts arriving without end, a long one still
        gets a chunk in every round."""
        if self._passed is not None:
            if any(s is self._passed for s in self._prefill):
                return  # the shorts moved ahead of it have not all run yet, or it runs now
            self._passed = None  # removed meanwhile
        head = self._prefill[0]
        if len(head.pending) <= step or all(len(s.pending) > step for s in self._prefill):
            return
        short = [s for s in self._prefill if len(s.pending) <= step]
        self._prefill = deque(short + [s for s in self._prefill if len(s.pending) > step])
        self._passed = head

    def _chunk_end(self, s: _Seq, step: int) -> int:
        """Where the next chunk of ``s`` ends (a token position): at an absolute multiple of
        the chunk size ``step``, so cuts do not depend on a hit; a first piece shorter than half
        a chunk (after a hit) joins the next chunk instead of paying a forward pass's fixed
        cost of its own; at the prompt's end at the latest."""
        pos = len(s.tokens)
        end = (pos // step + 1) * step
        if end - pos < step // 2:
            end += step
        last = pos + len(s.pending)
        if end >= last and self.hold_last_token and len(s.pending) > 1:
            end = last - 1  # the last token runs alone in the next chunk
        return min(last, end)

    def _prefill_chunk(self, step: int) -> list[PromptResponse]:
        """Run the next chunk of ``step`` tokens at most, of the queue's head (already ordered
        by `_short_first` this step) or of a batch of fresh short prompts behind it."""
        if self._prefill[0] is self._passed:
            self._passed = None  # it runs now: shorts may pass it again from the next chunk
        group = self._prefill_group(step)
        if len(group) > 1:
            return self._prefill_batch(group)
        s = self._prefill[0]
        pos = len(s.tokens)
        n = self._chunk_end(s, step) - pos
        chunk, s.pending = s.pending[:n], s.pending[n:]
        s.tokens.extend(chunk)
        x = mx.array(chunk, dtype=mx.uint32)[None]
        self.num_prefill_tokens += n
        done = s.num_prompt - len(s.pending)
        if s.pending:
            self.model(x, cache=s.cache)
            # No sync: the chunk runs while the host builds the next step's graph.
            mx.async_eval([c.state for c in s.cache])
            self._report(s, len(s.tokens))
            return [PromptResponse(s.uid, (done, s.num_prompt), False, s.state)]
        pad = padded_length(n) - n if self.pad_shapes and self._plain_kv(s) else 0
        if pad:
            x = mx.concatenate([x, mx.zeros((1, pad), dtype=mx.uint32)], axis=1)
            self.num_pad_tokens += pad
        # Without a pad, the last position (a pipeline stage computes only that one's logits).
        logits = self.model(x, cache=s.cache)[:, n - 1 if pad else -1, :]
        for c in s.cache if pad else ():
            c.trim(pad)  # causal: no real token attended to the pad after it
        if s.processors:
            s.context = TokenBuffer(s.tokens)
        y, lp = _sample([s], logits, None, self.grammars)
        mx.async_eval(y, lp)
        self._report(s, len(s.tokens))
        self._prefill.popleft()
        self._joining.append(_Joining([s], s.cache, y, lp, batched=False))
        s.cache = []
        return [PromptResponse(s.uid, (done, s.num_prompt), True, s.state)]

    def _report(self, s: _Seq, num_tokens: int) -> None:
        """Queue the chunk hook; it runs at the end of the next step, when the chunk's KV has
        (most likely) been computed, so reading it does not stall the pipeline."""
        if self.on_prefill_chunk is not None:
            # Frozen: by the time the hook runs, the next chunk may have moved a window layer's
            # cache on and replaced a state layer's arrays.
            self._reports.append((s.state, freeze(s.cache), num_tokens))

    def flush_reports(self) -> None:
        """Run the chunk hooks still due now (before a new sequence's prefix lookup, so it sees
        every block computed so far)."""
        reports, self._reports = self._reports, []
        self._run_reports(reports)

    def _run_reports(self, reports: list[tuple[Any, list[Any], int]]) -> None:
        for state, caches, n in reports:
            self.on_prefill_chunk(state, caches, n)  # type: ignore[misc]

    # ---- decode batch ---------------------------------------------------------------------

    def _join(self) -> None:
        """Move sequences whose prefill finished into the decode batch (their first token is
        fed in this step). Rows keep their order: decoding rows, then the joining ones in
        the order their prefills finished."""
        if not self._joining:
            return
        joining, self._joining = self._joining, []
        if not self._rows and len(joining) == 1:
            self._cache, self._merged = joining[0].cache, joining[0].batched
        else:
            # Batch-1 caches (a lone decoding row's, single joiners') are merged once, in row
            # order; batched pieces (the merged batch, groups prefilled together) are extended.
            pieces: list[list[Any]] = [self._cache] if self._rows and self._merged else []
            own: list[list[Any]] = [self._cache] if self._rows and not self._merged else []
            for j in joining:
                if j.batched:
                    if own:
                        pieces.append(_merge(own))
                        own = []
                    pieces.append(j.cache)
                else:
                    own.append(j.cache)
            if own:
                pieces.append(_merge(own))
            self._cache = pieces[0]
            for piece in pieces[1:]:
                for layer, c in enumerate(self._cache):
                    c.extend(piece[layer])
            self._merged = True
        ys = ([self._y] if self._y is not None else []) + [j.y for j in joining]
        lps = ([self._lp] if self._lp is not None else []) + [j.lp for j in joining]
        self._y = mx.concatenate(ys) if len(ys) > 1 else ys[0]
        self._lp = mx.concatenate(lps, axis=0) if len(lps) > 1 else lps[0]
        self._rows.extend(s for j in joining for s in j.seqs)
        if self._merged and self.num_draft_tokens:
            # Rows that speculate drop their own rejected tokens (same arrays, no copy).
            self._cache = [RaggedBatchKVCache.adopt(c) if type(c) is BatchKVCache else c for c in self._cache]

    def _emit(self, rows: list[_Seq], y_in: mx.array, lp_in: mx.array) -> list[TokenResponse]:
        """Read the tokens just fed to ``rows`` (the one host sync of the step) and emit them."""
        tokens = y_in.tolist()
        out: list[TokenResponse] = []
        done: list[int] = []
        for i, (s, t) in enumerate(zip(rows, tokens)):
            if s is _DEAD:
                continue
            reason = self._advance(s, t)
            r = TokenResponse(s, t, lp_in, i, reason)
            if reason is not None:  # rows is self._rows as it stands until _drop_rows below
                r.prompt_cache = self._extract(i) if self.finished_caches else None
                r.all_tokens = list(s.tokens)
                done.append(i)
            out.append(r)
        if done:
            self._drop_rows(done)
        return out

    # ---- speculative decoding (prompt lookup) ----------------------------------------------

    def _drafting(self, s: _Seq) -> Drafting | None:
        """``s``'s drafting state, made at its first chance; None while it may not speculate."""
        if s.spec_off:
            return None
        if s.drafting is None:
            if not can_draft(s.sampler, s.processors, s.grammar):
                s.spec_off = True
                return None
            s.drafting = Drafting(PromptLookup(), self.num_draft_tokens)
        return s.drafting

    def _trims_rows(self) -> bool:
        """The decode batch's caches can drop a different count of tokens per row: a lone
        row's plain ``KVCache`` layers (trimmed), a merged batch's `RaggedBatchKVCache`."""
        if self._merged:
            return all(isinstance(c, RaggedBatchKVCache) for c in self._cache)
        return all(type(c) is KVCache for c in self._cache)

    def _spec_step(self, y_in: mx.array, lp_in: mx.array) -> list[TokenResponse] | None:
        """One verify step of the decode batch, or None for a plain step.

        Each row that may speculate gets a draft ``d1..dk`` (prompt lookup, up to its
        adaptive ``num_draft``) after its next token ``y``; the batch is fed ``[y, d1..dk]``
        per row, right-padded to the longest draft (a plain row: ``[y, pad...]``), in one
        forward pass. `omlx.engine.speculate.verify` keeps each row's draft up to the first
        token its own sampler would not have drawn and picks its next token; the KV of every
        row's rest is dropped (``trim`` alone, `RaggedBatchKVCache.trim_rows` merged). A row
        that finishes inside its kept tokens (a stop token, ``max_tokens``) ends there, its
        caches cut to its last emitted token.

        The step runs when some row's next token is already on the host (a verify step reads
        them all) or its known tokens end in an n-gram seen before: reading the tokens to feed
        costs the pipeline's overlap, so a step with no likely draft stays pipelined. Returns
        the emitted responses (each row's ``y``, then its kept drafts), or None when no row
        had a draft (the tokens are then on the host, and a plain step feeds them).
        """
        rows = self._rows
        cand = [(i, d) for i, d in enumerate(map(self._drafting, rows)) if d is not None]
        if not cand or not self._trims_rows():
            return None
        if not any(rows[i].y_known is not None or d.lookup.propose(rows[i].tokens, 1) for i, d in cand):
            return None
        # A dead row's feed is never read: 0 stands in, so live rows' known tokens spare a sync.
        known = [0 if s is _DEAD else s.y_known for s in rows]
        ys: list[int] = known if None not in known else y_in.tolist()  # type: ignore[assignment]
        drafts: list[list[int]] = [[] for _ in rows]
        for i, d in cand:  # room: tokens still allowed after y
            drafts[i] = d.propose(rows[i].tokens, ys[i], rows[i].max_tokens - rows[i].num_generated - 1)
        width = 1 + max(len(d) for d in drafts)
        if width == 1:
            return None
        if self.pad_shapes:  # one query length for every verify step (`_verify_forward`)
            width = 1 + self.num_draft_tokens
        x = mx.array([[y, *d] + [0] * (width - 1 - len(d)) for y, d in zip(ys, drafts)], dtype=mx.uint32)
        logits = self._verify_forward(x)  # (B, width, V)
        v = verify(logits, [s.sampler for s in rows], drafts, y_in,
                   lambda idx, lg, inp: _sample([rows[i] for i in idx], lg, inp, self.grammars))
        self._trim_rows([width - 1 - a for a in v.accepted])
        self._y, self._lp = mx.array(v.next_tokens, dtype=mx.uint32), v.lp_next
        out: list[TokenResponse] = []
        done: list[int] = []
        for i, (s, y, d, a) in enumerate(zip(rows, ys, drafts, v.accepted)):
            if s is _DEAD:
                continue
            s.y_known = v.next_tokens[i]
            if d:
                self._record(s, len(d), a)
            emitted = [(y, lp_in, i)] + [(d[j], v.lp_positions[i], j) for j in range(a)]
            for e, (t, arr, row) in enumerate(emitted):
                reason = self._advance(s, t)
                r = TokenResponse(s, t, arr, row, reason)
                out.append(r)
                if e == 0 and d:
                    r.draft = (len(d), a, s.spec_off)
                if reason is not None:
                    r.all_tokens = list(s.tokens)
                    if self.finished_caches:
                        r.prompt_cache = self._extract(i)
                        for c in r.prompt_cache:  # the kept tokens past the finishing one
                            c.trim(len(emitted) - e - 1)
                    done.append(i)
                    break
        if done:
            self._drop_rows(done)
        return out

    def _verify_forward(self, x: mx.array) -> mx.array:
        """The verify step's forward pass over ``x`` ``(B, width)``. With ``pad_shapes`` (CUDA)
        the attention sees repeating shapes: ``width`` is always ``1 + num_draft_tokens``
        (`_spec_step` pads every row's draft) and the key length is the context rounded up to
        ``KVCache.step`` (`omlx.engine.ragged_cache.BucketedKV` for a lone row, the merged
        cache's ``bucket``), so cuDNN builds one attention graph per 256 tokens of context, not
        one per step (~45 ms each on an H100)."""
        if not self.pad_shapes:
            return self.model(x, cache=self._cache)
        if not self._merged:
            return self.model(x, cache=[BucketedKV(c, KVCache.step) for c in self._cache])
        for c in self._cache:
            c.bucket = KVCache.step
        try:
            return self.model(x, cache=self._cache)
        finally:
            for c in self._cache:
                c.bucket = 0

    def _record(self, s: _Seq, drafted: int, accepted: int) -> None:
        """Count a verify step of ``s`` (its `Drafting` and the runner's all-time counters)."""
        dr = s.drafting
        assert dr is not None
        dr.record(drafted, accepted, self.num_draft_tokens)
        if dr.off:
            s.spec_off = True
            logger.info("speculation off for sequence %d: %d of %d drafted tokens accepted in %d verify steps",
                        s.uid, dr.num_accepted, dr.num_drafted, dr.num_steps)
        self.num_spec_steps += 1
        self.num_drafted_tokens += drafted
        self.num_accepted_tokens += accepted

    def _trim_rows(self, n: list[int]) -> None:
        """Drop the last ``n[i]`` positions of decode row ``i`` (see `_trims_rows`)."""
        if not self._merged:
            if n[0]:
                for c in self._cache:
                    c.trim(n[0])
            return
        for c in self._cache:
            c.trim_rows(n)

    @staticmethod
    def _advance(s: _Seq, token: int) -> str | None:
        """Append emitted ``token`` to ``s``; its finish reason ("stop", "length") or None."""
        s.tokens.append(token)
        s.num_generated += 1
        if s.matcher.advance(token):
            return "stop"
        return "length" if s.num_generated >= s.max_tokens else None

    def _extract(self, row: int) -> list[Any]:
        """Batch-1 caches of decode row ``row`` (a copy when the batch is merged, queued for
        evaluation at once, not waited for: waiting would stall the step in flight. Until the
        copy has run, the batch's buffers are shared, so the next step's cache update writes a
        fresh copy of them instead of updating in place: about 1 ms for 32 rows of a 3B model
        on an H100, where a stall costs the host's whole step time.)"""
        if not self._merged:
            return self._cache
        out = [c.extract(row) for c in self._cache]
        mx.async_eval([c.state for c in out])
        return out

    def _drop_rows(self, rows: list[int]) -> None:
        """Sequences at decode rows ``rows`` leave the batch: a lone one's caches go, a merged
        batch's rows become dead (`omlx.engine.compaction`), and the batch is filtered when the
        policy says so or extracted to the last live row's own caches."""
        for i in rows:
            self._rows[i] = _DEAD
        self._num_dead += len(rows)
        live = [i for i, s in enumerate(self._rows) if s is not _DEAD]
        if not live:
            self._rows, self._cache, self._y, self._lp, self._merged = [], [], None, None, False
            self._num_dead = 0
            return
        if len(live) > 1 and not self.compaction.due(len(self._rows), self._num_dead):
            return
        idx = mx.array(live)
        self._y, self._lp = self._y[idx], self._lp[idx]  # type: ignore[index]
        self._rows, self._num_dead = [self._rows[i] for i in live], 0
        if len(live) == 1:
            # Back to one sequence: its own plain caches regain mlx-lm's fast causal path.
            self._cache = [c.extract(live[0]) for c in self._cache]
            self._merged = False
        else:
            self.num_compactions += 1
            for c in self._cache:
                c.filter(live)


#: The row of a sequence that finished in a merged batch (see `omlx.engine.compaction`): fed
#: its own greedy token each step, its outputs never read, its caches filtered out later.
#: It never speculates (``spec_off``): a verify step feeds it padding and emits nothing for it.
_DEAD = _Seq(uid=-1, cache=[], tokens=[], pending=[], num_prompt=0, max_tokens=0, sampler=greedy_sampler,
             processors=(), matcher=None, spec_off=True)


def _merge(caches: list[list[Any]]) -> list[Any]:
    """One batched cache per layer from per-sequence caches (mlx-lm's ``merge``, left-padded)."""
    return [caches[0][layer].merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]


def _row_view(c: Any, row: int, pad: int, end: int) -> KVCache:
    """A batch-1 ``KVCache`` view (no copy) of row ``row`` of ``BatchKVCache`` ``c``, whose row
    holds ``pad`` padding positions, then its tokens up to position ``end``."""
    v = KVCache()
    k, vv = c.keys[row : row + 1, :, pad:end], c.values[row : row + 1, :, pad:end]
    v.state = (k, vv, end - pad)
    return v

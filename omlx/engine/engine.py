"""One engine per loaded model: a thread that owns MLX and drives omlx's `BatchRunner`.

The engine turns `Request`s into typed `GenerationEvent`s delivered to a per-request sink (the
API layer's asyncio queue). It owns: admission through the `Scheduler`, prompt segmentation at
the prefix-cache lease of each request (looked up when its prefill can start, so a request
sharing a prefix with one ahead of it hits the blocks that one has just computed), its blocks
cached as prefill chunks complete, detokenization and stop strings,
logprobs, aborts, and failure isolation: per-request work (logits processors, non-greedy
samplers, detokenization, stop strings) runs guarded, so its exception fails that request only;
an exception from the batched forward pass cannot be attributed, so the batch is rebuilt and
its requests are retried from where they were (each at most ``MAX_STEP_RETRIES`` times). The
thread never dies of a request. It must not: speak HTTP, read config files, or know about API
shapes.

Each admitted request is one `RequestState` (omlx.engine.request_state) in one table keyed by
request id; the runner's sequence refers to that state and hands it back on every response and
chunk report, so no table is keyed by runner uid.

MLX belongs to this one thread (STYLE.md habit 10): every mlx call on the model happens here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol

import mlx.core as mx
from mlx_lm.generate import StopSequences

from omlx.cache.paged import common_prefix_len
from omlx.engine.grammar import Grammars
from omlx.engine.kv_cache import PrefixLease
from omlx.engine.output import OutputState, token_bytes
from omlx.engine.progress import PrefillRate, PrefillStatus, prefill_rate, warn_if_slow
from omlx.engine.request_state import RequestState, Sink
from omlx.engine.runner import BatchRunner
from omlx.engine.step_sizes import StepSizes, measured_step_sizes
from omlx.engine.sampling import guard_processor, guard_sampler, make_processors, make_sampler, repair_random_state
from omlx.errors import ClusterUnavailableError, EngineError
from omlx.request import (
    Admitted,
    Failed,
    Finished,
    GenerationEvent,
    PrefillProgress,
    Request,
    RequestStatus,
    SamplingParams,
    TextDelta,
    TokenLogprob,
    Usage,
)
from omlx.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: How many failed batch steps one request survives (its batch is rebuilt and it is retried).
MAX_STEP_RETRIES = 2
#: Shorter prefills are not fed to the restore cost model (fixed per-step costs dominate them).
_MIN_OBSERVED_PREFILL = 64


class PrefixCache(Protocol):
    """The engine's view of the KV cache tiers (implemented in omlx.engine.kv_cache)."""

    def acquire(self, token_ids: list[int], *, whole: bool = False, materialize: bool = True) -> PrefixLease: ...

    def materialize(self, lease: PrefixLease, *, room: int = 1) -> None: ...

    def next_logprobs(self, token_ids: list[int]) -> Any | None: ...

    def put_next_logprobs(self, token_ids: list[int], logprobs: Any) -> None: ...

    def store(self, lease: PrefixLease, prompt_cache: list[Any], token_ids: list[int]) -> None: ...

    def release(self, lease: PrefixLease) -> None: ...


class Pipeline(Protocol):
    """A runner that spans processes (cluster mode: `omlx.cluster.worker.ClusterPipeline`).

    The engine composes it; it never subclasses the engine. ``None`` on one node. Every method
    runs on the engine thread unless said otherwise.
    """

    #: Whether requests may carry a `Constraint` (the API refuses them with a 400 otherwise).
    supports_constraints: bool
    #: Sticky once set (any thread): the pipeline is lost; the engine is no longer alive and
    #: ``submit`` raises it.
    error: ClusterUnavailableError | None

    def attach(self, engine: Engine) -> None:
        """Called once from ``Engine.__init__``, after the engine's settings are final."""

    def wrap_runner(self, runner: BatchRunner) -> Any:
        """The runner the engine drives: ``runner``'s calls, made on every rank."""

    def before_insert(self, request: Request) -> None:
        """Prepare ``request`` for the ranks (may replace ``request.sampling``)."""

    def step_failed(self, error: Exception) -> ClusterUnavailableError:
        """A runner step raised: the error every request fails with. The engine then stops."""

    def idle(self) -> None:
        """About every 50 ms while nothing runs or waits (a heartbeat to the other ranks)."""

    def stopped(self) -> None:
        """The engine thread has ended (from the thread that called ``Engine.stop``)."""


class Engine:
    """Continuous batching for one model on its own thread.

    Args:
        model_id: the served id.
        model: an mlx-lm model (``nn.Module``).
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        scheduler: admission control (max running, max waiting).
        prefix_cache: the KV cache tiers, or None to run without a cache.
        block_size: KV block size in tokens (prefill chunks end at its multiples).
        prefill_step_size: most prompt tokens one forward pass processes per sequence.
        mixed_step_size: the same while other requests decode (default: ``prefill_step_size``).
        num_draft_tokens: prompt-lookup drafts per verify step (`BatchRunner`); 0 = off.
        max_tpot_slowdown: prefill pacing beside decoding sequences (`omlx.engine.pacing`);
            <= 1 = off (the default here: the cluster's replayed runners must step alike).
        pad_shapes: pad ragged prefill chunks to repeating lengths (`BatchRunner`; for CUDA,
            whose attention builds a cuDNN graph per new shape); off by default, as above.
        measure_steps: choose both step sizes by measuring the model on this device when the
            engine thread starts (`omlx.engine.step_sizes.measured_step_sizes`: once per model shape
            and device in the process; logged).
        make_processors: a request's logits processors (default:
            `omlx.engine.sampling.make_processors`; the test-only faults of omlx.engine.faults
            put theirs here).
        make_detokenizer: a request's streaming detokenizer (default: a fresh copy of the
            tokenizer's).
        make_cache: fresh per-layer caches for a new sequence (``--kv-bits``:
            `CacheSpec.make_cache` of the quantized layout); None = mlx-lm's ``make_prompt_cache``.
        pipeline: the runner's other ranks (cluster mode; `Pipeline`), or None on one node.
    """

    def __init__(
        self,
        model_id: str,
        model: Any,
        tokenizer: Any,
        *,
        scheduler: Scheduler,
        prefix_cache: PrefixCache | None = None,
        block_size: int = 256,
        prefill_step_size: int = 2048,
        mixed_step_size: int | None = None,
        measure_steps: bool = False,
        make_processors: Callable[[SamplingParams], list[Any]] = make_processors,
        make_detokenizer: Callable[[SamplingParams], Any] | None = None,
        make_cache: Callable[[], list[Any]] | None = None,
        num_draft_tokens: int = 0,
        max_tpot_slowdown: float = 0.0,
        pad_shapes: bool = False,
        pipeline: Pipeline | None = None,
    ):
        self.model_id = model_id
        self.model = model
        self.make_processors = make_processors
        self.make_detokenizer = make_detokenizer or (lambda p: tokenizer.detokenizer)
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.prefill_step_size = prefill_step_size
        self.mixed_step_size = mixed_step_size or prefill_step_size
        self.measure_steps = measure_steps
        self.make_cache = make_cache
        self.num_draft_tokens = num_draft_tokens
        self.max_tpot_slowdown = max_tpot_slowdown
        self.pad_shapes = pad_shapes
        self.step_sizes: StepSizes | None = None
        self._grammars: Grammars | None = None
        self._stop_sequences = StopSequences([(t,) for t in tokenizer.eos_token_ids])
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._sinks: dict[str, Sink] = {}  # submitted, not yet admitted (any thread -> engine thread)
        self._aborts: queue.SimpleQueue[tuple[str, Exception | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._gen: BatchRunner | None = None
        # Every admitted request, by request id, in admission order: the engine's one table of
        # requests (a state with ``uid`` None waits for its prefill to start).
        self._requests: dict[str, RequestState] = {}
        self._common: dict[tuple[str, str], int] = {}  # (ready, prefilling) request ids -> shared tokens
        self._faulted: list[RequestState] = []  # states whose own sampler or processor raised, this step
        self.num_batch_failures = 0
        self.num_request_failures = 0
        self.num_retried_requests = 0
        self.last_error: str | None = None
        self.last_step_s = 0.0  # time.monotonic() of the last step run with work
        self.pipeline = pipeline
        #: Requests may carry a `Constraint` (structured outputs, forced tool calls).
        self.supports_constraints = pipeline is None or pipeline.supports_constraints
        if pipeline is not None:
            pipeline.attach(self)

    # ---- called from any thread -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"engine-{self.model_id}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; running requests get an ``abort`` finish."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.pipeline is not None and (self._thread is None or not self._thread.is_alive()):
            self.pipeline.stopped()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and (self.pipeline is None or self.pipeline.error is None))

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; events go to ``sink`` from the engine thread.

        Raises:
            RateLimitError: the queue is full.
            EngineError: the engine is not running.
            ClusterUnavailableError: the engine's pipeline is lost.
        """
        if self.pipeline is not None and self.pipeline.error is not None:
            raise self.pipeline.error
        if not self.alive:
            raise EngineError(f"engine for {self.model_id} is not running")
        self._sinks[request.request_id] = sink
        try:
            self.scheduler.add(request)
        except Exception:
            self._sinks.pop(request.request_id, None)
            raise
        self._wake.set()

    def abort(self, request_id: str, error: Exception | None = None) -> None:
        """Abort a request; its batch row is freed on the next step.

        Args:
            error: None when the client went away (the request ends with an ``abort`` finish);
                otherwise the request ends with ``Failed(error)`` so its client learns why
                (memory limit reached, model unloaded).
        """
        # A waiting request leaves the queue now, so its place is free for the next request at
        # once (a client that drops a queued request and retries must not meet a 429 from its
        # own ghost); a running one is removed from the batch by the engine thread.
        req = self.scheduler.remove_waiting(request_id)
        sink = self._sinks.pop(request_id, None) if req is not None else None
        if req is not None:
            if sink is not None:
                sink(Finished("abort", Usage(req.num_prompt_tokens, 0)) if error is None else Failed(error))
            return
        self.scheduler.mark_aborting(request_id)
        self._aborts.put((request_id, error))
        self._wake.set()

    def active_requests(self) -> list[Request]:
        """Requests running or waiting, oldest first (a snapshot, from any thread)."""
        reqs = [st.request for st in list(self._requests.values())] + self.scheduler.waiting()
        return sorted(reqs, key=lambda r: r.arrival_s)

    def run_sync(self, request: Request, timeout_s: float = 600.0) -> list[GenerationEvent]:
        """Run one request to completion from a non-engine thread (warm-up, tools, tests).

        Returns:
            Every event of the request, the last being Finished or Failed.

        Raises:
            EngineError: no final event within ``timeout_s``.
        """
        return self.run_all([request], timeout_s)[0]

    def run_all(self, requests: list[Request], timeout_s: float = 600.0) -> list[list[GenerationEvent]]:
        """Submit ``requests`` at once and wait for all of them (from a non-engine thread).

        Returns:
            Per request, in order, every event of it, the last being Finished or Failed.

        Raises:
            EngineError: some request had no final event within ``timeout_s`` (all that had
                not finished are aborted).
        """
        events: list[list[GenerationEvent]] = [[] for _ in requests]
        left = [len(requests)]
        done = threading.Event()
        lock = threading.Lock()

        def sink_of(i: int) -> Sink:
            def sink(ev: GenerationEvent) -> None:
                events[i].append(ev)
                if isinstance(ev, (Finished, Failed)):
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            done.set()
            return sink

        for i, r in enumerate(requests):
            self.submit(r, sink_of(i))
        if requests and not done.wait(timeout_s):
            late = [r.request_id for r, evs in zip(requests, events)
                    if not evs or not isinstance(evs[-1], (Finished, Failed))]
            for rid in late:
                self.abort(rid)
            raise EngineError(f"requests {', '.join(late)} did not finish within {timeout_s:.0f} s")
        return events

    def num_active(self) -> int:
        """Requests known to the engine thread (running + being admitted)."""
        return len(self._requests)

    # ---- engine thread ----------------------------------------------------------------

    def _new_generator(self) -> Any:
        hook = self._on_prefill_chunk if self._caches_blocks_early() else None
        runner = BatchRunner(
            self.model,
            stop_tokens=[(t,) for t in self.tokenizer.eos_token_ids],
            prefill_step_size=self.prefill_step_size,
            mixed_step_size=self.mixed_step_size,
            block_size=self.block_size,
            on_prefill_chunk=hook,
            hold_last_token=self._hold_last_token(),
            make_cache=self.make_cache,
            grammars=self._grammars,
            num_draft_tokens=self.num_draft_tokens,
            max_tpot_slowdown=self.max_tpot_slowdown,
            pad_shapes=self.pad_shapes,
            finished_caches=self.prefix_cache is not None,
        )
        return runner if self.pipeline is None else self.pipeline.wrap_runner(runner)

    @property
    def grammars(self) -> Grammars:
        """Constrained-decoding grammars for this model (built on first use, any thread)."""
        if self._grammars is None:
            vocab = getattr(getattr(self.model, "args", None), "vocab_size", None) or len(self.tokenizer)
            self._grammars = Grammars(self.tokenizer, vocab)
            if self._gen is not None:
                self._gen.grammars = self._grammars
        return self._grammars

    def _measure_steps(self) -> None:
        """Pick the prefill chunk sizes for this model on this device (engine thread, once)."""
        try:
            sizes, reused = measured_step_sizes(self.model, self.block_size,
                                                max_step=max(self.prefill_step_size, self.block_size))
        except Exception:
            logger.exception("could not measure prefill chunk sizes; keeping %d", self.prefill_step_size)
            return
        self.step_sizes = sizes
        self.prefill_step_size, self.mixed_step_size = sizes.prefill_step_size, sizes.mixed_step_size
        logger.info("%s: prefill chunk %d tokens alone, %d beside decoding streams (decode step %.1f ms; "
                    "chunk ms by size %s%s)", self.model_id, sizes.prefill_step_size, sizes.mixed_step_size,
                    sizes.decode_step_ms, {k: round(v, 1) for k, v in sizes.chunk_ms.items()},
                    "; measured at an earlier load of this model shape" if reused else "")
        adopt = getattr(self.prefix_cache, "adopt_chunk_prefill_rate", None)
        ms = sizes.chunk_ms.get(sizes.prefill_step_size)
        if adopt is not None and ms:
            adopt(sizes.prefill_step_size / (ms / 1000))

    def _loop(self) -> None:
        if self.measure_steps:
            self._measure_steps()
        self._gen = self._new_generator()
        while not self._stopping:
            self._handle_aborts()
            self._admit()
            if not self._requests:
                self._write_deferred()
                self._wake.wait(0.05)
                self._wake.clear()
                self._idle()
                continue
            self.last_step_s = time.monotonic()  # the pool's lease expiry counts idle time from here
            try:
                prompt_resps, gen_resps = self._gen.next()
            except Exception as e:  # a failing step never kills the thread
                repair_random_state()
                self._fail_attributed(set())
                self._retry_batch(e)
                continue
            if self._faulted:
                self._fail_attributed({r.state for r in gen_resps if r.finish_reason is not None})
            for pr in prompt_resps:
                st = pr.state
                if st is None or st.finished:
                    continue
                done, total = pr.progress
                st.count_prefilled(done)
                if not pr.end_of_prompt:
                    st.sink(PrefillProgress(st.num_cached_tokens + done, st.num_cached_tokens + total))
            for r in gen_resps:
                try:
                    self._on_token(r)
                except Exception as e:
                    st = r.state
                    if st is not None and not st.finished:
                        logger.exception("request %s failed while emitting output", st.request_id)
                        self.num_request_failures += 1
                        self._drop(st, remove=r.finish_reason is None)
                        st.sink(Failed(EngineError(f"generation failed: {type(e).__name__}: {e}")))
        # Nothing is dropped silently: whatever is still here learns that the engine stopped.
        gone = EngineError(f"model {self.model_id} was unloaded (or the server is stopping) before this request finished; retry it")
        sinks = []
        for st in list(self._requests.values()):
            self._drop(st, remove=False)
            sinks.append(st.sink)
        self._fail_with_waiting(sinks, gone)

    def _write_deferred(self) -> None:
        """Nothing runs: hand the SSD tier the writes the cache held back meanwhile (blocks and
        tails of generated tokens, `TierPolicy.defer_generated`), off the requests' steps."""
        write = getattr(self.prefix_cache, "write_deferred", None)
        if write is not None:
            try:
                write()
            except Exception:
                logger.exception("could not queue the held-back KV blocks for the SSD tier")

    def _idle(self) -> None:
        """Engine thread, about every 50 ms while nothing runs or waits."""
        if self.pipeline is not None:
            self.pipeline.idle()  # the cluster's rank 0 sends its heartbeat

    def fail_everything(self, error: Exception) -> None:
        """Fail every running, starting and waiting request with ``error`` (any thread: the
        cluster's watchdog calls it while the engine thread is stuck in a collective)."""
        states = list(self._requests.values())  # the one being inserted too (cluster: stuck in it)
        self._requests.clear()
        sinks: list[Sink | None] = []
        for st in states:
            st.finished = True
            sinks.append(st.sink)
        self._fail_with_waiting(sinks, error)

    def _fail_with_waiting(self, sinks: list[Sink | None], error: Exception) -> None:
        """Send ``Failed(error)`` to ``sinks`` and to every request still waiting (which leaves
        the queue)."""
        for req in self.scheduler.waiting():
            if self.scheduler.remove_waiting(req.request_id) is not None:
                sinks.append(self._sinks.pop(req.request_id, None))
        for sink in sinks:
            try:
                if sink is not None:
                    sink(Failed(error))
            except RuntimeError:  # the server's event loop is already closed: nobody is listening
                pass

    def _fail_attributed(self, finished: set[RequestState]) -> None:
        """Fail the requests whose own processor or sampler raised in this step; only them
        (``finished``: those the step ended, already out of the runner's batch)."""
        faulted, self._faulted = self._faulted, []
        for st in faulted:
            error, st.fault = st.fault, None
            if st.finished or error is None:
                continue
            logger.error("request %s failed in its own sampling step (%s: %s); the other %d request(s) go on",
                         st.request_id, type(error).__name__, error, len(self._requests) - 1)
            self.num_request_failures += 1
            self.last_error = f"{type(error).__name__}: {error}"
            self._drop(st, remove=st not in finished)
            st.sink(Failed(EngineError(f"generation failed: {type(error).__name__}: {error}")))

    def _retry_batch(self, error: Exception) -> None:
        """The batched step failed without saying for whom: rebuild the batch and resume every
        request from its prompt plus the tokens it already produced (greedy output is unchanged).
        A request that has been in more than ``MAX_STEP_RETRIES`` failed steps fails.

        With a pipeline, a failed step leaves the ranks' runners out of step: every request
        fails with the pipeline's error and the engine stops."""
        self.num_batch_failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        if self.pipeline is not None:
            err = self.pipeline.step_failed(error)
            self.last_error = err.message
            self.fail_everything(err)
            self._stopping = True  # the loop ends; nothing more can run on this pipeline
            return
        survivors = [st for st in self._requests.values() if st.uid is not None]
        logger.error("batch step failed (%s: %s); retrying its %d request(s) in a fresh batch",
                     type(error).__name__, error, len(survivors), exc_info=error)
        self._gen = self._new_generator()
        for st in survivors:
            st.uid = None  # not in the new runner until resumed
        for st in survivors:
            st.num_retries += 1
            try:
                if st.num_retries > MAX_STEP_RETRIES:
                    raise EngineError(f"generation failed {st.num_retries} times in a row: {type(error).__name__}: {error}")
                self._resume(st)
                self.num_retried_requests += 1
            except Exception as e:
                self.num_request_failures += 1
                self._drop(st, remove=False)
                st.sink(Failed(e if isinstance(e, EngineError) else EngineError(f"generation failed: {type(e).__name__}: {e}")))

    def _resume(self, st: RequestState) -> None:
        """Insert ``st`` into the (new) batch again: prompt + generated tokens, remaining budget.

        Its prefix-cache lease is released (the old batch held its caches) and it is not stored.
        """
        if st.lease is not None and self.prefix_cache is not None:
            self.prefix_cache.release(st.lease)
            st.lease = None
        p = st.request.sampling
        remaining = p.max_tokens - st.num_output_tokens
        if remaining <= 0:
            self._finish(st, "length", remove=False, prompt_cache=None, all_tokens=None)
            return
        if st.grammar is not None:  # the failed step may have consumed a token never emitted
            st.grammar.rewind(st.num_output_tokens)
        (uid,) = self._gen.insert_segments(
            [[list(st.token_ids)]],
            max_tokens=[remaining],
            samplers=[st.sampler],
            logits_processors=[st.processors],
            stop_sequences=[self._stop_sequences],
            grammars=[st.grammar],
            states=[st],
        )
        st.start(uid, 0, st.request.num_prompt_tokens)

    def _handle_aborts(self) -> None:
        while True:
            try:
                rid, error = self._aborts.get_nowait()
            except queue.Empty:
                return
            st = self._requests.get(rid)
            if st is not None and st.uid is None:  # admitted, its prefill not started
                self._forget(st)
                self.scheduler.finish(rid, RequestStatus.ABORTED if error is None else RequestStatus.FAILED)
                st.sink(Finished("abort", Usage(st.request.num_prompt_tokens, 0)) if error is None else Failed(error))
            elif st is not None:
                self._keep_prefilled_blocks(st)
                if error is None:
                    self._finish(st, "abort", remove=True, prompt_cache=None, all_tokens=None)
                else:
                    self._drop(st, remove=True)
                    st.sink(Failed(error))
            elif (req := self.scheduler.remove_waiting(rid)) is not None:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    sink(Finished("abort", Usage(req.num_prompt_tokens, 0)) if error is None else Failed(error))

    def _admit(self) -> None:
        for req in self.scheduler.admit():
            sink = self._sinks.pop(req.request_id, None)
            if sink is None:  # aborted between add and admit
                self.scheduler.finish(req.request_id, RequestStatus.ABORTED)
                continue
            self._requests[req.request_id] = RequestState.admitted(req, sink)
        # A request whose prompt shares blocks that a request prefilling now is still computing
        # waits until they are in the cache (8 agents started at once on one system prompt
        # prefill it once; a retry of an abandoned prompt takes what its first try computed);
        # every other one starts now, behind nothing: the runner puts a prompt that fits one
        # chunk ahead of a long one (`BatchRunner`'s prefill order), so a short turn on a
        # cached conversation is not held up by another client's long first prompt.
        ready = [st for st in self._requests.values() if st.uid is None]
        if ready and self._gen is not None:
            flush = getattr(self._gen, "flush_reports", None)
            if flush is not None:
                flush()  # every block computed so far is in the cache before the lookups
            num_waiting = 0
            for st in ready:
                if st.finished:  # failed meanwhile (fail_everything, from another thread)
                    continue
                if self._waits_for_blocks(st.request):
                    num_waiting += 1
                    continue
                try:
                    self._insert(st)
                except Exception as e:
                    logger.exception("could not start request %s", st.request_id)
                    repair_random_state()
                    self._forget(st)
                    self.scheduler.finish(st.request_id, RequestStatus.FAILED)
                    # A lost pipeline (cluster mode) stays a 503 cluster_unavailable, not a 500.
                    err = e if isinstance(e, ClusterUnavailableError) else EngineError(f"could not start generation: {e}")
                    st.sink(Failed(err))
            if not num_waiting:
                self._common.clear()
        elif not ready:
            self._common.clear()

    def _waits_for_blocks(self, req: Request) -> bool:
        """Whether ``req`` would hit more of the prefix cache by waiting: a request prefilling
        now shares with ``req`` a full block that is not in the cache yet (past its cached
        prefix and, where blocks are cached as chunks finish, past its prefilled chunks)."""
        ids = req.prompt_token_ids
        bs = self.block_size
        early = self._caches_blocks_early()
        for st in self._requests.values():
            if st.uid is None or st.first_token_s is not None or st.lease is None:
                continue  # not started, decoding, or caching nothing (after a batch retry)
            key = (req.request_id, st.request_id)
            common = self._common.get(key)
            if common is None:
                common = self._common[key] = common_prefix_len(ids, st.request.prompt_token_ids) // bs * bs
            covered = st.num_computed_tokens if early else st.num_cached_tokens
            if common > covered // bs * bs:
                return True
        return False

    def _insert(self, st: RequestState) -> None:
        if self.pipeline is not None:
            self.pipeline.before_insert(st.request)
        req = st.request
        tokens = req.prompt_token_ids
        p = req.sampling
        st.processors = [guard_processor(st, f, self._faulted) for f in self.make_processors(p)]
        st.sampler = guard_sampler(st, make_sampler(p), self._faulted)
        st.grammar = self.grammars.matcher(p.constraint) if p.constraint is not None else None
        pc = self.prefix_cache
        # A processor or a grammar changes the first token's log-probabilities: no stored ones.
        first = pc.next_logprobs(tokens) if pc is not None and not st.processors and st.grammar is None else None
        st.lease = lease = pc.acquire(tokens, whole=first is not None, materialize=False) if pc is not None else None
        try:
            if lease is not None and first is not None and lease.num_cached_tokens == len(tokens):
                self._start_whole_hit(st, first)
                return
            if lease is not None:  # room for the rest of the prompt: its prefill writes in place
                pc.materialize(lease, room=len(tokens) - lease.num_cached_tokens)  # type: ignore[union-attr]
                st.num_cached_tokens, st.num_cached_tokens_cold = lease.num_cached_tokens, lease.num_cached_tokens_cold
            num_cached = st.num_cached_tokens
            warn_if_slow(req.request_id, len(tokens) - num_cached, len(tokens), self.prefill_rate())
            caches = [lease.caches] if lease is not None and lease.caches is not None else None
            (uid,) = self._gen.insert_segments(
                [[list(tokens[num_cached:])]],
                max_tokens=[p.max_tokens],
                caches=caches,
                all_tokens=[list(tokens[:num_cached])] if caches else None,
                samplers=[st.sampler],
                logits_processors=[st.processors],
                stop_sequences=[self._stop_sequences],
                grammars=[st.grammar],
                states=[st],
            )
        except Exception:
            if lease is not None and not lease.released:  # type: ignore[attr-defined]
                pc.release(lease)  # type: ignore[union-attr]
            st.lease = None
            raise
        st.start(uid, num_cached, len(tokens) - num_cached)
        st.start_s = time.monotonic()
        st.output = OutputState(self.make_detokenizer(p), p.stop)
        st.sink(Admitted(st.num_cached_tokens, st.num_cached_tokens_cold))

    def _start_whole_hit(self, st: RequestState, first: Any) -> None:
        """Start a request whose whole prompt is cached with its last position's log-probabilities.

        The first token is drawn by the request's own sampler from the stored array (the same
        input a run without cache gives it), emitted, and only then is the KV materialized and
        the request continued in the batch from that token; a request that ends at its first
        token never touches the KV at all.
        """
        req, lease = st.request, st.lease
        assert lease is not None
        p = req.sampling
        st.num_cached_tokens, st.num_cached_tokens_cold = lease.num_cached_tokens, lease.num_cached_tokens_cold
        st.start_s = time.monotonic()
        st.num_computed_tokens = req.num_prompt_tokens
        st.output = OutputState(self.make_detokenizer(p), p.stop)
        st.sink(Admitted(st.num_cached_tokens, st.num_cached_tokens_cold))
        token = int(st.sampler(first[None])[0].item())
        if st.fault is not None:
            fault, st.fault = st.fault, None
            self._faulted.remove(st)
            raise fault
        st.first_token_s = time.monotonic()
        is_eos = token in self._eos
        if not is_eos:
            st.add_output_token(token)
            lp = self._logprob(st, token, first) if p.logprobs else None
            text = st.output.add(token, lp)
            if text:
                ids, lps = st.output.take_tokens()
                st.sink(TextDelta(text, ids, lps if p.logprobs else None))
        if is_eos or st.output.matched_stop is not None or p.max_tokens <= 1:
            self._finish(st, "stop" if is_eos or st.output.matched_stop is not None else "length",
                         remove=False, prompt_cache=None, all_tokens=None)
            return
        self.prefix_cache.materialize(lease)  # type: ignore[union-attr]
        (uid,) = self._gen.insert_segments(
            [[[token]]],
            max_tokens=[p.max_tokens - 1],
            caches=[lease.caches],
            all_tokens=[list(req.prompt_token_ids)],
            samplers=[st.sampler],
            logits_processors=[[]],
            stop_sequences=[self._stop_sequences],
            states=[st],
        )
        st.start(uid, req.num_prompt_tokens, 0)

    def _logprob(self, st: RequestState, token: int, logprobs: mx.array) -> TokenLogprob:
        k = st.request.sampling.top_logprobs
        value = logprobs[token].item()
        top: list[TokenLogprob] = []
        if k > 0:
            idx = mx.argpartition(-logprobs, k - 1)[:k]
            vals = logprobs[idx]
            pairs = sorted(zip(idx.tolist(), vals.tolist()), key=lambda x: -x[1])
            top = [self._token_logprob(t, v) for t, v in pairs]
        tl = self._token_logprob(token, value)
        tl.top = top
        return tl

    def _token_logprob(self, token: int, value: float) -> TokenLogprob:
        raw = token_bytes(self.tokenizer, token)
        return TokenLogprob(token=raw.decode("utf-8", errors="replace"), logprob=value, bytes=list(raw))

    def _on_token(self, r: Any) -> None:
        st: RequestState | None = r.state
        if st is None or st.finished:
            return
        now = time.monotonic()
        if st.first_token_s is None:
            st.first_token_s = now
            if not st.processors and st.grammar is None and self.prefix_cache is not None:
                st.first_logprobs = r.logprobs
            self._observe_prefill(st, now)
        if r.draft is not None:
            st.num_draft_tokens += r.draft[0]
            st.num_accepted_draft_tokens += r.draft[1]
            st.speculation_off = st.speculation_off or r.draft[2]
        is_eos = r.finish_reason == "stop"
        if not is_eos:
            st.add_output_token(int(r.token))
            self._cache_decoded_block(st, r)
            lp = self._logprob(st, r.token, r.logprobs) if st.request.sampling.logprobs else None
            text = st.output.add(r.token, lp)
            if text:
                ids, lps = st.output.take_tokens()
                st.sink(TextDelta(text, ids, lps if st.request.sampling.logprobs else None))
        if st.output.matched_stop is not None:
            if r.finish_reason is None:
                caches = self._gen.remove([r.uid], return_prompt_caches=True).get(r.uid)
                pc, toks = caches if caches else (None, None)
                self._finish(st, "stop", remove=False, prompt_cache=pc, all_tokens=toks)
            else:
                self._finish(st, "stop", remove=False, prompt_cache=r.prompt_cache, all_tokens=r.all_tokens)
        elif r.finish_reason is not None:
            self._finish(st, "stop" if is_eos else "length", remove=False,
                         prompt_cache=r.prompt_cache, all_tokens=r.all_tokens)

    def _hold_last_token(self) -> bool:
        """A model with recurrent-state layers is snapshotted before its prompt's last token
        (see `BatchRunner`'s ``hold_last_token``)."""
        spec = getattr(self.prefix_cache, "spec", None)
        return bool(spec is not None and spec.has_state and self._caches_blocks_early())

    def _caches_blocks_early(self) -> bool:
        """The prefix cache takes blocks while a request runs (``cache_blocks``); the cluster's
        does not (its followers see a sequence's caches only at its end)."""
        return getattr(self.prefix_cache, "cache_blocks", None) is not None

    def _cache_blocks(self, st: RequestState, caches: list[Any], num_tokens: int, state_at: int | None = None) -> None:
        """Register ``st``'s full blocks among its first ``num_tokens`` tokens (KV in ``caches``;
        ``state_at``: where their state layers stand, when known exactly)."""
        try:
            self.prefix_cache.cache_blocks(  # type: ignore[union-attr]
                st.lease, caches, st.token_ids, num_tokens,
                state_at=state_at,
                prompt_end=num_tokens == st.request.num_prompt_tokens - (1 if self._gen.hold_last_token else 0))
        except Exception:
            logger.exception("could not cache the blocks of %s", st.request.request_id)

    def _on_prefill_chunk(self, st: RequestState | None, caches: list[Any], num_tokens: int) -> None:
        """Runner hook: a prefill chunk finished; its full blocks go to the prefix cache now, so
        a request behind this one that shares the prefix hits them while this one runs."""
        if st is not None and not st.finished and st.lease is not None:
            self._cache_blocks(st, caches, num_tokens, state_at=num_tokens)

    def _cache_decoded_block(self, st: RequestState, r: Any) -> None:
        """When decode fills a block, register it now (a long answer's blocks serve the next
        turn or a retry before the request ends)."""
        num_kv = st.num_computed_tokens
        if st.lease is None or r.finish_reason is not None or num_kv % self.block_size or not self._caches_blocks_early():
            return
        caches = self._gen.decode_caches(r.uid)
        if caches is not None:
            self._cache_blocks(st, caches, num_kv)

    def _keep_prefilled_blocks(self, st: RequestState) -> None:
        """Before a request leaves mid-prefill: run the chunk hooks still due (the last chunk's
        is queued until the next step), so every full block it computed stays in the prefix
        cache and a retry of the prompt resumes from there instead of from the last report."""
        if st.first_token_s is not None or st.lease is None or not self._caches_blocks_early():
            return
        flush = getattr(self._gen, "flush_reports", None)
        if flush is not None:
            try:
                flush()
            except Exception:
                logger.exception("could not cache the prefilled blocks of %s", st.request.request_id)

    def prefill_rate(self) -> PrefillRate | None:
        """The engine's best prefill rate estimate (`omlx.engine.progress.prefill_rate`); any thread."""
        cost = getattr(getattr(self.prefix_cache, "tiers", None), "cost", None)
        return prefill_rate(cost, self.step_sizes.chunk_ms if self.step_sizes else None, self.prefill_step_size)

    def prefilling(self) -> list[PrefillStatus]:
        """Requests whose prompt is being prefilled now, with progress, rate and ETA (a
        snapshot, from any thread), oldest first."""
        now = time.monotonic()
        rate = self.prefill_rate()
        rows = []
        for st in sorted(list(self._requests.values()), key=lambda s: s.start_s):
            if st.first_token_s is not None or st.uid is None:
                continue
            req = st.request
            elapsed = now - st.start_s
            done = st.num_insert_prefilled
            own = done / elapsed if done and elapsed > 0 else None
            tps = own or (rate.tokens_per_s if rate is not None else None)
            left = max(0, st.num_prompt_to_prefill - done)
            rows.append(PrefillStatus(
                request_id=req.request_id, model=self.model_id, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=st.num_cached_tokens, num_prefilled_tokens=req.num_prefilled_tokens,
                num_to_prefill=st.num_prompt_to_prefill, elapsed_s=elapsed, tokens_per_s=tps,
                eta_s=left / tps if tps else None))
        return rows

    def _observe_prefill(self, st: RequestState, now: float) -> None:
        """Give the cache's restore cost model a real prefill rate: only a request that was
        alone in the batch from insert to first token (no other request's steps in its time)."""
        observe = getattr(self.prefix_cache, "observe_prefill", None)
        num_tokens = len(st.request.prompt_token_ids) - st.num_cached_tokens
        alone = sum(s.uid is not None for s in self._requests.values()) == 1
        if observe is not None and alone and num_tokens >= _MIN_OBSERVED_PREFILL:
            observe(num_tokens, now - st.start_s)

    def _drop(self, st: RequestState, *, remove: bool) -> None:
        """Forget a request and free its batch row and lease, without any event."""
        self._forget(st)
        if remove and st.uid is not None:
            try:
                self._gen.remove([st.uid])
            except Exception:
                logger.exception("could not remove uid %d from the batch", st.uid)
        if st.lease is not None and self.prefix_cache is not None:
            self.prefix_cache.release(st.lease)
            st.lease = None
        self.scheduler.finish(st.request.request_id, RequestStatus.FAILED)

    def _forget(self, st: RequestState) -> None:
        """``st`` leaves the engine's table; later responses naming it are ignored."""
        st.finished = True
        self._requests.pop(st.request_id, None)

    def _finish(self, st: RequestState, reason: str, *, remove: bool, prompt_cache: Any, all_tokens: Any) -> None:
        self._forget(st)
        if remove and st.uid is not None:
            self._gen.remove([st.uid])
        if reason == "length" and st.grammar is not None and not st.grammar.complete:
            logger.warning("request %s reached max_tokens (%d) inside its constrained output (%s): the output is "
                           "cut short and does not parse; finish_reason is 'length'", st.request.request_id,
                           st.request.sampling.max_tokens, st.grammar.constraint.label)
        tail = st.output.finish() if reason != "abort" else ""
        ids, lps = st.output.take_tokens()
        if tail or (ids and st.request.sampling.logprobs):
            st.sink(TextDelta(tail, ids, lps if st.request.sampling.logprobs else None))
        if st.lease is not None and self.prefix_cache is not None:
            # Release before storing: a reused tail that the new blocks cover must be free to
            # be dropped, or every turn of a chat leaves a stale tail behind (measured 1.36x
            # the ideal resident KV bytes before this order).
            lease, st.lease = st.lease, None
            self.prefix_cache.release(lease)
            try:
                if prompt_cache is not None and all_tokens is not None:
                    self.prefix_cache.store(lease, prompt_cache, list(all_tokens))
                    if st.first_logprobs is not None:
                        self.prefix_cache.put_next_logprobs(list(st.request.prompt_token_ids), st.first_logprobs)
            except Exception:
                logger.exception("could not store KV blocks of %s", st.request.request_id)
        status = RequestStatus.ABORTED if reason == "abort" else RequestStatus.FINISHED
        self.scheduler.finish(st.request.request_id, status)
        now = time.monotonic()
        usage = Usage(
            num_prompt_tokens=st.request.num_prompt_tokens,
            num_completion_tokens=st.num_output_tokens,
            num_cached_tokens=st.num_cached_tokens,
            num_cached_tokens_cold=st.num_cached_tokens_cold,
            ttft_s=(st.first_token_s - st.request.arrival_s) if st.first_token_s else None,
            total_s=now - st.request.arrival_s,
            num_draft_tokens=st.num_draft_tokens,
            num_accepted_draft_tokens=st.num_accepted_draft_tokens,
            speculation_off=st.speculation_off,
        )
        st.sink(Finished(reason, usage, st.output.matched_stop))

"""Pipeline workers: rank 0 drives omlx's Engine, the other ranks replay its generator calls.

Owns: the control channel protocol, ``ClusterPipeline`` (rank 0: composed into the normal
continuous-batching Engine, whose runner calls it broadcasts to the other ranks first), ``run_follower``
(ranks > 0: replay those calls on their own ``BatchRunner`` over their own stage), the start-up
handshake, and turning a lost peer into ``ClusterUnavailableError``. Must not: speak HTTP (the
CLI hands rank 0's engine to the normal API app) or choose layer ranges.

Why replay works: omlx's ``BatchRunner`` is deterministic given its calls (``insert_segments``,
``next``, ``remove``) and the logits, and every rank gets the same logits (the stage all-sums them
from the last rank). So every rank's generator holds the same sequences, pads and slices its own
KV caches the same way, samples the same tokens (same samplers, same PRNG seed) and issues the
same collectives in the same order (rank 0 gives every unseeded sampled request a seed, so
sampling uses a per-request key chain, never a process's global PRNG). Each ``next`` message carries rank 0's previous tokens; a
rank that disagrees stops with an error instead of producing wrong text.

Prefix cache: every rank keeps the hot and SSD tiers of its own layers; rank 0's lookups,
releases and stores are replayed too, and the ranks agree on each request's cached-token count
(``omlx.cluster.prefix_cache``), so a cached insert splits its segments identically everywhere.

Control message (JSON, broadcast from rank 0 before the call it describes)::

    {"op": "hello", "seed", "max_running", "prefill_step_size", "mixed_step_size", "block_size",
     "stop_token_ids", "heartbeat_s"}                once
    {"op": "lookup", "lease": id, "tokens": [ids], "whole": bool, "prefill_tokens_per_s"}
                                                     then every rank gathers its count
    {"op": "insert", "segments": [[[ids]]], "max_tokens": [n], "sampling": [SamplingParams],
     "lease": id | null, "num_cached": n}            the lease's caches hold the first n tokens
    {"op": "next", "check": [[uid, token], ...]}     tokens rank 0 got from the previous next
    {"op": "remove", "uids": [...], "return_prompt_caches": bool}
    {"op": "release", "lease": id}  {"op": "store", "lease": id}
    {"op": "ping"}                                   rank 0 is idle (every heartbeat_s): nothing to do
    {"op": "stop"}                                   rank 0 is shutting down: exit 0

Every wait of a follower is bounded: a step by ``timeout_s``, the wait for rank 0's next message
by ``heartbeat_s + timeout_s`` (an idle rank 0 pings). A follower stuck behind a frozen peer, in
a step or before one, so exits with ``EXIT_PEER_LOST`` instead of hanging.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences, generation_stream

from omlx.cluster.group import ClusterGroup, Watchdog, lost_error
from omlx.cluster.pipeline import StageModel
from omlx.cluster.prefix_cache import ClusterPrefixCache, FollowerPrefixCache
from omlx.engine.engine import Engine
from omlx.engine.runner import BatchRunner
from omlx.engine.sampling import make_processors, make_sampler
from omlx.errors import ClusterUnavailableError, EngineError
from omlx.request import Request, SamplingParams

logger = logging.getLogger(__name__)

EXIT_PEER_LOST = 3
"""Exit code of a follower whose peer was lost or whose step timed out."""
EXIT_DESYNC = 4
"""Exit code of a follower that disagreed with rank 0 or failed a step."""


def handshake(group: ClusterGroup, stage: StageModel) -> list[dict[str, Any]]:
    """Exchange each rank's stage facts and configure the stage; every rank calls it once.

    Raises:
        ModelImportError: the ranks' ranges do not tile the model in rank order.
        ClusterUnavailableError: a peer was lost.
    """
    group.stream = generation_stream  # control messages queue behind the model's collectives
    facts = group.gather_messages(stage.local_facts())
    stage.configure(facts)
    ends = [(f["start"], f["end"]) for f in facts]
    for (_, end), (start, _) in zip(ends, ends[1:]):
        if start != end:
            from omlx.errors import ModelImportError

            raise ModelImportError(f"ranks' layer ranges {ends} are not contiguous in rank order")
    return facts


def _sampling_from(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    d["stop"] = tuple(d.get("stop", ()))
    d["logit_bias"] = tuple(tuple(x) for x in d.get("logit_bias", ()))
    return SamplingParams(**d)


def _generator(stage: StageModel, hello: dict[str, Any]) -> BatchRunner:
    # Mirrors Engine._new_generator: the followers' runners must be built identically.
    return BatchRunner(
        stage,
        stop_tokens=[(int(t),) for t in hello["stop_token_ids"]],
        prefill_step_size=int(hello["prefill_step_size"]),
        mixed_step_size=int(hello["mixed_step_size"]),
        block_size=int(hello["block_size"]),
    )


class _ReplicatedGenerator:
    """Rank 0's BatchRunner: every call is broadcast to the followers, then made locally."""

    def __init__(self, pipeline: ClusterPipeline, gen: BatchRunner):
        self._pipeline = pipeline
        self._gen = gen
        self._last_tokens: list[list[int]] = []

    @property
    def num_prefilling(self) -> int:
        return self._gen.num_prefilling

    def _call(self, what: str, message: dict[str, Any], fn: Any) -> Any:
        return self._pipeline.control(what, message, fn)

    def insert_segments(self, segments: list[list[list[int]]], **kw: Any) -> list[int]:
        p = self._pipeline.pending_sampling
        msg = {"op": "insert", "segments": segments, "max_tokens": kw["max_tokens"],
               "sampling": [dataclasses.asdict(p)], "lease": None, "num_cached": 0}
        caches = kw.get("caches")
        pc = self._pipeline.prefix_cache
        if pc is not None:
            # The followers store the sequence under this lease when rank 0 does, hit or miss.
            msg["lease"] = pc.take_pending(caches[0] if caches else None)
            msg["num_cached"] = len(kw["all_tokens"][0]) if caches else 0
        elif caches:
            raise EngineError("cluster insert with caches but no cluster prefix cache")
        return self._call("insert", msg, lambda: self._gen.insert_segments(segments, **kw))

    def next(self) -> Any:
        msg = {"op": "next", "check": self._last_tokens}
        prompt_resps, gen_resps = self._call("pipeline step", msg, self._gen.next)
        self._last_tokens = [[r.uid, int(r.token)] for r in gen_resps]
        return prompt_resps, gen_resps

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        msg = {"op": "remove", "uids": list(uids), "return_prompt_caches": return_prompt_caches}
        return self._call("remove", msg, lambda: self._gen.remove(uids, return_prompt_caches=return_prompt_caches))


class ClusterPipeline:
    """Rank 0's side of a pipeline, composed into omlx's `Engine` (its `Pipeline`): the engine's
    runner calls are broadcast to the followers, which replay them (`run_follower`).

    Args:
        group: the process group (this is rank 0).
        timeout_s: most seconds one step may block before the pipeline counts as lost.
        state: a dict shown in ``/health`` under ``cluster``; ``error`` is set when lost.
        seed: the PRNG seed every rank starts from.
        prefix_cache: rank 0's KV tiers (its layers only), or None to run without a cache. They
            are wrapped in a `ClusterPrefixCache` (``self.prefix_cache``, the engine's cache):
            each lookup, release and store is replayed on every rank (each over its own layers'
            tiers; a follower without tiers counts 0), and the ranks use the fewest cached
            tokens any of them holds. Whole-prompt hits only for greedy requests
            (``omlx.cluster.prefix_cache``).
        layer_ranges: every rank's ``(start, end)`` (per-rank cache stats).
    """

    #: Constrained decoding is not replayed on the followers' runners (their samplers would need
    #: rank 0's grammar state): the API refuses such requests with a 400 in cluster mode.
    supports_constraints = False

    def __init__(self, group: ClusterGroup, *, timeout_s: float, state: dict[str, Any], seed: int,
                 prefix_cache: Any = None, layer_ranges: list[tuple[int, int]] | None = None):
        self.group = group
        self.state = state
        self.seed = seed
        self.error: ClusterUnavailableError | None = None
        self.pending_sampling = SamplingParams()
        self.engine: Engine | None = None
        self.watchdog = Watchdog(timeout_s, self._on_timeout, rank=0)
        self.heartbeat_s = timeout_s / 2
        self._last_message = time.monotonic()
        self.prefix_cache = (ClusterPrefixCache(prefix_cache, group, self.control, layer_ranges or [])
                             if prefix_cache is not None else None)

    def attach(self, engine: Engine) -> None:
        """Seed the PRNG and send the followers the hello that builds their runners like rank 0's."""
        self.engine = engine
        mx.random.seed(self.seed)
        with self.watchdog.step("hello"):
            self.group.broadcast_message({
                "op": "hello", "seed": self.seed, "max_running": engine.scheduler.max_running,
                "prefill_step_size": engine.prefill_step_size, "mixed_step_size": engine.mixed_step_size,
                "block_size": engine.block_size,
                "stop_token_ids": list(engine.tokenizer.eos_token_ids), "heartbeat_s": self.heartbeat_s,
            })

    def control(self, what: str, message: dict[str, Any], fn: Any) -> Any:
        """Broadcast ``message`` to the followers, then run ``fn`` here; timed by the watchdog.

        Engine thread only. Returns ``fn()``.

        Raises:
            ClusterUnavailableError: the pipeline is (or becomes) lost; it is marked lost.
        """
        if self.error is not None:
            raise self.error
        with self.watchdog.step(what):
            try:
                self._last_message = time.monotonic()
                self.group.broadcast_message(message)
                return fn()
            except ClusterUnavailableError as e:
                self.mark_lost(e)
                raise
            except RuntimeError as e:  # "[ring] connection to a peer was lost", raised by mx.eval
                err = lost_error(self.group.rank, e)
                self.mark_lost(err)
                raise err from e

    def mark_lost(self, error: ClusterUnavailableError) -> None:
        """Record the pipeline as lost (sticky): ``/health`` turns 503 and new requests get 503."""
        if self.error is None:
            self.error = error
            self.state["error"] = error.message
            self.state["status"] = "lost"
            logger.error("%s", error.message)

    def wrap_runner(self, runner: BatchRunner) -> _ReplicatedGenerator:
        return _ReplicatedGenerator(self, runner)

    def before_insert(self, req: Request) -> None:
        if not req.sampling.greedy and req.sampling.seed is None:
            # Unseeded sampling would draw from each process's global PRNG, which the ranks
            # cannot keep in step (other threads draw from it too): give the request its own
            # key chain, sent to every rank with the insert.
            req.sampling = dataclasses.replace(req.sampling, seed=secrets.randbits(63))
        self.pending_sampling = req.sampling
        if self.prefix_cache is not None:
            # A seeded sampler's key chain would advance on rank 0 alone (module docstring).
            self.prefix_cache.allow_whole = req.sampling.greedy

    def step_failed(self, error: Exception) -> ClusterUnavailableError:
        # One node's engine rebuilds its runner and retries; here that would rebuild rank 0's
        # alone. A failed step leaves the ranks' runners out of step: the pipeline is over.
        err = error if isinstance(error, ClusterUnavailableError) else ClusterUnavailableError(
            f"cluster rank 0: pipeline step failed ({type(error).__name__}: {error}); "
            "restart the workers")
        self.mark_lost(err)
        return err

    def idle(self) -> None:
        # The followers bound their wait for the next message (module docstring): tell them
        # rank 0 is alive and idle. A lost pipeline sends nothing more.
        if self.error is None and time.monotonic() - self._last_message >= self.heartbeat_s:
            try:
                self.control("heartbeat", {"op": "ping"}, lambda: None)
            except ClusterUnavailableError:
                pass  # marked lost by control(); /health and new requests say so

    def stopped(self) -> None:
        """Tell the followers to exit (when the pipeline is still up)."""
        if self.error is None:
            try:
                with self.watchdog.step("stop"):
                    self.group.broadcast_message({"op": "stop"})
            except ClusterUnavailableError:
                pass

    def _on_timeout(self, error: ClusterUnavailableError) -> None:
        # Watchdog thread: the engine thread is stuck in a collective and cannot be interrupted,
        # so fail its requests from here (sinks are thread-safe) and stop accepting new ones.
        self.mark_lost(error)
        if self.engine is not None:
            self.engine.fail_everything(error)


def run_follower(group: ClusterGroup, stage: StageModel, cache: FollowerPrefixCache | None = None) -> int:
    """Ranks > 0: replay rank 0's generator calls until told to stop or the pipeline breaks.

    ``cache`` is this rank's side of the prefix cache (its layers' tiers); without one, this rank
    still takes part in every lookup (reporting 0 cached tokens, so nobody uses the cache).

    Every call a message describes has ``group.timeout_s``; the wait for the next message has
    the hello's ``heartbeat_s`` + ``group.timeout_s`` (an idle rank 0 pings every heartbeat_s).

    Returns:
        0 after a ``stop`` message. Exits the process with ``EXIT_PEER_LOST`` when a step times
        out (the thread is stuck in MLX and cannot be unwound).
    """
    rank = group.rank

    def on_timeout(error: ClusterUnavailableError) -> None:
        logger.error("%s", error.message)
        logging.shutdown()
        os._exit(EXIT_PEER_LOST)

    watchdog = Watchdog(group.timeout_s, on_timeout, rank=rank)
    try:
        hello = group.broadcast_message(None)
        if hello.get("op") != "hello":
            raise EngineError(f"rank {rank}: expected hello, got {hello.get('op')!r}")
        mx.random.seed(int(hello["seed"]))
        gen = _generator(stage, hello)
        stop_sequences = StopSequences([(int(t),) for t in hello["stop_token_ids"]])
        logger.info("rank %d: following rank 0 (layers [%d, %d))", rank, stage.layer_range.start, stage.layer_range.end)
        pc = cache or FollowerPrefixCache(None, group)
        mine: dict[int, int] = {}
        num_steps = 0
        t0 = time.monotonic()
        waiting = Watchdog(float(hello["heartbeat_s"]) + group.timeout_s, on_timeout, rank=rank)
        while True:
            with waiting.step("waiting for rank 0's next control message"):
                msg = group.broadcast_message(None)
            op = msg["op"]
            if op == "ping":
                continue
            if op == "stop":
                logger.info("rank %d: stopping after %d steps in %.0f s", rank, num_steps, time.monotonic() - t0)
                pc.close()
                return 0
            if op != "store":
                pc.forget_unstored()
            with watchdog.step(op):
                try:
                    if op == "insert":
                        params = [_sampling_from(d) for d in msg["sampling"]]
                        caches, all_tokens = pc.insert_caches(msg)
                        (uid,) = gen.insert_segments(
                            msg["segments"], max_tokens=msg["max_tokens"], caches=caches, all_tokens=all_tokens,
                            samplers=[make_sampler(p) for p in params],
                            logits_processors=[make_processors(p) for p in params],
                            stop_sequences=[stop_sequences for _ in params])
                        pc.inserted(msg, uid)
                    elif op == "next":
                        theirs = {int(u): int(t) for u, t in msg["check"]}
                        if theirs != mine:
                            raise EngineError(f"rank {rank} sampled {mine} where rank 0 sampled {theirs}: "
                                              "the ranks disagree; stopping the pipeline")
                        _, gen_resps = gen.next()
                        mine = {r.uid: int(r.token) for r in gen_resps}
                        for r in gen_resps:
                            if r.finish_reason is not None:
                                pc.finished(r.uid, r.prompt_cache, r.all_tokens)
                        num_steps += 1
                    elif op == "remove":
                        want = bool(msg.get("return_prompt_caches"))
                        got = gen.remove([int(u) for u in msg["uids"]], return_prompt_caches=want)
                        for uid, (prompt_cache, all_tokens) in (got or {}).items():
                            pc.finished(uid, prompt_cache, all_tokens)
                    elif op == "lookup":
                        pc.lookup(msg)
                    elif op == "release":
                        pc.release(msg)
                    elif op == "store":
                        pc.store(msg)
                    else:
                        raise EngineError(f"rank {rank}: unknown control op {op!r}")
                except RuntimeError as e:
                    raise lost_error(rank, e) from e
    except ClusterUnavailableError as e:
        logger.error("%s", e.message)
        return EXIT_PEER_LOST
    except Exception:
        logger.exception("rank %d: pipeline step failed; stopping", rank)
        return EXIT_DESYNC

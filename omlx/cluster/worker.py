"""Pipeline workers: rank 0 drives omlx's Engine, the other ranks replay its generator calls.

Owns: the control channel protocol, ``ClusterEngine`` (rank 0: the normal continuous-batching
Engine whose runner calls are first broadcast to the other ranks), ``run_follower``
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
from omlx.request import Failed, Request, SamplingParams

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

    def __init__(self, engine: ClusterEngine, gen: BatchRunner):
        self._engine = engine
        self._gen = gen
        self._last_tokens: list[list[int]] = []

    @property
    def num_prefilling(self) -> int:
        return self._gen.num_prefilling

    def _call(self, what: str, message: dict[str, Any], fn: Any) -> Any:
        return self._engine.control(what, message, fn)

    def insert_segments(self, segments: list[list[list[int]]], **kw: Any) -> list[int]:
        p = self._engine.pending_sampling
        msg = {"op": "insert", "segments": segments, "max_tokens": kw["max_tokens"],
               "sampling": [dataclasses.asdict(p)], "lease": None, "num_cached": 0}
        caches = kw.get("caches")
        pc = self._engine.prefix_cache
        if isinstance(pc, ClusterPrefixCache):
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


class ClusterEngine(Engine):
    """Rank 0's engine: omlx's Engine over a StageModel, its generator replayed on every rank.

    Args:
        group: the process group (this is rank 0).
        stage: rank 0's stage.
        timeout_s: most seconds one step may block before the pipeline counts as lost.
        state: a dict shown in ``/health`` under ``cluster``; ``error`` is set when lost.
        prefix_cache: rank 0's KV tiers (its layers only), or None to run without a cache. They
            are wrapped in a `ClusterPrefixCache`: each lookup, release and store is replayed on
            every rank (each over its own layers' tiers; a follower without tiers counts 0),
            and the ranks use the fewest cached tokens any of them holds. Whole-prompt hits
            only for greedy requests (``omlx.cluster.prefix_cache``).
        layer_ranges: every rank's ``(start, end)`` (per-rank cache stats).
        Others as ``Engine``.
    """

    #: Constrained decoding is not replayed on the followers' runners (their samplers would need
    #: rank 0's grammar state): the API refuses such requests with a 400 in cluster mode.
    supports_constraints = False

    def __init__(self, model_id: str, stage: StageModel, tokenizer: Any, *, scheduler: Any,
                 group: ClusterGroup, timeout_s: float, state: dict[str, Any], seed: int,
                 prefill_step_size: int = 2048, block_size: int = 256, prefix_cache: Any = None,
                 layer_ranges: list[tuple[int, int]] | None = None):
        super().__init__(model_id, stage, tokenizer, scheduler=scheduler, prefix_cache=None,
                         block_size=block_size, prefill_step_size=prefill_step_size)
        self.group = group
        self.state = state
        self.cluster_error: ClusterUnavailableError | None = None
        self.pending_sampling = SamplingParams()
        self._inserting: Any = None
        self.watchdog = Watchdog(timeout_s, self._on_timeout, rank=0)
        self.heartbeat_s = timeout_s / 2
        self._last_message = time.monotonic()
        if prefix_cache is not None:
            self.prefix_cache = ClusterPrefixCache(prefix_cache, group, self.control, layer_ranges or [])
        mx.random.seed(seed)
        with self.watchdog.step("hello"):
            group.broadcast_message({
                "op": "hello", "seed": seed, "max_running": scheduler.max_running,
                "prefill_step_size": self.prefill_step_size, "mixed_step_size": self.mixed_step_size,
                "block_size": self.block_size,
                "stop_token_ids": list(tokenizer.eos_token_ids), "heartbeat_s": self.heartbeat_s,
            })

    @property
    def alive(self) -> bool:
        return self.cluster_error is None and super().alive

    def control(self, what: str, message: dict[str, Any], fn: Any) -> Any:
        """Broadcast ``message`` to the followers, then run ``fn`` here; timed by the watchdog.

        Engine thread only. Returns ``fn()``.

        Raises:
            ClusterUnavailableError: the pipeline is (or becomes) lost; it is marked lost.
        """
        if self.cluster_error is not None:
            raise self.cluster_error
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

    def submit(self, request: Request, sink: Any) -> None:
        """As ``Engine.submit``; raises ClusterUnavailableError once the pipeline is lost."""
        if self.cluster_error is not None:
            raise self.cluster_error
        super().submit(request, sink)

    def mark_lost(self, error: ClusterUnavailableError) -> None:
        """Record the pipeline as lost (sticky): ``/health`` turns 503 and new requests get 503."""
        if self.cluster_error is None:
            self.cluster_error = error
            self.state["error"] = error.message
            self.state["status"] = "lost"
            logger.error("%s", error.message)

    def _idle(self) -> None:
        # The followers bound their wait for the next message (module docstring): tell them
        # rank 0 is alive and idle. A lost pipeline sends nothing more.
        if self.cluster_error is None and time.monotonic() - self._last_message >= self.heartbeat_s:
            try:
                self.control("heartbeat", {"op": "ping"}, lambda: None)
            except ClusterUnavailableError:
                pass  # marked lost by control(); /health and new requests say so

    def _on_timeout(self, error: ClusterUnavailableError) -> None:
        # Watchdog thread: the engine thread is stuck in a collective and cannot be interrupted,
        # so fail its requests from here (sinks are thread-safe) and stop accepting new ones.
        self.mark_lost(error)
        self._fail_everything(error)

    def _fail_everything(self, error: ClusterUnavailableError) -> None:
        """Fail every running, starting and waiting request with ``error``."""
        sinks = [st.sink for st in list(self._by_rid.values())] + [sink for _, sink in list(self._ready)]
        self._ready.clear()
        self._by_rid.clear()
        self._by_uid.clear()
        if self._inserting is not None:
            sinks.append(self._inserting)
        self._fail_with_waiting(sinks, error)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine, then tell the followers to exit (when the pipeline is still up)."""
        super().stop(timeout_s)
        if self.cluster_error is None and (self._thread is None or not self._thread.is_alive()):
            try:
                with self.watchdog.step("stop"):
                    self.group.broadcast_message({"op": "stop"})
            except ClusterUnavailableError:
                pass

    # ---- engine thread ----------------------------------------------------------------

    def _new_generator(self) -> Any:
        return _ReplicatedGenerator(self, super()._new_generator())

    def _insert(self, req: Request, sink: Any) -> None:
        if not req.sampling.greedy and req.sampling.seed is None:
            # Unseeded sampling would draw from each process's global PRNG, which the ranks
            # cannot keep in step (other threads draw from it too): give the request its own
            # key chain, sent to every rank with the insert.
            req.sampling = dataclasses.replace(req.sampling, seed=secrets.randbits(63))
        self.pending_sampling = req.sampling
        if isinstance(self.prefix_cache, ClusterPrefixCache):
            # A seeded sampler's key chain would advance on rank 0 alone (module docstring).
            self.prefix_cache.allow_whole = req.sampling.greedy
        self._inserting = sink  # not yet in _by_rid: the watchdog must still reach it
        try:
            super()._insert(req, sink)
        finally:
            self._inserting = None

    def _retry_batch(self, error: Exception) -> None:
        # Engine rebuilds its generator and retries; here that would rebuild rank 0's alone.
        # A failed step leaves the ranks' generators out of step: the pipeline is over.
        err = error if isinstance(error, ClusterUnavailableError) else ClusterUnavailableError(
            f"cluster rank 0: pipeline step failed ({type(error).__name__}: {error}); "
            "restart the workers")
        self.mark_lost(err)
        self.num_batch_failures += 1
        self.last_error = err.message
        self._fail_everything(err)
        self._stopping = True  # the loop ends; nothing more can run on this group


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

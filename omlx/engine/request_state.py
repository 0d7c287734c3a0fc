"""One request's state in the engine: the single record the engine, the runner and the cache read.

Owns: `RequestState`, a request from its admission to its end: its token ids, its KV progress,
the blocks it holds, its sampler, processors and output state, its counters, and the fault its
own sampler or processor raised (`omlx.engine.sampling.guard_sampler` records it here). The
engine keeps one table of states keyed by request id; the runner's row of a sequence refers to
its state and hands it back on every response and chunk report, so nothing is looked up by
runner uid.

Must not: import mlx (pure Python, like the scheduler that is to read it), call the model,
touch the runner's caches, or speak HTTP. The engine thread alone writes a state (other
threads only read snapshots).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from omlx.request import GenerationEvent, Request

if TYPE_CHECKING:
    from omlx.engine.grammar import GrammarMatcher
    from omlx.engine.kv_cache import PrefixLease
    from omlx.engine.output import OutputState

Sink = Callable[[GenerationEvent], None]


@dataclass(slots=True, eq=False)
class RequestState:
    """A request the engine thread has admitted, until it finishes, fails or is aborted.

    Attributes:
        request: the request (``request.num_prefilled_tokens`` is kept up to date here).
        sink: where its events go.
        token_ids: the prompt, then every output token (EOS excluded) as it is emitted; one
            list, extended in place (the prefix cache hashes it incrementally).
        uid: its sequence id in the current runner; None until it is inserted (admitted, still
            waiting for its prefill to start) and again while a batch retry re-inserts it.
        lease: the cached blocks it holds (its prefix hit and the blocks registered since;
            the block hashes, computed once and extended, are the lease's ``block_hashes``);
            None without a prefix cache, after a batch retry, and once released.
        num_cached_tokens: prompt tokens whose KV came from the cache (``num_cached_tokens_cold``
            of them from the SSD tier).
        num_computed_tokens: leading tokens of ``token_ids`` whose KV the runner has computed
            or restored (the cached prefix, prefill chunks as reported, then one per emitted
            token); after a batch retry it counts from 0 in the new runner.
        num_insert_start: ``num_computed_tokens`` when the current insert entered the runner.
        num_prompt_to_prefill: tokens the current insert prefills that count as prompt
            (uncached ones; all of the prompt after a batch retry); ``num_insert_prefilled``:
            how many of them the runner reported done.
        output: its detokenizer and stop strings (None until inserted).
        sampler, processors, grammar: its own, as guarded for the runner
            (`omlx.engine.sampling.guard_sampler`, ``guard_processor``).
        fault: the exception its own sampler or processor raised in this step (attributed:
            only this request fails, after the step).
        first_logprobs: log-probabilities of its first output token when nothing changed them;
            kept with the prompt's KV so a repeat of the prompt samples its first token
            without a forward pass.
        start_s: time.monotonic() when it entered the runner (after its cache restore).
        first_token_s: time.monotonic() of its first output token.
        finished: it has left the engine; responses and chunk reports still naming it are
            ignored.
    """

    request: Request
    sink: Sink
    token_ids: list[int]
    uid: int | None = None
    lease: PrefixLease | None = None
    num_cached_tokens: int = 0
    num_cached_tokens_cold: int = 0
    num_computed_tokens: int = 0
    num_insert_start: int = 0
    num_prompt_to_prefill: int = 0
    num_insert_prefilled: int = 0
    output: OutputState | None = None
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # constrained decoding
    fault: Exception | None = None
    first_logprobs: Any = None
    start_s: float = 0.0
    first_token_s: float | None = None
    num_retries: int = 0
    # Prompt-lookup speculation: draft tokens checked, accepted, and whether it was switched off.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    speculation_off: bool = False
    finished: bool = False

    @classmethod
    def admitted(cls, request: Request, sink: Sink) -> RequestState:
        """The state of ``request`` as the scheduler admits it (not yet in the runner)."""
        return cls(request=request, sink=sink, token_ids=list(request.prompt_token_ids))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        """Output tokens emitted so far (EOS excluded)."""
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens emitted so far (a copy)."""
        return self.token_ids[self.request.num_prompt_tokens:]

    def add_output_token(self, token: int) -> None:
        """Append an emitted output token; its KV is (being) computed by the step that feeds it."""
        self.token_ids.append(token)
        self.num_computed_tokens = len(self.token_ids)

    def start(self, uid: int, num_computed_tokens: int, num_prompt_to_prefill: int) -> None:
        """It entered the runner as sequence ``uid`` with ``num_computed_tokens`` tokens of KV."""
        self.uid = uid
        self.num_computed_tokens = self.num_insert_start = num_computed_tokens
        self.num_prompt_to_prefill, self.num_insert_prefilled = num_prompt_to_prefill, 0

    def count_prefilled(self, done: int) -> None:
        """The runner reports ``done`` tokens of the current insert prefilled: advance
        ``num_computed_tokens`` and count the prompt tokens among them into
        ``request.num_prefilled_tokens``."""
        self.num_computed_tokens = max(self.num_computed_tokens, self.num_insert_start + done)
        done = min(done, self.num_prompt_to_prefill)
        if done > self.num_insert_prefilled:
            self.request.num_prefilled_tokens += done - self.num_insert_prefilled
            self.num_insert_prefilled = done

    def record_fault(self, error: Exception, faulted: list[RequestState]) -> None:
        """Note ``error`` from its own sampler or processor (the first in a step wins) and
        list this state in ``faulted`` (the engine fails it after the step)."""
        if self.fault is None:
            self.fault = error
            faulted.append(self)

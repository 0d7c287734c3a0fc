"""Request, SamplingParams, RequestStatus and the typed events an engine emits.

These are the dataclasses passed between the API adapters, the scheduler and the engine.
Nothing here imports mlx or an HTTP library.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

_request_counter = itertools.count()

#: The seeds a request may give: a signed 64-bit integer, the range the OpenAI API reference
#: gives ``seed`` (its OpenAPI document: minimum -2**63, maximum 2**63 - 1). The sampler folds it
#: one-to-one into MLX's unsigned 64-bit key (``seed % 2**64``), so two seeds never share a key.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


def new_request_id() -> str:
    """A request id unique in this process (``req-<n>-<ns clock, hex>``); routes take one before
    the request exists, so its model lease and its log lines name the same request."""
    return f"req-{next(_request_counter)}-{time.time_ns():x}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must be, enforced token by token (constrained decoding).

    Attributes:
        grammar: an llguidance grammar (JSON text), validated for the model it was built for
            (`omlx.engine.grammar.Grammars`).
        label: what it enforces, for logs ("json_object", "json_schema 'person'", "tool call").
        start_after: token ids after which the constraint starts (the end of a reasoning block
            the prompt opened); empty: from the first generated token.
    """

    grammar: str
    label: str
    start_after: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI/Anthropic names mapped here once).

    Attributes:
        max_tokens: upper bound on generated tokens (>= 1).
        temperature: 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0, or k at least the vocabulary size, keeps all.
        min_p: drop tokens below min_p x p(top token); 0 disables.
        seed: makes sampling with temperature > 0 reproducible for this request; in
            [`SEED_MIN`, `SEED_MAX`].
        stop: strings that end generation; never included in the output text.
        presence_penalty, frequency_penalty: OpenAI's additive penalties in [-2, 2].
        repetition_penalty: multiplicative penalty (> 0; 1 disables).
        logit_bias: token id -> additive bias in [-100, 100].
        logprobs: return the sampled token's log-probability.
        top_logprobs: also return this many alternatives per position (0-20).
        constraint: the grammar the output must follow (structured outputs, forced tool
            calls), or None.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_processors(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(slots=True)
class Request:
    """One generation request as the engine sees it.

    Attributes:
        request_id: unique id (also used in API response ids).
        model: the served model id it targets.
        prompt_token_ids: the templated, tokenized prompt.
        sampling: sampling settings.
        arrival_s: time.monotonic() at arrival.
        num_prefilled_tokens: prompt tokens the engine ran through the model for this request
            so far (cached ones excluded; a prompt prefilled again after a failed batch step
            counts again). Written by the engine thread only.
    """

    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str = field(default_factory=new_request_id)
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_prefilled_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one token (natural log), with its text and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class PrefillProgress:
    """Emitted while the prompt is being prefilled (lets the API send keep-alives)."""

    num_computed_tokens: int
    num_tokens: int


@dataclass(slots=True)
class Admitted:
    """Emitted once when the request joins the batch: how much of its prompt the KV cache held.

    These are the numbers its final `Usage` reports, so a stream's first event can carry them.
    """

    num_cached_tokens: int
    num_cached_tokens_cold: int = 0


@dataclass(slots=True)
class TextDelta:
    """New output text (never splits a UTF-8 code point; stop strings are withheld).

    Attributes:
        text: the new text.
        token_ids: the tokens this delta completes.
        logprobs: one entry per token in ``token_ids`` when logprobs were asked for.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Usage:
    """Token counts for one request. ``num_cached_tokens`` counts prompt tokens reused from
    the KV cache; ``num_cached_tokens_cold`` is the part restored from the SSD tier.
    ``num_draft_tokens`` counts prompt-lookup draft tokens checked in verify steps and
    ``num_accepted_draft_tokens`` those the model agreed with (emitted without a step of their
    own); ``speculation_off`` says drafting was switched off for low acceptance."""

    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    num_cached_tokens_cold: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    speculation_off: bool = False


@dataclass(slots=True)
class Finished:
    """The last event of a successful request.

    Attributes:
        finish_reason: "stop" (EOS or a stop string), "length" (max_tokens) or "abort".
        stop_string: the stop string that matched, if any.
        usage: token counts.
    """

    finish_reason: str
    usage: Usage
    stop_string: str | None = None


@dataclass(slots=True)
class Failed:
    """The last event of a request that failed inside the engine."""

    error: Exception


GenerationEvent = Admitted | PrefillProgress | TextDelta | Finished | Failed

"""Speculative decoding's policy and acceptance rule: which tokens a verify step keeps, per row.

A verify step (`omlx.engine.runner.BatchRunner`) feeds each speculating row its next token
``y`` and its draft ``d_1..d_k`` (prompt lookup, `omlx.engine.lookup`) in one forward pass
beside plain decode rows. This module decides, from that pass's logits, how many draft tokens
each row keeps and which token it feeds next; the runner then drops the rest of each row's KV
(`omlx.engine.ragged_cache` in a merged batch). It also holds a sequence's drafting state:
its adaptive draft length and the rule that switches drafting off when it does not pay.

**The acceptance rule** (`verify`): for each position ``j`` (the distribution ``p_j`` of the
token after ``y, d_1..d_j``) the row's own sampler draws a token ``t_j`` exactly as a plain
decode step would draw it there; the draft is kept up to its first ``d_{j+1} != t_j``, and
``t_a`` (``a`` tokens kept) is the next token. Greedy, ``t_j = argmax p_j``: the output is
greedy decoding's. Sampled, this *is* speculative rejection sampling (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", Alg. 1; Chen et al. 2023) for a
deterministic draft: the draft distribution ``q`` is a point mass on ``d``, so ``d`` is to be
accepted with probability ``min(1, p(d) / q(d)) = p(d)`` and, when rejected, a token drawn from
``norm(max(0, p - q))``, i.e. ``p`` with ``d`` removed and renormalised. Drawing ``t ~ p`` and
accepting iff ``t == d`` does both at once: ``P(accept) = p(d)``, and a rejected ``t`` is
distributed as ``p`` given ``t != d``. So each emitted token has exactly the model's
distribution under the request's temperature, top-p, top-k and min-p (the sampler applies
them, as mlx-lm's ``make_sampler`` does), and since a seeded sampler draws position ``j`` with
the key its ``j``-th next call would use (`omlx.engine.sampling.RequestSampler.draw`, keys
of unused positions given back), a seeded request's tokens are the ones it draws with
speculation off.

Must not: touch caches or the model; know about HTTP or requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from omlx.engine.lookup import PromptLookup

logger = logging.getLogger(__name__)

#: ``(rows, logits (P, V), inputs (P,)) -> (tokens (P,), logprobs (P, V))``: the runner's plain
#: sampling (processors, grammar, the row's sampler) for rows that verify no draft this step.
PlainSample = Callable[[list[int], mx.array, mx.array], tuple[mx.array, mx.array]]


def can_draft(sampler: Any, processors: Sequence[Any], grammar: Any) -> bool:
    """A sequence may speculate: greedy, or a sampler that draws positions (``draw``/``keep``,
    `omlx.engine.sampling.RequestSampler`), and no logits processors or grammar (their
    state advances token by token, so they cannot score positions ahead)."""
    return (sampler is greedy_sampler or hasattr(sampler, "draw")) and not processors and grammar is None


@dataclass(slots=True, eq=False)
class Drafting:
    """One sequence's drafting state.

    Attributes:
        lookup: its n-gram index.
        num_draft: draft length of its next verify step (adapted to acceptance).
        off: switched off for low acceptance.
        num_steps, num_drafted, num_accepted: its verify steps, draft tokens checked, accepted.
    """

    lookup: PromptLookup
    num_draft: int
    off: bool = False
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    #: Verify steps that accept fewer tokens than this on average, over at least `PROBE_STEPS`
    #: of them, switch drafting off (a failed verify costs a wider forward and a host sync
    #: that a pipelined step hides).
    MIN_ACCEPTED = 0.5
    PROBE_STEPS = 16

    def propose(self, history: Sequence[int], last: int, room: int) -> list[int]:
        """Up to `num_draft` tokens (and at most ``room``) to follow ``history`` and ``last``."""
        return self.lookup.propose(history, min(self.num_draft, room), last=last) if room > 0 else []

    def record(self, drafted: int, accepted: int, max_draft: int) -> None:
        """Count one verify step; adapt the next draft length (twice what was accepted, 1 to
        ``max_draft``); switch off when acceptance stays below `MIN_ACCEPTED` per step."""
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_draft = min(max_draft, max(1, 2 * accepted))
        if self.num_steps >= self.PROBE_STEPS and self.num_accepted < self.MIN_ACCEPTED * self.num_steps:
            self.off = True


@dataclass(slots=True)
class Verdict:
    """What one verify step decided, per decode row (row order).

    Attributes:
        accepted: draft tokens kept (0 for a row without a draft).
        next_tokens: the token each row feeds next (drawn after its kept drafts).
        lp_next: ``(B, V)`` float32, the log-probabilities ``next_tokens`` were drawn from.
        lp_positions: per row with a draft, ``(N, V)`` float32 log-probabilities of its positions
            (position ``j`` scored draft token ``j``); None for the others.
    """

    accepted: list[int]
    next_tokens: list[int]
    lp_next: mx.array
    lp_positions: list[mx.array | None]


def verify(logits: mx.array, samplers: Sequence[Any], drafts: Sequence[list[int]], inputs: mx.array,
           sample_plain: PlainSample) -> Verdict:
    """Apply the acceptance rule (module docstring) to one verify step's logits.

    Args:
        logits: ``(B, N, V)``: the forward pass over each row's ``[y, d_1..d_k, pad...]``
            (``N = 1 +`` the longest draft; a row's pad positions are ignored).
        samplers: per row, its sampler (`can_draft` true for every row with a draft).
        drafts: per row, its draft (empty: a plain row, sampled by ``sample_plain`` from
            position 0).
        inputs: ``(B,)`` the tokens ``y`` fed at position 0 (for the plain rows' processors).
        sample_plain: the runner's plain sampling.

    Returns:
        The `Verdict`, after one host sync (the drawn tokens).
    """
    B = logits.shape[0]
    spec = [i for i in range(B) if drafts[i]]
    plain = [i for i in range(B) if not drafts[i]]
    lps: list[mx.array | None] = [None] * B
    drawn: list[mx.array] = []
    greedy = [i for i in spec if samplers[i] is greedy_sampler]
    if greedy:
        sel = logits[mx.array(greedy)] if len(greedy) < B else logits
        lp = sel - mx.logsumexp(sel, axis=-1, keepdims=True)  # (G, N, V)
        drawn.append(mx.argmax(lp, axis=-1).reshape(-1))
        for g, i in enumerate(greedy):
            lps[i] = lp[g]
    for i in spec:
        if samplers[i] is not greedy_sampler:
            lps[i] = lp_i = logits[i] - mx.logsumexp(logits[i], axis=-1, keepdims=True)
            drawn.append(samplers[i].draw(lp_i).astype(mx.uint32))
    y0 = lp0 = None
    if plain:
        idx = mx.array(plain)
        y0, lp0 = sample_plain(plain, logits[idx, 0, :], inputs[idx])
        drawn.append(y0.astype(mx.uint32))
    flat = mx.concatenate([d.astype(mx.uint32) for d in drawn]).tolist()  # the step's host sync
    N = logits.shape[1]
    tokens: dict[int, list[int]] = {}
    at = 0
    for i in greedy + [i for i in spec if samplers[i] is not greedy_sampler]:
        tokens[i], at = flat[at : at + N], at + N
    for i in plain:
        tokens[i], at = flat[at : at + 1], at + 1
    accepted, nxt, rows = [], [], []
    for i in range(B):
        t, d = tokens[i], drafts[i]
        a = 0
        while a < len(d) and t[a] == d[a]:
            a += 1
        accepted.append(a)
        nxt.append(t[a])
        if d:
            if hasattr(samplers[i], "keep"):
                samplers[i].keep(a + 1)  # t_0..t_a were used; later positions' keys come back
            rows.append(lps[i][a : a + 1])  # type: ignore[index]
        else:
            rows.append(lp0[plain.index(i) : plain.index(i) + 1])  # type: ignore[index]
    return Verdict(accepted, nxt, mx.concatenate(rows, axis=0) if B > 1 else rows[0], lps)

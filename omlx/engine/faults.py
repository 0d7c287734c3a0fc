"""Test-only fault injection (``OMLX_TEST_FAULT``), off in production.

The reliability tests need a real server whose generation fails on purpose, in one request or
in the batched forward pass, to prove that a fault fails only its own request. The spec comes
from ``ServerConfig.test_fault`` (env ``OMLX_TEST_FAULT``, read in config.py only when set);
when it is None nothing here runs and the engine uses the model and processors as they are.

Everything here stays outside the engine's step loop: `inject` hands the engine a wrapped model
and the two per-request factories it takes anyway (logits processors, detokenizer), so the
production loop has no fault branch at all.

Spec: comma-separated items, each ``<where>:seed=<int>``; a request whose ``seed`` equals the
value is the target.

- ``processor:seed=N``: the target's logits processor raises on every step (attributed: only
  the target fails).
- ``detokenize:seed=N``: emitting the target's first token raises (attributed).
- ``forward:seed=N``: the batched model forward raises once while the target is in the batch
  (not attributable: the engine retries every request of the batch). The target gets a logits
  processor that arms the wrapped model the first time it runs (the target's first sampled
  token), so the next forward pass, which carries the target, raises.

Must not: be enabled by anything but that variable, or touch mlx-lm's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omlx.errors import EngineError, InvalidRequestError
from omlx.request import SamplingParams

FAULT_KINDS = ("processor", "detokenize", "forward")


class InjectedFault(EngineError):
    """The error an injected fault raises (never raised unless OMLX_TEST_FAULT is set)."""


@dataclass(slots=True)
class FaultPlan:
    """Which seeds trigger which fault; ``forward_fired`` keeps the forward fault one-shot."""

    seeds: dict[str, frozenset[int]] = field(default_factory=dict)
    forward_fired: set[int] = field(default_factory=set)

    def hits(self, kind: str, seed: int | None) -> bool:
        return seed is not None and seed in self.seeds.get(kind, frozenset())


def parse_fault_spec(spec: str | None) -> FaultPlan | None:
    """``"processor:seed=7,forward:seed=9"`` -> FaultPlan; None or "" -> None.

    Raises:
        InvalidRequestError: an item that is not ``<kind>:seed=<int>`` with a known kind.
    """
    if not spec:
        return None
    seeds: dict[str, set[int]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        kind, _, arg = item.partition(":")
        if kind not in FAULT_KINDS or not arg.startswith("seed="):
            raise InvalidRequestError(f"OMLX_TEST_FAULT item {item!r}: expected <{'|'.join(FAULT_KINDS)}>:seed=<int>")
        try:
            seeds.setdefault(kind, set()).add(int(arg[5:]))
        except ValueError:
            raise InvalidRequestError(f"OMLX_TEST_FAULT item {item!r}: seed must be an integer") from None
    return FaultPlan({k: frozenset(v) for k, v in seeds.items()})


def failing_processor(tokens: Any, logits: Any) -> Any:
    """A logits processor that always raises (the ``processor`` fault)."""
    raise InjectedFault("injected processor fault (OMLX_TEST_FAULT)")


class FaultingModel:
    """Wraps a model; its forward raises once when ``armed`` is set (the ``forward`` fault).

    Every attribute but the call goes to the wrapped model, so mlx-lm sees the same layers,
    caches and config.
    """

    def __init__(self, model: Any):
        self._model = model
        self.armed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise InjectedFault("injected forward fault (OMLX_TEST_FAULT)")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class FaultingDetokenizer:
    """Wraps a request's streaming detokenizer; its first ``add_token`` raises (the
    ``detokenize`` fault). Every other attribute goes to the wrapped one."""

    def __init__(self, detokenizer: Any):
        self._detokenizer = detokenizer

    def add_token(self, token: int) -> None:
        raise InjectedFault("injected detokenize fault (OMLX_TEST_FAULT)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._detokenizer, name)


@dataclass(slots=True)
class Injected:
    """What `inject` gives the engine in place of its defaults."""

    model: Any
    make_processors: Callable[[SamplingParams], list[Any]]
    make_detokenizer: Callable[[SamplingParams], Any]


def inject(plan: FaultPlan, model: Any, tokenizer: Any,
           make_processors: Callable[[SamplingParams], list[Any]]) -> Injected:
    """The engine's model and per-request factories with ``plan``'s faults built in.

    Args:
        model: the mlx-lm model (wrapped in `FaultingModel` when ``plan`` has forward seeds).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (its ``detokenizer`` property gives a fresh one).
        make_processors: the production factory (`omlx.engine.sampling.make_processors`).
    """
    faulting = FaultingModel(model) if plan.seeds.get("forward") else None

    def processors(p: SamplingParams) -> list[Any]:
        procs = list(make_processors(p))
        if plan.hits("processor", p.seed):
            procs.append(failing_processor)
        if faulting is not None and plan.hits("forward", p.seed) and p.seed not in plan.forward_fired:
            seed = p.seed

            def arm(tokens: Any, logits: Any) -> Any:
                if seed not in plan.forward_fired:
                    plan.forward_fired.add(seed)
                    faulting.armed = True
                return logits
            procs.append(arm)
        return procs

    def detokenizer(p: SamplingParams) -> Any:
        d = tokenizer.detokenizer
        return FaultingDetokenizer(d) if plan.hits("detokenize", p.seed) else d

    return Injected(faulting if faulting is not None else model, processors, detokenizer)

"""Test-only fault injection (``OMLX_TEST_FAULT``), off in production.

The reliability tests need a real server whose generation fails on purpose, in one request or
in the batched forward pass, to prove that a fault fails only its own request. The spec comes
from ``ServerConfig.test_fault`` (env ``OMLX_TEST_FAULT``, read in config.py only when set);
when it is None nothing here runs and the engine uses the model and processors as they are.

Spec: comma-separated items, each ``<where>:seed=<int>``; a request whose ``seed`` equals the
value is the target.

- ``processor:seed=N``: the target's logits processor raises on every step (attributed: only
  the target fails).
- ``detokenize:seed=N``: emitting the target's first token raises (attributed).
- ``forward:seed=N``: the batched model forward raises once while the target is in the batch
  (not attributable: the engine retries every request of the batch).

Must not: be enabled by anything but that variable, or touch mlx-lm's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omlx.errors import EngineError, InvalidRequestError

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
